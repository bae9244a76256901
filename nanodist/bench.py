"""Fair comparisons in one run: the implementations take turns, so the machine's mood hits them all alike.

    take_turns({"torch": lambda: a.fit(max_steps=5), "nanodist": lambda: b.fit(max_steps=5)}, rounds=10, rotate=True)
    times = time_calls({"dist.all_reduce": ..., "ring_all_reduce": ...}, repeats=11, warmup=2)

On a laptop, other programs, frequency scaling and the operating system's moods come and go over
seconds. Timing one implementation for a minute and then the other compares two minutes as much as
two implementations. Interleaving them in short turns, and rotating who goes first, spreads every
disturbance over all of them: their ratio, measured in one run, is what the labs report. A solo turn
(lab03's 1-rank baseline) runs on the group's rank 0 alone while the other ranks wait at a barrier.
"""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from .group import Group


def turn_order(names: list[str], rounds: int, rotate: bool = False) -> list[str]:
    """The schedule: every name once per round, in order; rotated by one each round when `rotate`."""
    order = []
    for r in range(rounds):
        k = r % len(names) if rotate else 0
        order += names[k:] + names[:k]
    return order


def take_turns(turns: dict[str, Callable[[], None]], rounds: int, *, rotate: bool = False, solo=(),
               only: dict[str, int] | None = None, group=None, progress: Callable[[str], None] | None = None) -> None:
    """Run every turn once per round (see turn_order). Names in `solo` run on the group's rank 0 only, names in
    `only` on its first only[name] ranks; the other ranks wait at a barrier meanwhile. `progress(name)` is called
    after each turn."""
    g = Group.resolve(group)
    ranks = {**{name: 1 for name in solo}, **(only or {})}
    for name in turn_order(list(turns), rounds, rotate):
        n = ranks.get(name, g.size)
        if g.rank < n:
            turns[name]()
        if n < g.size:
            dist.barrier(group=g.pg)  # the others wait out the turn of the first n (seconds, far below the timeout)
        if progress is not None:
            progress(name)


def time_calls(calls: dict[str, Callable[[], None]], repeats: int, warmup: int = 0, group=None) -> dict[str, list[float]]:
    """Per-repeat wall time of each call, taking turns; each the max over ranks (a collective is as slow as its
    slowest rank). The ranks start each call together (a barrier), so one rank's lateness is not billed to it."""
    g = Group.resolve(group)
    sync = torch.cuda.synchronize if g.device.type == "cuda" else (lambda: None)
    for fn in calls.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in calls}

    def timed(name: str) -> Callable[[], None]:
        def run():
            sync()
            if g.size > 1:
                dist.barrier(group=g.pg)
            t0 = time.perf_counter()
            calls[name]()
            sync()
            times[name].append(time.perf_counter() - t0)
        return run

    take_turns({name: timed(name) for name in calls}, repeats, group=g)
    if g.size > 1:
        t = torch.tensor(list(times.values()), dtype=torch.float64, device=g.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g.pg)
        return dict(zip(times, t.tolist()))
    return times
