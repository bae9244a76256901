"""Lab 4 end to end at a tiny size: three optimizers, two gloo ranks, one results record."""
import pytest

import nanodist as nd

pytestmark = pytest.mark.dist


def test_lab04_trains_three_optimizers_and_records_memory(tmp_path):
    run = nd.launch("lab04_zero", nproc=2, timeout=240, echo=False, env={"NANODIST_RESULTS_DIR": str(tmp_path)},
                    args=["--model", "tiny", "--steps", "5", "--micro-batch", "4", "--seq-len", "16", "--no-progress"])
    assert list(tmp_path.glob("lab04_zero/*.json"))  # written where we asked
    rec = run.results
    assert rec["lab"] == "lab04_zero" and rec["world_size"] == 2 and rec["backend"] == "gloo"
    m = rec["metrics"]
    opts = m["opts"]
    assert set(opts) == {"ddp-adamw", "dist-adamw", "dist-muon"}
    for r in opts.values():
        assert len(r["losses"]) == 5 and r["median_step_s"] > 0 and r["val_loss"] is not None
        assert len(r["memory"]) == 2  # one report per rank
    # Same initial weights and data: DistAdamW follows DDP + AdamW step for step.
    assert opts["dist-adamw"]["losses"] == pytest.approx(opts["ddp-adamw"]["losses"], rel=1e-4)
    n = opts["ddp-adamw"]["params"]
    for mem in opts["ddp-adamw"]["memory"]:  # stage 0: everything replicated
        assert mem["params"] == mem["grads"] == 4 * n
        assert mem["optimizer_state"] - mem["optimizer_state_scalars"] == 8 * n
    zero = opts["dist-adamw"]["memory"]
    assert sum(mem["grads"] for mem in zero) >= 4 * n  # stage 2: each rank a shard of the gradient
    assert all(mem["grads"] <= 4 * n / 2 + 4 * 64 for mem in zero)  # (+ padding of odd-sized parameters)
    assert 0.45 < m["ratio_optimizer_state_dist_adamw_vs_adamw"] <= 0.52
    assert m["ratio_step_time_dist_adamw_vs_ddp_adamw"] > 0
    assert m["formula_fp32_adamw"]["stage2"]["grads"] == pytest.approx(4 * n / 2)
    out = run.output
    assert "ratio DistAdamW/DDP+AdamW step time:" in out and "(target <= 1.10)" in out
    assert "ratio optimizer-state bytes per rank DistAdamW/AdamW:" in out and "(target <= 0.52)" in out
    assert len(rec["steps"]) == 5
