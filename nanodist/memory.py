"""Per-rank memory of training: the ZeRO paper's formulas, and the same numbers measured on real tensors.

    report = measure_memory(model, optimizer)        # after optimizer.step(), before zero_grad()
    report.params, report.grads, report.optimizer_state     # bytes on this rank
    zero_memory_bytes(num_params, world_size=8, stage=2)     # the formula: what ZeRO promises
    memory_table(runs)                                        # formula next to measurement, as a Table

The formulas (Rajbhandari et al., "ZeRO", 2019). Training a model of Psi parameters with Adam in mixed
precision holds, on every data-parallel rank, 2 Psi bytes of fp16/bf16 parameters, 2 Psi of gradients
and K Psi of optimizer state, K = 12: an fp32 master copy of the parameters (4) and Adam's two
moments (4 + 4). ZeRO partitions them over the N ranks, one more term per stage:

    stage 0 (DDP):              2 Psi + 2 Psi + K Psi        everything replicated
    stage 1 (optimizer states): 2 Psi + 2 Psi + K Psi / N    DistAdamW(zero_stage=1)
    stage 2 (+ gradients):      2 Psi + 2 Psi / N + K Psi / N    DistAdamW(zero_stage=2), the default
    stage 3 (+ parameters):     (2 + 2 + K) Psi / N          nanodist.FSDP (chapter 5)

The byte counts are arguments, so the same function covers other precisions and optimizers
(`optimizer_bytes_per_param`): fp32 training without master weights is param_bytes=4, grad_bytes=4
and 8 bytes of AdamW state (exp_avg, exp_avg_sq) or 4 of Muon's (momentum).

How DistAdamW relates. At both stages each rank keeps exp_avg / exp_avg_sq for its 1/N slice of
every parameter only. At stage 1 the gradients are all-reduced: after step() every p.grad holds the
full averaged gradient, as under DDP. At stage 2 they are reduce-scattered: each rank receives, and
keeps (in a buffer reused every step), only the averaged gradient of its slice; step() consumes the
full local gradients (every p.grad is None afterwards) and the full averaged gradient never exists
anywhere. Caveat: autograd still materialises each rank's full *local* gradient during backward;
true ZeRO-2 reduce-scatters bucket by bucket as backward runs, freeing as it goes (FSDP does).

Measuring. `measure_memory` walks the actual tensors: the model's parameters, their .grad, the
gradient buffers the optimizer keeps (`optimizer.gradient_buffers()`, if it has one) and every tensor
in optimizer.state. A storage shared by several tensors (a tied weight, DDP's gradient buckets that
p.grad points into) counts once. Sharded parameters (DTensor, as FSDP2 makes) count their local shard
(`.to_local()`). Call it right after optimizer.step() and before zero_grad(): then parameters,
gradients and optimizer state are all alive, as at the peak of a step. On CUDA it also reports
torch.cuda.max_memory_allocated, which includes activations and temporaries.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import asdict, dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .table import Table

STAGES = (0, 1, 2, 3)


# ----------------------------------------------------------------------------- formulas

def optimizer_bytes_per_param(optimizer: str = "adamw", state_bytes: int = 4, master_bytes: int = 0) -> int:
    """Bytes of optimizer state per parameter: AdamW keeps 2 tensors (exp_avg, exp_avg_sq), Muon and SGD with
    momentum 1, plain SGD 0; each of `state_bytes`; plus a master copy of `master_bytes` (4 for mixed precision).

        optimizer_bytes_per_param("adamw", master_bytes=4) == 12    # the ZeRO paper's K
        optimizer_bytes_per_param("adamw") == 8                      # fp32 AdamW, no master copy
        optimizer_bytes_per_param("muon") == 4
    """
    per = {"adamw": 2, "adam": 2, "muon": 1, "sgd-momentum": 1, "sgd": 0}
    if optimizer.lower() not in per:
        raise ValueError(f"unknown optimizer {optimizer!r}: use one of {', '.join(per)}")
    return per[optimizer.lower()] * state_bytes + master_bytes


def muon_adamw_state_bytes(num_params: int, num_muon: int, world_size: int = 1, state_bytes: int = 4) -> float:
    """Optimizer-state bytes per rank when num_muon of num_params parameters are Muon's (one momentum each) and
    the rest AdamW's (two moments each), sharded over world_size ranks (ZeRO stage >= 1; an even deal)."""
    if not 0 <= num_muon <= num_params or world_size < 1:
        raise ValueError(f"need 0 <= num_muon <= num_params and world_size >= 1, got {num_muon}, {num_params}, "
                         f"{world_size}")
    return (optimizer_bytes_per_param("muon", state_bytes) * num_muon
            + optimizer_bytes_per_param("adamw", state_bytes) * (num_params - num_muon)) / world_size


