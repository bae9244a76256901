"""Distributed data parallel, written to be read: gradient buckets all-reduced while backward runs.

    model = nanodist.DDP(GPT(config))          # every rank: same weights (rank 0's), own data
    loss = model(x, y)[1]
    loss.backward()                            # when this returns, every grad is the average over ranks
    optimizer.step()

How it works. Parameters are grouped, in reverse registration order (roughly the order in which
backward produces their gradients), into buckets of about `bucket_cap_mb`. Each bucket owns one
flat buffer. A hook on every parameter fires as soon as autograd has accumulated its gradient;
the hook copies the gradient into its bucket's buffer, and when the last gradient of a bucket has
arrived the bucket's all-reduce is launched *asynchronously* — it runs on the backend's threads
while autograd goes on computing the gradients of earlier layers. That overlap is why DDP scales.
At the very end of backward a callback waits for every bucket and points each `param.grad` at its
averaged slice of the buffer.

`NaiveDDP` does the obvious thing instead — one blocking all-reduce per parameter after backward —
for comparison. Both work with any initialised default process group.
"""
from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .group import Group
from .sync import DONE as _DONE
from .sync import pack_buckets
from .runtime import get_logger

_ENGINE = torch.autograd.Variable._execution_engine  # queue_callback: run a function when backward ends


@dataclass
class _Bucket:
    index: int
    params: list[nn.Parameter]
    offsets: list[int]
    buffer: torch.Tensor
    slots: list[torch.Tensor]  # each parameter's slice of the buffer, shaped like the parameter
    grads: torch.Tensor  # the buffer without its extra last element (if any)
    ready: int = 0
    work: object = None
    launched_at: float = 0.0
    done_at: list = field(default_factory=list)
    reducer: object = None  # a nanodist.shm.SharedMemoryAllReduce, with DDP(shared_memory=True)
    shm_slots: list = None  # each parameter's slice of this rank's row of the shared memory


