"""The trainer: accumulation arithmetic, LR schedule, accumulation == big batch, bf16, wandb from rank 0 only."""
import copy
import math
import os
import random

import pytest
import torch

import nanodist as nd
from nanodist.data import CharTokenizer, TokenStream, generate_corpus
from nanodist.model import GPT, GPTConfig
from nanodist.testing import spawn
from nanodist.train import TrainConfig, Trainer, grad_accum_steps, lr_at
from wandb_offline import history as wandb_history


def test_grad_accum_arithmetic():
    assert grad_accum_steps(None, 8, 64, 2) == 1
    assert grad_accum_steps(8 * 64 * 2 * 3, 8, 64, 2) == 3
    assert grad_accum_steps(8192, 8, 64, 1) == 16 and grad_accum_steps(8192, 8, 64, 4) == 4
    with pytest.raises(ValueError) as e:
        grad_accum_steps(5000, 8, 64, 3)
    msg = str(e.value)
    assert "5000 tokens is not a positive multiple of" in msg and "8 x 64 x 3 = 1536" in msg
    assert "choose a total batch of 4608 tokens" in msg


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig(steps=20, lr=1.0, warmup_steps=4, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))
    assert math.isclose(lrs[-1], 0.1)


def tiny_setup(micro_batch, seed=0):
    text = generate_corpus(20_000, seed=0)
    tok = CharTokenizer(text)
    tokens = torch.tensor(tok.encode(text))
    torch.manual_seed(seed)
    model = GPT(GPTConfig.preset("tiny", vocab_size=tok.vocab_size, block_size=16))
    stream = TokenStream(tokens, batch_size=micro_batch, block_size=16, rank=0, world_size=1, seed=0, shuffle=False)
    return model, stream


@pytest.mark.numerical
def test_accumulation_equals_the_big_batch():
    """4 micro-steps of 2 sequences == 1 step of 8 sequences (same data, same update)."""
    small, s_small = tiny_setup(2)
    big, s_big = copy.deepcopy(small), None
    _, s_big = tiny_setup(8)
    cfgs = [TrainConfig(steps=3, total_batch_tokens=8 * 16, micro_batch=mb, seq_len=16, progress=False,
                        log_every=0, warmup_steps=1) for mb in (2, 8)]
    outs = []
    for model, stream, cfg in [(small, s_small, cfgs[0]), (big, s_big, cfgs[1])]:
        opt = torch.optim.SGD(model.parameters(), lr=0.5)  # SGD: parameter differences = gradient differences
        t = Trainer(model, opt, stream, cfg)
        outs.append((t.grad_accum, t.fit()))
    assert [o[0] for o in outs] == [4, 1]
    # Tolerances: the same batch summed in 4 parts or in one, a few fp32 roundings per step; SGD's update is linear
    # in the gradient, so they stay rounding-sized (1e-5 of the loss; parameters, moved 3 x lr x gradient, 1e-4)
    for a, b in zip(outs[0][1], outs[1][1]):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5)
    for p, q in zip(small.parameters(), big.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)


def test_bf16_autocast_trains_and_bad_dtype_is_rejected():
    model, stream = tiny_setup(4)
    cfg = TrainConfig(steps=4, micro_batch=4, seq_len=16, dtype="bf16", progress=False, log_every=0)
    hist = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stream, cfg).fit()
    assert all(math.isfinite(h["loss"]) for h in hist) and hist[-1]["loss"] < hist[0]["loss"]
    with pytest.raises(ValueError, match="dtype must be 'fp32' or 'bf16'"):
        Trainer(model, torch.optim.AdamW(model.parameters()), stream, TrainConfig(dtype="fp16"))