def zero_memory_bytes(num_params: int, world_size: int, stage: int, param_bytes: float = 2, grad_bytes: float = 2,
                      optim_bytes_per_param: float = 12) -> dict:
    """Bytes per rank of parameters, gradients and optimizer state at a ZeRO stage (0-3), and their total.

    Defaults are the ZeRO paper's mixed-precision Adam: 2 + 2 + 12 bytes per parameter. Stage s divides
    the optimizer state (s >= 1), the gradients (s >= 2) and the parameters (s >= 3) by world_size.
    Exact division, so a result may be fractional (an int when it is not): real shards round up and pad.
    """
    if stage not in STAGES:
        raise ValueError(f"ZeRO stage must be one of {STAGES}, got {stage!r}")
    if world_size < 1 or num_params < 0:
        raise ValueError(f"need world_size >= 1 and num_params >= 0, got {world_size} and {num_params}")
    n = world_size
    whole = lambda x: int(x) if float(x).is_integer() else x  # noqa: E731  (print bytes as integers when exact)
    params = num_params * param_bytes / (n if stage >= 3 else 1)
    grads = num_params * grad_bytes / (n if stage >= 2 else 1)
    state = num_params * optim_bytes_per_param / (n if stage >= 1 else 1)
    return {"params": whole(params), "grads": whole(grads), "optimizer_state": whole(state),
            "total": whole(params + grads + state)}


# ----------------------------------------------------------------------------- measurement

def _local(t):
    """The tensor this rank actually holds: a DTensor's local shard, otherwise the tensor itself."""
    if t is None:
        return None
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _tensors(obj):
    """Every tensor inside nested dicts / lists / tuples (optimizer state entries)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _storage_key(t: torch.Tensor):
    return (t.device, t.untyped_storage().data_ptr())


def _byte_range(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes of its storage that a tensor spans (strided views included), or None if empty."""
    if t.numel() == 0:
        return None
    start = t.storage_offset() * t.element_size()
    elements = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return start, start + elements * t.element_size()


def _add_range(ranges: list, new: tuple[int, int]) -> int:
    """Add a byte range to a storage's disjoint, sorted ranges; return how many bytes were not counted yet."""
    s, e = new
    overlap = sum(max(0, min(b, e) - max(a, s)) for a, b in ranges)
    keep = [(a, b) for a, b in ranges if b < s or a > e]
    for a, b in ranges:
        if not (b < s or a > e):
            s, e = min(a, s), max(b, e)
    ranges[:] = sorted(keep + [(s, e)])
    return (new[1] - new[0]) - overlap


def tensor_bytes(tensors, seen: dict | None = None) -> int:
    """Bytes the `tensors` occupy: memory viewed by several tensors counts once.

    What counts is the bytes each tensor views, not the whole storage behind it: DDP's gradients are views
    into bucket buffers that also hold a bookkeeping element, and a buffer's padding is nobody's gradient.
    Meta tensors hold no memory and count 0. `seen` (a dict) carries byte ranges already counted elsewhere.
    """
    seen = {} if seen is None else seen
    total = 0
    for t in tensors:
        t = _local(t)
        if t is None or t.device.type == "meta":
            continue
        span = _byte_range(t)
        if span is not None:
            total += _add_range(seen.setdefault(_storage_key(t), []), span)
    return total


