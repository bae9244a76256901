"""What the ranks of a ZeRO optimizer agree on before a step, in one small all-reduce.

Both sharded optimizers (ShardedOptimizer in sharded.py, ZeroOptimizer in zero1.py) hold only part of the averaged
gradient on each rank, so before stepping they must learn from the others:

- which parameters had a gradient on *any* rank (torch's optimizers skip a parameter whose grad is None, and a
  parameter used on one rank only still has an averaged gradient everywhere);
- when clipping, the global norm of the averaged gradient, summed from every rank's squared norm of its part;
- the divergence detector's digest of this rank's collectives (nanodist.diverge), so that ranks which issued
  different collectives are named at the next check instead of hanging.

One float64 vector carries all three: [flag per parameter..., squared norm, d, d^2]. Nothing waits for the
device: the norm and the clip coefficient stay tensors (the coefficient is applied by multiplying, as
torch.nn.utils.clip_grad_norm_ does), and the flags are read back only on a rank that lacked a gradient that it
could have had -- a rank that had every gradient knows the answer already.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .. import diverge


def agree(group, had_grad: list[bool], could_have: list[bool], parts: list[torch.Tensor], clip_norm: float | None,
          check: diverge.PendingCheck, what: str, shm=None):
    """(has_grad per parameter on any rank, global norm or None, clip coefficient or None).

    had_grad: this rank's flags; could_have: the parameters this optimizer reduces (a frozen one never has a
    gradient and is not asked about); parts: this rank's part of the averaged gradient (at one rank: every
    gradient) whose squares sum to the global squared norm; clip_norm: None (no norm), inf (the norm, no
    coefficient) or the max norm; check: the optimizer's divergence check; shm: a shared-memory all-reduce of the
    same length (ShardedOptimizer's intra-host transport), or None for the group's collective."""
    sq = None
    if clip_norm is not None:
        device = parts[0].device if parts else group.comm_device
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for t in parts:
            by_device.setdefault(t.device, []).append(t)
        # one foreach launch per device (not one norm per tensor: on a GPU the launches would cost more than the
        # reading), in fp64 so that the squares of many parts add up without losing the small ones
        norms = [n.to(device) for ts in by_device.values() for n in torch._foreach_norm(ts, 2, dtype=torch.float64)]
        sq = torch.stack(norms).square().sum() if norms else torch.zeros((), dtype=torch.float64, device=device)
    has_grad, total = list(had_grad), sq
    if group.size > 1:
        device = group.comm_device
        n = len(had_grad)
        host = torch.tensor([1.0 if h else 0.0 for h in had_grad] + [0.0, *diverge.agreement_values(group)],
                            dtype=torch.float64, pin_memory=device.type == "cuda")
        vec = host.to(device, non_blocking=True)
        if sq is not None:
            vec[n] = sq.to(device)
        if shm is not None:
            shm.mine.copy_(vec)
            dist.barrier(group=group.pg)  # every row written (no closing barrier: see ShardedOptimizer)
            vec = shm.rows[:group.size].sum(0)
        else:
            with diverge.waiting(diverge.issue(group, what)):
                dist.all_reduce(vec, group=group.pg)
        check.submit(vec[n + 1:], group)
        total = vec[n]
        if any(not h and c for h, c in zip(had_grad, could_have)):  # only here is a value read back
            has_grad = [v > 0 for v in vec[:n].tolist()]
    if clip_norm is None:
        return has_grad, None, None
    norm = total.sqrt()
    coef = torch.clamp(clip_norm / (norm + 1e-6), max=1.0) if math.isfinite(clip_norm) else None
    return has_grad, norm, coef