def wandb_worker(rank, world, wandb_dir):
    os.environ["WANDB_DIR"] = wandb_dir
    text = generate_corpus(20_000, seed=0)
    tok = CharTokenizer(text)
    torch.manual_seed(0)
    model = nd.DDP(GPT(GPTConfig.preset("tiny", vocab_size=tok.vocab_size, block_size=16)))
    stream = TokenStream(torch.tensor(tok.encode(text)), batch_size=2, block_size=16, seed=0)
    cfg = TrainConfig(steps=5, micro_batch=2, seq_len=16, progress=False, wandb=True, wandb_project="nanodist-test",
                      log_every=2)
    hist = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stream, cfg).fit()
    nd.check.assert_params_in_sync(model.module)
    return [round(h["loss"], 6) for h in hist], [h.get("loss_all_ranks") for h in hist]


@pytest.mark.dist
def test_wandb_offline_logs_every_step_from_rank0_only(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    (losses0, mean0), _ = spawn(wandb_worker, 2, args=(str(tmp_path),), timeout=120)
    runs = list(tmp_path.rglob("run-*.wandb"))
    assert len(runs) == 1, f"only rank 0 may create a run, found {runs}"
    rows = wandb_history(runs[0])
    assert [r["_step"] for r in rows] == [0, 1, 2, 3, 4]
    assert [round(r["loss"], 6) for r in rows] == losses0
    assert all("tokens_per_s" in r and "lr" in r for r in rows)
    assert [("loss_all_ranks" in r) for r in rows] == [m is not None for m in mean0] == [True, False, True, False, True]


def accumulation_worker(rank, world):
    text = generate_corpus(20_000, seed=0)
    tok = CharTokenizer(text)
    torch.manual_seed(0)
    model = nd.DDP(GPT(GPTConfig.preset("tiny", vocab_size=tok.vocab_size, block_size=16)))
    stream = TokenStream(torch.tensor(tok.encode(text)), batch_size=2, block_size=16, shuffle=False)
    cfg = TrainConfig(steps=3, total_batch_tokens=8 * 16, micro_batch=2, seq_len=16, progress=False, log_every=0,
                      warmup_steps=1)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.5), stream, cfg)
    trainer.fit()
    return trainer.grad_accum, model.sync_count, [p.detach().clone() for p in model.module.parameters()]


