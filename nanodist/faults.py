"""Faults on purpose: make one rank misbehave, to see what the run says (the debugging chapter, and the tests).

    faults.die(rank=1)                             # rank 1 is killed by SIGKILL, as the out-of-memory killer would
    model.forward = faults.nan_loss(model.forward, rank=1, call=4)     # rank 1's 4th loss is NaN
    faults.extra_backward(loss, rank=1)            # rank 1 runs one backward more than the others
    faults.hang(rank=1)                            # rank 1 never reaches the next collective
    loss = faults.scale_grad(loss, rank=1)         # rank 1's gradients come out 1.001 x too large, its loss unchanged

Each one acts on the given rank only (the global rank; every other rank is untouched) and does nothing
in a world of one where rank != 0. What each should produce -- a launch error naming the killed rank and
its signal, a non-finite stop naming the rank, a step-drift error naming both ranks' steps, a timeout --
is what the tests check. `scale_grad` is the smallest of them, the planted error that every tolerance of an
equivalence test must still catch (CONTRIBUTING: tolerances).
"""
from __future__ import annotations

import os
import signal
import time

import torch

from .group import Group


def _me(rank: int) -> bool:
    return Group.world().global_rank(Group.world().rank) == rank


def die(rank: int, sig: int = signal.SIGKILL, after_s: float = 0.5) -> None:
    """On `rank`: print a line, wait after_s, then send this process `sig` (no Python clean-up runs for SIGKILL)."""
    if _me(rank):
        print(f"rank {rank} is about to be killed by {signal.Signals(sig).name}", flush=True)
        time.sleep(after_s)
        os.kill(os.getpid(), sig)


def nan_loss(forward, rank: int, call: int):
    """Wrap a model's forward so that on `rank` the loss of its `call`-th call (1-based) is NaN."""
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        calls["n"] += 1
        logits, loss = forward(*args, **kwargs)
        if _me(rank) and calls["n"] == call and loss is not None:
            loss = loss * float("nan")
        return logits, loss

    return poisoned


def extra_backward(loss: torch.Tensor, rank: int) -> None:
    """On `rank`: one more backward of `loss` (call it after the usual one, keeping the graph)."""
    if _me(rank):
        loss.backward()


def hang(rank: int, seconds: float = 3600) -> None:
    """On `rank`: sleep instead of going on, so the other ranks wait for it in their next collective."""
    if _me(rank):
        time.sleep(seconds)


PLANTED_SCALE = 1.001


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def scale_grad(loss: torch.Tensor, rank: int, factor: float = PLANTED_SCALE) -> torch.Tensor:
    """On `rank`: the same loss value, whose backward gives gradients `factor` times too large (a silent bug in
    one rank's arithmetic, as small as the tests' planted error). Every other rank gets `loss` back unchanged."""
    return _ScaleGrad.apply(loss, factor) if _me(rank) else loss
