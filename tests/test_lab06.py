"""Lab 6 under torchrun: a run killed by SIGKILL under torchrun --max-restarts=1 resumes bit for bit (DDP with a
sharded checkpoint and wandb, FSDP with an asynchronous sharded one; Chapter 6 also runs ZeRO with a full one);
sharded checkpoints reshard 2 -> 3 -> 1 ranks with every window read exactly once; bad flags are refused before
training."""
import random
import sys
from pathlib import Path

import pytest

import nanodist as nd
from nanodist.check import check_sampler_exactly_once
from nanodist.checkpoint import read_meta, verify

TINY = ["--model", "tiny", "--micro-batch", "2", "--seq-len", "16", "--no-progress", "--steps", "8",
        "--checkpoint-every", "4"]
LAUNCH_S = 120  # each launch bounds its own wait
REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- lab 6 under torchrun

_runs: dict = {}


def lab6(root: Path, key: str, nproc: int, args: list, restarts: int = 0, env: dict | None = None):
    """Run lab 6 once per key for the whole module (tests share the uninterrupted runs)."""
    if key not in _runs:
        results = root / "results"
        _runs[key] = nd.launch("lab06_checkpoint", nproc=nproc, args=TINY + args, timeout=LAUNCH_S, echo=False,
                               restarts=restarts, env={"NANODIST_RESULTS_DIR": str(results), **(env or {})})
    return _runs[key]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("lab6")


def straight(root: Path, impl: str):
    """The uninterrupted run at W = 2: sharded checkpoints at steps 4 and 8."""
    return lab6(root, f"straight-{impl}", 2, ["--impl", impl, "--checkpoint-dir", str(root / f"straight-{impl}")])


def per_step(rec: dict) -> dict:
    """step -> loss, keeping the last record of each step (what every reader of a resumed run does)."""
    return {s["step"]: s["loss"] for s in rec["steps"]}


# Chapter 6 kills and resumes DDP (sharded), ZeRO (full) and FSDP (sharded) and asserts the same (fingerprints,
# one results file, latest, no .tmp left, checksums). This module adds what a chapter cannot show: a random step
# to die at, wandb logging both attempts into one run, and an asynchronous save (which may not have committed
# when the rank dies: then the run starts over).
KILLED = {"ddp": ["--checkpoint-format", "sharded", "--wandb"],
          "fsdp": ["--checkpoint-format", "sharded", "--async-checkpoint"]}


@pytest.mark.dist
@pytest.mark.parametrize("impl", list(KILLED))
def test_a_run_killed_by_sigkill_resumes_bit_exactly_under_torchrun(root, impl):
    base = straight(root, impl)
    die_at = random.Random().randint(5, 7)  # any step: the property holds for all of them
    ck = root / f"killed-{impl}"
    wandb_dir = root / f"wandb-{impl}"
    wandb_dir.mkdir()
    run = lab6(root, f"killed-{impl}", 2, ["--impl", impl, "--checkpoint-dir", str(ck), "--die-at", str(die_at)]
               + KILLED[impl], restarts=1, env={"WANDB_DIR": str(wandb_dir), "WANDB_MODE": "offline"})
    why = f"{impl}, rank 1 killed before step {die_at}"
    assert run.restarts == 1, why
    assert "is about to be killed by SIGKILL" in run.output
    m, m0 = run.results["metrics"], base.results["metrics"]
    assert m["attempt"] == 1 and m["resumed"]["attempt"] == 1, why
    assert m["resumed"]["step"] == 4 or (impl == "fsdp" and m["resumed"]["step"] in (0, 4)), why
    # bitwise: SHA-256 of every parameter and optimizer-state tensor, whole
    assert m["fingerprint"] == m0["fingerprint"], why
    # one results file for the run, every step once, the loss curve identical
    rec = run.results
    assert rec["run_id"] == read_meta(ck / "step_00000008")["run_id"]
    assert len(rec["resumes"]) == 1 and rec["complete"]
    assert sorted(per_step(rec)) == list(range(8))
    assert per_step(rec) == per_step(base.results), why
    # the checkpoints: committed, latest at the end, nothing half-written left
    assert (ck / "latest").read_text().strip() == "step_00000008"
    assert not list(ck.glob(".tmp-*"))
    verify(ck / "step_00000008")
    if "--wandb" in KILLED[impl]:  # both attempts log into one wandb run (offline: two directories, one id)
        ids = {p.stem.split("-")[-1] for p in wandb_dir.rglob("run-*.wandb")}
        assert len(list(wandb_dir.rglob("run-*.wandb"))) == 2 and len(ids) == 1, ids


