"""nanodist.results: the schema, validation errors naming file and field, aggregation across machines."""
import json
import os

import pytest

from nanodist import results
from nanodist.group import Group
from nanodist.results import Recorder, ResultsError, load, load_all, table, validate


def write_lines(path, record):
    """A results file holding `record` (folded, as load() returns it), written line by line with no checks."""
    head = {k: v for k, v in record.items() if k not in ("steps", "metrics", "complete", "stopped", "resumes")
            and not k.startswith("_")}
    lines = [{"kind": "header", **head}] + [{"kind": "step", **st} for st in record["steps"]]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines + [{"kind": "metrics", **record["metrics"]},
                                                                          {"kind": "end"}]))


def write_run(directory, lab="lab_x", world_size=1, steps=(0.5, 0.25, 0.75), host="laptop", **metrics):
    rec = Recorder(lab, config={"size": 3}, group=Group(size=world_size, ranks=tuple(range(world_size))))
    for i, t in enumerate(steps):
        rec.step(step=i, time_s=t, loss=1.0 / (i + 1))
    rec.metrics.update(metrics)
    path = rec.save(directory)
    data = load(path)
    data["hardware"]["hostname"] = host
    write_lines(path, data)
    return path


def test_recorder_writes_a_valid_file_in_the_results_dir(results_dir):
    rec = Recorder("lab_x", config={"size": 3, "path": results_dir}, argv=["lab_x.py", "--size", "3"])
    rec.step(step=0, time_s=0.1, loss=2.0)
    rec.metrics["tokens_per_s"] = 123.0
    path = rec.save()
    assert path == results_dir / "lab_x" / f"{rec.run_id}.jsonl"
    data = load(path)
    assert data["schema_version"] == results.SCHEMA_VERSION
    assert data["config"] == {"size": 3, "path": str(results_dir)}  # made JSON-safe
    assert data["argv"] == ["lab_x.py", "--size", "3"]
    assert data["steps"] == [{"step": 0, "time_s": 0.1, "loss": 2.0}]
    assert data["world_size"] == 1 and data["nnodes"] >= 1 and data["backend"] == "gloo"
    hw = data["hardware"]
    assert hw["cpu_logical_cores"] >= 1 and hw["torch"] and hw["gpu_count"] == len(hw["gpu_names"])
    assert not list(results_dir.rglob("*.tmp"))


def test_only_rank0_writes(results_dir):
    rec = Recorder("lab_x", group=Group(rank=1, size=2, backend="gloo", ranks=(0, 1)))
    assert rec.save() is None
    assert not (results_dir / "lab_x").exists()


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.pop("world_size"), "field 'world_size' is missing"),
    (lambda d: d.update(world_size="2"), "field 'world_size' should be int, got str"),
    (lambda d: d.update(world_size=0), "field 'world_size' must be >= 1"),
    (lambda d: d.update(nnodes=True), "field 'nnodes' should be int, got bool"),
    (lambda d: d.update(steps=[{"step": 0}]), r"field 'steps\[0\].time_s' is missing"),
    (lambda d: d.update(steps=[{"step": 0, "time_s": "fast"}]), r"field 'steps\[0\].time_s' should be a number"),
    (lambda d: d.update(schema_version=99), "update nanodist"),
    (lambda d: d["hardware"].pop("hostname"), "field 'hardware.hostname' is missing"),
])
def test_invalid_files_name_the_file_and_field(tmp_path, mutate, message):
    path = write_run(tmp_path)
    data = load(path)
    mutate(data)
    write_lines(path, data)
    with pytest.raises(ResultsError, match=message) as e:
        load(path)
    assert str(path) in str(e.value)


def test_not_json_and_not_an_object(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ResultsError, match="bad.json: not valid JSON"):
        load(bad)
    with pytest.raises(ResultsError, match="holds one JSON object, found list"):
        validate([], "x.json")


def test_aggregation_across_machines_and_labs(tmp_path):
    mine, theirs = tmp_path / "mine", tmp_path / "reference"
    write_run(mine / "lab_x", world_size=1, steps=(0.5, 0.25, 0.75), host="laptop", tokens_per_s=10.0)
    write_run(theirs / "lab_x", world_size=2, steps=(0.1, 0.3), host="gpu-box", tokens_per_s=40.0)
    write_run(mine / "lab_y", lab="lab_y", host="laptop")
    runs = load_all("lab_x", roots=[mine, theirs])
    assert [r["hardware"]["hostname"] for r in runs] == ["laptop", "gpu-box"]
    t = table(runs)
    assert t.column("host") == ["laptop", "gpu-box"]
    assert t.column("median_step_s") == [0.5, 0.2]
    assert t.column("tokens_per_s") == [10.0, 40.0]
    assert t.column("config.size") == [3, 3]
    assert t.where(world_size=2).column("host") == ["gpu-box"]
    assert len(load_all(roots=[mine, theirs])) == 3
    text = str(t.select("host", "world_size"))
    assert text.splitlines()[0].split() == ["host", "world_size"] and "gpu-box  2" in text
    assert t.select("host")._repr_html_().count("<tr>") == 3
    assert t.select("host")._repr_html_().startswith("<table><thead>")  # scrolls sideways when wide (nanodist.css)
    assert t.select("host").wrapped()._repr_html_().startswith('<table class="wrap"><thead>')  # a table of prose


def test_a_bad_file_among_good_ones_is_skipped_and_named(tmp_path):
    """One broken file -- of this lab or another -- never hides the good ones; the warning names it."""
    good = write_run(tmp_path / "lab_x")
    (tmp_path / "lab_x" / "broken.json").write_text("[]")
    (tmp_path / "lab_y").mkdir()
    (tmp_path / "lab_y" / "empty.jsonl").write_text("")
    with pytest.warns(UserWarning) as caught:
        runs = load_all(roots=[tmp_path])
    assert [r["_path"] for r in runs] == [str(good)]
    messages = [str(w.message) for w in caught]
    assert any("broken.json" in m and "holds one JSON object" in m for m in messages)
    assert any("empty.jsonl" in m and "is empty" in m for m in messages)
    with pytest.raises(ResultsError, match="broken.json"):  # read alone, a bad file is an error naming it
        load(tmp_path / "lab_x" / "broken.json")


def test_results_are_appended_as_the_run_goes_and_a_resumed_run_continues_its_file(results_dir):
    rec = Recorder("lab_x", config={"size": 3})
    for i in range(3):
        rec.step(step=i, time_s=0.1, loss=3.0 - i)
    killed = load(rec.path)  # nothing saved yet: as if the process had been killed here
    assert [st["step"] for st in killed["steps"]] == [0, 1, 2] and not killed["complete"]
    with open(rec.path, "a") as f:  # killed in the middle of writing a line
        f.write('{"kind": "step", "step": 3, "ti')
    assert [st["step"] for st in load(rec.path)["steps"]] == [0, 1, 2]
    # Resumed from a checkpoint taken after step 1: step 2 runs again, then 3 and 4.
    again = Recorder("lab_x", config={"size": 3}, run_id=rec.run_id)
    for i in (2, 3, 4):
        again.step(step=i, time_s=0.2, loss=10.0 + i)
    again.metrics["done"] = True
    again.save()
    data = load(again.path)
    assert [st["step"] for st in data["steps"]] == [0, 1, 2, 3, 4]  # every step once
    assert [st["loss"] for st in data["steps"]] == [3.0, 2.0, 12.0, 13.0, 14.0]  # the last record of each step
    assert data["complete"] and len(data["resumes"]) == 1 and data["metrics"] == {"done": True}
    assert data["resumes"][0]["world_size"] == data["world_size"]
    assert len(list(results_dir.rglob("*.jsonl"))) == 1  # one file for the run


def test_a_run_that_stopped_itself_says_why(results_dir):
    rec = Recorder("lab_x")
    rec.step(step=0, time_s=0.1, loss=float("nan"))
    rec.stop("non-finite values at step 0", step=0)
    data = load(rec.path)
    assert data["stopped"] == "non-finite values at step 0" and data["steps"][0]["loss"] == "nan"


