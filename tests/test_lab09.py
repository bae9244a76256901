"""Lab 9 end to end at a tiny size on two gloo ranks: the GPT split as TP, TP + SP and with the vocabulary split equals
one process; one block's collectives equal the formula's; its saved activations equal the formula's; the step-time
part trains DP, TP and TP + SP from the same weights on the same batches. Chapter 9 runs the lab on four ranks (TP =
4 and the 2 x 2 mesh). Bad flags are refused before any process group starts."""
import os
import subprocess
import sys

import pytest

import nanodist as nd
from nanodist.results import REPO_ROOT

pytestmark = pytest.mark.dist
TINY = ["--model", "tiny", "--seq-len", "16", "--batch", "4", "--micro-batch", "2", "--no-progress"]


@pytest.mark.numerical
def test_lab09_proves_its_set_ups_and_measures_them(tmp_path):
    run = nd.launch("lab09_tp", nproc=2, timeout=180, echo=False, env={"NANODIST_RESULTS_DIR": str(tmp_path)},
                    args=TINY + ["--parts", "equivalence", "traffic", "memory", "time", "--steps", "5"])
    m = run.results["metrics"]
    assert m["tp_sizes"] == [1, 2]
    names = {(r["tp"], r["set-up"]) for r in m["equivalence"]}
    assert (2, "TP + SP, vocabulary split") in names and (2, "MLP: nanodist vs torch's parallelize_module") in names
    assert all(r["worst_gradient"] <= r["tolerance"] for r in m["equivalence"]), m["equivalence"]
    # one block at TP = 2: 2 + 2 all-reduces of B x T x C fp32 values, exactly
    S = 4 * 16 * 64 * 4
    plain = next(r for r in m["traffic"] if r["tp"] == 2 and not r["sequence_parallel"])
    assert plain["equal"] and plain["counted"] == [["backward", "all-reduce", S, 2], ["forward", "all-reduce", S, 2]]
    assert plain["ring_bytes_counted"] == 4 * S  # 4 all-reduces, each 2 (n - 1) / n = 1 of S per rank at n = 2
    assert all(r["equal"] for r in m["traffic"]), m["traffic"]
    for r in m["memory"]:
        assert max(r["measured_per_rank"]) == r["formula"]["total"], r
    t = m["time"]
    runs = t["runs"]
    assert set(runs) == {"DP (nanodist DDP)", "TP = 2", "TP = 2 + SP"}
    assert len({r["tokens_per_step"] for r in runs.values()}) == 1  # the same global batch
    assert all(len(r["step_times_s"]) == 5 - 3 for r in runs.values())
    # TP and TP + SP compute the same steps as one process would: equal to each other within rounding
    tp, sp = runs["TP = 2"]["losses"], runs["TP = 2 + SP"]["losses"]
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(tp, sp)), (tp, sp)
    assert t["ratio_step_tp_vs_dp"] > 0 and t["bytes_per_step"]["tp"] > 0 and t["bytes_per_step"]["dp"] > 0
    # collectives a step: TP 2 + 2 a block; SP 16 a block (4 forward, 6 + 6 backward) and 4 around the blocks (the
    # final gather, the split's gradient, the final norm's weight and bias); DDP one a bucket and its control numbers
    calls = t["collectives_per_step"]
    assert (calls["tp"], calls["tp_sp"]) == (2 * 4, 2 * 16 + 4) and calls["dp"] >= 2, calls


@pytest.mark.parametrize("args, message", [
    (["--tp-sizes", "3"], "3 rank(s) cannot be formed from this launch's 1"),
    (["--parts", "time"], "run 2 or more"),
    (["--batch", "0"], "--batch must be a positive integer"),
])
def test_lab09_bad_flags_are_a_clear_message(tmp_path, args, message):
    out = subprocess.run([sys.executable, str(REPO_ROOT / "labs" / "lab09_tp.py"), *TINY, "--steps", "5", *args],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "NANODIST_RESULTS_DIR": str(tmp_path)})
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr
