"""Distributed data parallel, written to be read: gradient buckets all-reduced while backward runs.

    model = nanodist.DDP(GPT(config))          # every rank: same weights (rank 0's), own data
    loss = model(x, y)[1]
    loss.backward()                            # when this returns, every grad is the average over ranks
    optimizer.step()

How it works. Parameters are grouped, in reverse registration order (roughly the order in which
backward produces their gradients), into buckets of about `bucket_cap_mb`. Each bucket owns one
flat buffer. A hook on every parameter fires as soon as autograd has accumulated its gradient, and
when the last gradient of a bucket has arrived the bucket is launched: its gradients are copied into
its buffer and its all-reduce starts *asynchronously* -- it runs on the backend's threads while
autograd goes on computing the gradients of earlier layers. That overlap is why DDP scales. At the
very end of backward a callback waits for every bucket and points each `param.grad` at its averaged
slice of the buffer. The hooks, the order and the wait are the gradient-sync engine's
(nanodist.sync), which the sharded optimizers of chapter 4 share; DDP's own part is `_launch` and
`_finish`.

`NaiveDDP` does the obvious thing instead — one blocking all-reduce per parameter after backward —
for comparison. Both work with any initialised default process group.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from .group import Group
from . import diverge
from .runtime import get_logger, warn_if_differed
from .state import is_dtensor
from .sync import (DONE, Bucket, BucketTimeline, GradSync, LocalFinite, ReportsLocalFinite, Slot, Work, all_reduce_sum,
                   local, pack_buckets, refuse_dtensors)

_ENGINE = torch.autograd.Variable._execution_engine  # queue_callback: run a function when backward ends


class _SyncBase(nn.Module):
    """What DDP and NaiveDDP share: wrapping, broadcasting rank 0's state, no_sync, the end-of-backward callback."""

    takes_other_dimensions = False  # DTensor parameters laid out on other ranks of a mesh (DDP: see there)

    def __init__(self, module: nn.Module, group=None, broadcast_buffers: bool = True):
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("nanodist.DDP needs an initialised process group: call nanodist.init() first "
                               "(or torch.distributed.init_process_group)")
        self.module = module
        g = Group.resolve(group)
        self.group, self.pg, self.world_size = g, g.pg, g.size
        self.broadcast_buffers = broadcast_buffers
        self._require_sync = True
        refuse_dtensors(module.named_parameters(), f"nanodist.{type(self).__name__}",
                        group=g if self.takes_other_dimensions else None)
        self.trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._check_same_structure()  # first: every rank must agree before anyone may raise
        sparse = [n for n, m in module.named_modules() if getattr(m, "sparse", False) is True
                  and any(p.requires_grad for p in m.parameters())]
        if sparse:
            raise ValueError(f"{type(self).__name__} does not support sparse gradients, and {', '.join(sparse)} "
                             f"produce them (nn.Embedding(sparse=True)): use sparse=False")
        self.mismatched_at_wrap = self._broadcast_from_rank0()
        # Buffers broadcast before every forward: collected once, not by walking the module tree each step.
        self._sync_buffers = list(module.buffers()) if broadcast_buffers and self.world_size > 1 else []

    # --- wrapping -----------------------------------------------------------------------------------

    def _check_same_structure(self) -> None:
        """Every rank must wrap the same architecture, or the collectives below would hang or corrupt."""
        sparse = {id(p) for m in self.module.modules() if getattr(m, "sparse", False) is True for p in m.parameters()}
        self.group.check_same([(n, tuple(p.shape), str(p.dtype), p.requires_grad, id(p) in sparse)
                               for n, p in self.module.named_parameters()], "DDP")

    def _broadcast_from_rank0(self) -> list[str]:
        """Make every rank start from rank 0's parameters and buffers; return the names that differed."""
        tensors = [(n, local(p)) for n, p in self.module.named_parameters()] + list(self.module.named_buffers())
        return warn_if_differed("DDP", self.group.broadcast_from_first(tensors))

    # --- forward / no_sync ---------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        if self._in_backward():
            # The previous backward was interrupted (an exception, Ctrl-C) before its end-of-backward
            # callback ran: forget its half-finished state instead of mistaking it for this step's.
            get_logger().warning(f"{type(self).__name__}: the previous backward did not finish; its partial "
                                 f"gradient synchronisation was discarded")
            self._reset()
        if self._sync_buffers and self.require_sync:
            with diverge.waiting(diverge.issue(self.group, "DDP buffer broadcast")):
                for b in self._sync_buffers:  # e.g. BatchNorm running stats: rank 0's win, as in torch DDP
                    dist.broadcast(b.data, src=self.group.global_rank(0), group=self.pg)
        return self.module(*args, **kwargs)

    @property
    def require_sync(self) -> bool:
        """Whether the next backward synchronises the gradients (False inside no_sync())."""
        return self._require_sync

    @require_sync.setter
    def require_sync(self, sync: bool) -> None:
        self._require_sync = bool(sync)
        self._set_sync(self._require_sync)

    @contextlib.contextmanager
    def no_sync(self):
        """Inside this block backward only accumulates local gradients (gradient accumulation)."""
        before, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = before

    # --- the Trainer's protocol (nanodist.parallel.GradientSync) ------------------------------------

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """False: backward only accumulates local gradients (what no_sync() does for a block)."""
        self.require_sync = bool(requires_gradient_sync)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Every rank holds the whole averaged gradient: its norm is the global one, computed locally -- or, with
        tensor-parallel DTensors among them, over their mesh's other dimension (nanodist.parallel.clip_grad_norm_)."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        if any(is_dtensor(p.grad) for p in params):
            from .parallel import clip_grad_norm_
            return clip_grad_norm_(params, max_norm)
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def _in_backward(self) -> bool:
        """A backward started synchronising and did not finish (interrupted by an exception)."""
        return False

    def _reset(self) -> None:
        """Forget a half-finished synchronisation."""

    def _set_sync(self, sync: bool) -> None:
        """The wrapper's own reaction to require_sync changing."""

    @property
    def state_module(self) -> nn.Module:
        """Whose parameter names a training state uses (nanodist.state): the wrapped module's, no "module."."""
        return self.module

    def state_dict(self, *args, **kwargs):  # checkpoints hold the bare module's names, no "module." prefix
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


