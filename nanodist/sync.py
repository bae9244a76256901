"""The gradient-sync engine: gradients leave in buckets while backward is still running.

DDP (chapter 3) and the sharded optimizers (chapter 4) both average gradients over the ranks, and both
want the communication to start as soon as a group of gradients is ready, not after backward. This
file is the machinery they share:

    Bucket    a run of parameters whose gradients travel in one flat buffer; its Slots say which
              elements of which parameter sit where in that buffer
    GradSync  one autograd hook per parameter; when a bucket is complete it is *launched* (the owner
              packs it and starts its collective), strictly in bucket order on every rank; when
              backward ends, the remaining buckets are launched and every collective is waited for
    collectives  all_reduce_sum, reduce_scatter_sum, all_gather: async where the backend allows,
              nanodist's synchronous ring (chapter 2) where it moves fewer bytes (gloo)

What a bucket's collective is, and what happens to the result, belongs to the owner, which passes two
functions: `launch(bucket) -> Work` and `finish(missing)`. DDP all-reduces the bucket and points each
p.grad at its slice; DistAdamW reduce-scatters it and keeps only this rank's rows (ZeRO-2).

An observer (`Observer`, e.g. `BucketTimeline`) sees each event, and only when one is attached: with
none, the hooks take no timestamps and copy nothing.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import diverge
from .collectives import ring_all_gather, ring_reduce_scatter
from .group import Group
from .state import is_dtensor

_ENGINE = torch.autograd.Variable._execution_engine  # queue_callback: run a function when backward ends

# torch >= 2.13 renamed the single-tensor collectives; older versions only have the old names.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# ----------------------------------------------------------------------------- work handles

class Work:
    """A collective in flight, holding its tensors until wait() returns.

    On nccl the buffers of an async collective must outlive it: if the handle and tensors were dropped
    early, the caching allocator could hand their memory to another tensor mid-transfer. gloo has no
    get_future() for reduce-scatter, so the handle itself is what we keep. Work() is already done.
    """

    def __init__(self, work=None, *tensors: torch.Tensor, ticket=None):
        self.work, self.tensors, self.ticket = work, tensors, ticket

    def wait(self) -> bool:
        if self.work is not None:
            with diverge.waiting(self.ticket):  # the divergence detector's watchdog sees where this rank waits
                self.work.wait()
        self.work, self.tensors = None, ()
        return True

    def future(self):
        """The torch future of an async collective (None when done already, or when the backend has none)."""
        try:
            return self.work.get_future() if self.work is not None else None
        except RuntimeError:
            return None


DONE = Work()  # the handle of a reduction that has already finished


def refuse_dtensors(named, who: str, group: Group | None = None) -> None:
    """nanodist's wrappers and sharded optimizers pack plain tensors into flat buffers: a DTensor parameter (tensor
    parallelism, or a model sharded already) would be packed by its local piece as if it were whole. Say so at
    once, naming the first few, and what to do instead.

    `group`: the wrapper averages over it and can take DTensors laid out on *other* ranks -- another dimension of
    the mesh, as nanodist.tp's on "tensor" when `group` is "data" -- whose local pieces its ranks hold alike (DDP):
    those pass, and only DTensors spread over `group`'s own ranks are refused."""
    bad = [name for name, t in named if is_dtensor(t) and (group is None or _spread_over(t, group))]
    if bad:
        listed = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
        raise ValueError(f"{who} takes plain tensors, and {listed} {'is a DTensor' if len(bad) == 1 else 'are DTensors'}"
                         f" (tensor parallelism, or a model sharded already) on the ranks it would average over. "
                         f"Average such a model's gradients over the mesh's other dimension: nanodist.DDP(model, "
                         f"group=mesh['data']) or torch's fully_shard on the data dimension of the mesh "
                         f"(Trainer(mesh=...)); or give {who} the model before it is parallelised.")


def _spread_over(t, group: Group) -> bool:
    """Whether DTensor t is laid out over more than one rank of `group` (not only over other dimensions)."""
    ranks = set(t.device_mesh.mesh.flatten().tolist())
    return len(ranks & set(group.ranks)) > 1


def local(t):
    """A DTensor's local piece (what this rank holds and packs); anything else as it is (None too)."""
    return t.to_local() if is_dtensor(t) else t


def optimizer_params(optimizer) -> list:
    """(name, parameter) of every parameter an optimizer holds: its param_names where given, else its place."""
    return [(g.get("param_names", [None] * len(g["params"]))[j] or f"param_groups[{i}][{j}]", p)
            for i, g in enumerate(optimizer.param_groups) for j, p in enumerate(g["params"])]