@dataclass
class MemoryReport:
    """Bytes this rank holds, by kind. `optimizer_state_by_key` splits the state (exp_avg, exp_avg_sq, step, ...);
    `optimizer_state_scalars` is the part held by step counters (state key "step"), which formulas ignore."""

    params: int
    grads: int
    optimizer_state: int
    optimizer_state_by_key: dict = field(default_factory=dict)
    optimizer_state_scalars: int = 0
    cuda_max_allocated: int | None = None

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_state

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def measure_memory(model: torch.nn.Module, optimizer=None) -> MemoryReport:
    """Bytes of parameters, gradients and optimizer state on this rank, from the live tensors (see the module doc).

    Accepts a DDP-wrapped or a sharded model (DTensor parameters count their local shard). Gradients are the
    parameters' .grad plus `optimizer.gradient_buffers()` (DistAdamW/DistMuon's averaged shards at stage 2).
    """
    seen: dict = {}
    params = list(model.parameters())
    param_bytes = tensor_bytes(params, seen)
    grads = [p.grad for p in params if p.grad is not None]
    if optimizer is not None and hasattr(optimizer, "gradient_buffers"):
        grads += list(optimizer.gradient_buffers())
    grad_bytes = tensor_bytes(grads, seen)
    by_key: dict[str, int] = {}
    scalars = 0
    if optimizer is not None:
        # torch's ZeroRedundancyOptimizer keeps its state in the optimizer it wraps (.optim), over its own share
        holder = optimizer.optim if type(optimizer).__name__ == "ZeroRedundancyOptimizer" else optimizer
        for state in holder.state.values():
            for key, value in state.items():
                for t in _tensors(value):
                    n = tensor_bytes([t], seen)
                    by_key[key] = by_key.get(key, 0) + n
                    if key == "step":
                        scalars += n
    cuda = None
    devices = {p.device for p in params if p.device.type == "cuda"}
    if devices:
        cuda = max(torch.cuda.max_memory_allocated(d) for d in devices)
    return MemoryReport(params=param_bytes, grads=grad_bytes, optimizer_state=sum(by_key.values()),
                        optimizer_state_by_key=by_key, optimizer_state_scalars=scalars, cuda_max_allocated=cuda)


def memory_table(runs: list[dict], param_bytes: float = 4, grad_bytes: float = 4,
                 optim_bytes_per_param: float = 8) -> Table:
    """Formula next to measurement, one row per (run, rank).

    Each run is a dict with label, stage, world_size, num_params and the measured params / grads /
    optimizer_state (a MemoryReport.to_dict() plus those keys will do; `rank` and
    `optimizer_state_scalars` are shown when present). A run may override param_bytes / grad_bytes /
    optim_bytes_per_param (e.g. 4 for Muon). The defaults are fp32 AdamW without master weights, where
    the formula is exact up to the step counters (column `state_scalars`) and any padding of shards.
    """
    rows = Table()
    for run in runs:
        f = zero_memory_bytes(run["num_params"], run["world_size"], run["stage"],
                              param_bytes=run.get("param_bytes", param_bytes),
                              grad_bytes=run.get("grad_bytes", grad_bytes),
                              optim_bytes_per_param=run.get("optim_bytes_per_param", optim_bytes_per_param))
        row = {"label": run.get("label", f"stage {run['stage']}"), "stage": run["stage"],
               "world_size": run["world_size"], "rank": run.get("rank", 0)}
        for kind in ("params", "grads", "optimizer_state"):
            row[f"{kind}_formula"] = f[kind]
            row[f"{kind}_measured"] = run[kind]
        row["state_scalars"] = run.get("optimizer_state_scalars", 0)
        row["total_formula"] = f["total"]
        row["total_measured"] = run["params"] + run["grads"] + run["optimizer_state"]
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- estimates and the calculator

# Bytes per parameter of each kind, by training precision. "mixed" is the ZeRO paper's setting: bf16/fp16 weights
# and gradients for the forward and backward passes, an fp32 master copy and fp32 optimizer state for the update.
PRECISIONS = {
    "mixed": dict(param_bytes=2, grad_bytes=2, state_bytes=4, master_bytes=4),
    "fp32": dict(param_bytes=4, grad_bytes=4, state_bytes=4, master_bytes=0),  # what the lab runs on CPU
    "bf16": dict(param_bytes=2, grad_bytes=2, state_bytes=2, master_bytes=0),  # pure bf16: no master copy
}
OPTIMIZERS = ("adamw", "muon", "sgd-momentum", "sgd")