@pytest.mark.dist
@pytest.mark.numerical
def test_ddp_accumulation_syncs_once_per_step_and_equals_one_process():
    """2 ranks x 2 micro-steps (the first under no_sync) == 1 process x 4 micro-steps, on the same 8 windows."""
    (accum, syncs, params), _ = spawn(accumulation_worker, 2, timeout=120)
    assert accum == 2 and syncs == 3  # one gradient synchronisation per optimizer step, not per micro-step
    single, stream = tiny_setup(2)
    cfg = TrainConfig(steps=3, total_batch_tokens=8 * 16, micro_batch=2, seq_len=16, progress=False, log_every=0,
                      warmup_steps=1)
    trainer = Trainer(single, torch.optim.SGD(single.parameters(), lr=0.5), stream, cfg)
    trainer.fit()
    assert trainer.grad_accum == 4
    # SGD: parameter differences are gradient differences x lr, a few fp32 roundings of split sums (see above)
    for p, q in zip(params, single.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- the training state

def resume_worker(rank, world, parallel, save_at=3, steps=7):
    """Train `steps` steps straight; then again, saving the state at `save_at`, a fresh Trainer loading it and
    finishing. With dropout on, the random generators matter: a resume without them must diverge."""
    from nanodist.optim import make_muon_optimizer
    from nanodist.runtime import seed_everything
    text = generate_corpus(20_000, seed=0)
    tok = CharTokenizer(text)
    tokens = torch.tensor(tok.encode(text))

    def build(seed_model=0):
        torch.manual_seed(seed_model)
        model = GPT(GPTConfig.preset("tiny", vocab_size=tok.vocab_size, block_size=16, dropout=0.1))
        if parallel == "ddp":
            wrapped, opt = nd.DDP(model), torch.optim.AdamW(model.configure_param_groups(0.1), lr=1e-2)
        else:
            wrapped, opt = model, make_muon_optimizer(model, lr=1e-2, muon_lr=0.02)
        train = TokenStream(tokens, batch_size=2, block_size=16, seed=0)
        val = TokenStream(tokens, batch_size=2, block_size=16, seed=1)
        cfg = TrainConfig(steps=steps, total_batch_tokens=2 * 16 * world * 2, micro_batch=2, seq_len=16, lr=1e-2,
                          warmup_steps=2, progress=False, log_every=0, eval_every=2, eval_batches=2)
        return model, Trainer(wrapped, opt, train, cfg, val_data=val)

    seed_everything(123)
    model_a, a = build()
    a.fit()
    seed_everything(123)
    model_b, b = build()
    b.fit(max_steps=save_at)
    saved = copy.deepcopy(b.state_dict())
    val_before = b.evaluate()
    val_again = b.evaluate()
    after_eval = copy.deepcopy(b.state_dict())
    b.fit()  # the uninterrupted run, again, with an evaluation in the middle
    seed_everything(999)  # a fresh process would start from other random states
    model_c, c = build(seed_model=7)  # and other weights
    c.load_state_dict(copy.deepcopy(saved))
    c.fit()
    seed_everything(999)
    model_d, d = build(seed_model=7)
    forgot = copy.deepcopy(saved)
    forgot["rng"] = {f"rank{rank}": nd.runtime.rng_state()}  # a resume that forgets the generators
    d.load_state_dict(forgot)
    d.fit()
    same = lambda m, n: all(torch.equal(p, q) for p, q in zip(m.parameters(), n.parameters()))  # noqa: E731
    losses = lambda t: [h["loss"] for h in t.history]  # noqa: E731
    return {"b_equals_a": same(model_a, model_b), "resumed_equal": same(model_a, model_c),
            "forgot_rng_equal": same(model_a, model_d),
            "resumed_losses": losses(c) == losses(a)[save_at:], "c_step": c.step, "c_tokens": c.tokens_seen,
            "eval_changed_nothing": all(
                torch.equal(x, y) if torch.is_tensor(x) else x == y
                for x, y in zip(_leaves(saved), _leaves(after_eval))),
            "val_twice": (val_before, val_again), "keys": sorted(saved), "rng_keys": sorted(saved["rng"]),
            "data": saved["data"]["train"], "run_id_kept": c.run_id == b.run_id}


def _leaves(tree):
    if isinstance(tree, dict):
        for k in sorted(tree, key=str):
            yield from _leaves(tree[k])
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _leaves(v)
    else:
        yield tree.to_local() if hasattr(tree, "to_local") else tree


@pytest.mark.dist
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("parallel", ["ddp", "dist-muon-adamw"])
def test_a_saved_training_state_resumes_bit_exactly(world, parallel):
    outs = spawn(resume_worker, world, args=(parallel,), timeout=120)
    for rank, out in enumerate(outs):
        assert out["b_equals_a"], "the same seeds must give the same run (dropout included)"
        assert out["resumed_equal"] and out["resumed_losses"], (rank, parallel, world)
        assert not out["forgot_rng_equal"], "without the random generators dropout differs: the test can fail"
        assert out["c_step"] == 7 and out["c_tokens"] == 7 * 2 * 16 * world * 2
        assert out["eval_changed_nothing"] and out["val_twice"][0] == out["val_twice"][1]
        assert out["keys"] == ["config", "data", "model", "optimizer", "rng", "run_id", "scheduler",
                               "skipped_steps", "step", "tokens_seen", "world_size"]
        assert out["rng_keys"] == [f"rank{rank}"]  # per-rank values carry the rank in their key
        assert out["data"]["consumed"] == 3 * 2 * 2 * world  # a global cursor: 3 steps x 2 micro x B 2 x W
        assert out["run_id_kept"]


def fsdp2_worker(rank, world):
    """torch FSDP2 (fully_shard on a CPU mesh) driven by the Trainer with 2 micro-steps: the sync is off on the
    first (set_requires_gradient_sync), and the result equals one process on the whole batch."""
    from torch.distributed.fsdp import fully_shard
    text = generate_corpus(20_000, seed=0)
    tok = CharTokenizer(text)
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", vocab_size=tok.vocab_size, block_size=16))
    mesh = nd.Group.world().device_mesh  # built on the CPU explicitly
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    calls = []
    original = model.set_requires_gradient_sync
    model.set_requires_gradient_sync = lambda flag, **kw: (calls.append(flag), original(flag, **kw))[1]
    stream = TokenStream(torch.tensor(tok.encode(text)), batch_size=2, block_size=16, shuffle=False)
    cfg = TrainConfig(steps=3, total_batch_tokens=8 * 16, micro_batch=2, seq_len=16, progress=False, log_every=0,
                      warmup_steps=1, grad_clip=0.5)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.5), stream, cfg)
    hist = trainer.fit()
    full = [p.full_tensor().detach().clone() for p in model.parameters()]
    return trainer.grad_accum, calls, full, [h["grad_norm"] for h in hist]