class DDP(_SyncBase, ReportsLocalFinite):
    """Data parallel with bucketed, overlapped gradient all-reduce. Gradients are averaged over ranks.

    - bucket_cap_mb: bucket size; smaller buckets start communicating earlier, larger ones cost less latency.
    - find_unused_parameters: allow parameters that get no gradient in a step (costs one tiny all-reduce).
      Without it such parameters raise an error naming them. Frozen parameters are always skipped.
    - record_timeline: keep, per step, when each bucket was launched and finished (for the plots): an
      observer of the sync engine (nanodist.sync.BucketTimeline), so a DDP without it takes no timestamps.
    - shared_memory: CPU ranks on one machine reduce each bucket through shared memory (nanodist.shm)
      instead of the process group: no network stack, but the reduction runs in the hook, so it does not
      overlap backward. Where it cannot be used (ranks on several machines, no room in /dev/shm) DDP says
      so once and uses the process group.
    - deferred_checks: read the per-step consistency check (did every rank have every gradient, were all
      ranks at the same step) one sync later, from a host copy made without waiting, so that a step never
      waits for the device. Default: on when the gradients live on a GPU, where reading a device tensor
      would stall the CPU until the GPU catches up; off on the CPU, where reading it costs nothing and a
      fault is reported at the very step it happened. `check_pending()` reads a pending check at once.
      (find_unused_parameters=True still reads its flags every step: it must know before the update.)

    In a world of one there is nothing to average: the hooks still run, bucket by bucket (the timeline records
    them, and a parameter without a gradient is still an error, at once), but no bucket buffer is allocated and
    nothing is copied, scaled or reduced: the gradients stay in p.grad, where backward left them.

    On a 2-D mesh, DDP over the data dimension takes a model split by tensor parallelism (nanodist.tp) on the
    other one: its DTensor parameters' local pieces, which the ranks of a data group hold alike, are broadcast,
    packed and averaged as plain tensors, and each averaged gradient is a DTensor over its bucket's view.

    The hooks, the bucket order and the end-of-backward wait are the gradient-sync engine's (nanodist.sync);
    what is DDP's own is below: how a bucket is packed and reduced, and where the average ends up.
    """

    takes_other_dimensions = True

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25, group=None,
                 find_unused_parameters: bool = False, broadcast_buffers: bool = True,
                 record_timeline: bool = False, first_bucket_cap_mb: float | None = None,
                 shared_memory: bool = False, deferred_checks: bool | None = None):
        super().__init__(module, group, broadcast_buffers)
        first_bucket_cap_mb = bucket_cap_mb if first_bucket_cap_mb is None else first_bucket_cap_mb
        if not (bucket_cap_mb > 0 and first_bucket_cap_mb > 0):
            raise ValueError(f"bucket sizes must be positive, got bucket_cap_mb={bucket_cap_mb}, "
                             f"first_bucket_cap_mb={first_bucket_cap_mb}")
        self.bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        # Optionally a smaller first bucket (the last layers, whose gradients come first), so communication
        # starts earlier. torch DDP uses 1 MiB for its first iteration only and then rebuilds its buckets at
        # the full cap: each extra all-reduce pays the latency again, and on a CPU the overlap is not free.
        self.first_bucket_cap_bytes = int(min(first_bucket_cap_mb, bucket_cap_mb) * 2**20)
        self.find_unused_parameters = find_unused_parameters
        self.record_timeline = record_timeline
        self.sync_count = 0  # backward passes whose gradients were averaged (no_sync ones are not)
        self._params = [p for _, p in self.trainable]
        self.buckets = self._build_buckets()
        self.shared_memory = shared_memory and self.world_size > 1 and self._attach_shared_memory()
        self._missing = 0  # this rank's parameters without a gradient, sent along in the last bucket
        self.deferred_checks = (self.group.comm_device.type == "cuda") if deferred_checks is None else deferred_checks
        self._pending_check = None  # deferred_checks: (host copy of the summed control, its event, names missing)
        self.optimizer_steps = 0  # steps of the optimizers that hold these parameters (torch's global step hook)
        self._local_finite = LocalFinite()
        ids, me = {id(p) for p in self._params}, weakref.ref(self)

        def count_step(optimizer, args, kwargs):
            ddp = me()
            if getattr(optimizer, "nanodist_inner", False):  # a half of MuonAdamW: the container's step counts
                return
            if ddp is not None and any(id(p) in ids for g in optimizer.param_groups for p in g["params"][:1]):
                ddp.optimizer_steps += 1

        self._step_hook = register_optimizer_step_post_hook(count_step)
        self._timeline = BucketTimeline() if record_timeline else None
        self._engine = GradSync(self._params, self.buckets, self._launch, self._finish,
                                before_last=self._count_missing, observer=self._timeline,
                                names=[f"DDP: parameter {n}" for n, _ in self.trainable])

    def observe(self, observer) -> None:
        """Attach a nanodist.sync.Observer (e.g. a BucketTimeline of one's own) to the gradient hooks in place of
        the timeline record_timeline keeps; None puts that one back."""
        self._engine.observer = observer if observer is not None else self._timeline

    @property
    def timeline(self) -> list[dict]:
        """With record_timeline: one dict per bucket per backward (see nanodist.sync.BucketTimeline)."""
        return self._timeline.entries if self._timeline is not None else []

    def _build_buckets(self) -> list[Bucket]:
        order = list(reversed(range(len(self._params))))  # backward meets the last layers first
        pieces = [local(p) for p in self._params]  # a DTensor's local piece: what this rank averages
        runs = pack_buckets([pieces[i] for i in order], self.bucket_cap_bytes, self.first_bucket_cap_bytes)
        buckets = []
        for k, run in enumerate(runs):
            idx = [order[j] for j in run]
            slots, n = [], 0
            for i in idx:
                slots.append(Slot(i, 0, pieces[i].numel(), n))
                n += pieces[i].numel()
            p0 = pieces[idx[0]]
            b = Bucket(k, idx, slots, n, p0.dtype, p0.device)
            if self.world_size == 1:  # alone: the gradients stay where backward puts them (see the docstring)
                b.extra.update(what=f"DDP bucket {k} (a world of one: nothing to reduce)")
                buckets.append(b)
                continue
            buffer = torch.zeros(n, dtype=p0.dtype, device=p0.device)
            b.extra.update(buffer=buffer, grads=buffer, what=f"DDP all-reduce of bucket {k}",
                           views=[buffer[s.offset:s.offset + s.numel].view_as(pieces[s.param]) for s in slots])
            buckets.append(b)
        return buckets

    def _attach_shared_memory(self) -> bool:
        devices = {b.device.type for b in self.buckets}
        if devices != {"cpu"}:
            raise ValueError(f"DDP(shared_memory=True) reduces CPU tensors, but the parameters are on "
                             f"{', '.join(sorted(devices))}: leave shared_memory off on GPUs (nccl is faster)")
        from .shm import SharedMemoryAllReduce
        try:
            for b in self.buckets:
                reducer = SharedMemoryAllReduce(b.extra["buffer"].numel(), b.dtype, self.group)
                b.extra.update(reducer=reducer, shm_views=[reducer.mine[s.offset:s.offset + s.numel].view_as(
                    local(self._params[s.param])) for s in b.slots])
        except (ValueError, OSError) as e:  # raised on every rank alike, so every rank falls back together
            for b in self.buckets:
                b.extra.pop("reducer", None)
                b.extra.pop("shm_views", None)
            get_logger().warning(f"DDP: shared memory unavailable, reducing through the process group ({e})")
            return False
        return True

    # --- the engine's side --------------------------------------------------------------------------

    def _count_missing(self, missing: list[int]) -> None:
        self._missing = len(missing)

    def _launch(self, b: Bucket) -> Work:
        """Gather the bucket's gradients into its buffer in one call, scale by 1/N and all-reduce with SUM: the
        buffer then holds the average. This is torch DDP's arithmetic: with the same buckets the two agree to the
        last bit. A missing gradient travels as zeros."""
        if self.world_size == 1:
            return DONE
        reducer = b.extra.get("reducer")
        views = b.extra["shm_views"] if reducer is not None else b.extra["views"]
        have = [(v, local(self._params[s.param].grad)) for v, s in zip(views, b.slots)]
        for v, g in have:
            if g is None:
                v.zero_()
        pairs = [(v, g) for v, g in have if g is not None]
        if pairs:  # a gradient accumulated in place, already in its slot, is skipped by copy_
            torch._foreach_copy_([v for v, _ in pairs], [g for _, g in pairs])
        self._local_finite.add(reducer.mine if reducer is not None else b.extra["grads"])
        if b.index == len(self.buckets) - 1:
            # With the last bucket, three numbers travel in a tiny all-reduce of their own (a bucket keeps torch's
            # exact length, so its sums are bit for bit torch's): how many parameters got no gradient on this rank,
            # and this rank's optimizer-step count and its square. Summed, they tell every rank whether *any* rank
            # missed a gradient, and whether all ranks were at the same step (N sum(s^2) == (sum s)^2 only when
            # every s is equal).
            # Two more: the divergence detector's digest of this rank's collectives, d and d^2 (nanodist.diverge).
            tag = float(self.optimizer_steps % 1024 + 1)
            d, d2 = diverge.agreement_values(self.group)
            device = self.group.comm_device  # built on the host, sent without waiting (pinned on a GPU)
            host = torch.tensor([self._missing, tag, tag * tag, d, d2], dtype=torch.float64,
                                pin_memory=device.type == "cuda")
            self._control = host.to(device, non_blocking=True)
            self._control_work = all_reduce_sum(self._control, self.group, "DDP control numbers")
        if reducer is not None:
            # The gradients went straight into this rank's row of the shared memory; the ranks add up each
            # other's rows, and the average is copied into the bucket. Synchronous: done when this returns.
            reducer.mine.mul_(1.0 / self.world_size)
            b.extra["buffer"].copy_(reducer.all_reduce_())
            return DONE
        b.extra["grads"].mul_(1.0 / self.world_size)
        return all_reduce_sum(b.extra["buffer"], self.group, b.extra["what"])

    def _finish(self, missing: list[int]) -> None:
        self.sync_count += 1
        if self.world_size == 1:  # the check, on what this rank knows already: no collective, no device read
            if missing and not self.find_unused_parameters:
                self._raise_missing([self.trainable[i][0] for i in missing], "this step")
            return
        self._local_finite.close()
        params = self._params
        unused_everywhere = set()
        if self.find_unused_parameters:
            # Which parameters did *any* rank use? Those no rank used keep grad None, as in torch DDP.
            flags = torch.ones(len(params), dtype=torch.int32, device=self.group.comm_device)
            if missing:
                flags[missing] = 0
            with diverge.waiting(diverge.issue(self.group, "DDP unused-parameter flags")):
                dist.all_reduce(flags, group=self.pg)
            unused_everywhere = {i for i, f in enumerate(flags.tolist()) if f == 0}
        self._control_work.wait()
        names = [self.trainable[i][0] for i in missing]
        if self.deferred_checks:
            # Copy the sums to the host without waiting (pinned memory on a GPU), and read the *previous*
            # step's copy, long since arrived: every rank does the same, so every rank raises at the same sync.
            pending = self._pending_check
            cuda = self._control.is_cuda
            host = torch.empty(5, dtype=torch.float64, pin_memory=cuda)
            host.copy_(self._control, non_blocking=cuda)
            event = torch.cuda.Event() if cuda else None
            if event is not None:
                event.record()
            self._pending_check = (host, event, names)
            if pending is not None:
                self._check(*pending, late=True)
        else:
            self._check(self._control, None, names)
        for b in self.buckets:
            for s, view in zip(b.slots, b.extra["views"]):
                p = params[s.param]
                if is_dtensor(p):  # tensor parallelism's DTensor: the average is its local piece
                    if p.grad is None or p.grad._local_tensor is not view:
                        p.grad = _as_dtensor_like(view, p)
                elif p.grad is not view:
                    p.grad = view  # the averaged gradient lives in the bucket: no copy back
        for i in unused_everywhere:
            params[i].grad = None

    def check_pending(self) -> None:
        """Read a deferred consistency check now (deferred_checks), raising as the step itself would have.
        Every rank must call it at the same point (it may run a collective to name the ranks' steps)."""
        pending, self._pending_check = self._pending_check, None
        if pending is not None:
            self._check(*pending, late=True)

    def _check(self, control: torch.Tensor, event, names: list[str], late: bool = False) -> None:
        """The summed control numbers of a sync: raise if the ranks were at different steps or a gradient was
        missing (without find_unused_parameters). Every rank holds the same sums, so every rank raises."""
        if event is not None:
            event.synchronize()  # recorded a step ago: done by now
        missed, tags, squares, d, d2 = control.tolist()  # summed over the ranks
        when = "the previous step" if late else "this step"
        if self.world_size * squares != tags * tags:
            self._raise_step_drift()
        diverge.check_agreement(self.group, d, d2, "DDP")
        if missed > 0 and not self.find_unused_parameters:
            # Every rank raises, so no rank walks on into the next step's collectives alone.
            self._raise_missing(names, when)

    @staticmethod
    def _raise_missing(names: list[str], when: str) -> None:
        here = (f"on this rank: {', '.join(names[:8])}{', ...' if len(names) > 8 else ''}" if names
                else "on another rank (this rank had every gradient)")
        raise RuntimeError(
            f"DDP: parameter(s) got no gradient {when}, {here}. If they are unused on purpose, wrap "
            f"with DDP(..., find_unused_parameters=True), or freeze them (requires_grad_(False)).")

    def _raise_step_drift(self) -> None:
        """The ranks averaged gradients of different optimizer steps: say which rank was where, on every rank."""
        steps = self.group.all_gather_object(self.optimizer_steps)
        where = ", ".join(f"rank {self.group.global_rank(r)} after {s} optimizer step(s)" for r, s in enumerate(steps))
        raise RuntimeError(
            f"DDP: the ranks averaged gradients from different steps ({where}): a rank ran an extra backward, or "
            f"skipped one, so its gradients were averaged with another step's. Every rank must run the same "
            f"backward passes between optimizer steps.")

    # --- hooks into _SyncBase -----------------------------------------------------------------------

    def _in_backward(self) -> bool:
        return self._engine.pending

    def _reset(self) -> None:
        self._engine.reset()

    def _set_sync(self, sync: bool) -> None:
        self._engine.enabled = sync


def _as_dtensor_like(piece: torch.Tensor, p) -> torch.Tensor:
    """`piece` as the local piece of a DTensor laid out as p (no copy, no communication)."""
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(piece, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


class NaiveDDP(_SyncBase):
    """The baseline: after backward, one blocking all-reduce per parameter, no buckets, no overlap."""

    def __init__(self, module: nn.Module, group=None, broadcast_buffers: bool = True):
        super().__init__(module, group, broadcast_buffers)
        self._callback_queued = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for _, p in self.trainable]

    def _grad_ready(self, p: nn.Parameter) -> None:
        if self.require_sync and not self._callback_queued:
            self._callback_queued = True
            _ENGINE.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self._finish()

    def _in_backward(self) -> bool:
        return self._callback_queued

    def _reset(self) -> None:
        self._callback_queued = False

    def _finish(self) -> None:
        for _, p in self.trainable:
            if p.grad is None:  # unused here: join with zeros, or the ranks' all-reduces would pair up wrongly
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self.pg)
            p.grad.div_(self.world_size)
