"""Memory accounting: the ZeRO formulas, and the bytes measured on real runs at world sizes 1, 2 and 4.

fp32 training without master weights: 4 bytes per parameter, 4 per gradient, 8 of AdamW state. Every
parameter of the tiny GPT has a multiple of 4 elements, so shards need no padding and the formula is
exact -- except for AdamW's step counters (one 4-byte tensor per parameter or shard), which the
formula ignores and measure_memory reports as optimizer_state_scalars.
"""
import pytest
import torch
import torch.distributed as dist

import nanodist as nd
from nanodist.memory import (MemoryReport, measure_memory, memory_table, optimizer_bytes_per_param, tensor_bytes,
                             zero_memory_bytes)
from nanodist.model import GPT, GPTConfig
from nanodist.optim import DistAdamW, make_muon_optimizer, split_params_for_muon
from nanodist.testing import spawn

FP32 = dict(param_bytes=4, grad_bytes=4, optim_bytes_per_param=8)


# ----------------------------------------------------------------------------- formulas

def test_the_zero_papers_figure_1():
    """7.5B parameters, 64 GPUs, mixed-precision Adam (K = 12): 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per GPU."""
    psi, n = 7.5e9, 64
    totals = [zero_memory_bytes(psi, n, s)["total"] / 1e9 for s in range(4)]
    assert totals == pytest.approx([120, 31.4, 16.6, 1.875], abs=0.05)
    s2 = zero_memory_bytes(psi, n, 2)
    assert s2["params"] == 2 * psi and s2["grads"] == 2 * psi / n and s2["optimizer_state"] == 12 * psi / n


def test_optimizer_bytes_per_param():
    assert optimizer_bytes_per_param("adamw", master_bytes=4) == 12
    assert optimizer_bytes_per_param("adamw") == 8
    assert optimizer_bytes_per_param("muon") == 4 and optimizer_bytes_per_param("sgd") == 0
    assert optimizer_bytes_per_param("adamw", state_bytes=2, master_bytes=4) == 8  # bf16 moments
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        optimizer_bytes_per_param("lion")
    with pytest.raises(ValueError, match="ZeRO stage must be one of"):
        zero_memory_bytes(10, 2, 4)


def test_tensor_bytes_counts_viewed_bytes_once():
    buffer = torch.zeros(11)  # e.g. a DDP bucket: two gradients and one bookkeeping element
    grads = [buffer[:4].view(2, 2), buffer[4:10]]
    assert tensor_bytes(grads) == 40
    assert tensor_bytes(grads + [buffer[2:6]]) == 40  # overlapping views count once
    assert tensor_bytes([buffer[::2]]) == 44  # a strided view spans the bytes between its elements
    seen = {}
    assert tensor_bytes([buffer[:4]], seen) == 16 and tensor_bytes([buffer[:8]], seen) == 16


def test_tensor_bytes_counts_a_shared_storage_once():
    a = torch.zeros(10)
    assert tensor_bytes([a, a[2:5], a.view(2, 5)]) == 40
    assert tensor_bytes([a, torch.zeros(3, dtype=torch.float64), torch.zeros(4, device="meta")]) == 64
    model = GPT(GPTConfig.preset("tiny", vocab_size=65))  # tied embedding / output layer
    assert measure_memory(model).params == 4 * model.num_params()


# ----------------------------------------------------------------------------- measured on real runs

def tiny_gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", vocab_size=64, block_size=16))  # every numel (and every FSDP unit) a multiple of 4


def one_step(model, opt, seed=0):
    g = torch.Generator().manual_seed(seed + nd.get_rank())
    x = torch.randint(0, 64, (2, 16), generator=g)
    _, loss = model(x, x)
    loss.backward()
    opt.step()
    report = measure_memory(model, opt)  # right after the step: parameters, gradients, state all alive
    opt.zero_grad(set_to_none=True)
    return report