class _SyncBase(nn.Module):
    """What DDP and NaiveDDP share: wrapping, broadcasting rank 0's state, no_sync, the end-of-backward callback."""

    def __init__(self, module: nn.Module, group=None, broadcast_buffers: bool = True):
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("nanodist.DDP needs an initialised process group: call nanodist.init() first "
                               "(or torch.distributed.init_process_group)")
        self.module = module
        g = Group.resolve(group)
        self.group, self.pg, self.world_size = g, g.pg, g.size
        self.broadcast_buffers = broadcast_buffers
        self.require_sync = True
        self._callback_queued = False
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
        mine = [(n, tuple(p.shape), str(p.dtype), p.requires_grad, id(p) in sparse)
                for n, p in self.module.named_parameters()]
        everyone = self.group.all_gather_object(mine)
        for r, theirs in enumerate(everyone):
            if theirs != everyone[0]:
                diff = next(((a, b) for a, b in zip(everyone[0], theirs) if a != b), None)
                what = (f"first difference: rank 0 has {diff[0]}, rank {r} has {diff[1]}" if diff else
                        f"rank 0 has {len(everyone[0])} parameters, rank {r} has {len(theirs)}")
                raise ValueError(f"DDP: ranks wrap different models ({what}). Build the same model, with the "
                                 f"same frozen parameters, on every rank.")

    @torch.no_grad()
    def _broadcast_from_rank0(self) -> list[str]:
        """Make every rank start from rank 0's parameters and buffers; return the names that differed."""
        tensors = [(n, t) for n, t in list(self.module.named_parameters()) + list(self.module.named_buffers())]
        if self.world_size == 1 or not tensors:
            return []
        # A cheap fingerprint per tensor (sum and sum of squares in float64) tells who disagreed.
        fp = torch.stack([torch.stack([t.double().sum(), t.double().pow(2).sum()]) for _, t in tensors]).flatten()
        fp = torch.nan_to_num(fp, nan=1.2345e300).to(tensors[0][1].device)
        allfp = [torch.empty_like(fp) for _ in range(self.world_size)]
        dist.all_gather(allfp, fp, group=self.pg)
        differ = [tensors[i][0] for i in range(len(tensors))
                  if any(not torch.equal(a[2 * i:2 * i + 2], allfp[0][2 * i:2 * i + 2]) for a in allfp[1:])]
        for _, t in tensors:
            dist.broadcast(t.data, src=self.group.global_rank(0), group=self.pg)
        if differ:
            get_logger().warning(f"DDP: ranks started with different values for {len(differ)} tensor(s) "
                                 f"({', '.join(differ[:5])}{', ...' if len(differ) > 5 else ''}); "
                                 f"rank 0's were broadcast to all. Seed model init identically on every rank.")
        return differ

    # --- forward / no_sync ---------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        if self._callback_queued or self._in_backward():
            # The previous backward was interrupted (an exception, Ctrl-C) before its end-of-backward
            # callback ran: forget its half-finished state instead of mistaking it for this step's.
            get_logger().warning(f"{type(self).__name__}: the previous backward did not finish; its partial "
                                 f"gradient synchronisation was discarded")
            self._callback_queued = False
            self._reset()
        if self._sync_buffers and self.require_sync:
            for b in self._sync_buffers:  # e.g. BatchNorm running stats: rank 0's win, as in torch DDP
                dist.broadcast(b.data, src=self.group.global_rank(0), group=self.pg)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Inside this block backward only accumulates local gradients (gradient accumulation)."""
        before, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = before

    def _queue_end_of_backward(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            _ENGINE.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self._finish()

    def _in_backward(self) -> bool:
        return False

    def _reset(self) -> None:
        pass

    def state_dict(self, *args, **kwargs):  # checkpoints hold the bare module's names, no "module." prefix
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


class DDP(_SyncBase):
    """Data parallel with bucketed, overlapped gradient all-reduce. Gradients are averaged over ranks.

    - bucket_cap_mb: bucket size; smaller buckets start communicating earlier, larger ones cost less latency.
    - find_unused_parameters: allow parameters that get no gradient in a step (costs one tiny all-reduce).
      Without it such parameters raise an error naming them. Frozen parameters are always skipped.
    - record_timeline: keep, per step, when each bucket was launched and finished (for the plots).
    - shared_memory: CPU ranks on one machine reduce each bucket through shared memory (nanodist.shm)
      instead of the process group: no network stack, but the reduction runs in the hook, so it does not
      overlap backward. Where it cannot be used (ranks on several machines, no room in /dev/shm) DDP says
      so once and uses the process group.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25, group=None,
                 find_unused_parameters: bool = False, broadcast_buffers: bool = True,
                 record_timeline: bool = False, first_bucket_cap_mb: float | None = None,
                 shared_memory: bool = False):
        super().__init__(module, group, broadcast_buffers)
        first_bucket_cap_mb = bucket_cap_mb if first_bucket_cap_mb is None else first_bucket_cap_mb
        if bucket_cap_mb <= 0 or first_bucket_cap_mb <= 0:
            raise ValueError(f"bucket sizes must be positive, got bucket_cap_mb={bucket_cap_mb}, "
                             f"first_bucket_cap_mb={first_bucket_cap_mb}")
        self.bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        # Optionally a smaller first bucket (the last layers, whose gradients come first), so communication
        # starts earlier. torch DDP uses 1 MiB for its first iteration only and then rebuilds its buckets at
        # the full cap: each extra all-reduce pays the latency again, and on a CPU the overlap is not free.
        self.first_bucket_cap_bytes = int(min(first_bucket_cap_mb, bucket_cap_mb) * 2**20)
        self.find_unused_parameters = find_unused_parameters
        self.record_timeline = record_timeline
        self.timeline: list[dict] = []  # filled when record_timeline: one dict per bucket per step
        self.sync_count = 0  # backward passes whose gradients were averaged (no_sync ones are not)
        self.buckets = self._build_buckets()
        self.shared_memory = shared_memory and self.world_size > 1 and self._attach_shared_memory()
        # Per trainable parameter (by its index in self.trainable): its bucket, and its slice of that bucket's
        # buffer shaped like the parameter. The hooks below run once per parameter per backward, in Python, so
        # they only count; the copying is done per bucket, in one call, when the bucket is complete.
        self._params = [p for _, p in self.trainable]
        where = {id(p): (b, b.slots[j]) for b in self.buckets for j, p in enumerate(b.params)}
        self._bucket_of = [where[id(p)][0] for p in self._params]
        self._slot_of = [where[id(p)][1] for p in self._params]
        self._fired = [False] * len(self._params)  # which hooks ran in this backward
        self._n_fired = 0
        self._next = 0  # the next bucket to launch
        self._backward_start = None
        self._autograd_end = None
        self._missing = 0  # this rank's parameters without a gradient, sent along in the last bucket
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, i))
                       for i, p in enumerate(self._params)]

    def _build_buckets(self) -> list[_Bucket]:
        params = [p for _, p in reversed(self.trainable)]  # backward meets the last layers first
        buckets = [[params[i] for i in run]
                   for run in pack_buckets(params, self.bucket_cap_bytes, self.first_bucket_cap_bytes)]
        out = []
        for i, ps in enumerate(buckets):
            offsets, n = [], 0
            for p in ps:
                offsets.append(n)
                n += p.numel()
            # The last bucket carries one extra element: how many parameters got no gradient on this rank,
            # so that after its all-reduce every rank knows whether *any* rank missed one.
            extra = 1 if i == len(buckets) - 1 else 0
            buffer = torch.zeros(n + extra, dtype=ps[0].dtype, device=ps[0].device)
            slots = [buffer[o:o + p.numel()].view_as(p) for o, p in zip(offsets, ps)]
            out.append(_Bucket(i, ps, offsets, buffer, slots, buffer[:n]))
        return out

    def _attach_shared_memory(self) -> bool:
        devices = {b.buffer.device.type for b in self.buckets}
        if devices != {"cpu"}:
            raise ValueError(f"DDP(shared_memory=True) reduces CPU tensors, but the parameters are on "
                             f"{', '.join(sorted(devices))}: leave shared_memory off on GPUs (nccl is faster)")
        from .shm import SharedMemoryAllReduce
        try:
            for b in self.buckets:
                b.reducer = SharedMemoryAllReduce(b.buffer.numel(), b.buffer.dtype, self.group)
                b.shm_slots = [b.reducer.mine[o:o + p.numel()].view_as(p) for o, p in zip(b.offsets, b.params)]
        except (ValueError, OSError) as e:  # raised on every rank alike, so every rank falls back together
            for b in self.buckets:
                b.reducer = b.shm_slots = None
            get_logger().warning(f"DDP: shared memory unavailable, reducing through the process group ({e})")
            return False
        return True

    # --- during backward ----------------------------------------------------------------------------

    def _grad_ready(self, i: int, p: nn.Parameter) -> None:
        """Runs as soon as autograd has accumulated p.grad (p is self._params[i])."""
        if not self.require_sync:
            return  # no_sync: the gradient just accumulates in p.grad
        if self._backward_start is None:
            self._backward_start = time.perf_counter()
            self._queue_end_of_backward()
        if self._fired[i]:
            raise RuntimeError(f"DDP: parameter {self.trainable[i][0]} received a gradient twice in one backward "
                               f"(the same module run twice in one step?); this is not supported")
        self._fired[i] = True
        self._n_fired += 1
        bucket = self._bucket_of[i]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        # Buckets go out strictly in index order: collectives are matched across ranks by the order in
        # which they are called, so every rank must issue them in the same order.
        while self._next < len(self.buckets) and self.buckets[self._next].ready == len(self.buckets[self._next].params):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.reducer is not None:
            return self._reduce_in_shared_memory(bucket)
        # Gather the bucket's gradients into its buffer in one call (a gradient accumulated in place, already
        # in its slot, is skipped by copy_), scale by 1/N and all-reduce with SUM: the buffer then holds the
        # average. This is torch DDP's arithmetic: with the same buckets the two agree to the last bit.
        torch._foreach_copy_(bucket.slots, [p.grad for p in bucket.params])
        bucket.grads.mul_(1.0 / self.world_size)
        if bucket.index == len(self.buckets) - 1:
            bucket.buffer[-1] = self._missing
        bucket.launched_at = time.perf_counter()
        bucket.work = dist.all_reduce(bucket.buffer, op=dist.ReduceOp.SUM, group=self.pg, async_op=True)
        if self.record_timeline:
            bucket.done_at = []
            bucket.work.get_future().then(lambda _f, b=bucket: b.done_at.append(time.perf_counter()))

    def _reduce_in_shared_memory(self, bucket: _Bucket) -> None:
        # The same arithmetic, but the gradients go straight into this rank's row of the shared memory, the
        # ranks add up each other's rows, and the average is copied into the bucket. Synchronous: it is done
        # when this returns.
        reducer, n = bucket.reducer, bucket.grads.numel()
        torch._foreach_copy_(bucket.shm_slots, [p.grad for p in bucket.params])
        reducer.mine[:n].mul_(1.0 / self.world_size)
        if bucket.index == len(self.buckets) - 1:
            reducer.mine[-1] = self._missing
        bucket.launched_at = time.perf_counter()
        bucket.buffer.copy_(reducer.all_reduce_())
        bucket.work = _DONE
        bucket.done_at = [time.perf_counter()]

    # --- end of backward ----------------------------------------------------------------------------

    def _finish(self) -> None:
        self._autograd_end = time.perf_counter()  # autograd is done; from here on we only wait
        self.sync_count += 1
        params = self._params
        missing = [] if self._n_fired == len(params) else [i for i, f in enumerate(self._fired) if not f]
        # Parameters whose hook did not fire this step contribute what they hold: a gradient accumulated
        # under no_sync, or zeros. Then every remaining bucket goes out, in order.
        no_grad = [i for i in missing if params[i].grad is None]
        self._missing = len(no_grad)
        for i in missing:
            if params[i].grad is None:
                params[i].grad = torch.zeros_like(params[i])  # joins as zeros; set back to None below
            self._bucket_of[i].ready += 1
        self._launch_ready_buckets()
        unused_everywhere = set()
        if self.find_unused_parameters:
            # Which parameters did *any* rank use? Those no rank used keep grad None, as in torch DDP.
            flags = torch.ones(len(params), dtype=torch.int32, device=self.buckets[0].buffer.device)
            if no_grad:
                flags[no_grad] = 0
            dist.all_reduce(flags, group=self.pg)
            unused_everywhere = {i for i, f in enumerate(flags.tolist()) if f == 0}
        self._wait_all()
        anyone_missing = self.buckets[-1].buffer[-1].item() > 0  # summed counts: > 0 if any rank missed one
        if anyone_missing and not self.find_unused_parameters:
            for i in no_grad:
                params[i].grad = None
            self._reset()  # every rank raises, so no rank walks on into the next step's collectives alone
            names = [self.trainable[i][0] for i in no_grad]
            here = (f"on this rank: {', '.join(names[:8])}{', ...' if len(names) > 8 else ''}" if names
                    else "on another rank (this rank had every gradient)")
            raise RuntimeError(
                f"DDP: parameter(s) got no gradient this step, {here}. If they are unused on purpose, wrap "
                f"with DDP(..., find_unused_parameters=True), or freeze them (requires_grad_(False)).")
        for p, slot in zip(params, self._slot_of):
            if p.grad is not slot:
                p.grad = slot  # the averaged gradient lives in the bucket: no copy back
        for i in unused_everywhere:
            params[i].grad = None
        self._reset()

    def _wait_all(self) -> None:
        for b in self.buckets:
            b.work.wait()
        if self.record_timeline and self._backward_start is not None:
            # On CUDA a future may complete before the kernel does: the timeline is exact on gloo/CPU only.
            end = time.perf_counter()
            t0 = self._backward_start
            for b in self.buckets:
                done = b.done_at[0] if b.done_at else end
                self.timeline.append({"bucket": b.index, "numel": b.grads.numel(),
                                      "launch_s": b.launched_at - t0, "done_s": done - t0,
                                      "autograd_end_s": self._autograd_end - t0, "synced_s": end - t0})

    def _in_backward(self) -> bool:
        return self._backward_start is not None

    def _reset(self) -> None:
        for b in self.buckets:
            b.ready, b.work = 0, None
        self._fired = [False] * len(self._params)
        self._n_fired = 0
        self._next = 0
        self._missing = 0
        self._backward_start = None


class NaiveDDP(_SyncBase):
    """The baseline: after backward, one blocking all-reduce per parameter, no buckets, no overlap."""

    def __init__(self, module: nn.Module, group=None, broadcast_buffers: bool = True):
        super().__init__(module, group, broadcast_buffers)
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for _, p in self.trainable]

    def _grad_ready(self, p: nn.Parameter) -> None:
        if self.require_sync:
            self._queue_end_of_backward()

    def _finish(self) -> None:
        for _, p in self.trainable:
            if p.grad is None:  # unused here: join with zeros, or the ranks' all-reduces would pair up wrongly
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self.pg)
            p.grad.div_(self.world_size)