class LocalFinite:
    """Was this rank's own gradient finite, before the ranks averaged it? After averaging every rank holds the
    same NaN or inf, and only this says where it came from. One sum per bucket as it is packed (a NaN or inf
    anywhere makes the sum non-finite), kept on the device: nothing waits for it, and it is read only when a run
    stops on a non-finite gradient norm (the Trainer then names the rank)."""

    def __init__(self):
        self._sums: list[torch.Tensor] = []
        self.last: torch.Tensor | None = None  # a 0-D bool tensor: the last synchronisation's verdict

    def add(self, packed: torch.Tensor) -> None:
        self._sums.append(packed.sum(dtype=torch.float32))  # fp32: a low-precision sum of finite values overflows

    def close(self) -> None:
        if self._sums:  # (buckets on several devices: their sums meet on the first one's)
            self.last = torch.isfinite(torch.stack([s.to(self._sums[0].device) for s in self._sums]).sum())
            self._sums = []

    @staticmethod
    def cost_s(buffers: list[torch.Tensor], n: int = 50) -> float:
        """Seconds the check costs one synchronisation over these gradient buffers, measured here (the verdict is
        read at the end, so a GPU's asynchronous work is counted too)."""
        import time
        check = LocalFinite()
        t0 = time.perf_counter()
        for _ in range(n):
            for b in buffers:
                check.add(b)
            check.close()
        if check.last is not None:
            bool(check.last)
        return (time.perf_counter() - t0) / n


class ReportsLocalFinite:
    """For a wrapper that packs this rank's gradients (DDP, FSDP, the ZeRO optimizers): `local_gradient_finite`."""

    _local_finite: LocalFinite

    @property
    def local_gradient_finite(self):
        """A 0-D bool tensor: was this rank's own gradient finite at the last synchronisation (before averaging)?
        None before the first. Reading it waits for the device: the Trainer reads it only to name the rank when
        a run stops on a non-finite gradient norm."""
        return self._local_finite.last


# ----------------------------------------------------------------------------- collectives

class _CopyBack(Work):
    """A collective run on staged copies (see _staging): wait() also copies the result back where it belongs."""

    def __init__(self, work, dst: torch.Tensor, src: torch.Tensor, *keep: torch.Tensor):
        super().__init__(work, src, *keep, ticket=getattr(work, "ticket", None))
        self.dst, self.src = dst, src

    def wait(self) -> bool:
        super().wait()
        if self.dst is not None:
            self.dst.copy_(self.src)
            self.dst = self.src = None
        return True

    def future(self):
        return None  # the result is not in place until wait() has copied it back


def _staging(group: Group, *tensors: torch.Tensor) -> torch.device | None:
    """Where to copy tensors the backend cannot move: the group's comm_device (the CPU for gloo) when a tensor is
    elsewhere (ranks sharing a GPU through gloo, whose point-to-point calls cannot read GPU memory); else None."""
    device = group.comm_device
    return device if any(t.device != device for t in tensors) else None


def all_reduce_sum(buffer: torch.Tensor, group: Group, what: str = "all-reduce") -> Work:
    """Sum `buffer` over the group, in place, asynchronously. `what` names it for the divergence detector."""
    return all_reduce(buffer, group, what, dist.ReduceOp.SUM)


def all_reduce(buffer: torch.Tensor, group: Group, what: str, op) -> Work:
    """Reduce `buffer` over the group with `op` (a dist.ReduceOp), in place, asynchronously."""
    if group.size == 1:
        return DONE
    ticket = diverge.issue(group, what)
    staged = _staging(group, buffer)
    if staged is not None:
        copy = buffer.to(staged)
        work = Work(dist.all_reduce(copy, op=op, group=group.pg, async_op=True), ticket=ticket)
        return _CopyBack(work, buffer, copy)
    return Work(dist.all_reduce(buffer, op=op, group=group.pg, async_op=True), buffer, ticket=ticket)


def reduce_scatter_sum(out: torch.Tensor, inp: torch.Tensor, group: Group, ring: bool,
                       what: str = "reduce-scatter") -> Work:
    """out = the sum over ranks of row `rank` of inp, shape (size, *out.shape). The ring is synchronous."""
    if group.size == 1:
        out.copy_(inp[0])
        return DONE
    staged = _staging(group, out, inp)
    if staged is not None:
        copy = torch.empty(out.shape, dtype=out.dtype, device=staged)
        work = reduce_scatter_sum(copy, inp.to(staged), group, ring, what)
        return _CopyBack(work, out, copy)
    ticket = diverge.issue(group, what)
    if ring:
        with diverge.waiting(ticket):
            ring_reduce_scatter(out, inp, group=group, check=False)  # shapes hold by construction
        return DONE
    # The flat (concatenated) form: gloo's version rejects the stacked (size, row) one.
    return Work(_reduce_scatter_single(out, inp.view(-1), group=group.pg, async_op=True), out, inp, ticket=ticket)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: Group, ring: bool, what: str = "all-gather") -> Work:
    """Row r of out (shape (size, *inp.shape)) = rank r's inp. The ring is synchronous."""
    if group.size == 1:
        out[0].copy_(inp)
        return DONE
    staged = _staging(group, out, inp)
    if staged is not None:
        copy = torch.empty(out.shape, dtype=out.dtype, device=staged)
        work = all_gather(copy, inp.to(staged), group, ring, what)
        return _CopyBack(work, out, copy)
    ticket = diverge.issue(group, what)
    if ring:
        with diverge.waiting(ticket):
            ring_all_gather(out, inp, group=group, check=False)
        return DONE
    return Work(_all_gather_single(out.view(-1), inp, group=group.pg, async_op=True), out, inp, ticket=ticket)