def exactly_once(segments: list[dict]) -> None:
    """Windows read by a chain of runs, each resumed where the checkpoint it loaded left off: with the sampler
    checker, every window of the epoch up to the last run's cursor is read exactly once, across world sizes."""
    read = []
    for seg, nxt in zip(segments, segments[1:] + [None]):
        stop = nxt["start"] if nxt else seg["stop"]
        mine = [[p for p in ps if p < stop] for ps in seg["positions"]]
        # within the segment, at its own world size: a distributed sampler's even split
        check_sampler_exactly_once([[p - seg["start"] for p in ps] for ps in mine], stop - seg["start"],
                                   drop_last=True)
        read += [p for ps in mine for p in ps]
    check_sampler_exactly_once([read], segments[-1]["stop"], drop_last=True)


@pytest.mark.dist
@pytest.mark.parametrize("impl", ["zero", "fsdp2"])  # nanodist.FSDP: Chapter 6 runs 2 -> 3 -> 1 and asserts it
def test_a_sharded_checkpoint_reshards_from_2_to_3_to_1_ranks(root, impl):
    base = straight(root, impl)
    first = root / f"straight-{impl}" / "step_00000004"
    at3 = lab6(root, f"at3-{impl}", 3, ["--impl", impl, "--checkpoint-dir", str(root / f"at3-{impl}"),
                                         "--checkpoint-every", "2", "--resume", str(first)])
    second = root / f"at3-{impl}" / "step_00000006"
    at1 = lab6(root, f"at1-{impl}", 1, ["--impl", impl, "--checkpoint-dir", str(root / f"at1-{impl}"),
                                         "--resume", str(second)])
    m3, m1 = at3.results["metrics"], at1.results["metrics"]
    # parameters and optimizer state equal at the load point (the fingerprint is of the whole tensors)
    assert read_meta(first)["world_size"] == 2 and read_meta(second)["world_size"] == 3
    assert m3["resumed"] == {**m3["resumed"], "step": 4, "world_size": 3,
                             "fingerprint": read_meta(first)["fingerprint"]}
    assert m1["resumed"] == {**m1["resumed"], "step": 6, "world_size": 1,
                             "fingerprint": read_meta(second)["fingerprint"]}
    assert m1["fingerprint"] == read_meta(root / f"at1-{impl}" / "step_00000008")["fingerprint"]
    # the data: every window of the epoch read once, across 2, then 3, then 1 rank(s)
    exactly_once([base.results["metrics"]["windows"], m3["windows"], m1["windows"]])
    assert m3["windows"]["world_size"] == 3 and m1["windows"]["world_size"] == 1
    # one run: the same results file goes on, each step once
    assert at1.results["run_id"] == at3.results["run_id"] == base.results["run_id"]
    assert [r["world_size"] for r in at1.results["resumes"]] == [3, 1]
    assert sorted(per_step(at1.results)) == list(range(8))


def _lab6_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("lab06_checkpoint", REPO / "labs" / "lab06_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_lab_refuses_bad_flags_before_training(tmp_path, monkeypatch):
    lab = _lab6_module()  # the flag checks, in-process (each launch costs seconds of start-up)
    for args, says in ((["--steps", "8"], "--checkpoint-dir is required"),
                       (["--checkpoint-dir", str(tmp_path), "--die-at", "1", "--die-rank", "1"], "--die-rank must be"),
                       (["--checkpoint-dir", str(tmp_path), "--die-at", "20", "--die-rank", "0"],
                        "--die-at must be a step between 1"),
                       (["--checkpoint-dir", " "], "--checkpoint-dir is empty")):
        monkeypatch.setattr(sys, "argv", ["lab06_checkpoint.py", "--model", "tiny", *args])
        _, parsed = lab.parse_args()
        assert says in (lab.check(parsed, 1) or ""), args
    # and under torchrun: a directory that cannot be made fails before any training, naming it
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(nd.LaunchError) as e:
        nd.launch("lab06_checkpoint", nproc=1, args=["--model", "tiny", "--micro-batch", "2", "--seq-len", "16",
                                                      "--no-progress", "--checkpoint-dir",
                                                      str(tmp_path / "file" / "sub")],
                  timeout=LAUNCH_S, echo=False, env={"NANODIST_RESULTS_DIR": str(tmp_path / "r")})
    assert "is not writable" in str(e.value), str(e.value)
