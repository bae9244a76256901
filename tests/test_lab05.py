"""Lab 5 end to end at a tiny size: DDP, ZeRO-2, nanodist FSDP and torch FSDP2 taking turns on two gloo ranks, with a
budget; and its memory (stages 0-3 against the formula), timeline and activation-checkpointing modes on three ranks."""
import os
import subprocess
import sys

import pytest

import nanodist as nd
from nanodist.memory import zero_memory_bytes
from nanodist.results import REPO_ROOT
from nanodist.testing import within

pytestmark = pytest.mark.dist
TINY = ["--model", "tiny", "--micro-batch", "2", "--seq-len", "16", "--no-progress"]


@pytest.mark.numerical
def test_lab05_compares_four_implementations_within_a_budget(tmp_path):
    run = nd.launch("lab05_fsdp", nproc=2, timeout=120, echo=False, env={"NANODIST_RESULTS_DIR": str(tmp_path)},
                    args=TINY + ["--steps", "5", "--budget", "0.5"])
    rec = run.results
    m = rec["metrics"]
    impls = m["impls"]
    assert set(impls) == {"ddp", "zero1", "zero2", "fsdp", "fsdp2"}
    # the same weights and data: all four take the same steps (FSDP's shards add in another order: allclose)
    for name in ("zero1", "zero2", "fsdp", "fsdp2"):
        within(f"lab05 5 losses, {name} vs DDP", impls[name]["losses"], impls["ddp"]["losses"], 1e-4,
               "the same sums in other orders (shards, buckets): rounding-level differences through 5 AdamW steps")
    n = impls["ddp"]["params"]
    assert impls["fsdp"]["params"] == impls["fsdp2"]["params"] == n
    for mem in impls["ddp"]["memory"]:
        assert mem["params"] == mem["grads"] == 4 * n and mem["peak"] > mem["held"]
    for mem in impls["fsdp"]["memory"]:  # 1/2 of everything, up to each unit's padding
        assert 4 * n / 2 <= mem["params"] == mem["grads"] < 4 * n / 2 + 4 * 8
        assert mem["gathered_max"] > 0 and mem["activations_max"] > 0
    assert 0.45 < m["ratio_states_fsdp_vs_ddp"] <= 0.52
    assert m["ratio_bytes_sent_fsdp_vs_ddp"] == pytest.approx(1.5, rel=0.02)  # 3 (N-1)/N x model vs 2 (N-1)/N
    assert m["bytes_per_step_predicted"]["fsdp"] == pytest.approx(1.5 * m["bytes_per_step_predicted"]["ddp"])
    for b in impls["fsdp"]["peak_bound"]:
        assert b["peak"] <= b["bound"]
    assert m["ratio_step_fsdp_vs_fsdp2"] > 0
    fits = {name: r["fits_budget"] for name, r in impls.items()}
    peaks = {name: max(mem["peak"] for mem in r["memory"]) for name, r in impls.items()}
    assert fits == {name: p <= 0.5 * 2**20 for name, p in peaks.items()}
    out = run.output
    for line in ("ratio nanodist FSDP / torch FSDP2 step time:", "ratio bytes each rank sends per step, FSDP / DDP",
                 "ratio parameters + gradients + optimizer state per rank, FSDP / DDP:", "nanodist FSDP peak per rank"):
        assert line in out
    assert len(rec["steps"]) == 5