# ----------------------------------------------------------------------------- buckets

def pack_buckets(tensors, cap_bytes: int, first_cap_bytes: int | None = None) -> list[list[int]]:
    """Group consecutive tensors into buckets of at most `cap_bytes` (the first of `first_cap_bytes`) with one
    dtype and device each; returns the buckets as lists of indices. A tensor larger than the cap gets its own."""
    buckets, current, size = [], [], 0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        cap = cap_bytes if buckets or first_cap_bytes is None else first_cap_bytes
        head = tensors[current[0]] if current else None
        if current and (size + nbytes > cap or t.dtype != head.dtype or t.device != head.device):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


@dataclass(frozen=True)
class Slot:
    """One contiguous run of a parameter's flattened gradient, and where it sits in its bucket's buffer."""

    param: int  # index of the parameter in the engine's list
    start: int  # first element, counted in param.view(-1)
    numel: int
    offset: int  # first element in the bucket's flat buffer


@dataclass(eq=False)
class Bucket:
    """Parameters whose gradients travel in one flat buffer of `numel` elements; the owner fills in the rest."""

    index: int
    params: list[int]  # indices into the engine's parameters
    slots: list[Slot]
    numel: int
    dtype: torch.dtype
    device: torch.device
    ready: int = 0  # parameters of this bucket whose gradient has arrived in this backward
    work: Work | None = None  # the collective in flight
    extra: dict = field(default_factory=dict)  # the owner's per-bucket state (buffers, shards)

    def pack(self, buffer: torch.Tensor, grads: list[torch.Tensor | None]) -> None:
        """Copy every slot of the gradients into the flat `buffer`; a missing gradient (None) leaves zeros."""
        dst, src = [], []
        for s in self.slots:
            g = grads[s.param]
            if g is not None:
                dst.append(buffer[s.offset:s.offset + s.numel])
                src.append(g.reshape(-1)[s.start:s.start + s.numel])
            else:
                buffer[s.offset:s.offset + s.numel].zero_()
        if dst:
            torch._foreach_copy_(dst, src)


# ----------------------------------------------------------------------------- observers

class Observer:
    """Receives the engine's events; the base does nothing. Attach one with GradSync(..., observer=)."""

    def backward_started(self) -> None: ...

    def grad_ready(self, index: int, grad: torch.Tensor) -> None: ...

    def bucket_launched(self, bucket: Bucket) -> None: ...

    def autograd_finished(self) -> None: ...

    def synced(self, buckets: list[Bucket]) -> None: ...


class BucketTimeline(Observer):
    """When each bucket left and arrived, per backward: the DDP timeline of chapter 3.

    `entries` gets one dict per bucket per backward: bucket, numel, launch_s, done_s, autograd_end_s and
    synced_s, in seconds since the first gradient of that backward. A collective's completion time comes
    from its future (gloo: exact; CUDA: when the kernel was enqueued, not finished) or, for a collective
    that finishes before it returns (the ring, shared memory), from the moment it returned.
    """

    def __init__(self):
        self.entries: list[dict] = []
        self._t0 = self._autograd_end = None
        self._launched: dict[int, float] = {}
        self._done: dict[int, float] = {}

    def backward_started(self) -> None:
        self._t0, self._launched, self._done = time.perf_counter(), {}, {}

    def bucket_launched(self, bucket: Bucket) -> None:
        self._launched[bucket.index] = time.perf_counter()
        fut = bucket.work.future() if bucket.work is not None else None
        if fut is not None:
            fut.then(lambda _f, i=bucket.index: self._done.setdefault(i, time.perf_counter()))
        else:
            self._done[bucket.index] = time.perf_counter()

    def autograd_finished(self) -> None:
        self._autograd_end = time.perf_counter()

    def synced(self, buckets: list[Bucket]) -> None:
        if self._t0 is None:
            return
        end, t0 = time.perf_counter(), self._t0
        for b in buckets:
            self.entries.append({"bucket": b.index, "numel": b.numel, "launch_s": self._launched[b.index] - t0,
                                 "done_s": self._done.get(b.index, end) - t0,
                                 "autograd_end_s": (self._autograd_end or end) - t0, "synced_s": end - t0})
        self._t0 = None


