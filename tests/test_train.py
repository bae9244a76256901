"""The trainer: accumulation arithmetic, LR schedule, accumulation == big batch, bf16, wandb from rank 0 only."""
import copy
import math
import os

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
    (losses0, mean0), _ = spawn(wandb_worker, 2, args=(str(tmp_path),), timeout=240)
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
    for p, q in zip(params, single.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
