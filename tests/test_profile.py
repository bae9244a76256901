"""--profile (nanodist.profile, experiment.profile_step): the trace reader on traces built by hand (lanes,
collectives in launch order, the point-to-point messages inside nanodist's ring not counted, overlap computed by
hand, a GPU's kernels), the order check against nanodist's own record (and its failure on a reordered trace), the
annotation of nanodist's synchronous collectives, and the labs' --profile at 2 and 3 ranks: a trace per rank
under the results file's run id, the profiled step beside unprofiled ones, agreement with DDP's, ZeRO-2's and
FSDP's own records."""
import json

import pytest
import torch

import nanodist as nd
from nanodist import profile as prof
from nanodist.results import load_all

MAIN, GLOO = 11, 12


def span(name, ts, dur, tid=MAIN, cat="cpu_op", **args):
    return {"ph": "X", "name": name, "cat": cat, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def write(tmp_path, events, name="t.trace.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def cpu_trace():
    """A 100 us step: forward 0-30, backward 30-80 during which bucket 0 (1000 elements) is all-reduced by gloo
    on its own thread (40-70), a ring reduce-scatter of 600 elements on the step's thread 80-95 (its sends and
    receives inside it), and an all-gather launched at 96."""
    return [span(prof.STEP, 0, 100, cat="user_annotation"),
            span("aten::mm", 0, 30), span("autograd::engine::evaluate_function: MmBackward0", 30, 50),
            span("c10d::allreduce_", 40, 2, **{"Input Dims": [[[1000]], [], [], [], []]}),
            span("gloo:all_reduce", 40, 30, tid=GLOO, cat="user_annotation"),
            span("nanodist ring reduce_scatter (600 elements)", 80, 15, cat="user_annotation"),
            span("c10d::send", 81, 3, **{"Input Dims": [[[300]], [], []]}),
            span("c10d::recv_", 84, 3, **{"Input Dims": [[[300]], [], []]}),
            span("c10d::_allgather_base_", 96, 1, **{"Input Dims": [[800], [400], []]}),
            span("aten::add", 200, 5)]  # after the step: not in it


def test_a_cpu_trace_read_back_as_lanes_and_collectives(tmp_path):
    t = prof.read_trace(write(tmp_path, cpu_trace()))
    assert t.device == "cpu" and t.step_s == pytest.approx(100e-6)
    assert [(c.kind, c.numel, c.transport) for c in t.collectives] == [
        ("all_reduce", 1000, "process group"), ("reduce_scatter", 600, "ring"), ("all_gather", 800, "process group")]
    # communication: gloo 40-70 and the ring 80-95 = 45 us; compute: 0-80 (the c10d launch inside it does not
    # cut it: the backward span covers it) -> under compute: 40-70 = 30 of 45
    assert t.busy_s("communication") == pytest.approx(45e-6)
    assert t.busy_s("compute") == pytest.approx(80e-6)
    assert t.overlap() == pytest.approx(30 / 45)


def test_a_gpu_trace_takes_its_lanes_from_the_kernels(tmp_path):
    events = [span(prof.STEP, 0, 100, cat="user_annotation"),
              span("c10d::allreduce_", 10, 1, **{"Input Dims": [[[4096]], [], []]}),
              # launched from autograd's thread for the GPU, as a backward hook does
              span("c10d::_reduce_scatter_base_", 60, 1, tid=13, **{"Input Dims": [[64], [128], []]}),
              span("ampere_sgemm", 5, 50, tid=7, cat="kernel"),
              span("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 30, 40, tid=8, cat="kernel"),
              span("aten::mm", 0, 90)]  # the host's launches are not the GPU's lanes
    t = prof.read_trace(write(tmp_path, events))
    assert t.device == "cuda"
    assert t.busy_s("compute") == pytest.approx(50e-6) and t.busy_s("communication") == pytest.approx(40e-6)
    assert t.overlap() == pytest.approx(25 / 40)
    assert [(c.kind, c.numel) for c in t.collectives] == [("all_reduce", 4096), ("reduce_scatter", 128)]


def test_a_trace_without_the_step_marker_or_with_two_is_refused(tmp_path):
    with pytest.raises(ValueError, match="step_marker"):
        prof.read_trace(write(tmp_path, [span("aten::mm", 0, 10)]))
    two = [span(prof.STEP, 0, 10, cat="user_annotation"), span(prof.STEP, 20, 10, cat="user_annotation")]
    with pytest.raises(ValueError, match="2 'nanodist step' spans"):
        prof.read_trace(write(tmp_path, two))


def test_gloos_worker_threads_are_communication_not_compute(tmp_path):
    events = cpu_trace() + [span("aten::add_", 45, 10, tid=GLOO)]  # gloo reducing on its own thread
    t = prof.read_trace(write(tmp_path, events))
    assert t.busy_s("compute") == pytest.approx(80e-6)  # as without it


def test_no_communication_has_no_overlap(tmp_path):
    t = prof.read_trace(write(tmp_path, [span(prof.STEP, 0, 10, cat="user_annotation"), span("aten::mm", 0, 10)]))
    assert t.overlap() is None and t.collectives == []


def test_agreement_in_order_with_extras_and_its_failures():
    traced = [prof.Collective(k, n, i, "process group") for i, (k, n) in
              enumerate([("all_reduce", 10), ("all_reduce", 5), ("all_reduce", 20)])]
    ok = prof.agree(traced, [("all_reduce", 10), ("all_reduce", 20)])
    assert ok["agrees"] and ok["extra"] == [("all_reduce", 5)]
    swapped = prof.agree(traced, [("all_reduce", 20), ("all_reduce", 10)])
    assert not swapped["agrees"] and swapped["missing"] == ("all_reduce", 10) and swapped["matched"] == 1
    assert not prof.agree(traced, [("reduce_scatter", 10)])["agrees"]
    assert not prof.agree(traced, [])["agrees"]  # nothing to compare is not an agreement


def test_annotated_records_a_span_only_under_a_profiler(tmp_path):
    calls = []

    @prof.annotated("ring", "all_reduce", lambda a: a["t"].numel())
    def collective(t, scale=1.0):
        calls.append(scale)
        return t * scale

    assert torch.equal(collective(torch.ones(3), scale=2.0), torch.full((3,), 2.0))
    with torch.profiler.profile() as p, prof.step_marker():
        collective(torch.ones(7))
    p.export_chrome_trace(str(tmp_path / "a.trace.json"))
    t = prof.read_trace(tmp_path / "a.trace.json")
    assert [(c.kind, c.numel, c.transport) for c in t.collectives] == [("all_reduce", 7, "ring")]
    assert calls == [2.0, 1.0]


# ----------------------------------------------------------------------------- the labs' --profile

TINY = ["--model", "tiny", "--steps", "5", "--no-progress", "--profile"]


def profiled(results, lab, names, world):
    (rec,) = [r for r in load_all(lab, roots=[results], include_reference=False) if "profile" in r["metrics"]]
    prof_ = rec["metrics"]["profile"]
    assert sorted(prof_) == sorted(names)
    for name in names:
        assert len(prof_[name]) == world
        for rank, p in enumerate(prof_[name]):
            assert p["trace"] == f"{rec['run_id']}.{name}.rank{rank}.trace.json"
            assert (results / lab / p["trace"]).is_file()
            assert p["profiled_step_s"] > 0 and p["unprofiled_step_s"] > 0
            assert p["compute_s"] > 0 and p["communication_s"] > 0 and 0 <= p["overlap"] <= 1
    return rec, prof_


@pytest.mark.dist
def test_lab03_profiles_nanodist_and_torch_ddp_and_agrees_with_the_bucket_timeline(results_dir):
    run = nd.launch("lab03_ddp", nproc=2, args=TINY + ["--impl", "all", "--no-baseline", "--bucket-mb", "0.1", "--timeline"],
                    timeout=120, echo=False)
    rec, p = profiled(results_dir, "lab03_ddp", ["nanodist", "torch"], 2)
    for rank in range(2):
        a = p["nanodist"][rank]["agreement"]
        assert a["agrees"] and a["of"] == len(rec["metrics"]["impls"]["nanodist"]["buckets"]) > 1, a
        assert p["torch"][rank]["agreement"] is None  # torch DDP: nothing of nanodist's to compare
    printed = "\n".join(run.lines(0))
    assert "profile nanodist: profiled step" in printed and "unprofiled" in printed and "the same order" in printed
    # The check can fail: the same trace with two of its bucket all-reduces launched the other way round.
    trace = json.loads((results_dir / "lab03_ddp" / p["nanodist"][0]["trace"]).read_text())
    launches = [e for e in trace["traceEvents"] if e.get("name") == "c10d::allreduce_" or
                str(e.get("name", "")).startswith("nanodist shm all_reduce")]
    sizes = [c["numel"] for c in p["nanodist"][0]["collectives"]]
    first, second = sorted(launches, key=lambda e: e["ts"])[:2]
    first["ts"], second["ts"] = second["ts"], first["ts"]
    path = results_dir / "swapped.trace.json"
    path.write_text(json.dumps(trace))
    swapped = prof.read_trace(path)
    record = [tuple(x) for x in p["nanodist"][0]["own_record"]]
    assert sizes[0] != sizes[1]  # (the tiny model's first two launches differ in size: the swap shows)
    assert not prof.agree(swapped.collectives, record)["agrees"]


@pytest.mark.dist
def test_lab04_profiles_zero2_at_three_ranks(results_dir):
    nd.launch("lab04_zero", nproc=3, args=TINY + ["--opt", "dist-adamw", "--bucket-mb", "0.1"], timeout=120, echo=False)
    _, p = profiled(results_dir, "lab04_zero", ["dist-adamw"], 3)
    for mine in p["dist-adamw"]:
        a = mine["agreement"]
        assert a["agrees"] and a["of"] > 1 and all(k == "reduce_scatter" for k, _ in mine["own_record"]), a


@pytest.mark.dist
def test_lab05_profiles_fsdp_and_agrees_with_its_events(results_dir):
    nd.launch("lab05_fsdp", nproc=2, args=TINY + ["--impl", "fsdp"], timeout=120, echo=False)
    _, p = profiled(results_dir, "lab05_fsdp", ["fsdp"], 2)
    for mine in p["fsdp"]:
        kinds = [k for k, _ in mine["own_record"]]
        assert mine["agreement"]["agrees"] and "all_gather" in kinds and "reduce_scatter" in kinds, mine["agreement"]


@pytest.mark.parametrize("lab,args", [("lab03_ddp", ["--impl", "nanodist", "--worlds", "1"]),
                                      ("lab04_zero", ["--memory-only"]),
                                      ("lab05_fsdp", ["--timeline"])])
def test_profile_with_a_mode_that_trains_no_timed_step_is_refused(lab, args, results_dir):
    from nanodist.testing import run_script
    out = run_script(f"labs/{lab}.py", TINY + args, timeout=120)
    assert out.returncode == 2 and "--profile" in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


def test_without_profile_no_trace_is_written(results_dir):
    from nanodist.testing import run_script
    out = run_script("labs/lab03_ddp.py", ["--model", "tiny", "--steps", "4", "--no-progress", "--impl", "nanodist"],
                     timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert not list(results_dir.rglob("*.trace.json"))
    (rec,) = load_all("lab03_ddp", roots=[results_dir], include_reference=False)
    assert "profile" not in rec["metrics"]


def test_a_world_of_one_profiles_compute_only_and_says_nothing_travels(results_dir):
    from nanodist.testing import run_script
    out = run_script("labs/lab03_ddp.py", TINY + ["--impl", "nanodist"], timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    (rec,) = load_all("lab03_ddp", roots=[results_dir], include_reference=False)
    (mine,) = rec["metrics"]["profile"]["nanodist"]
    assert mine["own_record"] == [] and mine["agreement"] is None and mine["collectives"] == []
    assert mine["overlap"] is None and mine["compute_s"] > 0
    assert "nothing travels in a world of one" in out.stdout


def test_the_committed_gpu_traces_read_back_as_their_runs_recorded():
    """The H200's traces (labs/results/reference/, gzip-compressed) give the collectives, lanes and agreement
    their runs recorded when read here, on any machine: the reader is the one that made the figures."""
    from nanodist.results import REFERENCE_DIR, references
    seen = 0
    for lab in ("lab03_ddp", "lab04_zero", "lab05_fsdp"):
        for rec in references(lab, match=lambda r: r["device"] == "cuda" and "profile" in r["metrics"]):
            for name, ranks in rec["metrics"]["profile"].items():
                for mine in ranks:
                    path = REFERENCE_DIR / lab / (mine["trace"] + ".gz")
                    if not path.is_file():
                        continue
                    t = prof.read_trace(path)
                    assert t.device == "cuda"
                    assert [(c.kind, c.numel) for c in t.collectives] == [
                        (c["kind"], c["numel"]) for c in mine["collectives"]]
                    assert t.busy_s("compute") == pytest.approx(mine["compute_s"])
                    assert t.busy_s("communication") == pytest.approx(mine["communication_s"])
                    assert t.overlap() == pytest.approx(mine["overlap"])
                    if mine["own_record"]:
                        again = prof.agree(t.collectives, [tuple(x) for x in mine["own_record"]])
                        assert again["agrees"] and mine["agreement"]["agrees"], (lab, name, again)
                    seen += 1
    assert seen >= 10  # DDP (nanodist's, torch's), ZeRO-2, DDP + AdamW, FSDP, FSDP2 traces of the H200