@pytest.mark.dist
@pytest.mark.numerical
def test_the_trainer_accumulates_with_torch_fsdp2_like_one_big_batch():
    (accum, calls, params, norms), _ = spawn(fsdp2_worker, 2, timeout=120)
    assert accum == 2 and calls == [False, True] * 3  # no sync on the first micro-step of each step
    single, stream = tiny_setup(2)
    cfg = TrainConfig(steps=3, total_batch_tokens=8 * 16, micro_batch=2, seq_len=16, progress=False, log_every=0,
                      warmup_steps=1, grad_clip=0.5)
    trainer = Trainer(single, torch.optim.SGD(single.parameters(), lr=0.5), stream, cfg)
    hist = trainer.fit()
    # the clipped norm is global; SGD keeps the differences rounding-sized (split sums; the norm over shards)
    assert norms == pytest.approx([h["grad_norm"] for h in hist], rel=1e-5)
    for p, q in zip(params, single.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def nonfinite_worker(rank, world, mode, results_dir):
    os.environ["NANODIST_RESULTS_DIR"] = results_dir
    text = generate_corpus(20_000, seed=0)
    tok = CharTokenizer(text)
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", vocab_size=tok.vocab_size, block_size=16))
    model.forward = nd.faults.nan_loss(model.forward, rank=1, call=4)  # rank 1's loss turns NaN at step 3
    stream = TokenStream(torch.tensor(tok.encode(text)), batch_size=2, block_size=16, seed=0)
    cfg = TrainConfig(steps=6, micro_batch=2, seq_len=16, progress=False, log_every=0, nonfinite=mode)
    rec = nd.Recorder("test_nonfinite")
    trainer = Trainer(nd.DDP(model), torch.optim.AdamW(model.parameters(), lr=1e-3), stream, cfg, recorder=rec)
    try:
        trainer.fit()
        error = None
    except nd.train.NonFiniteError as e:
        error = str(e)
    finite = all(torch.isfinite(p).all() for p in model.parameters())
    return {"error": error, "step": trainer.step, "skipped": trainer.skipped_steps, "finite": bool(finite),
            "path": str(rec.path), "history": [(h["step"], h.get("skipped", False)) for h in trainer.history]}


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["stop", "skip"])
def test_a_nan_on_one_rank_stops_every_rank_or_is_skipped(tmp_path, mode):
    outs = spawn(nonfinite_worker, 2, args=(mode, str(tmp_path)), timeout=120)
    if mode == "stop":
        for out in outs:  # every rank stops at the same step, with the same message naming rank 1
            assert out["error"] == outs[0]["error"] and "non-finite values at step 3" in out["error"]
            assert "nan on rank 1" in out["error"] and "nonfinite='skip'" in out["error"]
            assert out["step"] == 4 and [s for s, _ in out["history"]] == [0, 1, 2]
        from nanodist.results import load
        record = load(outs[0]["path"])
        assert "non-finite values at step 3" in record["stopped"] and len(record["steps"]) == 3
    else:
        for out in outs:
            assert out["error"] is None and out["step"] == 6 and out["skipped"] == 1 and out["finite"]
            assert [s for s, skipped in out["history"] if skipped] == [3]