def bytes_per_param(precision: str = "mixed", optimizer: str = "adamw") -> dict:
    """The byte counts `zero_memory_bytes` takes, for a training precision and an optimizer.

        bytes_per_param("mixed", "adamw") == {"param_bytes": 2, "grad_bytes": 2, "optim_bytes_per_param": 12}
        bytes_per_param("fp32", "adamw")  == {"param_bytes": 4, "grad_bytes": 4, "optim_bytes_per_param": 8}

    A master copy is only kept by an optimizer that has one to keep: plain SGD in mixed precision still
    holds it (4 bytes), so "sgd" costs 4 there and 0 in fp32.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    p = PRECISIONS[precision]
    return {"param_bytes": p["param_bytes"], "grad_bytes": p["grad_bytes"],
            "optim_bytes_per_param": optimizer_bytes_per_param(optimizer, p["state_bytes"], p["master_bytes"])}


def memory_estimate_table(num_params: float, world_sizes=(1, 8, 64), stages=STAGES, precision: str = "mixed",
                          optimizer: str = "adamw", unit: float = 2**30) -> Table:
    """Per-rank memory of the model states from `zero_memory_bytes`, one row per (world size, stage).

    Values in `unit` bytes (GiB by default; unit=1e9 gives the ZeRO paper's GB), rounded to 2 decimals; `vs_ddp` is the total
    divided by stage 0's at the same world size.
    """
    per = bytes_per_param(precision, optimizer)
    rows = Table()
    for n in world_sizes:
        ddp = zero_memory_bytes(num_params, n, 0, **per)["total"]
        for s in stages:
            f = zero_memory_bytes(num_params, n, s, **per)
            rows.append({"world_size": n, "stage": s, **{k: round(v / unit, 2) for k, v in f.items()},
                         "vs_ddp": round(f["total"] / ddp, 3) if ddp else None})
    return rows


def memory_calculator(num_params: float = 7e9, world_size: int = 8, stage: int = 2, precision: str = "mixed",
                      optimizer: str = "adamw"):
    """An ipywidgets calculator of per-rank memory: sliders for parameters, world size, ZeRO stage, precision
    and optimizer, and the table of `memory_estimate_table` (GiB per rank) for the choice and for DDP.

    Display the returned widget in JupyterLab or Jupyter Notebook; it needs a live kernel to react. Its text
    form (a terminal, nbval) is a one-line summary of the initial choice.
    """
    import ipywidgets as w

    # Clear errors for bad arguments, before any widget exists.
    zero_memory_bytes(num_params, int(world_size), stage, **bytes_per_param(precision, optimizer))
    sizes = sorted({2**k for k in range(13)} | {int(world_size)})
    controls = {
        "params": w.FloatLogSlider(value=num_params, base=10, min=6, max=12.5, step=0.01, description="parameters",
                                   readout_format=".3s", continuous_update=False),
        "world": w.SelectionSlider(options=sizes, value=int(world_size), description="world size",
                                   continuous_update=False),
        "stage": w.IntSlider(value=stage, min=0, max=3, description="ZeRO stage", continuous_update=False),
        "precision": w.ToggleButtons(options=list(PRECISIONS), value=precision, description="dtype"),
        "optimizer": w.ToggleButtons(options=list(OPTIMIZERS), value=optimizer, description="optimizer"),
    }
    result = w.HTML()

    def summary() -> str:  # short: ipywidgets cuts a widget's text form at 110 characters
        c = {k: v.value for k, v in controls.items()}
        total = zero_memory_bytes(c["params"], c["world"], c["stage"],
                                  **bytes_per_param(c["precision"], c["optimizer"]))["total"]
        return (f"{c['params']:.3g} params, {c['world']} ranks, stage {c['stage']}, {c['precision']} "
                f"{c['optimizer']}: {total / 2**30:.2f} GiB per rank")

    def update(_=None) -> None:
        c = {k: v.value for k, v in controls.items()}
        table = memory_estimate_table(c["params"], [c["world"]], sorted({0, c["stage"]}), c["precision"],
                                      c["optimizer"])
        result.value = (f"<p>{summary()} (parameters, gradients and optimizer state)</p>" + table._repr_html_()
                        + "<p>GiB = 2<sup>30</sup> bytes; activations come on top.</p>")

    for control in controls.values():
        control.observe(update, names="value")
    update()

    class MemoryCalculator(w.VBox):
        def __repr__(self) -> str:
            return f"memory calculator: {summary()}"

    return MemoryCalculator(list(controls.values()) + [result])


# ----------------------------------------------------------------------------- memory over a step

def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


class LiveBytes:
    """Our own account of the bytes that come and go during a step, by kind, in the order they happen.

        live = LiveBytes()                                  # also an FSDP observer: FSDP(..., observer=live)
        with live.track():                                  # saved-for-backward tensors, through autograd's hooks
            loss = model(x, y)[1]; loss.backward()
        live.peak, live.at_peak                             # the largest total, and what it was made of

    Two kinds are counted: "activations" -- every tensor autograd saves for backward, except parameters and views of
    them (and, given `parameters=model.parameters()`, tensors on their storage: a DTensor parameter's local piece,
    which tensor parallelism multiplies by, is not a view autograd can see through), counted once per storage while
    any saved reference to it is alive (added when saved, removed when backward has unpacked it for the last time)
    -- and "gathered" -- FSDP units' full parameter buffers, between their gather and their free. What a step holds
    throughout (parameters or shards, gradients, optimizer state) is measure_memory's business; add it to get the
    step's peak. Temporaries inside an operation are not counted: allocated_peak() measures those too, from the
    allocator, and the difference is the workspace of the operations.
    """

    def __init__(self, clock=None, parameters=()):
        self.events: list[tuple] = []  # (kind, +/- bytes, clock()) in order
        # parameters whose storage autograd may see under another tensor (a DTensor's local piece, which tensor
        # parallelism multiplies by): saved, they are parameters, not activations
        self._parameters = {_local(p).untyped_storage().data_ptr() for p in parameters}
        self._clock = clock or (lambda: len(self.events))  # e.g. an AllocationTracker's operation count
        self._saved: dict[tuple, list] = {}  # storage -> [bytes, references alive]
        self._gathered: dict[str, int] = {}
        self.peak, self.at_peak = 0, {}

    def _add(self, kind: str, nbytes: int) -> None:
        self.events.append((kind, nbytes, self._clock()))

    def _pack(self, t: torch.Tensor):
        base = t if t._base is None else t._base
        if base.is_leaf and base.requires_grad:  # a parameter (or a view of one, as FSDP's are): not an activation
            return (t, None)
        if self._parameters and t.untyped_storage().data_ptr() in self._parameters:
            return (t, None)
        key = (t.device, t.untyped_storage().data_ptr())
        entry = self._saved.get(key)
        if entry is None:
            entry = self._saved[key] = [t.untyped_storage().nbytes(), 0]
            self._add("activations", entry[0])
        entry[1] += 1
        return (t, key)

    def _unpack(self, packed):
        t, key = packed
        entry = self._saved.get(key) if key is not None else None
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:  # backward has used the last saved reference: autograd lets it go
                self._add("activations", -entry[0])
                del self._saved[key]
        return t

    def track(self):
        """A context: count what autograd saves for backward inside it."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    @contextlib.contextmanager
    def track_module(self, module: torch.nn.Module):
        """A context: count what autograd saves for backward during each forward of `module` only (one block of
        a model, say), however the model reaches it.

            live = LiveBytes(parameters=model.parameters())
            with live.track_module(model.blocks[0]):
                model(x, y)
            live.saved_bytes()                             # what block 0 saved for backward
        """
        entered = []

        def enter(_module, _args):
            entered.append(self.track())
            entered[-1].__enter__()

        def leave(_module, _args, _out):
            entered.pop().__exit__(None, None, None)

        hooks = [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
        try:
            yield self
        finally:
            for h in hooks:
                h.remove()
            while entered:  # a forward that raised inside the module: its hooks are still on autograd's stack
                entered.pop().__exit__(None, None, None)

    def saved_bytes(self) -> int:
        """Every byte autograd saved for backward while tracked (each storage once while saved), freed or not."""
        return sum(delta for kind, delta, _ in self.events if kind == "activations" and delta > 0)

    # FSDP observer: a unit's full buffer is alive from the gather to the free
    def gather_started(self, unit) -> None:
        self._gathered[unit.name] = unit.full_bytes
        self._add("gathered", unit.full_bytes)

    def freed(self, unit) -> None:
        self._add("gathered", -self._gathered.pop(unit.name, 0))

    def gathered(self, unit) -> None: ...

    def reduce_started(self, unit) -> None: ...

    def reduced(self, unit) -> None: ...

    def summary(self) -> dict:
        """peak (bytes), the kinds at that moment, and the largest of each kind on its own."""
        live, best, at, most = {"activations": 0, "gathered": 0}, 0, {}, {"activations": 0, "gathered": 0}
        for kind, delta, _ in self.events:
            live[kind] += delta
            most[kind] = max(most[kind], live[kind])
            total = sum(live.values())
            if total > best:
                best, at = total, dict(live)
        self.peak, self.at_peak = best, at
        return {"peak": best, "at_peak": at, "max": most}


@contextlib.contextmanager
def allocated_peak():
    """The allocator's view of a region: {"peak": bytes, "end": bytes} above what was allocated at its start.

    On CUDA, torch.cuda.max_memory_allocated. On the CPU, which keeps no such statistic, torch's profiler
    records the bytes every operation allocates and frees; their running sum, in time order, is the live
    total (the profiler's own messages are kept off the terminal)."""
    result: dict = {}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        yield result
        torch.cuda.synchronize()
        result.update(peak=torch.cuda.max_memory_allocated() - start, end=torch.cuda.memory_allocated() - start,
                      source="torch.cuda.max_memory_allocated")
        return
    from torch.profiler import ProfilerActivity, profile
    with _quiet(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield result
    live = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    result.update(peak=peak, end=live, source="torch.profiler (CPU allocations)")


@contextlib.contextmanager
def _quiet():
    """Silence what native code prints on stdout/stderr (the profiler's start/stop lines) for the duration."""
    import os
    import sys
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


class AllocationTracker(TorchDispatchMode):
    """Our own allocation accounting: every storage made during a region, from its creation to its death.

        with AllocationTracker() as alloc:          # on the thread that runs the step (CPU or CUDA)
            loss = model(x, y)[1]; loss.backward(); opt.step()
        alloc.peak, alloc.live                      # bytes above what existed before: the most at once, and now

    A dispatch mode sees the output of every operation (activations, gradients, temporaries, optimizer
    state created lazily). An output whose storage is new -- not one of the operation's inputs, not seen
    before -- is counted, and a weak reference to that storage says when it is freed (when the last tensor
    viewing it goes, e.g. when backward releases what it saved). Storages that existed before the region
    (parameters, optimizer state) are not counted even when operations write into them. Storage resizes
    (how FSDP, ours and torch's, allocate and free a gathered unit behind the same tensor) are counted as
    the bytes they add or release. What it cannot see: work on other threads (a backend's own staging).
    Operations run slower while it watches: measure memory and time in separate steps.
    """

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen: dict[int, list] = {}  # id(storage) -> [bytes counted, weak reference]
        self.timeline: list[int] = []
        self._resize = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
                storage = t.untyped_storage()
                if id(storage) not in inputs:
                    self._track(storage)
        return out

    def is_new(self, t: torch.Tensor) -> bool:
        """Whether `t`'s memory was allocated inside the region (and is therefore part of live / peak)."""
        return id(t.untyped_storage()) in self._seen

    def _track(self, storage) -> None:
        key = id(storage)
        if key in self._seen:
            return
        n = storage.nbytes()
        self._seen[key] = [n, weakref.ref(storage, lambda _r, key=key: self._freed(key))]
        self.add(n)

    def _freed(self, key: int) -> None:
        n, _ = self._seen.pop(key, (0, None))
        self.add(-n)

    def _resized(self, storage, before: int) -> None:
        delta = storage.nbytes() - before
        entry = self._seen.get(id(storage))
        if entry is not None:
            entry[0] += delta  # what its death will give back
        self.add(delta)

    def add(self, nbytes: int) -> None:
        """Count bytes that appear (positive) or go (negative) without an operation creating a tensor."""
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        self.timeline.append(self.live)

    def __enter__(self):
        original, tracker = torch.UntypedStorage.resize_, self

        def resize_(storage, size):
            before = storage.nbytes()
            result = original(storage, size)
            tracker._resized(storage, before)
            return result

        self._resize = original
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)


def process_memory(device=None) -> dict:
    """What this process holds now, as a watch for a leak: on a GPU, torch.cuda.memory_allocated (the tensors
    alive); on the CPU, the bytes malloc has handed out and not had back (glibc's mallinfo2, every arena: the
    tensors, and the interpreter's own), or where that is not available (not glibc) the resident set of the
    process (psutil: coarser -- the allocator's cached pages count too). A leak of tensors shows as steady
    growth in either. {"bytes", "source"}."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        return {"bytes": torch.cuda.memory_allocated(device), "source": "torch.cuda.memory_allocated"}
    in_use = _malloc_in_use()
    if in_use is not None:
        return {"bytes": in_use, "source": "malloc in use (mallinfo2)"}
    import psutil
    return {"bytes": psutil.Process().memory_info().rss, "source": "resident set (psutil)"}


def _malloc_in_use() -> int | None:
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
    except (OSError, AttributeError):  # not glibc, or a glibc older than 2.33
        return None
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)  # in use: in the arenas, and in blocks mapped on their own
