"""Lab 3 end to end: three DDP implementations train identically; bad input gets a clear message."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import nanodist as nd
from nanodist.results import load_all
from nanodist.testing import run_script, within
from wandb_offline import history as wandb_history

LAB = Path(__file__).resolve().parents[1] / "labs" / "lab03_ddp.py"
SMALL = ["--model", "tiny", "--micro-batch", "2", "--seq-len", "16", "--steps", "5", "--no-progress"]
pytestmark = pytest.mark.dist


def run_lab(args, results_dir, extra_env=None):
    env = {**os.environ, "NANODIST_RESULTS_DIR": str(results_dir), **(extra_env or {})}
    env = {k: v for k, v in env.items() if v is not None}  # None: unset the variable
    if "PYTHONPATH" in (extra_env or {}):  # it changes what the lab imports: a fresh interpreter
        return subprocess.run([sys.executable, str(LAB), *args], capture_output=True, text=True, timeout=120,
                              env=env)
    return run_script(LAB, args, env=env, timeout=120)  # forked from a process that imported torch


@pytest.mark.numerical
def test_all_implementations_in_one_run_train_identically(results_dir):
    run = nd.launch("lab03_ddp", nproc=2, args=SMALL + ["--timeline", "--verify"], timeout=120, echo=False)
    m = run.results["metrics"]
    v = m["verify"]  # N x b == 1 x Nb: gradients and (SGD) parameters equal up to rounding
    assert len(v["max_abs_diff"]) == 5
    # absolute differences of O(0.1) values summed in another order (two half-batches, then the average): a few
    # fp32 roundings, below 6e-7 measured on five CPU kernel paths; 1e-5 keeps a margin of 16
    within("lab03 N x b vs 1 x Nb: largest gradient and parameter difference over 5 steps",
           [max(v["max_abs_diff"]), max(v["grad_max_abs_diff"])], [0.0, 0.0], 1e-5,
           "absolute, in units of 1: fp32 roundings of a two-way split sum", abs_floor=1.0)
    # and the same bound fails the planted error (rank 0's gradient x 1.001) at the first step
    with pytest.raises(AssertionError, match="beyond the tolerance"):
        within("lab03 planted error (must fail): largest gradient difference at step 0",
               [v["planted_grad_max_abs_diff"]], [0.0], 1e-5, "as above", abs_floor=1.0)
    # on CPU ranks of one machine nanodist reduces through shared memory, and nanodist-pg, like torch, through gloo
    assert set(m["impls"]) == {"single", "torch", "nanodist", "nanodist-pg", "naive"}
    assert m["impls"]["nanodist"]["transport"] == "shared memory"
    assert m["impls"]["nanodist-pg"]["transport"] == "the process group"
    curves = {k: m["impls"][k]["losses"] for k in ("torch", "nanodist", "nanodist-pg", "naive")}
    for k in ("nanodist", "nanodist-pg", "naive"):
        within(f"lab03 5 losses, {k} DDP vs torch DDP", curves[k], curves["torch"], 1e-4,
               "torch's buckets and ours sum the same gradients, the naive one per tensor: AdamW trajectories")
    assert curves["torch"][-1] < curves["torch"][0]
    assert m["impls"]["single"]["world_size"] == 1 and m["impls"]["torch"]["world_size"] == 2
    for key in ("ratio_nanodist_vs_torch", "ratio_nanodist_pg_vs_torch", "ratio_naive_vs_torch", "speedup",
                "efficiency", "ratio_divergence_tracking_vs_step", "ratio_local_finite_check_vs_step"):
        assert m[key] > 0
    assert m["efficiency"] == pytest.approx(m["speedup"] / 2)
    assert m["baseline_source"] == "same run"
    timeline = m["impls"]["nanodist"]["timeline"]
    assert len(timeline) == 5 * len(m["impls"]["nanodist"]["buckets"])
    assert len(run.results["steps"]) == 5 and run.results["steps"][0]["tokens_per_s"] > 0
    printed = "\n".join(run.lines(0))
    assert "ratio nanodist/torch DDP throughput:" in printed and "weak-scaling efficiency" in printed
    assert "ratio local-gradient finiteness check / nanodist DDP step:" in printed
    # MFU on a CPU: against the matmul rate measured in the rank's own process
    assert "MFU against this CPU's measured fp32 matmul rate (1 thread(s))" in printed
    for r in m["impls"].values():
        assert 0 < r["mfu"] < 1.5 and r["tflops_per_rank"] > 0
        assert r["tflops_per_rank"] == pytest.approx(r["tokens_per_s"] * r["flops_per_token"] / r["world_size"] / 1e12)


def test_speedup_against_an_earlier_one_rank_run(results_dir):
    single = run_lab(SMALL + ["--impl", "single", "--scaling", "strong"], results_dir)
    assert single.returncode == 0, single.stderr
    # A later 1-rank run of another machine with the same hostname (virtual machines are all "vm"), ten times
    # faster: the speedup must not be taken against it.
    (path,) = (results_dir / "lab03_ddp").glob("*.jsonl")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    lines[0]["hardware"]["cpu_model"] += " (another machine)"
    lines[0]["run_id"] = "29991231T000000.000000-ffff"
    lines[0]["created"] = "2999-12-31T00:00:00+00:00"
    (metrics,) = [line for line in lines if line["kind"] == "metrics"]
    for r in metrics["impls"].values():
        r["tokens_per_s"] *= 10
    (path.parent / "29991231T000000.000000-ffff.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    run = nd.launch("lab03_ddp", nproc=2, args=SMALL + ["--impl", "nanodist", "--scaling", "strong"],
                    timeout=120, echo=False)
    m = run.results["metrics"]
    assert m["baseline_source"] == "an earlier 1-rank run"
    (one,) = [r for r in load_all("lab03_ddp", roots=[results_dir], include_reference=False)
              if r["world_size"] == 1 and "another machine" not in r["hardware"]["cpu_model"]]
    expected = m["tokens_per_s"] / one["metrics"]["impls"]["single"]["tokens_per_s"]
    assert m["speedup"] == pytest.approx(expected)
    # strong scaling: the same total batch, so 1 rank accumulates twice as many micro-steps
    assert one["metrics"]["impls"]["single"]["grad_accum"] == 2 * m["impls"]["nanodist"]["grad_accum"]


@pytest.mark.parametrize("args, message", [
    (["--total-batch", "1000"], "total batch of 1000 tokens is not a positive multiple of"),
    (["--impl", "fancy"], "invalid choice: 'fancy'"),
    (["--steps", "2"], "--steps must be more than 3"),
    (["--micro-batch", "512", "--seq-len", "512"], "token stream too small"),
    (["--data", "/no/such/file.txt"], "/no/such/file.txt"),
    (["--worlds", "1"], "--worlds and --micro-batches measure one data-parallel --impl"),
    (["--impl", "nanodist", "--worlds", "1", "--verify"], "without --verify"),
    (["--impl", "nanodist", "--worlds", "1", "2"], "2 rank(s) cannot be formed from this launch's 1"),
    (["--impl", "nanodist", "--micro-batches", "2", "2"], "distinct positive integers"),
    (["--impl", "torch", "--worlds", "1", "--timeline"], "--timeline records nanodist DDP's buckets"),
    (["--impl", "nanodist", "--scaling", "strong", "--total-batch", "64", "--micro-batches", "3"],
     "the total batch of 64 tokens does not split into 1 rank(s) x micro-batches of 3 x 16 tokens"),
])
def test_bad_input_is_a_clear_message(results_dir, args, message):
    out = run_lab(SMALL + ["--impl", "single"] + args, results_dir)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr


def test_wandb_missing_or_not_logged_in_does_not_stop_the_lab(results_dir, tmp_path):
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "wandb.py").write_text("raise ImportError('no wandb here')\n")
    out = run_lab(SMALL + ["--impl", "single", "--wandb"], results_dir, {"PYTHONPATH": str(fake)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("wandb is not installed") == 1
    not_logged_in = {"WANDB_DIR": str(tmp_path), "WANDB_API_KEY": None, "WANDB_MODE": None,
                     "NETRC": str(tmp_path / "none")}
    out = run_lab(SMALL + ["--impl", "single", "--wandb"], results_dir, not_logged_in)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("wandb is logging offline") == 1


def test_wandb_gets_one_complete_run_per_implementation(results_dir, tmp_path):
    nd.launch("lab03_ddp", nproc=2, args=SMALL + ["--wandb"], timeout=120, echo=False,
              env={"WANDB_DIR": str(tmp_path), "WANDB_MODE": "offline"})
    runs = sorted(tmp_path.rglob("run-*.wandb"))
    assert len(runs) == 5  # single, torch, nanodist, nanodist-pg, naive: one each, from rank 0 only
    for run in runs:
        assert [row["_step"] for row in wandb_history(run)] == [0, 1, 2, 3, 4]


def test_one_launch_measures_several_world_sizes_and_micro_batches(results_dir):
    """--worlds / --micro-batches (Chapter 8): every world size x micro-batch trained in turns on the launch's
    first N ranks; strong scaling keeps the global batch, so fewer ranks accumulate more micro-steps."""
    run = nd.launch("lab03_ddp", nproc=2, timeout=120, echo=False,
                    args=SMALL + ["--impl", "nanodist", "--scaling", "strong", "--total-batch", "128",
                                  "--worlds", "1", "2", "--micro-batches", "1", "2"])
    rows = run.results["metrics"]["sweep"]
    assert [(r["world_size"], r["micro_batch"]) for r in rows] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert [r["grad_accum"] for r in rows] == [8, 4, 4, 2]  # 128 tokens = world x micro-batch x 16 x accumulation
    assert all(len(r["step_times_s"]) == 5 - 3 and r["params"] > 0 for r in rows)  # the timed steps, after warm-up
    one = {r["micro_batch"]: r["tokens_per_s"] for r in rows if r["world_size"] == 1}
    for r in rows:
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / one[r["micro_batch"]])
        assert r["efficiency"] == pytest.approx(r["speedup"] / r["world_size"])


def test_a_sweep_with_a_timeline_times_the_backward_and_the_wait_for_the_buckets(results_dir):
    """--timeline in a sweep (Chapter 8's knee): rows above one rank carry the backward's time and what the step
    waited for its buckets -- rank 0's wait, and each step's shortest wait over the ranks (no slower peer in it)."""
    run = nd.launch("lab03_ddp", nproc=2, timeout=120, echo=False,
                    args=SMALL + ["--impl", "nanodist-pg", "--bucket-mb", "100", "--worlds", "1", "2",
                                  "--micro-batches", "1", "4", "--timeline"])
    rows = run.results["metrics"]["sweep"]
    keys = ("backward_s", "exposed_comm_s", "comm_span_s", "comm_s")
    assert [all(k in r for k in keys) for r in rows] == [False, False, True, True]
    for r in rows[2:]:
        assert 0 < r["backward_s"] < r["median_step_s"] and 0 < r["comm_s"] < r["median_step_s"]
        assert 0 < r["exposed_comm_s"] < r["median_step_s"] and r["buckets"] == 1
