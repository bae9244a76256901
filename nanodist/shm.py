"""All-reduce through shared memory, for CPU ranks on one machine.

gloo sends every byte through the network stack, even between two processes on the same machine: on
a laptop a 3 MiB gradient all-reduce goes through loopback TCP, copied into and out of the kernel on
each side. Processes on one machine can instead map the same memory and add each other's data
directly. NCCL does this between GPUs of one node (its SHM and P2P transports), and so does
DeepSpeed's shared-memory all-reduce for CPUs. This file is that idea in a few lines:

    reducer = SharedMemoryAllReduce(numel, torch.float32)   # collective: every rank of the group
    reducer.all_reduce_(tensor)                              # tensor = sum over ranks, in place

The mapped file holds one row per rank and one row for the result. An all-reduce is

    1. each rank copies its tensor into its row               (or writes it there directly: `mine`)
    2. barrier                                                every row is written
    3. rank r adds up chunk r of every row into the result    (a reduce-scatter, done by reading)
    4. barrier                                                every chunk of the result is written
    5. each rank copies the result out                        (an all-gather, done by reading)

A reduce-scatter is steps 1-3 with each rank's chunk read into its own output, and an all-gather is
each rank writing its chunk of the result row, a barrier, and everyone reading the row: ZeRO (chapter
4) uses these two. Each operation ends with a barrier once everyone has read, so that the next one
may write again -- unless the caller passes fence=False because, in its sequence of operations, another
barrier always comes between this read and the next write to the same memory.

The barriers are the process group's (gloo's): they carry a few bytes, and as system calls they also
order the memory writes before them against the reads after them, on every CPU architecture. The
file is deleted as soon as every rank has mapped it, so nothing is left behind, even after a crash.
"""
from __future__ import annotations

import os
import socket
import tempfile
import uuid

import torch
import torch.distributed as dist

from .group import Group
from .profile import annotated


