"""DistAdamW: AdamW whose state is sharded over the ranks (ZeRO), averaging gradients itself.

    model = GPT(cfg)                                   # no DDP wrapper: the optimizer averages gradients
    opt = DistAdamW(model.configure_param_groups(0.1), lr=3e-3, betas=(0.9, 0.95))
    loss.backward(); opt.step(); opt.zero_grad()       # step() is a collective: every rank calls it

Every parameter is cut into world_size equal slices (the last ones padded with zeros, so any shape
works: (7, 5), (3,), a 0-D scalar); rank r updates slice r and keeps exp_avg / exp_avg_sq / step for
that slice only -- about 1/N of AdamW's 8 bytes per parameter. The step is the pipeline of
nanodist.optim.common: reduce-scatter the gradients, AdamW on this rank's slices, all-gather.

The update is torch.optim.AdamW's, operation for operation (decoupled weight decay, bias correction):
after any number of steps the parameters equal those of one torch.optim.AdamW fed the averaged gradient.
Ranks must start from the same parameters (seed the model identically; after the first step they
agree anyway, since every slice comes from its one owner).
"""
from __future__ import annotations

import math

import torch

from .common import Piece, ShardedOptimizer


class DistAdamW(ShardedOptimizer):
    """AdamW with optimizer state (and, at zero_stage=2, the averaged gradient) sharded over the ranks.

    Arguments as torch.optim.AdamW (lr, betas, eps, weight_decay; param groups may override them),
    plus group, and zero_stage / bucket_cap_mb / collectives (see ShardedOptimizer).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, group=None, *, zero_stage: int = 2,
                 bucket_cap_mb: float = 25.0, collectives: str = "auto"):
        # The same checks and messages as torch.optim.AdamW.
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = dict(lr=lr, betas=tuple(float(b) for b in betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, group=group, zero_stage=zero_stage,
                         bucket_cap_mb=bucket_cap_mb, collectives=collectives)

    def _layout(self, items):
        """Each parameter in world_size slices of ceil(numel / world_size) elements, slice r for rank r.

        Every row of the bucket's buffer has the same shape: parameter k's slices all sit at the same
        offset, one per row, so packing is a reshape of the (padded) gradient into (world_size, slice).
        """
        W, pieces, offset = self.world_size, [], 0
        for index, group, numel in items:
            size = math.ceil(numel / W)
            for r in range(W):
                start = r * size
                n = min(size, numel - start)
                if n > 0:  # a 3-element parameter on 4 ranks: rank 3 gets nothing (and keeps no state)
                    pieces.append(Piece(index, group, r, start, n, offset))
            offset += size
        return pieces, offset

    def _update(self, group, items):
        """torch.optim.AdamW's single-tensor update, on this rank's slices."""
        beta1, beta2 = group["betas"]
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        for p, grad, param in items:  # grad and param are flat slices (views) of the same elements
            state = self.state[p]
            if not state:  # lazily, like torch: state exists only for slices that were updated
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(param)
                state["exp_avg_sq"] = torch.zeros_like(param)
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            state["step"] += 1
            step = state["step"].item()
            if weight_decay != 0:
                param.mul_(1 - lr * weight_decay)  # decoupled weight decay: not part of the gradient
            exp_avg.lerp_(grad, 1 - beta1)  # m = beta1 m + (1 - beta1) g
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)  # v = beta2 v + (1 - beta2) g^2
            bias_correction1 = 1 - beta1 ** step
            bias_correction2 = 1 - beta2 ** step
            denom = (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(eps)
            param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