def test_the_results_folder_is_checked_before_any_work(tmp_path):
    assert results.check_writable(tmp_path / "new") == tmp_path / "new"
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ResultsError, match="cannot write results under .*file.*NANODIST_RESULTS_DIR"):
        results.check_writable(blocker)


def test_reference_runs_are_read_only_when_asked_for(tmp_path, monkeypatch):
    mine = tmp_path / "results"
    reference = mine / "reference"  # as in the repository: labs/results/reference/ inside labs/results/
    monkeypatch.setattr(results, "REFERENCE_DIR", reference)
    monkeypatch.setenv("NANODIST_RESULTS_DIR", str(mine))
    write_run(mine / "lab_x", host="laptop")
    write_run(reference / "lab_x", host="gpu-box")
    assert [r["hardware"]["hostname"] for r in load_all("lab_x")] == ["laptop", "gpu-box"]
    assert [r["hardware"]["hostname"] for r in load_all("lab_x", include_reference=False)] == ["laptop"]


def test_provenance_names_machine_backend_world_and_date():
    record = {"world_size": 2, "nnodes": 1, "backend": "nccl", "created": "2026-11-23T10:00:00+00:00",
              "hardware": {"cpu_model": "AMD EPYC 9454", "cpu_logical_cores": 16, "gpu_names": ["NVIDIA H100", "NVIDIA H100"],
                           "torch": "2.11.0"}}
    line = results.provenance(record)
    assert line == ("Measured on AMD EPYC 9454 (16 cores, 2 x NVIDIA H100), nccl, 2 ranks, torch 2.11.0, "
                    "2026-11-23.")
    record.update(world_size=1, nnodes=1, backend="gloo")
    record["hardware"].update(gpu_names=[], cpu_logical_cores=2)
    assert "(2 cores, no GPU), gloo, 1 rank," in results.provenance(record)
    record.update(world_size=4, nnodes=2)
    assert "4 ranks on 2 nodes" in results.provenance(record)


def test_the_repository_ships_reference_runs_that_the_chapters_draw():
    from nanodist.results import beside, is_reference, machine, references
    for lab in ("lab01_ranks", "lab02_allreduce", "lab03_ddp", "lab04_zero", "lab05_fsdp", "lab06_checkpoint"):
        refs = references(lab)
        assert refs, f"no reference run of {lab} under labs/results/reference/"
        for r in refs:
            assert is_reference(r) and r["complete"] and r["hardware"]["cpu_model"]
            assert not any(str(a).startswith(("/tmp", "/home", "/work")) for a in r["argv"]), r["argv"]
    ref = references("lab03_ddp", match=lambda r: "speedup" in r["metrics"])[0]
    mine = {**ref, "hardware": {**ref["hardware"], "cpu_model": "My CPU", "cpu_logical_cores": 8}}
    mine.pop("_path")
    table = beside(mine, [ref], {"speedup": lambda r: r["metrics"]["speedup"], "missing": lambda r: r["metrics"]["x"]})
    assert [row["run"] for row in table] == ["this run", "reference"]
    assert table[0]["measured on"] == "My CPU (8 cores)" and table[1]["measured on"] == machine(ref)
    assert table[0]["speedup"] == round(ref["metrics"]["speedup"], 3) and table[0]["missing"] is None
    assert not is_reference(mine)


def test_a_printed_results_path_carries_no_machines_folders(tmp_path, monkeypatch):
    """Labs print "wrote <path>": relative from the repository and from book/ (a committed notebook shows it),
    whole for a folder elsewhere, and nothing on ranks that wrote nothing."""
    from nanodist.results import shown
    repo = tmp_path / "repo"
    (repo / "book").mkdir(parents=True)
    written = repo / "labs" / "results" / "lab03_ddp" / "run.jsonl"
    monkeypatch.chdir(repo)
    assert shown(written) == os.path.join("labs", "results", "lab03_ddp", "run.jsonl")
    monkeypatch.chdir(repo / "book")
    assert shown(written) == os.path.join("..", "labs", "results", "lab03_ddp", "run.jsonl")
    elsewhere = tmp_path.parent / "nanodist-results-x" / "run.jsonl"
    assert shown(elsewhere) == str(elsewhere)
    assert shown(None) == ""