def _shm_dir() -> str:
    """Linux's /dev/shm (memory, never written to disk) when it exists, else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class SharedMemoryAllReduce:
    """Sums a CPU tensor of `numel` elements of `dtype` over the ranks of `group`, through shared memory;
    also reduce-scatters and all-gathers (numel = world size x the chunk each rank owns).

    Creating one is a collective call. It raises ValueError, on every rank, when the ranks are not all on
    one machine, and OSError, on every rank, when the shared memory cannot be allocated (a full /dev/shm,
    as in a container started with a small --shm-size): callers fall back to the process group.
    """

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32, group=None):
        g = Group.resolve(group)
        self.group, self.pg = g, g.pg
        self.world_size, self.rank = g.size, g.rank
        self.numel, self.dtype = numel, dtype
        hosts = g.all_gather_object(socket.gethostname())
        if len(set(hosts)) > 1:
            raise ValueError(f"shared memory needs every rank on one machine; these ranks run on "
                             f"{sorted(set(hosts))}: reduce through the process group instead")
        nbytes = (self.world_size + 1) * numel * torch.empty((), dtype=dtype).element_size()
        # Rank 0 creates and sizes the file; everyone learns whether that worked before anyone maps it.
        made = [None]
        if self.rank == 0:
            path = os.path.join(_shm_dir(), f"nanodist-shm-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                try:
                    if hasattr(os, "posix_fallocate"):
                        os.posix_fallocate(fd, 0, nbytes)  # reserve now: a full /dev/shm is an error here, not a crash later
                    else:
                        os.ftruncate(fd, nbytes)
                finally:
                    os.close(fd)
                made = [path]
            except OSError as e:
                if os.path.exists(path):
                    os.unlink(path)
                made = [f"error: {e}"]
        dist.broadcast_object_list(made, src=g.global_rank(0), group=g.pg)
        if made[0].startswith("error: "):
            raise OSError(f"could not allocate {nbytes / 2**20:.1f} MiB of shared memory in {_shm_dir()} "
                          f"({made[0][7:]}): reduce through the process group instead")
        flat, error = None, None
        try:
            flat = torch.from_file(made[0], shared=True, size=(self.world_size + 1) * numel, dtype=dtype)
        except (OSError, RuntimeError) as e:
            error = f"rank {self.rank}: {e}"
        errors = g.all_gather_object(error)  # every rank learns whether every rank mapped it
        if self.rank == 0:
            os.unlink(made[0])  # everyone has mapped it (or failed to): the name is no longer needed
        if any(errors):
            raise OSError(f"could not map the shared memory ({'; '.join(e for e in errors if e)}): "
                          f"reduce through the process group instead")
        self.rows = flat.view(self.world_size + 1, numel)
        self.mine = self.rows[self.rank]  # write this rank's contribution here to save a copy
        self.result = self.rows[self.world_size]
        # This rank adds up elements [lo, hi) of every row: chunks as even as they can be, the first ones one longer.
        base, extra = divmod(numel, self.world_size)
        self.lo = self.rank * base + min(self.rank, extra)
        self.hi = self.lo + base + (self.rank < extra)

    @annotated("shm", "all_reduce", lambda a: a["self"].numel)
    def all_reduce_(self, tensor: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
        """Sum over ranks, in place. With `tensor=None` the contribution is whatever this rank wrote into
        `self.mine`, and the sum stays in `self.result` (read it before the next call). `scale` multiplies the
        contribution on its way in (1/N makes the sum an average). Returns the tensor holding the sum."""
        if tensor is not None:
            if tensor.numel() != self.numel or tensor.dtype != self.dtype or tensor.device.type != "cpu":
                raise ValueError(f"this reducer sums {self.numel} {self.dtype} elements on the CPU, got "
                                 f"{tensor.numel()} {tensor.dtype} on {tensor.device}")
            if scale is None:
                self.mine.copy_(tensor.reshape(-1))
            else:
                torch.mul(tensor.reshape(-1), scale, out=self.mine)
        elif scale is not None:
            self.mine.mul_(scale)
        dist.barrier(group=self.pg)
        lo, hi = self.lo, self.hi
        torch.sum(self.rows[:self.world_size, lo:hi], dim=0, out=self.result[lo:hi])
        dist.barrier(group=self.pg)
        if tensor is None:
            return self.result
        if tensor.is_contiguous():
            tensor.view(-1).copy_(self.result)
        else:
            tensor.copy_(self.result.view_as(tensor))
        return tensor

    @annotated("shm", "reduce_scatter", lambda a: a["self"].numel)
    def reduce_scatter_(self, out: torch.Tensor, fence: bool = True) -> torch.Tensor:
        """Every rank has written its whole input into `self.mine` (world_size chunks of out.numel() elements):
        out = the sum over ranks of chunk `rank`. Collective. fence=False: see the module docstring."""
        m = out.numel()
        if m * self.world_size != self.numel:
            raise ValueError(f"this reducer holds {self.numel} elements, {self.world_size} chunks of "
                             f"{self.numel // self.world_size}; got an output of {m}")
        dist.barrier(group=self.pg)  # every row is written
        torch.sum(self.rows[:self.world_size, self.rank * m:(self.rank + 1) * m], dim=0, out=out.view(-1))
        if fence:
            dist.barrier(group=self.pg)  # every rank has read its chunk: the rows may be written again
        return out

    @annotated("shm", "all_gather", lambda a: a["self"].numel)
    def all_gather_(self, inp: torch.Tensor, read, fence: bool = True) -> None:
        """Rank r's `inp` lands in chunk r of the result row; `read(result)` runs on every rank once all chunks
        are in (copy out what you need: the row is reused). Collective. fence=False: see the module docstring."""
        m = inp.numel()
        self.result[self.rank * m:(self.rank + 1) * m].copy_(inp.view(-1))
        dist.barrier(group=self.pg)  # every chunk is written
        read(self.result.view(self.world_size, m))
        if fence:
            dist.barrier(group=self.pg)  # everyone has read: the row may be written again
