"""What torch.profiler saw in one training step: its Chrome trace read back as lanes of compute and
communication, the collectives in the order they were launched, and how much of the communication ran while
something computed.

    with torch.profiler.profile(...) as prof, step_marker():
        ...one step...
    prof.export_chrome_trace(path)
    trace = read_trace(path)
    trace.collectives          # [Collective(kind, numel, start_s, transport)], in launch order
    trace.overlap()            # the fraction of communication time during which compute ran
    agree(trace.collectives, own_timeline)   # the same collectives in the same order as nanodist's own record?

Where the trace finds each thing (torch 2.11-2.13):
- the step: the span `step_marker()` records ("nanodist step"), in the process that ran the step;
- collectives launched through a process group: that process's `c10d::` operators (`c10d::allreduce_`,
  `c10d::_allgather_base_`, `c10d::_reduce_scatter_base_`, ...), with their tensors' shapes, on whichever
  thread launched them (on a GPU the backward's hooks run on autograd's thread for the device);
- nanodist's own synchronous collectives (the ring over point-to-point messages, shared memory): the spans
  `annotated` records around them ("nanodist ring reduce_scatter (4096 elements)"); the point-to-point
  messages inside one are part of it, not collectives of their own;
- communication running: gloo's worker threads' spans (`gloo:all_reduce`, ...), NCCL's kernels on a GPU
  (`ncclDevKernel_...`), and nanodist's synchronous collectives;
- compute: on a GPU, every other kernel; on a CPU, the process's operators outside collectives and off gloo's
  worker threads (whose few operators are its reductions).

Nothing here runs unless a profiler does: `annotated` checks whether one is recording before it formats a
name, and the rest reads files.
"""
from __future__ import annotations

import functools
import gzip
import inspect
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from torch.autograd import _profiler_enabled
from torch.profiler import record_function

STEP = "nanodist step"
_ANNOTATION = re.compile(r"^nanodist (?P<transport>\w+) (?P<kind>\w+) \((?P<numel>\d+) elements\)$")
# c10d's operator names (torch/csrc/distributed/c10d/Ops.cpp), leading underscores dropped, by prefix -> the
# collective they start; first match wins (reduce_scatter before reduce)
_C10D_KINDS = (("reduce_scatter", "reduce_scatter"), ("allreduce", "all_reduce"), ("allgather", "all_gather"),
               ("broadcast", "broadcast"), ("alltoall", "all_to_all"), ("barrier", "barrier"),
               ("monitored_barrier", "barrier"), ("send", "send"), ("recv", "recv"), ("reduce", "reduce"),
               ("gather", "gather"), ("scatter", "scatter"))


def step_marker():
    """The span that tells read_trace which part of the trace is the step, and on which thread it ran."""
    return record_function(STEP)