def measure_all(rank, W):
    out = {}
    raw = tiny_gpt()
    model = nd.DDP(raw) if dist.is_initialized() else raw
    out["stage 0"] = one_step(model, torch.optim.AdamW(raw.configure_param_groups(0.1)))
    for stage in (1, 2):
        raw = tiny_gpt()
        opt = DistAdamW(raw.configure_param_groups(0.1), zero_stage=stage)
        out[f"stage {stage}"] = one_step(raw, opt)
        out[f"stage {stage} pieces"] = len(opt.local_pieces())
    raw = tiny_gpt()
    fsdp = nd.FSDP(raw, units=list(raw.blocks))  # every block a unit, the embeddings and the final norm the root
    out["stage 3"] = one_step(fsdp, torch.optim.AdamW(fsdp.configure_param_groups(0.1)))
    out["stage 3 pieces"] = len(list(fsdp.parameters()))
    raw = tiny_gpt()
    out["muon"] = one_step(raw, make_muon_optimizer(raw))
    out["num_params"] = raw.num_params()
    out["muon_params"] = sum(p.numel() for _, p in split_params_for_muon(raw)[0])
    out["num_tensors"] = len(list(raw.parameters()))
    if W > 1:
        out["dtensor"] = measure_sharded(rank, W)
    return out