def inf_grad_worker(rank, world, wrapper, bad):
    """Every loss finite; on rank `bad` a backward hook writes an inf into the gradient flowing out of block 0's MLP
    at step 2 (the forward, and so the loss, is untouched)."""
    text = generate_corpus(20_000, seed=0)
    tok = CharTokenizer(text)
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", vocab_size=tok.vocab_size, block_size=16))
    calls = [0]

    def poison(module, grad_input, grad_output):
        calls[0] += 1
        if rank == bad and calls[0] == 3:  # the third backward: step 2
            g = grad_input[0].clone()
            g.view(-1)[0] = float("inf")
            return (g,)
        return None

    model.blocks[0].mlp.register_full_backward_hook(poison)
    stream = TokenStream(torch.tensor(tok.encode(text)), batch_size=2, block_size=16, rank=rank, world_size=world,
                         seed=0)
    cfg = TrainConfig(steps=5, micro_batch=2, seq_len=16, progress=False, log_every=0)
    if wrapper == "ddp":
        m, opt = nd.DDP(model), torch.optim.AdamW(model.parameters(), lr=1e-3)
    elif wrapper == "fsdp":
        m = nd.FSDP(model, units=list(model.blocks))
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    elif wrapper == "dist-adamw":
        m, opt = model, nd.optim.DistAdamW(model.parameters(), lr=1e-3)
    else:
        m, opt = model, nd.optim.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    try:
        Trainer(m, opt, stream, cfg).fit()
        return None
    except nd.train.NonFiniteError as e:
        return str(e)


@pytest.mark.dist
@pytest.mark.parametrize("wrapper", ["ddp", "dist-adamw", "zero1", "fsdp"])
def test_an_inf_gradient_with_finite_losses_names_the_rank_it_came_from(wrapper):
    """After averaging every rank holds the inf; only the rank's own gradient, checked as it was packed, says
    where it came from (before, the message said only that some gradient became non-finite)."""
    bad = random.randrange(3)
    for err in spawn(inf_grad_worker, 3, args=(wrapper, bad), timeout=120):
        assert err is not None and "non-finite values at step 2" in err, err
        assert f"but the gradient of rank {bad} was non-finite before the ranks averaged it" in err, err


def data_group_worker(rank, world):
    """A Trainer whose group is one dimension of a 2 x 2 mesh (the data dimension; the other a tensor dimension, as
    Chapter 9's trainer will have): its random generators are keyed by the global rank, so the two ranks that share
    a data-group rank do not collide in a checkpoint, and a state saved by this rank loads back into it."""
    import torch.distributed as dist
    text = generate_corpus(20_000, seed=0)
    tok = CharTokenizer(text)
    mesh = nd.Group.world().mesh({"tensor": 2, "data": 2})
    data = mesh["data"]
    torch.manual_seed(0)
    model = nd.DDP(GPT(GPTConfig.preset("tiny", vocab_size=tok.vocab_size, block_size=16)), group=data)
    stream = TokenStream(torch.tensor(tok.encode(text)), batch_size=2, block_size=16, shuffle=False,
                         rank=data.rank, world_size=data.size)
    cfg = TrainConfig(steps=2, total_batch_tokens=4 * 16, micro_batch=2, seq_len=16, progress=False, log_every=0)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.5), stream, cfg, group=data)
    trainer.fit(max_steps=1)
    saved = trainer.state_dict()
    want = torch.rand(3)
    trainer.load_state_dict(saved)
    return {"data_rank": data.rank, "global": dist.get_rank(), "rng_keys": sorted(saved["rng"]),
            "restored": torch.equal(torch.rand(3), want)}


@pytest.mark.dist
def test_a_trainer_on_a_data_group_keys_its_generators_by_the_global_rank():
    outs = spawn(data_group_worker, 4, timeout=120)
    assert sorted(o["data_rank"] for o in outs) == [0, 0, 1, 1]  # two ranks share each data-group rank
    for o in outs:
        assert o["rng_keys"] == [f"rank{o['global']}"] and o["restored"], o
