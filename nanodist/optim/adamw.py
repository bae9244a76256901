"""AdamW's update, on the rows of a parameter this rank owns (the math only; the sharding is in sharded.py).

    opt = DistAdamW(model.configure_param_groups(0.1), lr=3e-3, betas=(0.9, 0.95))
    loss.backward(); opt.step(); opt.zero_grad()       # step() is a collective: every rank calls it

DistAdamW cuts every parameter's elements into world_size equal slices, the way torch.chunk cuts the
flattened parameter (ceil(numel / N) each; the last ones shorter, or empty: any shape works, 0-D
included): rank r keeps exp_avg, exp_avg_sq and step for slice r only -- about 1/N of AdamW's 8 bytes
per parameter.

The update is torch.optim.AdamW's, operation for operation (decoupled weight decay, bias correction):
after any number of steps the parameters equal those of one torch.optim.AdamW fed the averaged gradient.
It runs as torch's foreach kernels (a handful of calls per param group), or as torch's fused AdamW kernel
(one call) with fused=True -- the default on a GPU, where a step is otherwise a chain of small launches.
"""
from __future__ import annotations

import torch

DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=None)  # torch.optim.AdamW's


def check(group: dict) -> None:
    """torch.optim.AdamW's argument checks, with its messages."""
    if not 0.0 <= group["lr"]:
        raise ValueError(f"Invalid learning rate: {group['lr']}")
    if not 0.0 <= group["eps"]:
        raise ValueError(f"Invalid epsilon value: {group['eps']}")
    betas = group["betas"]
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= group["weight_decay"]:
        raise ValueError(f"Invalid weight_decay value: {group['weight_decay']}")
    if group.get("fused") not in (None, True, False):
        raise ValueError(f"fused must be True, False or None (None: fused on a GPU, foreach on the CPU), "
                         f"got {group['fused']!r}")
    group["betas"] = tuple(float(b) for b in betas)


def init_state(chunk_shape: tuple, like: torch.Tensor) -> dict:
    """Fresh state for one slice: torch.optim.AdamW's keys, shaped like the slice."""
    return {"step": torch.tensor(0.0, dtype=torch.float32),
            "exp_avg": torch.zeros(chunk_shape, dtype=like.dtype, device=like.device),
            "exp_avg_sq": torch.zeros(chunk_shape, dtype=like.dtype, device=like.device)}


def update(group: dict, items: list[tuple[dict, torch.Tensor, torch.Tensor]]) -> None:
    """AdamW on every slice of a param group: torch's fused kernel (one launch) where the group asks for it --
    fused=True, or None with the parameters on a GPU -- else the foreach kernels. items: (state, averaged
    gradient slice, parameter slice), flat views of the same elements."""
    if not items:
        return
    fused = group.get("fused")
    if fused or (fused is None and items[0][2].is_cuda):
        fused_update(group, items)
    else:
        foreach_update(group, items)


def foreach_update(group: dict, items: list[tuple[dict, torch.Tensor, torch.Tensor]]) -> None:
    """torch.optim.AdamW's update, operation for operation, on every slice of a param group at once (foreach
    kernels: a handful of calls per group, not per parameter)."""
    beta1, beta2 = group["betas"]
    lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
    states, grads, params = (list(x) for x in zip(*items))
    exp_avgs, exp_avg_sqs = [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states]
    steps = [st["step"] for st in states]
    torch._foreach_add_(steps, 1)
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)  # decoupled weight decay: not part of the gradient
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)  # m = beta1 m + (1 - beta1) g
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)  # v = beta2 v + (1 - beta2) g^2
    counts = [s.item() for s in steps]  # step counters live on the CPU, as torch's do: no device wait
    bias_correction1 = [1 - beta1 ** k for k in counts]
    bias_correction2_sqrt = [(1 - beta2 ** k) ** 0.5 for k in counts]
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, [-lr / b for b in bias_correction1])


def fused_update(group: dict, items: list[tuple[dict, torch.Tensor, torch.Tensor]]) -> None:
    """The same update as torch's fused AdamW kernel (torch.optim.AdamW(fused=True)): one launch for the group.
    Its step counters live on the parameters' device, as torch's fused AdamW keeps them (moved there once)."""
    beta1, beta2 = group["betas"]
    states, grads, params = (list(x) for x in zip(*items))
    device = params[0].device
    for st in states:
        if st["step"].device != device:
            st["step"] = st["step"].to(device)
    steps = [st["step"] for st in states]
    torch._foreach_add_(steps, 1)
    torch._fused_adamw_(params, grads, [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states], [],
                        steps, amsgrad=False, lr=group["lr"], beta1=beta1, beta2=beta2,
                        weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