# ----------------------------------------------------------------------------- the engine

class GradSync:
    """Hooks on `params` that launch each bucket's collective during backward, in bucket order.

    - launch(bucket) -> Work: pack the bucket (read p.grad) and start its collective. Called once per bucket
      per sync, in index order on every rank (collectives pair up across ranks by the order of the calls).
    - finish(missing): after every collective of this sync was waited for. `missing` lists the parameters
      that had no gradient on this rank (their slots were packed as zeros).
    - before_last(missing): called once the missing parameters are known, before the remaining buckets are
      launched (DDP sends the count along in its last bucket).

    Hooks fire only while `enabled` (set_requires_gradient_sync); a disabled backward just accumulates p.grad.
    sync() does by hand what the end of backward does: launch what is left (reading p.grad) and wait.
    stale() -> bool, asked at the first gradient of each backward: True says the owner's layout no longer fits
    (a parameter was frozen or unfrozen), so this backward only accumulates p.grad and the owner, having rebuilt
    its buckets, calls sync() itself.
    """

    def __init__(self, params: list[torch.nn.Parameter], buckets: list[Bucket], launch, finish,
                 before_last=None, observer: Observer | None = None, names: list[str] | None = None, stale=None):
        self.params, self.buckets = params, buckets
        self._launch_fn, self._finish_fn, self._before_last = launch, finish, before_last
        self.observer = observer
        self.names = names or [f"parameter {i}" for i in range(len(params))]
        self.enabled = True
        self._bucket_of = [None] * len(params)
        for b in buckets:
            for i in b.params:
                self._bucket_of[i] = b
        self._fired = [False] * len(params)
        self._n_fired = 0
        self._next = 0  # the next bucket to launch
        self._active = False  # a sync is under way (some hook fired, or sync() started)
        self._callback_queued = False
        self._stale, self._sitting_out = stale, False
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, i))
                       for i, p in enumerate(params) if self._bucket_of[i] is not None]

    # --- during backward ----------------------------------------------------------------------------

    def _grad_ready(self, i: int, p: torch.nn.Parameter) -> None:
        if not self.enabled or self._sitting_out:
            return  # accumulation: the gradient just adds up in p.grad
        if not self._active:
            if self._stale is not None and self._stale():
                self._sitting_out = True
                _ENGINE.queue_callback(self._stop_sitting_out)
                return
            self._active = True
            if self.observer is not None:
                self.observer.backward_started()
        if not self._callback_queued:
            self._callback_queued = True
            _ENGINE.queue_callback(self._end_of_backward)
        if self._fired[i]:
            raise RuntimeError(f"{self.names[i]} received a gradient twice in one backward (the same module run "
                               f"twice in one step, or reentrant activation checkpointing?): this is not supported")
        self._fired[i] = True
        self._n_fired += 1
        if self.observer is not None:
            self.observer.grad_ready(i, p.grad)
        bucket = self._bucket_of[i]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch_ready()

    def _launch_ready(self) -> None:
        # Strictly in index order: every rank must issue the same collectives in the same order.
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if b.ready != len(b.params):
                return
            b.work = self._launch_fn(b)
            if self.observer is not None:
                self.observer.bucket_launched(b)
            self._next += 1

    def _stop_sitting_out(self) -> None:
        self._sitting_out = False

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        if self.observer is not None:
            self.observer.autograd_finished()
        self.sync()

    # --- the rest -----------------------------------------------------------------------------------

    @property
    def pending(self) -> bool:
        """Whether a backward started a sync that has not been finished (interrupted by an exception)."""
        return self._active

    def sync(self) -> list[int]:
        """Launch every bucket not yet launched (from what p.grad holds) and wait for all; returns `missing`."""
        self._active = True
        missing = [] if self._n_fired == len(self.params) else [i for i, f in enumerate(self._fired) if not f]
        missing = [i for i in missing if self._bucket_of[i] is not None and self.params[i].grad is None]
        if self._before_last is not None:
            self._before_last(missing)
        for b in self.buckets[self._next:]:
            b.ready = len(b.params)
        try:
            self._launch_ready()
            for b in self.buckets:
                if b.work is not None:
                    b.work.wait()
            self._finish_fn(missing)
            if self.observer is not None:
                self.observer.synced(self.buckets)
        finally:
            self.reset()
        return missing

    def reset(self) -> None:
        """Forget a half-finished sync (after an interrupted backward)."""
        for b in self.buckets:
            b.ready, b.work = 0, None
        self._fired = [False] * len(self.params)
        self._n_fired, self._next, self._active = 0, 0, False

    def remove(self) -> None:
        """Remove the hooks (the owner is being discarded)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
