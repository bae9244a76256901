"""The gradient-sync engine: buckets of gradients, and the handles of collectives in flight.

DDP (chapter 3) and the sharded optimizers (chapter 4) share what is here; see ARCHITECTURE.md.
"""
from __future__ import annotations

import torch


class Work:
    """A collective in flight, holding its tensors until wait() returns.

    On nccl the buffers of an async collective must outlive it: if the handle and tensors were dropped
    early, the caching allocator could hand their memory to another tensor mid-transfer. gloo has no
    get_future() for reduce-scatter, so the handle itself is what we keep. Work() is already done.
    """

    def __init__(self, work=None, *tensors: torch.Tensor):
        self.work, self.tensors = work, tensors

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
        self.work, self.tensors = None, ()
        return True


DONE = Work()  # the handle of a reduction that has already finished


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