def test_lab05_memory_stages_timeline_and_checkpointing(tmp_path):
    run = nd.launch("lab05_fsdp", nproc=3, timeout=120, echo=False, env={"NANODIST_RESULTS_DIR": str(tmp_path)},
                    args=TINY + ["--steps", "4", "--memory-only", "--timeline", "--checkpointing-compare"])
    m = run.results["metrics"]
    assert "impls" not in m
    stages = {r["stage"]: r for r in m["memory"]}
    assert set(stages) == {0, 1, 2, 3}
    for stage, r in stages.items():
        n = r["num_params"]
        f = zero_memory_bytes(n, 3, stage, 4, 4, 8)
        assert r["formula"] == f
        for mem in r["memory"]:  # up to the padding of uneven shards (at most a few elements per piece)
            assert mem["params"] == pytest.approx(f["params"], abs=4 * 64)
            assert mem["grads"] == pytest.approx(f["grads"], abs=4 * 64)
            assert mem["optimizer_state"] - mem["optimizer_state_scalars"] == pytest.approx(f["optimizer_state"],
                                                                                            abs=8 * 64)
    t = m["timeline"]
    for mode in ("prefetch", "no_prefetch"):
        events = t[mode]["events"]
        units = [u["name"] for u in t[mode]["units"]]
        assert units == ["blocks.0", "blocks.1", "root"]
        reduced = [e["unit"] for e in events if e["event"] == "reduced"]
        assert sorted(reduced) == sorted(units)  # every unit's gradient reduced once in the step
        gathers = [e["unit"] for e in events if e["event"] == "gather_started"]
        assert gathers == ["root", "blocks.0", "blocks.1", "blocks.1", "blocks.0"]  # forward, then backward
    c = m["checkpointing"]
    assert c["on"]["activations_max"] < c["off"]["activations_max"]
    assert c["on"]["median_step_s"] > 0 and c["off"]["median_step_s"] > 0


def test_lab05_with_one_rank_keeps_its_metrics(tmp_path):
    """One process has nothing to send: the lab says so instead of dividing by zero after the whole comparison."""
    run = nd.launch("lab05_fsdp", nproc=1, timeout=120, echo=False, env={"NANODIST_RESULTS_DIR": str(tmp_path)},
                    args=TINY + ["--steps", "4"])
    m = run.results["metrics"]
    assert set(m["impls"]) == {"ddp", "zero1", "zero2", "fsdp", "fsdp2"} and "ratio_bytes_sent_fsdp_vs_ddp" not in m
    assert "bytes sent per step: none with one rank" in run.output and m["ratio_states_fsdp_vs_ddp"] > 0.9


def test_lab05_worlds_times_one_implementation_at_several_world_sizes(tmp_path):
    """--worlds without --memory-only (Chapter 8's Amdahl fit): one implementation's step at each world size, in
    turns, the same total batch at each (strong scaling), speedups against the 1-rank row."""
    run = nd.launch("lab05_fsdp", nproc=2, timeout=120, echo=False, env={"NANODIST_RESULTS_DIR": str(tmp_path)},
                    args=TINY + ["--impl", "fsdp", "--steps", "5", "--worlds", "1", "2", "--total-batch", "128"])
    m = run.results["metrics"]
    assert m["impl"] == "fsdp" and m["scaling"] == "strong"
    rows = m["sweep"]
    assert [(r["world_size"], r["grad_accum"]) for r in rows] == [(1, 4), (2, 2)]  # 128 = N x 2 x 16 x accumulation
    assert rows[0]["speedup"] == 1 and rows[1]["speedup"] == pytest.approx(rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"])
    assert all(len(r["step_times_s"]) == 5 - 3 for r in rows)


@pytest.mark.parametrize("args, message", [
    (["--worlds", "1"], "--worlds without --memory-only times one --impl"),
    (["--impl", "fsdp", "--worlds", "1", "--timeline"], "not with --timeline"),
    (["--impl", "fsdp", "--worlds", "1", "--budget", "20"], "--checkpointing-compare or --budget"),
    (["--impl", "fsdp", "--worlds", "2"], "2 rank(s) cannot be formed from this launch's 1"),
    (["--impl", "fsdp", "--worlds", "1", "--total-batch", "100"], "total batch of 100 tokens is not a positive multiple"),
])
def test_lab05_bad_worlds_is_a_clear_message(tmp_path, args, message):
    out = subprocess.run([sys.executable, str(REPO_ROOT / "labs" / "lab05_fsdp.py"), *TINY, "--steps", "5", *args],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "NANODIST_RESULTS_DIR": str(tmp_path)})
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr
