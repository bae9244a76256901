"""Sharded optimizers (ZeRO): DistAdamW and DistMuon equal torch's AdamW and Muon fed the averaged gradient.

One spawn per world size (1, 2, 3, 4) runs every distributed check and returns what it measured; the
tests below assert on it. Gradients are multiples of 1/64 in [-1, 1), so their sums are exact in any
order: the averaged gradient is then bitwise the reference's, and the comparisons can be tight.
"""
import contextlib
import copy

import pytest
import torch
import torch.distributed as dist

import nanodist as nd
from nanodist.check import assert_params_in_sync
from nanodist.data import CharTokenizer, TokenStream, generate_corpus
from nanodist.model import GPT, GPTConfig
from nanodist.optim import (DistAdamW, DistMuon, ShardedOptimizer, make_muon_optimizer, newton_schulz,
                            newton_schulz_singular_values, split_params_for_muon)
from nanodist.optim.muon import _adjust_lr_rule, _newton_schulz
from nanodist.testing import spawn
from nanodist.train import TrainConfig, Trainer

WORLD_SIZES = (1, 2, 3)  # 3: uneven and empty slices (a (3,) and a () parameter); 4 on 2 cores: 16 s, no new case
ADAMW_SHAPES = [(7, 5), (3,), (), (10, 4), (1,), (2, 3)]
MUON_SHAPES = [(7, 5), (10, 4), (7, 5), (3, 9)]
# Why these tolerances: every gradient is a multiple of 1/64 in [-1, 1) (grads_for), so its sum over up to 4 ranks is
# exact in fp32 in any order, and the averaged gradient ours and torch's optimizer see is bitwise the same on every
# CPU. What is left is the optimizer's own elementwise arithmetic (AdamW: the foreach or fused kernel on slices vs
# torch's on whole tensors; Muon: the same bf16 Newton-Schulz on the same matrix): 1e-6 absolute after the steps,
# against parameters that each step moves by ~lr = 1e-2.
RTOL, ATOL = 1e-5, 1e-7


# ----------------------------------------------------------------------------- helpers (run in the workers)

def grads_for(shapes, step, world_size, seed=0):
    """Every rank's gradients at `step`: each rank can compute all of them, hence the exact average."""
    out = []
    for q in range(world_size):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + q)
        out.append([torch.randint(-64, 64, s, generator=g).float() / 64 for s in shapes])
    return out


def make_params(shapes, seed=1):
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=g) for s in shapes]
    return [torch.nn.Parameter(t.clone()) for t in init], [torch.nn.Parameter(t.clone()) for t in init]


def local(t):
    """This rank's part of a state tensor: state_dict() hands sharded AdamW state out as DTensors."""
    return t.to_local() if hasattr(t, "to_local") else t


def max_diff(a, b):
    return max(((x.detach() - y.detach()).abs().max().item() if x.numel() else 0.0) for x, y in zip(a, b))


def all_close(a, b, rtol=RTOL, atol=ATOL):
    return all(torch.allclose(x.detach(), y.detach(), rtol=rtol, atol=atol) for x, y in zip(a, b))


def adamw_groups(ps):
    # ps: the six ADAMW_SHAPES, then "never" (no rank ever has a gradient) and "only0" (rank 0 only).
    return [{"params": ps[:3] + [ps[6]], "lr": 1e-2, "weight_decay": 0.1},
            {"params": ps[3:6] + [ps[7]], "lr": 3e-3, "weight_decay": 0.0, "betas": (0.8, 0.99)}]


def check_adamw(rank, W, collectives, stage, bucket_mb, steps=20, fused=None):
    shapes = ADAMW_SHAPES + [(4,), (5,)]
    ps, rs = make_params(shapes)
    opt = DistAdamW(adamw_groups(ps), collectives=collectives, zero_stage=stage, bucket_cap_mb=bucket_mb, fused=fused)
    ref = torch.optim.AdamW(adamw_groups(rs), fused=fused)
    for t in range(steps + 1):
        gs = grads_for(shapes, t, W)
        for q in range(W):
            gs[q][6] = None
            if q != 0:
                gs[q][7] = None
        for i, p in enumerate(ps):
            p.grad = None if gs[rank][i] is None else gs[rank][i].clone()
        for i, r in enumerate(rs):
            present = [g[i] for g in gs if g[i] is not None]
            r.grad = sum(present) / W if present else None  # a missing gradient counts as zeros
        if t == steps:
            opt.record_next_step()
        opt.step()
        ref.step()
    order = [next(j for j, q in enumerate(ps) if q is p) for g in opt.param_groups for p in g["params"]]
    record_ok = True
    for e in opt.recorded:  # e["index"] counts parameters in param-group order
        j = order[e["index"]]
        mine, avg = gs[rank][j], rs[j].grad
        record_ok &= (e["grad"] is None) == (mine is None) and (mine is None or torch.equal(e["grad"], mine))
        record_ok &= torch.equal(e["param"], ps[j].detach())
        if e["piece"] is not None and avg is not None:
            a, n = e["piece"]
            record_ok &= torch.equal(e["updated_shard"], ps[j].detach().reshape(-1)[a:a + n])
            record_ok &= torch.equal(e["grad_shard"], avg.reshape(-1)[a:a + n])
    return {"close": all_close(ps, rs), "diff": max_diff(ps, rs), "record_ok": record_ok,
            "never_unchanged": torch.equal(ps[6].detach(), make_params(shapes)[0][6].detach()),
            "never_state": len(opt.state.get(ps[6], {})) + len(ref.state.get(rs[6], {})),
            "grads_after_step": [p.grad is not None for p in ps]}


def muon_groups(ps):
    return [{"params": ps[:3] + [ps[4]], "lr": 0.02, "weight_decay": 0.1},
            {"params": [ps[3]], "lr": 0.05, "weight_decay": 0.0, "nesterov": False, "adjust_lr_fn": "match_rms_adamw"}]


def check_muon(rank, W, collectives, stage, steps=20, batched=None):
    shapes = MUON_SHAPES + [(4, 4)]  # the last one never gets a gradient
    ps, rs = make_params(shapes, seed=2)
    few, few_ref = make_params([(6, 4), (4, 6)], seed=3)  # fewer matrices than ranks at W = 3, 4
    opt = DistMuon(muon_groups(ps), collectives=collectives, zero_stage=stage, batched=batched)
    opt_few = DistMuon(few, lr=0.03, ns_steps=4, collectives=collectives, zero_stage=stage)
    ref, ref_few = torch.optim.Muon(muon_groups(rs)), torch.optim.Muon(few_ref, lr=0.03, ns_steps=4)
    for t in range(steps):
        gs = grads_for(shapes + [(6, 4), (4, 6)], t, W, seed=5)
        for q in range(W):
            gs[q][4] = None
        for i, p in enumerate(ps + few):
            p.grad = None if gs[rank][i] is None else gs[rank][i].clone()
        for i, r in enumerate(rs + few_ref):
            r.grad = None if gs[0][i] is None else sum(g[i] for g in gs) / W
        for o in (opt, opt_few, ref, ref_few):
            o.step()
    owners = [pc.rank for pc in opt_few.local_pieces()]
    return {"diff": max_diff(ps + few, rs + few_ref), "never_state": len(opt.state.get(ps[4], {})),
            "few_owned_here": len(owners), "momentum_here": sorted(i for i, st in opt.state_dict()["state"].items() if st)}


def check_combined_clip(rank, W, steps=10):
    """One optimizer with an AdamW and a Muon group, max_grad_norm == clip_grad_norm_ over all, then torch's."""
    a_shapes, m_shapes = [(9,), (), (5, 3)], [(6, 4), (4, 6), (6, 4)]
    pa, ra = make_params(a_shapes, seed=7)
    pm, rm = make_params(m_shapes, seed=8)
    opt = ShardedOptimizer([{"params": pa, "kind": "adamw", "lr": 1e-2}, {"params": pm, "kind": "muon", "lr": 0.02}])
    opt.max_grad_norm = 0.5
    ref_a, ref_m = torch.optim.AdamW(ra, lr=1e-2), torch.optim.Muon(rm, lr=0.02)
    norms, ref_norms = [], []
    for t in range(steps):
        gs = grads_for(a_shapes + m_shapes, t, W, seed=11)
        for i, p in enumerate(pa + pm):
            p.grad = gs[rank][i].clone()
        for i, r in enumerate(ra + rm):
            r.grad = sum(g[i] for g in gs) / W
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ra + rm, 0.5).item())
        opt.step()
        ref_a.step()
        ref_m.step()
        norms.append(opt.last_grad_norm)
    return {"adamw_diff": max_diff(pa, ra), "adamw_close": all_close(pa, ra, rtol=1e-5, atol=1e-6),
            "muon_diff": max_diff(pm, rm), "norms": norms, "ref_norms": ref_norms,
            "lr_groups": [g["lr"] for g in opt.param_groups]}


def run_steps(opt, ps, shapes, start, steps, W, rank):
    for t in range(start, start + steps):
        gs = grads_for(shapes, t, W, seed=13)
        for i, p in enumerate(ps):
            p.grad = gs[rank][i].clone()
        opt.step()


def check_state_dict(rank, W):
    out = {}
    for kind, shapes, make in (
            ("adamw", ADAMW_SHAPES, lambda ps: DistAdamW(adamw_groups(ps + make_params([(4,), (5,)])[0]), lr=1e-2)),
            ("muon", MUON_SHAPES, lambda ps: DistMuon(ps, lr=0.02))):
        ps, _ = make_params(shapes, seed=17)
        opt = make(ps)
        run_steps(opt, ps, shapes, 0, 3, W, rank)
        saved = copy.deepcopy(opt.state_dict())
        snapshot = [p.detach().clone() for p in ps]
        run_steps(opt, ps, shapes, 3, 3, W, rank)
        qs = [torch.nn.Parameter(s.clone()) for s in snapshot]
        fresh = make(qs)
        fresh.load_state_dict(copy.deepcopy(saved))
        run_steps(fresh, qs, shapes, 3, 3, W, rank)
        pieces = {pc.param: pc.numel for pc in opt.local_pieces()}
        state = {i: st for i, st in saved["state"].items() if st}  # entries of what this rank keeps
        shard_only = set(state) <= set(pieces) and all(
            local(t).numel() in (1, pieces[i]) for i, s in state.items() for t in s.values() if torch.is_tensor(t))
        out[kind] = {"resume_diff": max_diff(ps, qs), "shard_only": shard_only, "saved": saved,
                     "state_numel": sum(local(t).numel() for s in state.values() for k, t in s.items() if k != "step")}
        if kind == "adamw":  # rank 0's shard, loaded on another rank: a clear error
            objs = [saved if rank == 0 else None]
            if W > 1:
                dist.broadcast_object_list(objs, src=0)
            try:
                make(make_params(shapes)[0]).load_state_dict(objs[0])
                out["wrong_rank_error"] = None
            except ValueError as e:
                out["wrong_rank_error"] = str(e)
    return out


def check_gpt_state_bytes(rank, W):
    """On a real model: the state this rank keeps is 1/W of torch.optim.AdamW's (plus padding and step counters)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", vocab_size=65, block_size=16))
    opt = DistAdamW(model.configure_param_groups(0.1))
    ref = torch.optim.AdamW(model.configure_param_groups(0.1))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    ref.step()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    size = lambda sd: sum(local(t).numel() * t.element_size() for s in sd["state"].values() for t in s.values())  # noqa
    return {"mine": size(opt.state_dict()), "adamw": size(ref.state_dict())}


def train_gpt(rank, W, which, steps=4):
    text = generate_corpus(20_000, seed=0)
    tok = CharTokenizer(text)
    tokens = torch.tensor(tok.encode(text))
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", vocab_size=tok.vocab_size, block_size=16))
    raw = model
    if which == "ddp-adamw":
        model = nd.DDP(raw)
        opt = torch.optim.AdamW(raw.configure_param_groups(0.1), lr=3e-3)
    elif which == "dist-adamw":
        opt = DistAdamW(raw.configure_param_groups(0.1), lr=3e-3)
    else:
        opt = make_muon_optimizer(raw, lr=3e-3, muon_lr=0.02)
    stream = TokenStream(tokens, batch_size=4, block_size=16, rank=rank, world_size=W, seed=0)
    cfg = TrainConfig(steps=steps, micro_batch=4, seq_len=16, total_batch_tokens=4 * 16 * W * 2, lr=3e-3,
                      warmup_steps=1, progress=False, log_every=0, grad_clip=0.5)
    history = Trainer(model, opt, stream, cfg).fit()
    try:
        assert_params_in_sync(raw)
        in_sync = None
    except AssertionError as e:
        in_sync = str(e)
    return {"losses": [h["loss"] for h in history], "not_in_sync": in_sync,
            "grad_norm": getattr(opt, "last_grad_norm", None)}


def error_of(fn):
    try:
        fn()
    except (ValueError, RuntimeError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def check_errors(rank, W):
    p32, p64 = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    meta = torch.nn.Parameter(torch.zeros(3, device="meta"))
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    sparse_opt = DistAdamW(emb.parameters())
    return {
        "dtype": error_of(lambda: DistAdamW([p32, p64])),
        "device": error_of(lambda: DistAdamW([p32, meta])),
        "sparse": error_of(sparse_opt.step),
        "muon_1d": error_of(lambda: DistMuon([torch.nn.Parameter(torch.zeros(3, 4)), p32])),
        "muon_3d": error_of(lambda: DistMuon([torch.nn.Parameter(torch.zeros(2, 3, 4))])),
        "torch_state": error_of(lambda: DistAdamW([p32]).load_state_dict(torch.optim.AdamW([p32]).state_dict())),
        "muon_loads_adamw": error_of(lambda: DistMuon([torch.nn.Parameter(torch.zeros(3, 4))]).load_state_dict(
            DistAdamW([torch.nn.Parameter(torch.zeros(3, 4))]).state_dict())),
    }


def check_subgroup(rank, W):
    """group=: ranks 0 and 1 of a larger world train alone; the others do not take part."""
    sub = dist.new_group([0, 1])  # every rank must call new_group, members or not
    if rank > 1:
        return None
    ps, rs = make_params(ADAMW_SHAPES)
    opt, ref = DistAdamW(ps, lr=1e-2, group=sub), torch.optim.AdamW(rs, lr=1e-2)
    ms, rms = make_params(MUON_SHAPES, seed=2)
    muon, ref_muon = DistMuon(ms, lr=0.02, group=sub), torch.optim.Muon(rms, lr=0.02)
    for t in range(5):
        gs = grads_for(ADAMW_SHAPES + MUON_SHAPES, t, 2)
        for i, p in enumerate(ps + ms):
            p.grad = gs[rank][i].clone()
        for i, r in enumerate(rs + rms):
            r.grad = (gs[0][i] + gs[1][i]) / 2
        for o in (opt, ref, muon, ref_muon):
            o.step()
    return {"world_size": opt.world_size, "diff": max_diff(ps + ms, rs + rms)}


def run_all(rank, W):
    out = {"adamw": {}, "muon": {}}
    for name, args in {"ring-stage2": ("auto", 2, 25.0), "torch-stage2-small-buckets": ("torch", 2, 1e-4),
                       "ring-stage1-small-buckets": ("ring", 1, 1e-4), "shm-stage2-small-buckets": ("shm", 2, 1e-4),
                       "shm-stage1": ("shm", 1, 25.0)}.items():
        out["adamw"][name] = check_adamw(rank, W, *args)
    out["adamw"]["fused-ring-stage2"] = check_adamw(rank, W, "auto", 2, 1e-4, fused=True)  # vs torch's fused AdamW
    for name, args in {"ring-stage2": ("auto", 2), "torch-stage1": ("torch", 1), "shm-stage2": ("shm", 2)}.items():
        out["muon"][name] = check_muon(rank, W, *args)
    out["muon_batched"] = check_muon(rank, W, "auto", 2, batched=True)
    out["combined_clip"] = check_combined_clip(rank, W)
    out["state_dict"] = check_state_dict(rank, W)
    out["gpt_state_bytes"] = check_gpt_state_bytes(rank, W)
    out["train"] = {which: train_gpt(rank, W, which) for which in ("ddp-adamw", "dist-adamw", "dist-muon")}
    out["errors"] = check_errors(rank, W)
    out["subgroup"] = check_subgroup(rank, W) if W >= 3 else None
    return out


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"W{w}")
def runs(request):
    """Every rank's results of run_all at one world size: one spawn per world size."""
    return request.param, spawn(run_all, request.param, timeout=120)


pytestmark = pytest.mark.dist


# ----------------------------------------------------------------------------- the tests

def test_dist_adamw_equals_torch_adamw_on_the_averaged_gradient(runs):
    W, outs = runs
    for rank, out in enumerate(outs):
        for name, r in out["adamw"].items():
            assert r["close"], f"W={W} rank {rank} {name}: max |diff| {r['diff']:.3g}"
            assert r["diff"] <= 1e-6, (W, rank, name, r["diff"])


def test_a_parameter_nobody_has_a_gradient_for_is_skipped_everywhere(runs):
    W, outs = runs
    for out in outs:
        for r in out["adamw"].values():
            assert r["never_unchanged"] and r["never_state"] == 0  # as torch.optim.AdamW: untouched, no state
        for r in out["muon"].values():
            assert r["never_state"] == 0


def test_stage2_consumes_the_gradients_and_stage1_leaves_the_averaged_ones(runs):
    W, outs = runs
    for out in outs:
        # A world of one steps straight from p.grad (no buffer, no copy) and leaves it, as torch's optimizers do.
        assert out["adamw"]["ring-stage2"]["grads_after_step"] == ([True] * 6 + [False, True] if W == 1 else [False] * 8)
        # stage 1: every parameter somebody had a gradient for holds the averaged gradient; "never" stays None
        assert out["adamw"]["ring-stage1-small-buckets"]["grads_after_step"] == [True] * 6 + [False, True]


def test_recorded_pipeline_buffers_match_the_step(runs):
    W, outs = runs
    for out in outs:
        assert all(r["record_ok"] for r in out["adamw"].values())


def test_dist_muon_equals_torch_muon(runs):
    W, outs = runs
    for rank, out in enumerate(outs):
        for name, r in out["muon"].items():
            # Bitwise-equal averaged gradients give identical bf16 Newton-Schulz inputs.
            assert r["diff"] <= 1e-6, f"W={W} rank {rank} {name}: max |diff| {r['diff']:.3g}"
        # Newton-Schulz batched over same-shape matrices (a GPU's default): the same up to a bf16 rounding in a
        # few entries (a batched matrix multiply may round differently), so up to lr x 2^-8 per step.
        assert out["muon_batched"]["diff"] <= 20 * 0.05 * 2**-8, (W, rank, out["muon_batched"]["diff"])
    owned = [out["muon"]["ring-stage2"]["few_owned_here"] for out in outs]
    assert sum(owned) == 2 and max(owned) == (2 if W == 1 else 1)  # two matrices: one each, other ranks idle
    momentum = [set(out["muon"]["ring-stage2"]["momentum_here"]) for out in outs]
    assert set().union(*momentum) == {0, 1, 2, 4}  # state_dict numbering: group 0's four, then group 1's; 3 never
    assert sum(len(m) for m in momentum) == len(set().union(*momentum))  # each matrix's state on one rank


def test_combined_optimizer_clips_by_the_global_norm_of_the_averaged_gradient(runs):
    W, outs = runs
    for out in outs:
        r = out["combined_clip"]
        assert r["adamw_close"], r["adamw_diff"]
        assert r["muon_diff"] <= 2e-3, r["muon_diff"]  # clip coefficients may differ in the last bit -> bf16
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-6)
        assert r["ref_norms"][0] > 0.5  # clipping was active
        assert r["lr_groups"] == [1e-2, 0.02]


def test_state_dict_round_trip_resumes_identically_and_holds_only_the_shard(runs):
    W, outs = runs
    for out in outs:
        for kind in ("adamw", "muon"):
            r = out["state_dict"][kind]
            assert r["resume_diff"] == 0.0
            assert r["shard_only"]
            assert r["saved"]["zero"]["world_size"] == W
    # The ranks' AdamW shards partition the parameters: together exactly one copy of exp_avg and exp_avg_sq.
    n = sum(torch.Size(s).numel() for s in ADAMW_SHAPES)  # the two extra parameters never had a gradient
    assert sum(out["state_dict"]["adamw"]["state_numel"] for out in outs) == 2 * n
    assert sum(out["state_dict"]["muon"]["state_numel"] for out in outs) == sum(a * b for a, b in MUON_SHAPES)


def test_state_per_rank_is_one_over_world_size_of_adamw(runs):
    W, outs = runs
    for out in outs:
        r = out["gpt_state_bytes"]
        assert r["mine"] / r["adamw"] <= 1 / W + 0.01, r
    assert sum(out["gpt_state_bytes"]["mine"] for out in outs) == pytest.approx(outs[0]["gpt_state_bytes"]["adamw"],
                                                                                 rel=0.01)


def test_loading_another_ranks_shard_fails_clearly(runs):
    W, outs = runs
    if W == 1:
        assert outs[0]["state_dict"]["wrong_rank_error"] is None  # rank 0 loading its own shard works
        return
    assert outs[0]["state_dict"]["wrong_rank_error"] is None
    for out in outs[1:]:
        msg = out["state_dict"]["wrong_rank_error"]
        assert "rank 0's shard" in msg and "must load the state it saved itself" in msg


def test_a_shard_saved_at_another_world_size_is_refused(runs, no_process_group):
    W, outs = runs
    if W == 1:
        pytest.skip("needs a state saved at world size > 1")
    saved = outs[1]["state_dict"]["adamw"]["saved"]
    ps = make_params(ADAMW_SHAPES + [(4,), (5,)])[0]
    with pytest.raises(ValueError) as e:
        DistAdamW(adamw_groups(ps)).load_state_dict(saved)  # this process: a world of one
    msg = str(e.value)
    assert f"rank 1's shard of a run with {W} ranks, but this run has 1" in msg
    assert "save and load through nanodist.checkpoint" in msg


def test_training_a_gpt_matches_ddp_and_keeps_ranks_in_sync(runs):
    W, outs = runs
    for out in outs:
        for which, r in out["train"].items():
            assert r["not_in_sync"] is None, r["not_in_sync"]
        ddp, zero = out["train"]["ddp-adamw"]["losses"], out["train"]["dist-adamw"]["losses"]
        assert zero == pytest.approx(ddp, rel=1e-4)
        assert out["train"]["dist-adamw"]["grad_norm"] > 0  # the Trainer handed clipping to the optimizer
        assert out["train"]["dist-muon"]["losses"][-1] < out["train"]["dist-muon"]["losses"][0]


def test_a_process_group_of_some_ranks(runs):
    W, outs = runs
    if W < 3:
        pytest.skip("needs ranks outside the group")
    assert [out["subgroup"] and out["subgroup"]["world_size"] for out in outs] == [2, 2] + [None] * (W - 2)
    assert all(out["subgroup"]["diff"] == 0.0 for out in outs[:2])


def test_bad_input_errors_say_what_to_do(runs):
    W, outs = runs
    for out in outs:
        e = out["errors"]
        assert "must share a device and a dtype" in e["dtype"] and "torch.float64" in e["dtype"]
        assert "must share a device and a dtype" in e["device"] and "meta" in e["device"]
        assert e["sparse"].startswith("RuntimeError") and "does not support sparse gradients" in e["sparse"]
        assert "Muon only supports 2D parameters" in e["muon_1d"] and "DistAdamW" in e["muon_1d"]
        assert "Muon only supports 2D parameters" in e["muon_3d"]
        assert "no 'zero' entry" in e["torch_state"]
        assert "saved by DistAdamW" in e["muon_loads_adamw"]


# ----------------------------------------------------------------------------- in this process: no process group

@pytest.fixture
def no_process_group():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is active in this test process")


def test_world_of_one_without_a_process_group(no_process_group):
    ps, rs = make_params(ADAMW_SHAPES)
    opt, ref = DistAdamW(ps, lr=1e-2), torch.optim.AdamW(rs, lr=1e-2)
    ms, rms = make_params(MUON_SHAPES, seed=2)
    muon, ref_muon = DistMuon(ms, lr=0.02), torch.optim.Muon(rms, lr=0.02)
    for t in range(5):
        g = grads_for(ADAMW_SHAPES + MUON_SHAPES, t, 1)[0]
        for p, r, gi in zip(ps + ms, rs + rms, g):
            p.grad, r.grad = gi.clone(), gi.clone()
        for o in (opt, ref, muon, ref_muon):
            o.step()
    assert opt.world_size == 1 and max_diff(ps, rs) == 0.0 and max_diff(ms, rms) == 0.0


class HostReads:
    """Make every way of reading a tensor's value on the host raise: on a GPU each of them waits for the device.
    `allowed`: tensors that live on the host on a GPU too (AdamW's step counters, as in torch), whose reads cost
    nothing."""

    NAMES = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")

    def __init__(self, allowed=()):
        self.allowed = {id(t) for t in allowed}

    def __enter__(self):
        self.saved = {n: getattr(torch.Tensor, n) for n in self.NAMES}

        def refuse(name):
            original = self.saved[name]

            def read(t, *args, **kwargs):
                if id(t) in self.allowed:
                    return original(t, *args, **kwargs)
                raise AssertionError(f"a host read: Tensor.{name} on a tensor of shape {tuple(t.shape)}")
            return read
        for n in self.NAMES:
            setattr(torch.Tensor, n, refuse(n))
        return self

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, f)


def steps_without_host_reads(rank, W):
    """DistAdamW and the Muon/AdamW pair, clipping on, every rank with every gradient: after a first step (which
    creates the state), steps read no tensor on the host -- on a GPU they never wait for it."""
    torch.manual_seed(0)
    out = {}
    for name in ("adamw", "muon"):
        model = GPT(GPTConfig.preset("tiny", vocab_size=64, block_size=16))
        opt = DistAdamW(model.configure_param_groups(0.1), lr=1e-2) if name == "adamw" else make_muon_optimizer(model)
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))
        opt._digest_check.deferred = True  # the divergence check as on a GPU: a step late, from host buffers
        for step in range(3):
            counters = [st["step"] for st in opt.state.values() if "step" in st]  # made by the first step
            with HostReads(counters + (opt._digest_check.buffers or [])) if step else contextlib.nullcontext():
                _, loss = model(x, x)
                loss.backward()
                norm = opt.clip_grad_norm_(1.0)
                opt.step()
                opt.zero_grad()
        out[name] = float(norm)
    # The Trainer around it, with the flush (which reads the losses, norms and timings) held off as on a GPU:
    # gradient accumulation, clipping, the scheduler and the update read nothing back either.
    text = generate_corpus(20_000, seed=0)
    tok = CharTokenizer(text)
    model = GPT(GPTConfig.preset("tiny", vocab_size=tok.vocab_size, block_size=16))
    opt = make_muon_optimizer(model)
    stream = TokenStream(torch.tensor(tok.encode(text)), batch_size=2, block_size=16, rank=rank, world_size=W, seed=0)
    cfg = TrainConfig(steps=4, micro_batch=2, seq_len=16, total_batch_tokens=2 * 16 * W * 2, lr=3e-3, warmup_steps=1,
                      progress=False, log_every=0, grad_clip=1.0)
    trainer = Trainer(model, opt, stream, cfg)
    opt._digest_check.deferred = True
    trainer.fit(max_steps=1)  # creates the optimizer state
    trainer._flush_every = 10**9
    with HostReads([st["step"] for st in opt.state.values() if "step" in st] + (opt._digest_check.buffers or [])):
        trainer.train_step()
        trainer.train_step()
    out["trainer_losses"] = [h["loss"] for h in trainer.fit()]  # the flush reads the held rows
    return out


@pytest.mark.parametrize("W", [1, 2, 3])
def test_a_step_reads_nothing_back_from_the_device(W):
    outs = [steps_without_host_reads(0, 1)] if W == 1 else spawn(steps_without_host_reads, W, timeout=120)
    for out in outs:
        assert out["adamw"] == outs[0]["adamw"] > 0 and out["muon"] == outs[0]["muon"] > 0  # one global norm
        losses = out["trainer_losses"]  # this rank's own batches: every step logged, and training
        assert len(losses) == 4 and losses[-1] < losses[0]


def test_host_reads_are_caught():  # the test above would notice a read
    with HostReads(), pytest.raises(AssertionError, match="a host read: Tensor.item"):
        torch.ones(1).item()
    with HostReads(), pytest.raises(AssertionError, match="Tensor.__bool__"):
        bool(torch.ones(1) > 0)


def test_a_world_of_one_updates_p_grad_in_place_with_no_buffers(no_process_group):
    """W = 1 is the plain optimizer: no gradient hooks, no bucket buffers, the update reads p.grad itself."""
    ps, rs = make_params(ADAMW_SHAPES)
    opt, ref = DistAdamW(ps, lr=1e-2, zero_stage=2), torch.optim.AdamW(rs, lr=1e-2)
    assert all(not p._post_accumulate_grad_hooks for p in ps if p._post_accumulate_grad_hooks is not None)
    for t in range(3):
        g = grads_for(ADAMW_SHAPES, t, 1)[0]
        for p, r, gi in zip(ps, rs, g):
            p.grad, r.grad = gi.clone(), gi.clone()
        before = [p.grad.data_ptr() for p in ps]
        opt.step()
        ref.step()
        assert [p.grad.data_ptr() for p in ps] == before  # not copied into a buffer, not freed
    assert opt.gradient_buffers() == [] and all("shard" not in b.extra and "send" not in b.extra for b in opt._buckets)
    assert max_diff(ps, rs) == 0.0


@pytest.mark.parametrize("shape", [(6, 4), (4, 6), (5, 5), (1, 7)])
def test_batched_newton_schulz_equals_torch_matrix_by_matrix(shape):
    from nanodist.optim.muon import newton_schulz_batched
    g = torch.Generator().manual_seed(sum(shape))
    stack = torch.randn(5, *shape, generator=g)
    stack[2] = 0  # a zero matrix: the eps clamp, as in torch
    batched = newton_schulz_batched(stack, ns_steps=5)
    for k in range(5):  # equal, or a bf16 rounding apart where a batched multiply rounds differently
        single = newton_schulz(stack[k], (3.4445, -4.7750, 2.0315), 5, 1e-7)
        assert batched[k].dtype == single.dtype == torch.bfloat16 and batched[k].shape == single.shape
        assert (batched[k].float() - single.float()).abs().max() <= 2**-7, k


def test_muon_adamw_is_torchs_muon_and_adamw_as_one_optimizer(no_process_group):
    """The reference DistMuon is measured against: the same split as make_muon_optimizer, torch's own updates, one
    set of param groups (an LR scheduler reaches both) and one state mapping."""
    from nanodist.optim import MuonAdamW
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", vocab_size=64, block_size=16))
    ref = copy.deepcopy(model)
    opt = MuonAdamW(model, lr=1e-2, muon_lr=0.02)
    muon, adamw = split_params_for_muon(ref)
    ref_adamw = torch.optim.AdamW([{"params": [p for _, p in adamw if p.ndim >= 2], "weight_decay": 0.1},
                                   {"params": [p for _, p in adamw if p.ndim < 2], "weight_decay": 0.0}],
                                  lr=1e-2, betas=(0.9, 0.95))
    ref_muon = torch.optim.Muon([p for _, p in muon], lr=0.02, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)  # halves every group's lr
    for o in (ref_adamw, ref_muon):
        for g in o.param_groups:
            g["lr"] *= 0.5
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        for m, step in ((model, opt.step), (ref, lambda: (ref_adamw.step(), ref_muon.step()))):
            m(x, x)[1].backward()
            step()
            m.zero_grad()
    assert max_diff(list(model.parameters()), list(ref.parameters())) == 0.0
    assert [g["lr"] for g in opt.param_groups] == [5e-3, 5e-3, 0.01]
    assert len(opt.state) == len(list(model.parameters())) and sched.last_epoch == 0
    assert opt.adamw.state is opt.state and opt.muon.state is opt.state


def test_argument_errors():
    p = torch.nn.Parameter(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="zero_stage must be 1 or 2"):
        DistAdamW([p], zero_stage=3)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1"):
        DistAdamW([p], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="Adjust learning rate function nope is not supported"):
        DistMuon([p], adjust_lr_fn="nope")
    with pytest.raises(ValueError, match="collectives must be one of"):
        DistMuon([p], collectives="mpi")
    with pytest.raises(ValueError, match="a param group's kind must be one of adamw, muon, got 'sgd'"):
        ShardedOptimizer([{"params": [p], "kind": "sgd"}])
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        ShardedOptimizer([{"params": [p], "kind": "adamw"}, {"params": [p], "kind": "muon"}])
    opt = DistAdamW([p])
    with pytest.raises(ValueError, match="must share a device and a dtype"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2)),
                                        torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))]})
    assert len(opt.param_groups) == 1  # the bad group was not kept


def test_nanodist_exports_the_optimizers():
    assert nd.DistAdamW is DistAdamW and nd.DistMuon is DistMuon


# ----------------------------------------------------------------------------- Muon's pieces

def test_newton_schulz_copy_matches_torch_and_lr_rule():
    g = torch.Generator().manual_seed(0)
    for shape in [(7, 5), (5, 7), (16, 16)]:
        m = torch.randn(shape, generator=g)
        assert torch.equal(_newton_schulz(m), newton_schulz(m, (3.4445, -4.7750, 2.0315), 5, 1e-7))
        for fn in (None, "original", "match_rms_adamw"):
            from torch.optim._muon import _adjust_lr
            assert _adjust_lr_rule(0.02, fn, shape) == _adjust_lr(0.02, fn, torch.Size(shape))


def test_newton_schulz_pushes_singular_values_towards_one():
    m = torch.randn(32, 16, generator=torch.Generator().manual_seed(0)) * torch.logspace(0, -2, 16)
    sv = newton_schulz_singular_values(m)
    assert len(sv["per_step"]) == 6 and torch.equal(sv["after"], sv["per_step"][-1])
    assert sv["before"].max() <= 1.0 and sv["before"].min() < 0.01  # badly conditioned input
    assert 0.5 < sv["after"].min() and sv["after"].max() < 1.3  # roughly orthogonal afterwards
    with pytest.raises(ValueError, match="needs a matrix"):
        newton_schulz_singular_values(torch.zeros(3))


def test_split_params_for_muon_sends_hidden_matrices_to_muon():
    for tie in (True, False):
        model = GPT(GPTConfig.preset("tiny", vocab_size=65, tie_weights=tie))
        muon, adamw = split_params_for_muon(model)
        names = {n for n, _ in muon}
        assert names == {n for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks.")}
        assert all(p.ndim == 2 for _, p in muon)
        assert {n for n, _ in adamw} >= {"wte.weight", "wpe.weight", "ln_f.weight"}
        assert ("lm_head.weight" in {n for n, _ in adamw}) == (not tie)
        assert len(muon) + len(adamw) == len(list(model.parameters()))
    opt = make_muon_optimizer(model)
    assert isinstance(opt, torch.optim.Optimizer) and [g["kind"] for g in opt.param_groups] == ["adamw", "adamw", "muon"]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0, 0.0]


# ----------------------------------------------------------------------------- one optimizer for both kinds

def check_container(rank, W):
    """The Muon + AdamW pair is one torch Optimizer: LambdaLR drives it, DCP's get/set_state_dict accept it,
    Muon's ownership ignores the bucket size, and the reduce-scatters leave during backward."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from nanodist.sync import BucketTimeline
    text = generate_corpus(20_000, seed=0)
    tok = CharTokenizer(text)
    tokens = torch.tensor(tok.encode(text))
    stream = TokenStream(tokens, batch_size=2, block_size=16, rank=rank, world_size=W, seed=0)
    batches = [next(stream) for _ in range(6)]

    def build(cap=25.0):
        torch.manual_seed(0)
        model = GPT(GPTConfig.preset("tiny", vocab_size=tok.vocab_size, block_size=16))
        return model, make_muon_optimizer(model, lr=3e-3, muon_lr=0.02, bucket_cap_mb=cap)

    def train(model, opt, sched, xs):
        for x, y in xs:
            model(x, y)[1].backward()
            opt.step()
            opt.zero_grad()
            sched.step()

    out = {}
    model, opt = build()
    warm = lambda step: min(1.0, (step + 1) / 3)  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warm)
    out["is_optimizer"] = isinstance(opt, torch.optim.Optimizer)
    out["lrs"] = [[g["lr"] for g in opt.param_groups]]
    timeline = BucketTimeline()
    opt.observe(timeline)
    train(model, opt, sched, batches[:3])
    opt.observe(None)
    out["lrs"].append([g["lr"] for g in opt.param_groups])
    out["initial_lr"] = [g["initial_lr"] for g in opt.param_groups]
    out["timeline"] = timeline.entries
    # DCP's view: keyed by parameter name, sharded AdamW state as DTensors of the flattened parameter.
    msd, osd = get_state_dict(model, opt)
    out["dcp_keys"] = sorted(n for n, st in osd["state"].items() if st)  # what this rank keeps
    out["dcp_names_match"] = sorted(osd["state"]) == sorted(n for n, p in model.named_parameters())
    wte = osd["state"]["wte.weight"]["exp_avg"]
    out["wte_exp_avg"] = (type(wte).__name__, tuple(wte.shape))
    saved = (copy.deepcopy(msd), copy.deepcopy(osd), copy.deepcopy(sched.state_dict()))
    train(model, opt, sched, batches[3:])
    model2, opt2 = build()
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, warm)
    set_state_dict(model2, opt2, model_state_dict=saved[0], optim_state_dict=saved[1])
    sched2.load_state_dict(saved[2])
    train(model2, opt2, sched2, batches[3:])
    out["resumed_equal"] = all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))
    out["resumed_lrs_equal"] = [g["lr"] for g in opt.param_groups] == [g["lr"] for g in opt2.param_groups]
    # Which rank owns which matrix: the same at any bucket size.
    owners = {}
    for cap in (25.0, 1e-4):
        _, o = build(cap)
        owners[cap] = sorted(pc.param for pc in o.local_pieces() if o.param_groups[pc.group]["kind"] == "muon")
    out["owners"] = owners
    out["muon_names"] = [n for n, _ in split_params_for_muon(model)[0]]
    return out


@pytest.mark.parametrize("W", [2, 3])
def test_the_muon_adamw_pair_is_one_torch_optimizer(W):
    outs = spawn(check_container, W, timeout=120)
    for rank, out in enumerate(outs):
        assert out["is_optimizer"]
        base = out["initial_lr"]
        assert len(base) == 3 and base[-1] == 0.02  # two AdamW groups, then the Muon group
        assert out["lrs"][0] == pytest.approx([b / 3 for b in base])  # LambdaLR drove every group, both kinds
        assert out["lrs"][1] == pytest.approx(base)
        assert out["resumed_equal"] and out["resumed_lrs_equal"]
        assert out["wte_exp_avg"] == ("DTensor", (65 * 64,))
        assert out["dcp_names_match"]  # every parameter by name, on every rank
        assert out["owners"][25.0] == out["owners"][1e-4]  # ownership ignores the bucket size
        # ZeRO-2 in backward: every bucket's reduce-scatter was launched before autograd had finished.
        assert out["timeline"] and all(e["launch_s"] <= e["autograd_end_s"] for e in out["timeline"])
    # Every Muon matrix's state lives on exactly one rank.
    keys = [set(out["dcp_keys"]) for out in outs]
    assert len(outs[0]["muon_names"]) == 8 and all(sum(n in k for k in keys) == 1 for n in outs[0]["muon_names"])


def test_muon_adamw_loads_its_state_into_both_halves(no_process_group):
    from nanodist.optim import MuonAdamW
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", vocab_size=64, block_size=16))
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    opt = MuonAdamW(model)
    model(x, x)[1].backward()
    opt.step()
    again = MuonAdamW(model)
    again.load_state_dict(opt.state_dict())
    assert again.adamw.state is again.state and again.muon.state is again.state and len(again.state) == len(opt.state)
    assert again.adamw.param_groups + again.muon.param_groups == again.param_groups
    assert all(a is b for a, b in zip(again.adamw.param_groups + again.muon.param_groups, again.param_groups))
    assert again.adamw.nanodist_inner and again.muon.nanodist_inner and not getattr(again, "nanodist_inner", False)


def _ddp_counts_one_step_of_muon_adamw(rank, W):
    from nanodist.optim import MuonAdamW
    model = GPT(GPTConfig.preset("tiny", vocab_size=64, block_size=16))
    ddp, opt = nd.DDP(model), MuonAdamW(model)
    x = torch.randint(0, 64, (2, 16))
    for _ in range(2):
        ddp(x, x)[1].backward()
        opt.step()
        opt.zero_grad()
    return ddp.optimizer_steps


def test_ddp_counts_a_step_of_muon_adamw_once():  # not once more for each of its two halves
    assert spawn(_ddp_counts_one_step_of_muon_adamw, 2, timeout=120) == [2, 2]


# ----------------------------------------------------------------------------- frozen parameters (users' models)

def _freeze_schedule(model, step):
    """Steps 0-1 as built; at 2 freeze block 0 (after the optimizer was built); at 4 unfreeze it, and block 1,
    which was frozen when the optimizer was built."""
    if step == 2:
        model.blocks[0].requires_grad_(False)
    if step == 4:
        model.blocks[0].requires_grad_(True)
        model.blocks[1].requires_grad_(True)


def freezing_worker(rank, W):
    from nanodist import parity
    from nanodist.optim import MuonAdamW, make_muon_optimizer

    def run(build, dist_rank, world):
        model = parity.UserModel()
        opt = build(model)
        for step in range(6):
            _freeze_schedule(model, step)
            x, y = parity.batch(step, dist_rank, world)
            model(x, y)[1].backward()
            opt.step()
            opt.zero_grad()
        return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}

    init = {n: p.detach().clone() for n, p in parity.UserModel().named_parameters(remove_duplicate=False)}
    adamw = run(lambda m: torch.optim.AdamW(m.parameters(), lr=parity.LR, weight_decay=parity.WEIGHT_DECAY), 0, 1)
    muon_ref = run(lambda m: MuonAdamW(m, lr=parity.LR, weight_decay=parity.WEIGHT_DECAY), 0, 1)
    out = {}
    for stage in (1, 2):
        got = run(lambda m: DistAdamW(m.parameters(), lr=parity.LR, weight_decay=parity.WEIGHT_DECAY,
                                      zero_stage=stage), rank, W)
        out[f"zero{stage}"] = parity.deviation(got, adamw, init)
    got = run(lambda m: make_muon_optimizer(m, lr=parity.LR, weight_decay=parity.WEIGHT_DECAY), rank, W)
    out["muon"] = parity.deviation(got, muon_ref, init)
    out["block1_moved"] = float((adamw["blocks.1.fc.weight"] - init["blocks.1.fc.weight"]).abs().max())
    return out


@pytest.mark.parametrize("W", [2, 3])
def test_parameters_frozen_and_unfrozen_while_training_match_torch(W):
    """A frozen parameter gets no bucket, no hook and no state at W >= 2 (it used to make building the optimizer
    raise); freezing or unfreezing one after the optimizer was built re-plans the buckets before the next reduction
    and trains exactly as torch.optim.AdamW (Muon) on one process."""
    for out in spawn(freezing_worker, W, timeout=120):
        assert out["block1_moved"] > 0  # unfrozen at step 4: it trained afterwards
        for name in ("zero1", "zero2", "muon"):
            dev, where = out[name]
            # fp32 sums in another order; see tests/test_parity.py for the tolerance's measure
            assert dev < 1e-4, (name, dev, where)


@pytest.mark.parametrize("option", ["amsgrad", "maximize"])
def test_adamw_state_with_an_option_dist_adamw_lacks_is_refused_by_name(no_process_group, option):
    """torch's AdamW(amsgrad=True) keeps max_exp_avg_sq, AdamW(maximize=True) ascends: DistAdamW has neither, so
    their state is refused, naming the option, instead of loading into different arithmetic."""
    from nanodist.state import load_optimizer_state_dict, optimizer_state_dict
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", vocab_size=64, block_size=16))
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    saved = torch.optim.AdamW(model.parameters(), lr=1e-3, **{option: True})
    model(x, x)[1].backward()
    saved.step()
    state = optimizer_state_dict(model, saved)
    with pytest.raises(ValueError, match=f"ran AdamW with {option}=True, which DistAdamW does not implement"):
        load_optimizer_state_dict(model, DistAdamW(model.parameters(), lr=1e-3), state)
    plain = torch.optim.AdamW(model.parameters(), lr=1e-3)  # the same option off: loads as before
    plain.step()
    load_optimizer_state_dict(model, DistAdamW(model.parameters(), lr=1e-3), optimizer_state_dict(model, plain))