def annotated(transport: str, kind: str, numel):
    """Decorate a synchronous collective so that a profiler records it as one span named for the trace reader;
    numel(arguments) gives the size of the whole (unsharded) tensor from the call's bound arguments. Without a
    profiler recording, the call goes straight through."""
    def wrap(fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if not _profiler_enabled():
                return fn(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            with record_function(f"nanodist {transport} {kind} ({int(numel(bound.arguments))} elements)"):
                return fn(*args, **kwargs)
        return call
    return wrap


@dataclass(frozen=True)
class Collective:
    kind: str  # all_reduce, reduce_scatter, all_gather, broadcast, ...
    numel: int  # elements of the whole tensor: the reduced buffer, the gathered output, the scattered input
    start_s: float  # launched, in seconds from the start of the step
    transport: str  # "process group" (c10d), or nanodist's own: "ring", "shm"


@dataclass
class Trace:
    """One step's trace: spans as (start_s, end_s) from the start of the step."""

    step_s: float
    collectives: list[Collective]
    compute: list[tuple[float, float]] = field(default_factory=list)
    communication: list[tuple[float, float]] = field(default_factory=list)
    device: str = "cpu"  # "cuda" when the lanes are the GPU's kernels

    def overlap(self) -> float | None:
        """The fraction of the communication lane's time during which the compute lane was busy too (None: no
        communication)."""
        comm = union(self.communication)
        total = sum(b - a for a, b in comm)
        if total <= 0:
            return None
        return intersection(comm, union(self.compute)) / total

    def busy_s(self, lane: str) -> float:
        return sum(b - a for a, b in union(getattr(self, lane)))


def union(spans) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def intersection(a, b) -> float:
    """Total length of the intersection of two sorted, disjoint lists of spans."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _c10d_kind(name: str) -> str | None:
    """The collective a c10d operator starts (None: not a c10d operator, or not a collective)."""
    if not name.startswith("c10d::"):
        return None
    op = name[len("c10d::"):].lstrip("_")
    return next((kind for prefix, kind in _C10D_KINDS if op.startswith(prefix)), None)


def _numel(dims) -> int:
    """The whole tensor of a c10d operator from its "Input Dims": the larger of its first two inputs (the buffer
    of an all-reduce; the output of a gather, the input of a reduce-scatter), each a tensor's dims or a list of
    them; a scalar's dims are empty."""
    def size(d) -> int:
        if isinstance(d, list) and all(isinstance(x, int) for x in d):
            n = 1
            for x in d:
                n *= x
            return n
        return max((size(x) for x in d), default=0) if isinstance(d, list) else 0
    return max((size(d) for d in (dims or [])[:2]), default=0)


def read_trace(path) -> Trace:
    """The step's lanes and collectives from a Chrome trace torch.profiler exported (see the module docstring),
    or the same gzip-compressed (.gz). Raises ValueError when the trace holds no step marker."""
    path = Path(path)
    if path.suffix == ".gz":  # a committed trace, compressed (Perfetto opens these as they are)
        with gzip.open(path, "rt") as f:
            events = json.load(f)
    else:
        events = json.loads(path.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in spans if e.get("name") == STEP and e.get("cat") in ("user_annotation", "cpu_op")]
    if not steps:
        raise ValueError(f"{path}: no '{STEP}' span: record the step inside nanodist.profile.step_marker()")
    if len(steps) > 1:
        raise ValueError(f"{path}: {len(steps)} '{STEP}' spans: read_trace reads a trace of one step")
    step = steps[0]
    t0, t1 = step["ts"], step["ts"] + step["dur"]
    sec = lambda us: (us - t0) / 1e6  # noqa: E731
    inside = [e for e in spans if t0 <= e["ts"] <= t1 and e is not step]
    # The step's process, every thread of it: on a GPU the backward (and the hooks that launch collectives) runs
    # on autograd's thread for the device, not on the one that called backward.
    host = [e for e in inside if e["pid"] == step["pid"] and e.get("cat") in ("cpu_op", "user_annotation")]
    ours = [e for e in host if _ANNOTATION.match(e["name"])]

    def within_ours(e) -> bool:  # inside one of nanodist's collectives, on the same thread
        return any(o is not e and o["tid"] == e["tid"] and o["ts"] <= e["ts"] and
                   e["ts"] + e["dur"] <= o["ts"] + o["dur"] for o in ours)

    collectives = []
    for e in host:
        m = _ANNOTATION.match(e["name"])
        if m:
            if not within_ours(e):
                collectives.append(Collective(m["kind"], int(m["numel"]), sec(e["ts"]), m["transport"]))
            continue
        kind = _c10d_kind(e["name"])
        if kind is not None and not within_ours(e):
            collectives.append(Collective(kind, _numel(e.get("args", {}).get("Input Dims")), sec(e["ts"]),
                                          "process group"))
    collectives.sort(key=lambda c: c.start_s)
    mine = [(sec(o["ts"]), sec(o["ts"] + o["dur"])) for o in ours]
    gloo = [(sec(e["ts"]), sec(e["ts"] + e["dur"])) for e in host if e["name"].startswith("gloo:")]
    kernels = [e for e in inside if e.get("cat") == "kernel"]
    if kernels:  # a GPU: its kernels are the lanes
        nccl = [e for e in kernels if e["name"].lower().startswith("nccl")]
        comm = [(sec(e["ts"]), sec(e["ts"] + e["dur"])) for e in nccl] + gloo + mine
        compute = [(sec(e["ts"]), sec(e["ts"] + e["dur"])) for e in kernels if e not in nccl]
        return Trace(sec(t1), collectives, compute, comm, "cuda")
    # gloo's worker threads run a few operators of their own (reductions): communication, not compute
    workers = {e["tid"] for e in host if e["name"].startswith("gloo:")} - {step["tid"]}
    ops = [e for e in host if e.get("cat") == "cpu_op" and e["tid"] not in workers
           and not e["name"].startswith("c10d::") and not within_ours(e)]
    compute = _minus(union((sec(e["ts"]), sec(e["ts"] + e["dur"])) for e in ops), union(mine))
    return Trace(sec(t1), collectives, compute, gloo + mine, "cpu")


def _minus(spans, holes) -> list[tuple[float, float]]:
    """spans with the holes cut out (both sorted and disjoint)."""
    out = []
    for a, b in spans:
        for h0, h1 in holes:
            if h1 <= a or h0 >= b:
                continue
            if h0 > a:
                out.append((a, h0))
            a = max(a, h1)
        if a < b:
            out.append((a, b))
    return out


def agree(traced: list[Collective], own: list[tuple[str, int]]) -> dict:
    """Does the trace show nanodist's own record of the step, (kind, numel) in launch order? Each of `own` must
    appear in the trace, in the same order (the trace may hold collectives the record does not: a control
    all-reduce, a gradient-norm sum). Returns {"agrees", "matched", "missing": the first of own not found in
    order (or None), "extra": the trace's collectives not in the record}."""
    i, matched, extra = 0, 0, []
    for c in traced:
        if i < len(own) and (c.kind, c.numel) == tuple(own[i]):
            i, matched = i + 1, matched + 1
        else:
            extra.append((c.kind, c.numel))
    missing = None if i == len(own) else tuple(own[i])
    return {"agrees": missing is None and bool(own), "matched": matched, "of": len(own), "missing": missing,
            "extra": extra}