def measure_sharded(rank, W):
    """A model whose parameter is a DTensor sharded over the ranks (as FSDP2 makes): its local shard counts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (W,))
    layer = torch.nn.Linear(8, 4 * W, bias=False)
    layer.weight = torch.nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Shard(0)]))
    layer.weight.grad = distribute_tensor(torch.ones(4 * W, 8), mesh, [Shard(0)])
    report = measure_memory(layer)
    return {"params": report.params, "grads": report.grads, "local_bytes": 4 * 8 * 4}


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda w: f"W{w}")
def measured(request):
    W = request.param
    if W == 1:  # a world of one needs no process group at all
        if dist.is_available() and dist.is_initialized():
            pytest.skip("a process group is active in this test process")
        return W, [measure_all(0, 1)]
    return W, spawn(measure_all, W, timeout=120)


@pytest.mark.dist
def test_measured_bytes_match_the_formulas_exactly(measured):
    W, outs = measured
    for rank, out in enumerate(outs):
        n, k = out["num_params"], out["num_tensors"]
        for stage in (0, 1, 2, 3):
            m: MemoryReport = out[f"stage {stage}"]
            f = zero_memory_bytes(n, W, stage, **FP32)
            assert (m.params, m.grads) == (f["params"], f["grads"]), (stage, rank, m)
            # AdamW's step counters: 4 bytes per parameter tensor (stage 0) or per shard this rank updates.
            pieces = k if stage == 0 else out[f"stage {stage} pieces"]
            assert m.optimizer_state_scalars == 4 * pieces
            assert m.optimizer_state - m.optimizer_state_scalars == f["optimizer_state"], (stage, rank, m)
            assert set(m.optimizer_state_by_key) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.dist
def test_stage2_keeps_a_gradient_shard_and_muon_keeps_one_momentum(measured):
    W, outs = measured
    total = lambda key, what: sum(getattr(out[key], what) for out in outs)  # noqa: E731
    n, n_muon = outs[0]["num_params"], outs[0]["muon_params"]
    assert total("stage 2", "grads") == 4 * n  # the shards, together one gradient
    assert total("stage 3", "params") == total("stage 3", "grads") == 4 * n  # FSDP: together, one model
    momentum = sum(out["muon"].optimizer_state_by_key.get("momentum_buffer", 0) for out in outs)
    assert momentum == 4 * n_muon  # each matrix's momentum on exactly one rank
    adam = sum(out["muon"].optimizer_state_by_key["exp_avg"] for out in outs)
    assert adam == 4 * (n - n_muon)


@pytest.mark.dist
def test_memory_table_puts_formula_next_to_measurement(measured):
    W, outs = measured
    runs = [{"label": f"stage {s}", "stage": s, "world_size": W, "rank": r, "num_params": out["num_params"],
             **out[f"stage {s}"].to_dict()} for r, out in enumerate(outs) for s in (0, 1, 2, 3)]
    table = memory_table(runs, **FP32)
    assert len(table) == 4 * W and table.columns[:4] == ["label", "stage", "world_size", "rank"]
    for row in table:
        assert row["grads_measured"] == row["grads_formula"]
        assert row["total_measured"] - row["state_scalars"] == row["total_formula"]
    assert "params_formula" in str(table)


@pytest.mark.dist
def test_a_sharded_model_counts_its_local_shard(measured):
    W, outs = measured
    if W == 1:
        pytest.skip("sharding needs more than one rank")
    for out in outs:
        d = out["dtensor"]
        assert d["params"] == d["local_bytes"] and d["grads"] == d["local_bytes"]


def test_bytes_per_param_and_the_zero_paper_figure():
    from nanodist.memory import bytes_per_param, memory_estimate_table
    assert bytes_per_param("mixed", "adamw") == {"param_bytes": 2, "grad_bytes": 2, "optim_bytes_per_param": 12}
    assert bytes_per_param("fp32", "adamw") == {"param_bytes": 4, "grad_bytes": 4, "optim_bytes_per_param": 8}
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        bytes_per_param("fp8")
    # ZeRO paper, Figure 1: 7.5B parameters on 64 GPUs, mixed-precision Adam: 120 / 31.4 / 16.6 / 1.9 GB
    rows = memory_estimate_table(7.5e9, world_sizes=[64], unit=1e9)
    assert [r["total"] for r in rows] == [120.0, 31.41, 16.64, 1.88]
    assert rows[0]["vs_ddp"] == 1.0 and rows[3]["vs_ddp"] == pytest.approx(1.88 / 120, abs=1e-3)


def test_memory_calculator_reacts_to_its_controls():
    from nanodist.memory import memory_calculator

    def widgets(w):
        yield w
        for child in getattr(w, "children", ()):
            yield from widgets(child)

    calc = memory_calculator(7e9, world_size=8, stage=2)
    assert repr(calc) == "memory calculator: 7e+09 params, 8 ranks, stage 2, mixed adamw: 24.45 GiB per rank"
    stage = next(w for w in widgets(calc) if getattr(w, "description", "") == "ZeRO stage")
    html = next(w for w in widgets(calc) if "<table>" in str(getattr(w, "value", "")))
    stage.value = 3  # 16 bytes x 7e9 / 8 ranks = 14e9 bytes
    assert repr(calc).endswith("stage 3, mixed adamw: 13.04 GiB per rank")
    assert "13.04" in html.value
    with pytest.raises(ValueError):
        memory_calculator(7e9, stage=5)


def test_muon_adamw_state_bytes():
    from nanodist.memory import muon_adamw_state_bytes
    assert muon_adamw_state_bytes(100, 0) == 800 and muon_adamw_state_bytes(100, 100) == 400
    assert muon_adamw_state_bytes(100, 40, world_size=4) == (4 * 40 + 8 * 60) / 4
    with pytest.raises(ValueError, match="num_muon <= num_params"):
        muon_adamw_state_bytes(10, 11)


# ----------------------------------------------------------------------------- activations, by autograd's hooks

def test_live_bytes_tracks_one_module_only():
    """track_module counts what one module saves for backward, however often and from wherever it is called,
    and nothing of the rest of the model; a forward that raises inside the module leaves no hooks behind."""
    from nanodist.memory import LiveBytes
    torch.manual_seed(0)
    first, second = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
    x = torch.randn(5, 8)
    live = LiveBytes()
    with live.track_module(second):
        h = torch.relu(first(x))  # relu saves its output: not `second`'s
        second(h).sum()
        second(h * 2).sum()  # called again: its input is saved again
    # `second` (a Linear) saves its input for the weight's gradient, (5, 16) floats, on each call
    assert live.saved_bytes() == 2 * 5 * 16 * 4
    everything = LiveBytes()
    with everything.track():
        second(torch.relu(first(x))).sum()
    assert everything.saved_bytes() > 5 * 16 * 4  # x for first's weight, relu's output: the module's is a part

    class Fails(torch.nn.Module):
        def forward(self, t):
            raise ValueError("planted")

    failing, failing_module = LiveBytes(), Fails()
    with failing.track_module(failing_module):
        with pytest.raises(ValueError, match="planted"):
            failing_module(x)
    second(torch.relu(first(x))).sum()  # untracked: a hook left on autograd's stack would count this
    assert failing.saved_bytes() == 0
