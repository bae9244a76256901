"""Fully sharded data parallel (ZeRO stage 3), written to be read: each rank keeps 1/N of the parameters.

    model = nanodist.FSDP(GPT(cfg), units=list(model.blocks))     # every Block a unit, the rest the root
    opt = torch.optim.AdamW(model.configure_param_groups(0.1), lr=3e-3)   # steps this rank's shards
    loss = model(x, y)[1]; loss.backward(); opt.step(); opt.zero_grad()

ZeRO stages 1 and 2 (chapter 4) shard the optimizer state and the gradients; every rank still holds
every parameter. FSDP shards the parameters too, and gathers a piece of the model only while it
computes. The pieces are *units*: the submodules you name (a transformer Block, typically) plus the
root, which holds whatever parameters no unit does (the embeddings, the final norm, the head).

A unit's parameters live as one flat buffer, padded to a multiple of N, of which rank r keeps chunk r
(its *shard*, fp32: the master copy). Around each unit:

    forward:   all-gather the shards into the unit's full buffer  ->  run  ->  free the buffer
    backward:  all-gather again  ->  run  ->  reduce-scatter the gradient into this rank's shard  ->  free

The full buffer is a persistent tensor whose storage is allocated by the gather and released by the
free (storage resize, as PyTorch's first FSDP does): the module's parameters are views of it, and
the tensors autograd saved for backward find their data again once it is re-gathered. Its gradient
arrives through a post-accumulate-grad hook of the gradient-sync engine (nanodist.sync), which
launches each unit's reduce-scatter during backward, in a fixed order on every rank, and waits for
all of them when backward ends -- the same machinery as DDP and the sharded optimizers.

Prefetch: while unit i runs forward, unit i+1's all-gather is already on its way; in backward, unit
i-1's while unit i runs. So at most two units are gathered at any time, besides the root (which stays
gathered from the first forward to the end of backward, as in torch's FSDP2).

The optimizer sees, for every original parameter, a Parameter that is a (possibly empty) view into
this rank's shard, named as in the bare model: AdamW steps them, weight decay can be grouped by the
original shapes (configure_param_groups), and their gradients are views into the reduced shard. The
module holds the same Parameters whenever a unit is not gathered (module.named_parameters() names them,
`layer.weight` reads this rank's 1-D piece of it); while it is gathered, views of the full buffer. So a
read never touches released memory, and freezing `layer.weight` after wrapping freezes what the
optimizer steps: its part of the reduced gradient is dropped. A unit no rank used in a step gets no
gradient at all (None: the optimizer skips it, as one process would); inside a unit that ran, a
parameter unused in the step gets a zero gradient (as in torch's FSDP1). Ranks start from rank 0's
weights (broadcast when wrapping, as DDP does).

Gradient clipping: `fsdp.clip_grad_norm_(max_norm)` is the global norm. torch's
`torch.nn.utils.clip_grad_norm_(fsdp.parameters(), ...)` sees this rank's pieces only, so it returns a
rank-local norm and clips each rank by another factor (as with torch's FSDP1); FSDP2's parameters are
DTensors, and there the same torch call returns the global norm. The Trainer always calls the wrapper's.
Mixed precision: param_dtype (bf16) gathers and computes in bf16 from the fp32 shards; gradients are
reduced in reduce_dtype (fp32 by default) and kept in fp32.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from . import diverge
from .group import Group
from .state import param_shaped, torch_layout
from .sync import (Bucket, GradSync, LocalFinite, Observer, ReportsLocalFinite, Slot, Work, all_gather,
                   reduce_scatter_sum, refuse_dtensors)

def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class Unit:
    """One unit's flat parameters: the fp32 shard this rank keeps, the full buffer gathered around compute."""

    def __init__(self, index: int, name: str, module: nn.Module, slots: list[tuple], group: Group,
                 param_dtype: torch.dtype | None, ring: bool):
        # slots: (fqn, [(module, attribute)], parameter) for every distinct parameter of the unit, in order.
        self.index, self.name, self.module, self.group, self.ring = index, name, module, group, ring
        self.what_gather, self.what_reduce = f"FSDP all-gather of unit {name}", f"FSDP reduce-scatter of unit {name}"
        params = [p for _, _, p in slots]
        dtypes, devices = {p.dtype for p in params}, {p.device for p in params}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(f"FSDP unit {name!r} mixes {sorted(map(str, dtypes | devices))}: a unit is one flat "
                             f"buffer, so its parameters must share a dtype and a device (convert the model first)")
        # A unit computes a gradient when any of its parameters trains; a frozen one beside them gets none (its
        # part of the reduced gradient is dropped), as in torch's FSDP with use_orig_params.
        self.requires_grad = any(p.requires_grad for p in params)
        W, r = group.size, group.rank
        self.names = [f for f, _, _ in slots]
        self.homes = [homes for _, homes, _ in slots]
        self.shapes = [p.shape for p in params]
        self.offsets, n = [], 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        self.padded = math.ceil(n / W) * W if n else W
        self.shard_numel = self.padded // W
        master = params[0].dtype
        with torch.no_grad():
            flat = torch.zeros(self.padded, dtype=master, device=params[0].device)
            for p, o in zip(params, self.offsets):
                flat[o:o + p.numel()].copy_(p.reshape(-1))
            self.shard = flat[r * self.shard_numel:(r + 1) * self.shard_numel].clone()  # the fp32 master shard
        self.compute_dtype = param_dtype or master
        self.full = torch.empty(self.padded, dtype=self.compute_dtype, device=self.shard.device,
                                requires_grad=self.requires_grad)  # the unit's parameters while gathered
        self._full_data = self.full.data  # written by the gather: its own version counter, autograd's is untouched
        self._free()
        self.gathered = False
        self.work: Work | None = None  # an all-gather in flight (prefetch)
        self._send: torch.Tensor | None = None
        # This rank's part of every parameter: (start, stop) in the shard, and where in the parameter it starts.
        mine = {k: (a, b) for k, a, b in flat_layout([p.numel() for p in params], W)[r] if k is not None}
        self.local = []
        for k, o in enumerate(self.offsets):
            a, b = mine.get(k, (0, 0))
            at = o + a - r * self.shard_numel
            self.local.append((at, at + b - a, a) if b > a else (0, 0, 0))
        self.views = [nn.Parameter(self.shard[s:e], requires_grad=p.requires_grad)
                      for (s, e, _), p in zip(self.local, params)]
        self.grad_shard: torch.Tensor | None = None
        self.had_grad = False  # this rank computed a gradient for the unit in the backward being reduced
        self.install_local()

    # --- gather and free ----------------------------------------------------------------------------

    def _free(self) -> None:
        self.full.untyped_storage().resize_(0)

    def gather(self) -> None:
        """Start the all-gather (asynchronous where the backend allows); wait() finishes it."""
        if self.gathered or self.work is not None:
            return
        self.full.untyped_storage().resize_(self.padded * self.full.element_size())
        with torch.no_grad():
            self._send = self.shard.to(self.compute_dtype) if self.compute_dtype != self.shard.dtype else self.shard
            out = self._full_data.view(self.group.size, self.shard_numel)
            self.work = all_gather(out, self._send, self.group, ring=False, what=self.what_gather)

    def wait(self) -> None:
        if not self.gathered:
            self.gather()
            self.work.wait()
            self.work, self._send = None, None
            self.gathered = True
            self._install()

    def _install(self) -> None:
        """Point the modules' parameter attributes at views of the gathered buffer (re-made at every gather). One
        split of the buffer, not a slice per parameter: in backward, the split's gradient is one tensor for the
        whole unit, where slices would each build a zero-filled buffer of the unit's size. (A plain attribute:
        the module's registered parameter, the local view, steps aside until the unit is freed.)"""
        sizes = [shape.numel() for shape in self.shapes] + [self.padded - self.numel]
        for view, shape, homes in zip(torch.split(self.full, sizes), self.shapes, self.homes):
            view = view.view(shape)
            for module, attr in homes:
                module._parameters.pop(attr, None)
                module.__dict__[attr] = view

    def install_local(self) -> None:
        """Point the modules' parameters at this rank's local views -- the very (1-D, possibly empty) Parameters
        the optimizer steps -- whenever the unit is not gathered: a read between steps sees real memory, never
        the freed buffer, and module.named_parameters() names them."""
        for view, homes in zip(self.views, self.homes):
            for module, attr in homes:
                module.__dict__.pop(attr, None)
                module._parameters[attr] = view

    def free(self) -> None:
        if self.gathered:
            self._free()
            self.install_local()
            self.gathered = False

    @property
    def full_bytes(self) -> int:
        return self.padded * self.full.element_size()


