"""How the Trainer talks to whatever averages the gradients: one small protocol, and adapters for torch's wrappers.

    sync = gradient_sync(model, optimizer, group)
    sync.set_requires_gradient_sync(False)      # accumulation micro-steps: backward only adds up p.grad
    sync.set_requires_gradient_sync(True)       # the last micro-step: this backward synchronises
    norm = sync.clip_grad_norm_(1.0)            # the global norm of the synchronised gradient, then clipped

Who averages the gradients differs by chapter: a DDP wrapper around the model (nanodist's or torch's,
chapter 3), the optimizer itself (ZeRO, chapter 4), or FSDP (chapter 5: nanodist's or torch's
`fully_shard`). nanodist's DDP and ShardedOptimizer implement the two methods themselves. torch's DDP
and FSDP2 get a thin adapter, and a world of one needs nothing. Anything else is an error, so a
gradient sync that would silently run on every micro-step, or not at all, is not possible.

Who clips: whoever sees the synchronised gradient. Under DDP every rank holds the whole averaged
gradient, so the global norm is a local computation. A ZeRO optimizer or FSDP holds shards: the norm
needs a sum of squares over the ranks, which they fold into a collective they already run. Gradients that are
DTensors of any placement beside plain ones (tensor parallelism): `clip_grad_norm_` here.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from .group import Group
from .state import full_tensor, is_dtensor


@runtime_checkable
class GradientSync(Protocol):
    """What the Trainer needs from the piece that synchronises gradients."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """False: the next backward only accumulates p.grad locally. True: it synchronises."""

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the synchronised gradient to max_norm by its global norm; return that norm (before clipping).
        Collective where the gradient is sharded: every rank calls it."""


def clip_grad_norm_(params, max_norm: float) -> torch.Tensor:
    """Clip gradients that may be DTensors of any placement, on any mesh, mixed with plain tensors, by their global
    2-norm, and return that norm (before clipping) as a plain tensor, the same on every rank. A plain gradient, and
    a DTensor's Replicate placement, count once (every rank of that dimension holds the same values); a Shard
    placement's squares are summed over its mesh dimension's ranks; a Partial one (a sum still pending) is refused.
    A collective over every mesh dimension a parameter is sharded on: call it on every rank, with the same
    parameters in the same order. The collectives follow the parameters, not their gradients, so a rank whose
    gradient is missing (counted as zeros) still joins them. Where torch.nn.utils.clip_grad_norm_ refuses DTensor
    and plain gradients mixed, or DTensors on different meshes (tensor parallelism beside replicated layers), this
    is the norm to use. The squares are taken in one foreach launch per device, as torch's clip_grad_norm_ does."""
    import torch.distributed as dist
    locals_, plain, sharded = [], [], {}  # sharded: (mesh, dims) -> squares, one all-reduce per kind of layout
    for p in params:
        g = p.grad
        if not is_dtensor(p) and not is_dtensor(g):
            if g is not None:
                plain.append(g)
                locals_.append(g)
            continue
        layout = g if g is not None else p
        if any(pl.is_partial() for pl in layout.placements):
            raise ValueError(f"clip_grad_norm_: a gradient with placements {layout.placements} holds a pending sum "
                             f"(Partial): redistribute it to Shard or Replicate first")
        # sharded: anything not replicated (Shard, and FSDP2 x TP's _StridedShard, which is no Shard in torch 2.13)
        dims = tuple(i for i, pl in enumerate(layout.placements) if not pl.is_replicate())
        entry = sharded.setdefault((id(layout.device_mesh), dims), (layout.device_mesh, dims, [], p.to_local().device))
        if g is not None:
            entry[2].append(g.to_local())
            locals_.append(entry[2][-1])
    if not locals_ and not sharded:
        return torch.zeros(())
    device = locals_[0].device if locals_ else next(iter(sharded.values()))[3]
    total = _squares(plain, device)
    for mesh, dims, parts, _ in sharded.values():
        sq = _squares(parts, device)
        for d in dims:  # the squares of a shard, summed over the ranks of each dimension it is sharded on
            group = Group.of(mesh.get_group(d))
            on = sq.to(group.comm_device)
            dist.all_reduce(on, group=group.pg)
            sq = on.to(device)
        total += sq
    norm = total.sqrt()
    if max_norm != float("inf"):
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for local in locals_:
            local.detach().mul_(coef.to(local.device, local.dtype))
    return norm


def _squares(tensors: list[torch.Tensor], device) -> torch.Tensor:
    """The sum of the squares of every element of `tensors` (fp32), on `device`: one foreach norm per device."""
    total = torch.zeros((), device=device, dtype=torch.float32)
    by_device: dict = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t.detach())
    for ts in by_device.values():
        norms = torch._foreach_norm(ts, 2, dtype=torch.float32)
        total += torch.stack(norms).pow(2).sum().to(device)
    return total


def _local_clip(params, max_norm: float) -> torch.Tensor:
    # Under replicated gradients the norm is the same on every rank. An infinite max_norm measures without clipping.
    # DTensor gradients (tensor parallelism, FSDP2 on a mesh) may sit beside plain ones or on several meshes, which
    # torch's clip_grad_norm_ refuses: the placement-aware norm above takes them all.
    params = [p for p in params if p.grad is not None]
    if any(is_dtensor(p.grad) for p in params):
        return clip_grad_norm_(params, max_norm)
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


class _TorchDDP:
    """torch.nn.parallel.DistributedDataParallel: its no_sync() flips require_backward_grad_sync."""

    def __init__(self, model: nn.Module):
        self.model = model

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        self.model.require_backward_grad_sync = bool(requires_gradient_sync)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return _local_clip(self.model.parameters(), max_norm)


class _FSDP2:
    """torch's fully_shard: it has set_requires_gradient_sync; the norm of DTensor gradients is global."""

    def __init__(self, model: nn.Module):
        self.model = model

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        self.model.set_requires_gradient_sync(bool(requires_gradient_sync))

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        norm = _local_clip(self.model.parameters(), max_norm)
        return full_tensor(norm)


class _Alone:
    """A world of one: nothing to synchronise."""

    def __init__(self, model: nn.Module):
        self.model = model

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        pass

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return _local_clip(self.model.parameters(), max_norm)


def _is_fsdp2(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def gradient_sync(model: nn.Module, optimizer, group=None) -> GradientSync:
    """The object that synchronises this model's gradients: the model (nanodist DDP/FSDP), the optimizer (ZeRO),
    an adapter for torch DDP or FSDP2, or nothing at all in a world of one. Raises ValueError when two things
    would synchronise (DDP around a model whose optimizer averages too) or nothing would on several ranks."""
    group = Group.resolve(group)
    own = [x for x in (model, optimizer) if isinstance(x, GradientSync) and not _is_fsdp2(x)]
    if len(own) == 2:
        raise ValueError(f"both the model ({type(model).__name__}) and the optimizer ({type(optimizer).__name__}) "
                         f"average the gradients: a sharded optimizer does it itself, so give it the bare model "
                         f"(no DDP wrapper)")
    if own:
        return own[0]
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return _TorchDDP(model)
    if _is_fsdp2(model):
        return _FSDP2(model)
    if group.size == 1:
        return _Alone(model)
    raise ValueError(
        f"nothing averages the gradients over the {group.size} ranks: {type(model).__name__} is not wrapped and "
        f"{type(optimizer).__name__} does not average them. Wrap the model (nanodist.DDP, torch DDP, fully_shard) "
        f"or use a sharded optimizer (nanodist.DistAdamW, make_muon_optimizer).")