class FSDP(nn.Module, ReportsLocalFinite):
    """ZeRO-3 over `units` (submodules of `module`; the root holds the rest). See the module docstring.

    - group: the ranks that shard (default: the world).
    - reshard_after_forward: free a unit's gathered parameters after its forward (True, ZeRO-3) or keep
      them until its backward is done (False: more memory, one all-gather fewer, ZeRO-2-like).
    - prefetch: gather the next unit while the current one computes, in forward and in backward.
    - param_dtype: compute dtype (e.g. torch.bfloat16): the fp32 shards are cast before the all-gather.
    - reduce_dtype: dtype of the gradient reduce-scatter (default: the shards' fp32; bf16 halves the bytes).
    - collectives: "auto" (the reduce-scatter through nanodist's ring on gloo, torch's on nccl), "ring", "torch".
    - observer: a nanodist.fsdp.FSDPTimeline (or any object with its methods, or a list of them) to record
      gathers, frees and reduce-scatters: the chapter's figures, and nanodist.memory's accounting.

    Implements the Trainer's protocol: set_requires_gradient_sync (off: backward keeps each unit's full local
    gradient and reduces nothing) and clip_grad_norm_ (the global norm, from every rank's shard; torch's
    clip_grad_norm_ over fsdp.parameters() would be this rank's alone: see the module docstring).
    full_state_dict(all_ranks=True) gives every rank the whole model; state_dict() is FSDP2's sharded layout.
    """

    def __init__(self, module: nn.Module, units=(), *, group=None, reshard_after_forward: bool = True,
                 prefetch: bool = True, param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                 collectives: str = "auto", observer=None):
        super().__init__()
        if collectives not in ("auto", "ring", "torch"):
            raise ValueError(f"FSDP: collectives must be one of auto, ring, torch, got {collectives!r}")
        refuse_dtensors(module.named_parameters(), "nanodist.FSDP")
        self.module = module
        g = Group.resolve(group)
        self.group, self.world_size = g, g.size
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self.reduce_dtype = reduce_dtype
        self.observer = observer
        ring = collectives == "ring" or (collectives == "auto" and g.backend == "gloo")
        self._check_same_model()
        # Every rank keeps its own chunk of every parameter: ranks that built the model with different seeds would
        # train a mixture of their models. They start from rank 0's, as with DDP (and buffers too).
        from .runtime import warn_if_differed
        self.mismatched_at_wrap = warn_if_differed("FSDP", g.broadcast_from_first(list(module.named_parameters()) +
                                                                                  list(module.named_buffers())))
        unit_modules = list(units)
        names = {id(m): n for n, m in module.named_modules()}
        for m in unit_modules:
            if id(m) not in names or m is module:
                raise ValueError(f"FSDP: every unit must be a submodule of the model (not the model itself), got "
                                 f"{type(m).__name__}")
        owner = {}  # id(param) -> unit index; the root (index len(units)) takes what no unit holds
        slots: list[list] = [[] for _ in range(len(unit_modules) + 1)]
        homes: dict[int, list] = {}
        for mname, m in module.named_modules():
            for attr, p in list(m._parameters.items()):
                if p is None:
                    continue
                homes.setdefault(id(p), []).append((m, attr))
        for u, um in enumerate(unit_modules + [module]):
            for mname, p in (um.named_parameters() if um is not module else module.named_parameters()):
                if id(p) in owner:
                    continue
                fqn = (names[id(um)] + "." + mname) if um is not module else mname
                # A parameter also used outside this unit (tied) must live in one unit that covers all its uses.
                used_in = {self._unit_of(mod, unit_modules) for mod, _ in homes[id(p)]}
                if len(used_in) > 1 and um is not module:
                    others = [names[id(unit_modules[i])] if i is not None else "the root" for i in used_in if i != u]
                    raise ValueError(f"FSDP: parameter {fqn!r} of unit {names[id(um)]!r} is shared with {others}: a "
                                     f"shared parameter must belong to one unit that contains all its uses (tie it "
                                     f"within one unit, or leave both modules to the root)")
                owner[id(p)] = u
                slots[u].append((fqn, homes[id(p)], p))
        self.units: list[Unit] = []
        for u, um in enumerate(unit_modules + [module]):
            name = names[id(um)] or "root"
            if slots[u]:
                self.units.append(Unit(len(self.units), name, um, slots[u], g, param_dtype, ring))
        # The module's parameters are now this rank's local views (Unit.install_local); while a unit is gathered,
        # views of its full buffer. The original parameters are no longer referenced.
        self._views = [p for unit in self.units for p in unit.views]
        self._names = [n for unit in self.units for n in unit.names]
        self._root = self.units[-1] if self.units and self.units[-1].module is module else None
        self._order = [u for u in self.units if u is not self._root]  # forward order of the (non-root) units
        self._frozen_units = [u for u in self.units if not u.requires_grad]
        self._ran, self._ran_expected = [], list(range(len(self._order)))
        self._digest_check = diverge.PendingCheck("FSDP")
        self._local_finite = LocalFinite()
        self._install_hooks()
        trainable = [u for u in self.units if u.requires_grad]
        # Backward produces the last units' gradients first, the root's (embeddings) last.
        order = list(reversed([u for u in trainable if u is not self._root])) + \
            ([self._root] if self._root is not None and self._root.requires_grad else [])
        buckets = [Bucket(i, [trainable.index(u)], [Slot(trainable.index(u), 0, u.padded, 0)], u.padded,
                          u.compute_dtype, u.shard.device) for i, u in enumerate(order)]
        for b, u in zip(buckets, order):
            b.extra["unit"] = u
        self._engine = GradSync([u.full for u in trainable], buckets, self._launch_reduce, self._finish_reduce,
                                names=[f"FSDP unit {u.name}" for u in trainable])
        for u in trainable:  # after the engine's hook: the reduce-scatter reads the gradient first, then the params go
            u.full.register_post_accumulate_grad_hook(lambda _p, u=u: self._after_backward(u))

    # --- set-up ----------------------------------------------------------------------------------------

    def _check_same_model(self) -> None:
        self.group.check_same([(n, tuple(p.shape), str(p.dtype), p.requires_grad)
                               for n, p in self.module.named_parameters()], "FSDP")

    @staticmethod
    def _unit_of(mod: nn.Module, units: list[nn.Module]) -> int | None:
        for i, u in enumerate(units):
            if any(m is mod for m in u.modules()):
                return i
        return None

    def _install_hooks(self) -> None:
        if self._root is not None:
            self.module.register_forward_pre_hook(self._root_pre_forward)
            self.module.register_forward_hook(self._root_post_forward)
        for i, unit in enumerate(self._order):
            unit.module.register_forward_pre_hook(lambda m, a, i=i: self._pre_forward(i))
            unit.module.register_forward_hook(lambda m, a, out, i=i: self._post_forward(i, out))

    def _event(self, what: str, unit: Unit) -> None:
        if self.observer is not None:
            for obs in self.observer if isinstance(self.observer, (list, tuple)) else (self.observer,):
                getattr(obs, what)(unit)

    # --- forward ------------------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        if self._engine.pending:  # a backward was interrupted: forget its half-finished reduction
            self._engine.reset()
        for unit in self._frozen_units:
            for name, view in zip(unit.names, unit.views):
                if view.requires_grad:
                    raise ValueError(f"FSDP: {name} was unfrozen after wrapping, but every parameter of its unit "
                                     f"({unit.name}) was frozen when FSDP wrapped the model, so the unit computes no "
                                     f"gradient. Unfreeze it before wrapping (FSDP then reduces its unit's gradient; "
                                     f"frozen parameters beside it get none).")
        return self.module(*args, **kwargs)

    def _gather(self, unit: Unit) -> None:
        if not unit.gathered and unit.work is None:
            self._event("gather_started", unit)
            unit.gather()

    def _wait(self, unit: Unit) -> None:
        if not unit.gathered:
            self._gather(unit)
            unit.wait()
            self._event("gathered", unit)

    def _free(self, unit: Unit) -> None:
        if unit.gathered:
            unit.free()
            self._event("freed", unit)

    def _root_pre_forward(self, module, args) -> None:
        if _in_backward():
            return
        self._ran = []  # the units this forward runs, in order: the divergence report says so when it is not FSDP's
        self._wait(self._root)  # the root stays gathered until its gradient is reduced (or, without grad, the end)
        if self.prefetch and self._order:
            self._gather(self._order[0])

    def _root_post_forward(self, module, args, out):
        if _in_backward():
            return out
        if self._ran != self._ran_expected and self.world_size > 1:
            diverge.note(self.group, f"its forward ran units {', '.join(self._order[i].name for i in self._ran)} "
                                     f"(FSDP's order: {', '.join(u.name for u in self._order)})")
        if not torch.is_grad_enabled():
            self._free(self._root)  # no backward will follow (evaluation): nothing to keep it for
        elif self._root.requires_grad:  # a second backward (retain_graph) finds the root freed: gather it again
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(self._root_pre_backward)
        return out

    def _root_pre_backward(self, grad):
        self._wait(self._root)
        return grad

    def _pre_forward(self, i: int) -> None:
        unit = self._order[i]
        if not _in_backward():
            self._ran.append(i)
        self._wait(unit)
        if self.prefetch and not _in_backward() and i + 1 < len(self._order):
            self._gather(self._order[i + 1])

    def _post_forward(self, i: int, out):
        unit = self._order[i]
        if _in_backward():  # activation checkpointing recomputes the forward inside backward: keep the params
            return out
        if torch.is_grad_enabled():  # a frozen unit too: backward needs its parameters to reach the units before it
            first = next((t for t in (out if isinstance(out, (tuple, list)) else (out,))
                          if torch.is_tensor(t) and t.requires_grad), None)
            if first is not None:
                first.register_hook(lambda grad, i=i: self._pre_backward(i, grad))
        if self.reshard_after_forward or not torch.is_grad_enabled():
            self._free(unit)
        return out

    # --- backward -----------------------------------------------------------------------------------

    def _pre_backward(self, i: int, grad):
        self._wait(self._order[i])
        if self.prefetch and i > 0:
            self._gather(self._order[i - 1])
        return grad

    def _launch_reduce(self, b: Bucket) -> Work:
        """A unit's gradient is complete: reduce-scatter it into this rank's shard of the gradient."""
        unit = b.extra["unit"]
        grad = unit.full.grad
        unit.had_grad = grad is not None
        if grad is None:  # the unit took no part in this step on this rank: it contributes zeros
            if self.world_size > 1:
                diverge.note(self.group, f"unit {unit.name} got no gradient in its backward")
            grad = torch.zeros(unit.padded, dtype=unit.compute_dtype, device=unit.shard.device)
        dtype = self.reduce_dtype or unit.shard.dtype
        send = grad if grad.dtype == dtype else grad.to(dtype)
        self._local_finite.add(send)
        out = torch.empty(unit.shard_numel, dtype=dtype, device=send.device)
        b.extra["out"] = out
        self._event("reduce_started", unit)
        work = reduce_scatter_sum(out, send.view(self.world_size, unit.shard_numel), self.group, unit.ring,
                                  unit.what_reduce)
        unit.full.grad = None  # the full gradient is not kept: only this rank's shard of it
        return work

    def _after_backward(self, unit: Unit) -> None:
        """A unit's gradient is complete (reduced or, under accumulation, kept): its parameters can go, and so can
        those of the frozen units after it, whose backward (which only passes the gradient on) is done too."""
        if unit is not self._root:
            self._free(unit)
        done = self._order if unit is self._root else self._order[self._order.index(unit) + 1:]
        for other in done:
            if not other.requires_grad:
                self._free(other)

    def _finish_reduce(self, missing) -> None:
        self._local_finite.close()
        W = self.world_size
        buckets = self._engine.buckets
        # A unit no rank used in this step gets no gradient (None), as a module unused in one process would: the
        # optimizer then skips it. Agreed in one small all-reduce, read back only on a rank that lacked a unit.
        # The divergence detector's digest (d, d^2) rides along (nanodist.diverge).
        had = [b.extra["unit"].had_grad for b in buckets]
        if W > 1 and buckets:
            flags = torch.tensor([float(h) for h in had] + list(diverge.agreement_values(self.group)),
                                 dtype=torch.float64, device=self.group.comm_device)
            with diverge.waiting(diverge.issue(self.group, "FSDP agreement (which units had a gradient)")):
                dist.all_reduce(flags, group=self.group.pg)
            self._digest_check.submit(flags[-2:], self.group)
            if not all(had):
                had = [v > 0 for v in flags[:-2].tolist()]
        for b, used in zip(buckets, had):
            unit, out = b.extra["unit"], b.extra.pop("out")
            if not used:
                continue
            out = out.to(unit.shard.dtype) if out.dtype != unit.shard.dtype else out
            if W > 1:
                out.div_(W)
            for (s, e, _), view in zip(unit.local, unit.views):
                if not view.requires_grad:  # frozen (before or after wrapping): its gradient is dropped
                    out[s:e].zero_()
            if not self._has_grad(unit):  # the optimizer's zero_grad dropped the last one
                unit.grad_shard = out
                for (s, e, _), view in zip(unit.local, unit.views):
                    view.grad = out[s:e] if view.requires_grad else None
            else:  # another backward since the last step: add its gradient
                unit.grad_shard.add_(out)
            self._event("reduced", unit)
        if self._root is not None:
            self._free(self._root)

    @staticmethod
    def _has_grad(unit: Unit) -> bool:
        """Whether the unit holds a reduced gradient not yet dropped by a zero_grad (the optimizer's or ours)."""
        if unit.grad_shard is None:
            return False
        return any(v.grad is not None for v in unit.views)

    # --- the Trainer's protocol ---------------------------------------------------------------------

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """False: backward keeps every unit's full local gradient (accumulation) and reduces nothing."""
        self._engine.enabled = bool(requires_gradient_sync)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The global norm of the averaged gradient, from every rank's shard (one small all-reduce); clips it."""
        sq = torch.zeros((), dtype=torch.float64, device=self.group.comm_device)
        live = [u for u in self.units if self._has_grad(u)]
        for unit in live:
            sq += torch.linalg.vector_norm(unit.grad_shard, dtype=torch.float64).to(sq.device) ** 2
        if self.world_size > 1:
            with diverge.waiting(diverge.issue(self.group, "FSDP gradient norm")):
                dist.all_reduce(sq, group=self.group.pg)
        norm = sq.sqrt()
        coef = float(max_norm) / (float(norm) + 1e-6)  # torch.nn.utils.clip_grad_norm_'s formula
        if coef < 1.0:
            for unit in live:
                unit.grad_shard.mul_(coef)
        return norm.float()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for unit in self.units:
            unit.grad_shard = None
            unit.full.grad = None
            for v in unit.views:
                v.grad = None

    # --- what the optimizer and the checkpoint see ---------------------------------------------------

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """This rank's shard of every original parameter, under its original name (the module's own
        named_parameters() yields the same Parameters, between forward passes)."""
        for name, p in zip(self._names, self._views):
            yield prefix + name, p

    def parameters(self, recurse: bool = True):
        for _, p in self.named_parameters():
            yield p

    def configure_param_groups(self, weight_decay: float) -> list[dict]:
        """Weight decay on the shards of matrices (original ndim >= 2), none on biases and norms: the rule of
        GPT.configure_param_groups, decided by the original shapes (a shard is always 1-D)."""
        shapes = {n: s for unit in self.units for n, s in zip(unit.names, unit.shapes)}
        decay = [(n, p) for n, p in self.named_parameters() if p.requires_grad and len(shapes[n]) >= 2]
        no_decay = [(n, p) for n, p in self.named_parameters() if p.requires_grad and len(shapes[n]) < 2]
        return [{"params": [p for _, p in ps], "param_names": [n for n, _ in ps], "weight_decay": wd}
                for ps, wd in ((decay, weight_decay), (no_decay, 0.0)) if ps]

    @torch.no_grad()
    def full_state_dict(self, all_ranks: bool = False) -> dict:
        """Every parameter whole, under its original name (tied ones under each), on the group's rank 0 -- the
        other ranks get {} -- or, with all_ranks=True, on every rank. A collective: every rank calls it. Loadable
        into the bare model with plain torch."""
        out = {}
        keep = all_ranks or self.group.is_main
        for unit in self.units:
            full = torch.empty(unit.padded, dtype=unit.shard.dtype, device=unit.shard.device)
            all_gather(full.view(self.world_size, unit.shard_numel), unit.shard, self.group, ring=False,
                       what=f"FSDP full_state_dict all-gather of unit {unit.name}").wait()
            if keep:
                for name, o, shape in zip(unit.names, unit.offsets, unit.shapes):
                    out[name] = full[o:o + shape.numel()].view(shape).clone()
        out.update({alias: out[name] for alias, name in self._aliases().items() if name in out})
        return {k: out[k] for k in sorted(out)} if keep else {}

    @torch.no_grad()
    def load_full_state_dict(self, state: dict) -> None:
        """Load whole parameters (what full_state_dict() or the bare model's state_dict() holds) into the shards;
        every rank passes the same dict (e.g. torch.load on each)."""
        self.load_state_dict(state)

    def _row_ranges(self, unit: Unit, rank: int) -> list[tuple[int, int]]:
        """Where each parameter's dim-0 chunk for `rank` (torch.chunk's rule, DTensor Shard(0)'s) lies in the unit's
        flat buffer."""
        chunks = dim0_layout(unit.shapes, self.world_size)[rank]
        return [(o + a, o + b) for o, (_, a, b) in zip(unit.offsets, chunks)]

    def _to_param_layout(self, unit: Unit, flat: torch.Tensor, names=None, group: Group | None = None) -> dict:
        """This rank's flat piece of a unit-sized vector (the shard, or an optimizer state laid out like it) as
        one tensor per parameter in FSDP2's layout: a DTensor Shard(0) of the parameter's shape holding this
        rank's dim-0 chunk (a plain tensor in a world of one; 0-D parameters whole). One all-to-all per unit,
        on `group` (the same ranks as this FSDP's, in the same order; default: its own)."""
        from torch.distributed.tensor import DTensor, Shard
        W, r = self.world_size, self.group.rank
        group = self.group if group is None else group
        have = [(q * unit.shard_numel, (q + 1) * unit.shard_numel) for q in range(W)]
        want = [self._row_ranges(unit, q) for q in range(W)]
        pieces = exchange_ranges(flat, have, want, group)
        whole = None
        out = {}
        for name, shape, (a, b), piece in zip(unit.names, unit.shapes, want[r], pieces):
            if names is not None and name not in names:
                continue
            if len(shape) == 0:
                if whole is None:  # every rank takes part in the gather, whichever parameter needs it
                    whole = self._gather_flat(unit, flat, group)
                k = unit.names.index(name)
                out[name] = whole[unit.offsets[k]:unit.offsets[k] + 1].view(()).clone()
                continue
            rows = (b - a) // (shape.numel() // shape[0]) if shape[0] else 0
            local = piece.view(rows, *shape[1:])
            out[name] = (DTensor.from_local(local, group.device_mesh, [Shard(0)], run_check=False,
                                            shape=shape, stride=torch.empty(shape, device="meta").stride())
                         if W > 1 else local)
        if whole is None and any(len(shape) == 0 for shape in unit.shapes) and W > 1:
            self._gather_flat(unit, flat, group)  # keep the collectives in step when the 0-D one was filtered out
        return out

    def _from_param_layout(self, unit: Unit, tensors: dict, dtype: torch.dtype) -> torch.Tensor:
        """The inverse: from one tensor per parameter -- whole (a full state dict, the bare model's) or DTensor
        chunks of this world size (what torch.distributed.checkpoint hands back) -- to this rank's flat piece
        (padding zero). A collective when DTensors come in."""
        W, r = self.world_size, self.group.rank
        flat = torch.zeros(unit.shard_numel, dtype=dtype, device=unit.shard.device)
        if all(not hasattr(tensors[n], "to_local") for n in unit.names):
            for name, shape, (s, e, start) in zip(unit.names, unit.shapes, unit.local):
                if tuple(tensors[name].shape) != tuple(shape):
                    raise ValueError(f"FSDP: {name!r} has shape {tuple(tensors[name].shape)}, the model {tuple(shape)}")
                flat[s:e].copy_(tensors[name].reshape(-1)[start:start + (e - s)])
            return flat
        chunks = []
        for name, shape in zip(unit.names, unit.shapes):
            t = tensors[name]
            if not hasattr(t, "to_local"):  # a 0-D parameter comes whole: this rank's chunk of it
                a, b = self._row_ranges(unit, r)[unit.names.index(name)]
                o = unit.offsets[unit.names.index(name)]
                chunks.append(t.reshape(-1)[a - o:b - o].to(dtype))
                continue
            if t.device_mesh.size() != W:
                raise ValueError(f"FSDP: {name!r} is sharded over {t.device_mesh.size()} ranks, this run has {W}: "
                                 f"load it through torch.distributed.checkpoint, which reshards")
            chunks.append(t.to_local().reshape(-1).to(dtype))
        have = [self._row_ranges(unit, q) for q in range(W)]
        want = [[(q * unit.shard_numel, (q + 1) * unit.shard_numel)] for q in range(W)]
        (mine,) = exchange_ranges(torch.cat(chunks), have, want, self.group, multi_have=True)
        valid = min(unit.shard_numel, max(0, unit.numel - r * unit.shard_numel))  # the padding stays zero
        flat[:valid].copy_(mine[:valid])
        return flat

    def _gather_flat(self, unit: Unit, flat: torch.Tensor, group: Group | None = None) -> torch.Tensor:
        full = torch.empty(unit.padded, dtype=flat.dtype, device=flat.device)
        all_gather(full.view(self.world_size, unit.shard_numel), flat, self.group if group is None else group,
                   ring=False, what=f"FSDP state all-gather of unit {unit.name}").wait()
        return full

    @torch.no_grad()
    def state_dict(self, *args, **kwargs) -> dict:
        """Every parameter by its original name, as a DTensor Shard(0) of its own shape: this rank's dim-0 chunk
        (torch.chunk's rule) -- torch FSDP2's layout, which torch.distributed.checkpoint saves and loads at any
        world size. The flat padded shard is a runtime layout, so the chunks are moved there with one all-to-all
        per unit. A collective: every rank calls it. (0-D parameters come whole, on every rank.)"""
        out = {}
        for unit in self.units:
            out.update(self._to_param_layout(unit, unit.shard))
        return {**out, **{alias: out[name] for alias, name in self._aliases().items()}}

    def _aliases(self) -> dict[str, str]:
        """A tied parameter's other names -> its own (the bare module's state_dict() holds it under each: so do
        this FSDP's state dicts, and a checkpoint maps between the wrappers name for name)."""
        where = {id(m): n for n, m in self.module.named_modules()}
        out = {}
        for unit in self.units:
            for name, homes in zip(unit.names, unit.homes):
                for m, attr in homes:
                    alias = (where[id(m)] + "." if where[id(m)] else "") + attr
                    if alias != name:
                        out[alias] = name
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict, strict: bool = True, assign: bool = False):
        """Load what state_dict() returned (DTensor chunks of this world size, as torch.distributed.checkpoint
        hands them back) or whole tensors (full_state_dict(), the bare model's state_dict()). A collective."""
        for unit in self.units:
            missing = [n for n in unit.names if n not in state_dict]
            if missing:
                raise KeyError(f"FSDP.load_state_dict: no entry for {', '.join(missing[:5])}")
            unit.shard.copy_(self._from_param_layout(unit, state_dict, unit.shard.dtype))

    # --- the optimizer's state, in the same layout ----------------------------------------------------

    def _view_owner(self) -> dict:
        return {id(v): (unit, j) for unit in self.units for j, v in enumerate(unit.views)}

    @torch.no_grad()
    def optimizer_state_dict(self, optimizer) -> dict:
        """`optimizer.state_dict()` (a torch optimizer stepping this FSDP's shards) keyed by parameter name, its
        per-element state (AdamW's moments, a momentum) as DTensor Shard(0) of each parameter's shape, like
        state_dict(): independent of the world size and of how the units are packed. A collective."""
        return self._optimizer_layout(self._optimizer_flats(optimizer), self.group)

    @torch.no_grad()
    def state_snapshot(self, optimizer=None):
        """Copy this rank's shards and the optimizer's state now, without communicating, and return
        `layout(group=None) -> (state_dict(), optimizer_state_dict())` of that copy: a collective on `group` (the
        same ranks; default this FSDP's), which may run later, in another thread -- an asynchronous save takes the
        snapshot between steps and lays it out in the background on a process group of its own."""
        cpu = torch.device("cpu")  # the copy waits in host memory (a GPU's memory is the training's)
        shards = [unit.shard.detach().to(cpu, copy=True) for unit in self.units]
        opt = self._optimizer_flats(optimizer, cpu) if optimizer is not None else None

        def layout(group: Group | None = None):
            model = {}
            for unit, flat in zip(self.units, shards):
                model.update(self._to_param_layout(unit, flat, group=group))
            model.update({alias: model[name] for alias, name in self._aliases().items()})
            return model, (self._optimizer_layout(opt, group) if opt is not None else None)

        return layout

    def _optimizer_flats(self, optimizer, device: torch.device | None = None) -> dict:
        """The optimizer's state copied into this rank's flat layout, one vector per unit and per-element key,
        plus its scalars (copied) and parameter groups by name. No communication."""
        owner = self._view_owner()
        names = {id(v): n for unit in self.units for n, v in zip(unit.names, unit.views)}
        sd = optimizer.state_dict()
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if any(id(p) not in owner for p in params):
            raise ValueError("FSDP.optimizer_state_dict: the optimizer steps parameters that are not this FSDP's "
                             "shards (build it from fsdp.parameters() or fsdp.configure_param_groups())")
        by_param = {id(p): sd["state"].get(i, {}) for i, p in enumerate(params)}
        state: dict = {names[id(p)]: {} for p in params}
        flats = []  # (unit, key, flat vector, the names that have this key)
        for unit in self.units:
            mine = [(j, v) for j, v in enumerate(unit.views) if id(v) in by_param]
            keys = sorted({k for _, v in mine for k, t in by_param[id(v)].items()
                           if torch.is_tensor(t) and k != "step" and t.shape == v.shape})
            for k in keys:  # the same keys on every rank: every rank holds a (possibly empty) piece of every param
                flat = torch.zeros(unit.shard_numel, dtype=torch.float32, device=device or unit.shard.device)
                for j, v in mine:
                    s, e, _ = unit.local[j]
                    if k in by_param[id(v)]:
                        flat[s:e].copy_(by_param[id(v)][k])
                flats.append((unit, k, flat, {unit.names[j] for j, v in mine if k in by_param[id(v)]}))
            for j, v in mine:
                for k, t in by_param[id(v)].items():
                    if k not in keys:  # scalars (AdamW's step): equal on every rank
                        copy = torch.is_tensor(t)
                        state[unit.names[j]][k] = t.detach().to(device or t.device, copy=True) if copy else t
        groups = [{**g, "params": [names[id(p)] for p in og["params"]]}
                  for g, og in zip(sd["param_groups"], optimizer.param_groups)]
        return {"state": state, "param_groups": groups, "flats": flats}

    def _optimizer_layout(self, opt: dict, group: Group | None) -> dict:
        state = {n: dict(st) for n, st in opt["state"].items()}
        for unit, k, flat, with_key in opt["flats"]:
            for name, t in self._to_param_layout(unit, flat, names=with_key, group=group).items():
                state[name][k] = t
        return {"state": state, "param_groups": opt["param_groups"]}

    @torch.no_grad()
    def load_optimizer_state_dict(self, optimizer, state_dict: dict) -> None:
        """Load what optimizer_state_dict() returned (at this or, through torch.distributed.checkpoint, another
        world size), or the same with whole tensors (a full checkpoint). A collective."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        names = {id(v): n for unit in self.units for n, v in zip(unit.names, unit.views)}
        shapes = {n: s for unit in self.units for n, s in zip(unit.names, unit.shapes)}
        # a state tensor saved flat (DistAdamW's moments) or in the parameter's shape: the parameter's shape
        saved = {n: {k: param_shaped(t, torch.empty(shapes[n], device="meta")) if n in shapes and torch.is_tensor(t)
                     and k != "step" and t.numel() == math.prod(shapes[n]) else t for k, t in st.items()}
                 for n, st in state_dict["state"].items()}
        local: dict = {names[id(p)]: {} for p in params}
        for unit in self.units:
            mine = [(j, v) for j, v in enumerate(unit.views) if names.get(id(v)) in local]
            keys = sorted({k for j, _ in mine for k, t in saved.get(unit.names[j], {}).items()
                           if torch.is_tensor(t) and k != "step" and tuple(t.shape) == tuple(unit.shapes[j])})
            for k in keys:
                tensors = {n: saved[n][k] if k in saved.get(n, {}) else torch.zeros(shape)
                           for n, shape in zip(unit.names, unit.shapes)}
                flat = self._from_param_layout(unit, tensors, torch.float32)
                for j, v in mine:
                    if k in saved.get(unit.names[j], {}):
                        s, e, _ = unit.local[j]
                        local[unit.names[j]][k] = flat[s:e].clone()
            for j, _ in mine:
                for k, t in saved.get(unit.names[j], {}).items():
                    if k not in keys:
                        local[unit.names[j]][k] = t.to_local() if hasattr(t, "to_local") else t
        # by name: each live group takes the saved group with the same parameters, whatever their order
        order = [names[id(p)] for p in params]
        optimizer.load_state_dict(torch_layout(optimizer, order, local, state_dict["param_groups"]))

    def full_tensor(self, unit: Unit, name: str) -> torch.Tensor:
        """One parameter, whole, on every rank (an all-gather of its unit)."""
        full = self._gather_flat(unit, unit.shard)
        k = unit.names.index(name)
        return full[unit.offsets[k]:unit.offsets[k] + unit.shapes[k].numel()].view(unit.shapes[k])


def flat_layout(numels: list[int], world_size: int) -> list[list[tuple]]:
    """How a unit's flat buffer is cut: for each rank, the pieces it holds as (k, start, stop) -- elements
    [start, stop) of parameter k -- and, at the end of the last ranks, (None, start, stop) for the padding that
    makes the buffer a multiple of world_size (positions in the buffer). Every piece is 1/world_size of the
    buffer; a parameter may straddle two or more ranks."""
    total = sum(numels)
    shard = max(math.ceil(total / world_size), 1)
    starts = [sum(numels[:k]) for k in range(len(numels))]
    out = []
    for r in range(world_size):
        lo, hi = r * shard, (r + 1) * shard
        pieces = [(k, max(lo, o) - o, min(hi, o + n) - o) for k, (o, n) in enumerate(zip(starts, numels))
                  if max(lo, o) < min(hi, o + n)]
        if hi > total:
            pieces.append((None, max(lo, total), hi))
        out.append(pieces)
    return out


def dim0_layout(shapes: list, world_size: int) -> list[list[tuple]]:
    """How torch FSDP2 cuts the same parameters (DTensor Shard(0), torch.chunk's rule): for each rank, (k, start,
    stop) in elements of parameter k, one entry per parameter (start == stop: this rank holds none of it). Rows
    are dealt ceil(rows / world_size) at a time, so the last ranks may hold fewer, or none."""
    out = []
    for r in range(world_size):
        pieces = []
        for k, shape in enumerate(shapes):
            shape = tuple(shape)
            rows = shape[0] if shape else 1
            cols = math.prod(shape[1:]) if shape else 1
            size = math.ceil(rows / world_size)
            a, b = min(r * size, rows), min((r + 1) * size, rows)
            pieces.append((k, a * cols, b * cols))
        out.append(pieces)
    return out


def exchange_ranges(local: torch.Tensor, have, want, group: Group, multi_have: bool = False) -> list[torch.Tensor]:
    """Move pieces of one flat vector between ranks with one all-to-all.

    Rank q holds the elements have[q] = (start, stop) of the vector in `local` (multi_have: a list of such ranges,
    concatenated in `local`), and wants the ranges want[q] = [(start, stop), ...]. Returns this rank's wanted
    ranges, one tensor each. The held ranges must together cover every wanted element exactly once.
    """
    W, r = group.size, group.rank
    held = have if multi_have else [[h] for h in have]
    mine_held, where, k = held[r], [], 0
    for a, b in mine_held:  # where each held range starts in `local`
        where.append(k)
        k += b - a

    def overlap(a, b, c, d):
        return max(a, c), min(b, d)

    send, send_sizes = [], []
    for q in range(W):
        n = 0
        for c, d in want[q]:
            for (a, b), at in zip(mine_held, where):
                lo, hi = overlap(a, b, c, d)
                if lo < hi:
                    send.append(local[at + lo - a:at + hi - a])
                    n += hi - lo
        send_sizes.append(n)
    recv_sizes, plan = [], []
    for p in range(W):
        n = 0
        for i, (c, d) in enumerate(want[r]):
            for a, b in held[p]:
                lo, hi = overlap(a, b, c, d)
                if lo < hi:
                    plan.append((i, lo, hi))
                    n += hi - lo
        recv_sizes.append(n)
    flat_send = torch.cat(send) if send else local.new_empty(0)
    if W == 1:
        received = flat_send
    else:  # through the backend's device (gloo: the CPU), back to where the data lives
        comm = group.comm_device
        buf = torch.empty(sum(recv_sizes), dtype=local.dtype, device=comm)
        dist.all_to_all_single(buf, flat_send.to(comm), recv_sizes, send_sizes, group=group.pg)
        received = buf.to(local.device)
    out = [local.new_empty(d - c) for c, d in want[r]]
    at = 0
    for i, lo, hi in plan:  # pieces arrive by source rank; within a source, in the order it sent them
        c = want[r][i][0]
        out[i][lo - c:hi - c].copy_(received[at:at + hi - lo])
        at += hi - lo
    return out


class FSDPTimeline(Observer):
    """What FSDP did when, for the chapter's figure: one dict per event (unit, what, t in seconds since the first)."""

    def __init__(self):
        import time
        self._clock, self.events, self._t0 = time.perf_counter, [], None

    def _add(self, what: str, unit: Unit) -> None:
        t = self._clock()
        self._t0 = t if self._t0 is None else self._t0
        self.events.append({"unit": unit.name, "event": what, "t": t - self._t0, "bytes": unit.full_bytes,
                            "numel": unit.padded})

    def gather_started(self, unit): self._add("gather_started", unit)  # noqa: E704
    def gathered(self, unit): self._add("gathered", unit)  # noqa: E704
    def freed(self, unit): self._add("freed", unit)  # noqa: E704
    def reduce_started(self, unit): self._add("reduce_started", unit)  # noqa: E704
    def reduced(self, unit): self._add("reduced", unit)  # noqa: E704
