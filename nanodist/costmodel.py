"""The alpha-beta cost model: how long a collective takes, from two numbers per machine.

    t = alpha * steps + beta * bytes

- alpha (s): the fixed cost of one step -- software overhead plus wire latency, paid however small the message;
- beta (s/byte): the time per byte through one rank's link, i.e. 1 / bandwidth;
- steps, bytes: what the algorithm does for a message of S bytes on N ranks (`cost()`). `bytes` counts
  what the busiest rank pushes through its link; a send and a receive that overlap count once.

    algorithm                        steps              bytes
    ring_all_reduce                  2(N-1)             2(N-1)/N * S
    ring_reduce_scatter              N-1                (N-1)/N * S     (S = the input, N outputs)
    ring_all_gather                  N-1                (N-1)/N * S     (S = the output)
    naive_all_reduce                 2(N-1)             2(N-1) * S      (all through rank 0)
    recursive_doubling_all_reduce    log2 P (+2)        steps * S       (P = largest power of two <= N;
                                                                         +2 fold steps when N != P)

Fit alpha and beta to measured times (`fit`, or `fit_results` on a lab02 record), then predict other
sizes and world sizes (`predict`), or where one algorithm overtakes another (`crossover_size`).
torch's own collectives are fitted with the ring's counts (`dist.all_reduce` -> ring_all_reduce...):
the bandwidth-optimal counts, so their beta reads as the link speed they achieve (the same convention
as nccl-tests' bus bandwidth). An implementation that does more work shows up as a slower link: gloo
runs reduce_scatter_tensor as a whole all-reduce, and its fitted bandwidth comes out well below the ring's.
Later chapters use the model to project, e.g., DDP's gradient all-reduce:

    model = fit_results(record)["dist.all_reduce"]
    model.predict(4 * n_params, world_size=64)             # seconds per step spent in all-reduce
    CostModel.from_link("ring_all_reduce", latency_s=5e-6, bandwidth_GBps=100)   # a datasheet link
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def _recursive_doubling(size: float, n: int) -> tuple[int, float]:
    pow2 = 1 << (n.bit_length() - 1)  # ranks beyond the largest power of two fold in first, unfold last
    steps = (pow2.bit_length() - 1) + (2 if n != pow2 else 0)
    return steps, steps * size


# algorithm -> (size_bytes, world_size) -> (steps, bytes through the busiest rank's link)
ALGORITHMS = {
    "ring_all_reduce": lambda s, n: (2 * (n - 1), 2 * (n - 1) / n * s),
    "ring_reduce_scatter": lambda s, n: (n - 1, (n - 1) / n * s),
    "ring_all_gather": lambda s, n: (n - 1, (n - 1) / n * s),
    "naive_all_reduce": lambda s, n: (2 * (n - 1), 2 * (n - 1) * s),
    "recursive_doubling_all_reduce": _recursive_doubling,
}
# torch's collectives (and short names) counted as the bandwidth-optimal algorithm for that collective.
ALIASES = {
    "dist.all_reduce": "ring_all_reduce", "all_reduce": "ring_all_reduce",
    "dist.reduce_scatter_tensor": "ring_reduce_scatter", "dist.reduce_scatter_single": "ring_reduce_scatter",
    "reduce_scatter": "ring_reduce_scatter",
    "dist.all_gather_into_tensor": "ring_all_gather", "dist.all_gather_single": "ring_all_gather",
    "all_gather": "ring_all_gather",
    "naive": "naive_all_reduce", "recursive_doubling": "recursive_doubling_all_reduce",
}


def busbw_factor(collective: str, world_size: int) -> float:
    """nccl-tests' bus-bandwidth factor: the fraction of a collective's S bytes that crosses each rank's link under
    the optimal algorithm -- 2(n-1)/n for all-reduce, (n-1)/n for reduce-scatter and all-gather. busbw = algbw x it."""
    n = world_size
    return 2 * (n - 1) / n if collective == "all_reduce" else (n - 1) / n


def _canonical(algorithm: str) -> str:
    name = ALIASES.get(algorithm, algorithm)
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}: use one of {', '.join(list(ALGORITHMS) + list(ALIASES))}")
    return name


def cost(algorithm: str, size_bytes: float, world_size: int) -> tuple[float, float]:
    """(steps, bytes through the busiest rank's link) for one call of `algorithm` on `size_bytes` and N ranks."""
    if not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if size_bytes < 0:
        raise ValueError(f"size_bytes must be >= 0, got {size_bytes!r}")
    steps, moved = ALGORITHMS[_canonical(algorithm)](size_bytes, int(world_size))
    return float(steps), float(moved)


@dataclass(frozen=True)
class CostModel:
    """alpha and beta for one algorithm on one machine; `predict` gives seconds for any size and world size."""

    algorithm: str
    alpha_s: float
    beta_s_per_byte: float
    backend: str = "unknown"
    device: str = "unknown"
    world_size: int | None = None  # the world size it was fitted at (None: several, or a hand-made model)
    n_points: int = 0
    rel_rmse: float | None = None  # root-mean-square relative error of the fit: 0.05 = within ~5 %

    @property
    def bandwidth_GBps(self) -> float:
        """1 / beta, in GB/s (10^9 bytes per second): the link speed the fit sees."""
        return math.inf if self.beta_s_per_byte == 0 else 1e-9 / self.beta_s_per_byte

    def predict(self, size_bytes, world_size: int | None = None):
        """Predicted seconds for one call (a float, or an array for an array of sizes)."""
        return predict(self, size_bytes, world_size)

    @classmethod
    def from_link(cls, algorithm: str, latency_s: float, bandwidth_GBps: float, **kw) -> "CostModel":
        """A model from a datasheet: per-step latency and per-rank link bandwidth (GB/s)."""
        return cls(_canonical(algorithm), float(latency_s), 1e-9 / float(bandwidth_GBps), **kw)


def predict(model: CostModel, size_bytes, world_size: int | None = None):
    """Seconds `model` predicts for a message of `size_bytes` (scalar or array) on `world_size` ranks.

    world_size defaults to the one the model was fitted at. alpha and beta are properties of the links,
    so predicting another world size is the point -- as long as the links stay the same kind.
    """
    n = world_size if world_size is not None else model.world_size
    if n is None:
        raise ValueError(f"predict: model for {model.algorithm} has no world size of its own: pass world_size=")
    steps, per_byte = cost(model.algorithm, 1.0, n)  # bytes moved are linear in the size
    sizes = np.asarray(size_bytes, dtype=float)
    if np.any(sizes < 0):
        raise ValueError("predict: sizes must be >= 0 bytes")
    t = model.alpha_s * steps + model.beta_s_per_byte * per_byte * sizes
    return float(t) if t.ndim == 0 else t


def fit(sizes_bytes, times_s, algorithm: str, world_size, backend: str = "unknown",
        device: str = "unknown") -> CostModel:
    """Fit alpha and beta to measured (size, time) pairs of `algorithm` by least squares.

    world_size is one int or one per measurement (fit across world sizes). The fit minimises the
    *relative* error, so 4 KiB messages (microseconds, where alpha shows) count as much as 64 MiB ones
    (where beta shows); alpha and beta are kept >= 0. Needs >= 2 measurements at >= 2 sizes.
    """
    name = _canonical(algorithm)
    sizes = np.asarray(sizes_bytes, dtype=float).ravel()
    times = np.asarray(times_s, dtype=float).ravel()
    worlds = np.broadcast_to(np.asarray(world_size), sizes.shape) if np.ndim(world_size) == 0 else \
        np.asarray(world_size).ravel()
    if not (len(sizes) == len(times) == len(worlds)):
        raise ValueError(f"fit: {len(sizes)} sizes, {len(times)} times and {len(worlds)} world sizes: "
                         f"give one of each per measurement")
    if len(sizes) < 2 or len(np.unique(sizes)) < 2:
        raise ValueError(f"fit: {name} needs at least 2 measurements at different sizes to separate alpha from "
                         f"beta, got {len(sizes)} (sizes {sorted(set(sizes.tolist()))}). Sweep more sizes.")
    if not np.all(np.isfinite(times)) or np.any(times <= 0):
        raise ValueError(f"fit: times must be positive seconds, got {times.tolist()}")
    counts = np.array([cost(name, s, int(n)) for s, n in zip(sizes, worlds)])  # columns: steps, bytes
    if not np.any(counts[:, 1] > 0):
        raise ValueError(f"fit: {name} moves no bytes at world size {sorted(set(worlds.tolist()))}: "
                         f"measure with at least 2 ranks")
    # Divide every row by its time: least squares on relative errors instead of absolute ones.
    a, y = counts / times[:, None], np.ones_like(times)
    coef = np.linalg.lstsq(a, y, rcond=None)[0]
    if np.any(coef < 0):  # a negative alpha or beta is noise, not physics: keep the term that fits better
        candidates = []
        for k in (0, 1):
            col, only = a[:, k], np.zeros(2)
            only[k] = max(float(col @ y / (col @ col)), 0.0) if col.any() else 0.0
            candidates.append(only)
        coef = min(candidates, key=lambda c: float(np.sum((a @ c - y) ** 2)))
    rel = a @ coef - y
    single = int(worlds[0]) if len(np.unique(worlds)) == 1 else None
    return CostModel(name, float(coef[0]), float(coef[1]), backend=backend, device=device, world_size=single,
                     n_points=len(sizes), rel_rmse=float(np.sqrt(np.mean(rel ** 2))))


def crossover_size(model_a: CostModel, model_b: CostModel, world_size: int | None = None) -> float | None:
    """The message size (bytes) at which model_a and model_b predict the same time, or None if they never do.

    Typically a = ring, b = recursive doubling (or a tree): below the crossover the algorithm with fewer
    steps wins, above it the one that moves fewer bytes. world_size defaults to model_a's.
    """
    n = world_size or model_a.world_size or model_b.world_size
    if n is None:
        raise ValueError("crossover_size: neither model has a world size of its own: pass world_size=")
    steps_a, per_a = cost(model_a.algorithm, 1.0, n)
    steps_b, per_b = cost(model_b.algorithm, 1.0, n)
    dt_fixed = model_b.alpha_s * steps_b - model_a.alpha_s * steps_a
    bytes_a, bytes_b = model_a.beta_s_per_byte * per_a, model_b.beta_s_per_byte * per_b
    dt_per_byte = bytes_a - bytes_b
    # Per-byte costs equal up to float rounding (e.g. a beta copied through from_link) are equal: a
    # "crossover" at 1e15 bytes from a difference in the 16th digit would be noise, not an answer.
    if abs(dt_per_byte) <= 1e-9 * max(abs(bytes_a), abs(bytes_b)):
        return None
    size = dt_fixed / dt_per_byte
    return float(size) if size > 0 and math.isfinite(size) else None


def fit_results(record: dict, ops=None, min_bytes: float = 0) -> dict[str, CostModel]:
    """A CostModel per op measured by a lab02 results record (its metrics["sweep"] rows).

    ops: which ops to fit (default: every op with >= 2 sizes); min_bytes: ignore smaller messages.
    """
    rows = record.get("metrics", {}).get("sweep")
    if not rows:
        raise ValueError(f"fit_results: record {record.get('run_id', '?')} of lab {record.get('lab', '?')} has no "
                         f"metrics['sweep'] rows: give it a lab02_allreduce results record")
    if record["world_size"] < 2:
        raise ValueError(f"fit_results: run {record.get('run_id', '?')} had world size {record['world_size']}, "
                         f"where collectives move nothing: rerun the lab with nproc >= 2")
    wanted = list(dict.fromkeys(r["op"] for r in rows)) if ops is None else list(ops)
    models = {}
    for op in wanted:
        pts = [(r["size_bytes"], r["time_s"]) for r in rows if r["op"] == op and r["size_bytes"] >= min_bytes]
        if ops is None and len({s for s, _ in pts}) < 2:
            continue
        models[op] = fit([s for s, _ in pts], [t for _, t in pts], op, record["world_size"],
                         backend=record.get("backend", "unknown"), device=record.get("device", "unknown"))
    return models


def data_parallel_speedup(step_s: float, comm_s: float, world_size: int, scaling: str) -> float:
    """Speedup of N data-parallel ranks over one, when the gradient all-reduce (comm_s, at this world size) does
    not overlap the compute (step_s: one rank's step time). A lower bound: overlap can only make it better.

        weak scaling (each rank keeps its batch, N x the work per step):   N x step_s / (step_s + comm_s)
        strong scaling (the total batch is split, 1/N of the work each):   step_s / (step_s / N + comm_s)
    """
    if scaling not in ("weak", "strong"):
        raise ValueError(f"scaling must be 'weak' or 'strong', got {scaling!r}")
    if world_size < 1 or step_s <= 0 or comm_s < 0:
        raise ValueError(f"need world_size >= 1, step_s > 0 and comm_s >= 0, got {world_size}, {step_s}, {comm_s}")
    comm = comm_s if world_size > 1 else 0.0
    if scaling == "weak":
        return world_size * step_s / (step_s + comm)
    return step_s / (step_s / world_size + comm)


SYNC_COLLECTIVES = {  # what each rank sends per step, in units of the model's bytes, by ring: see bytes_per_step
    "ddp": (("all_reduce", 1),),
    "zero1": (("reduce_scatter", 1), ("all_gather", 1)),  # ZeRO's P_os: DDP's volume, the update in between
    "zero1-allreduce": (("all_reduce", 1), ("all_gather", 1)),  # DistAdamW(zero_stage=1): keeps the whole gradient
    "zero2": (("reduce_scatter", 1), ("all_gather", 1)),
    "fsdp": (("all_gather", 2), ("reduce_scatter", 1)),  # gathered for forward and again for backward
    "fsdp-keep": (("all_gather", 1), ("reduce_scatter", 1)),  # reshard_after_forward=False: kept for backward
}


def bytes_per_step(strategy: str, model_bytes: float, world_size: int) -> float:
    """Bytes each rank sends per optimizer step to keep `model_bytes` of parameters in sync, ring algorithms.

        ddp     all-reduce the gradients                         2 (N-1)/N x model
        zero1   reduce-scatter, all-gather (ZeRO's P_os)          2 (N-1)/N x model
        zero1-allreduce  all-reduce, all-gather: DistAdamW(zero_stage=1), which leaves every rank the whole
                averaged gradient                                3 (N-1)/N x model
        zero2   reduce-scatter, all-gather                        2 (N-1)/N x model
        fsdp    all-gather twice (forward, backward), reduce-scatter  3 (N-1)/N x model: 1.5x DDP's
        fsdp-keep  FSDP keeping the gathered units for backward   2 (N-1)/N x model
    """
    if strategy not in SYNC_COLLECTIVES:
        raise ValueError(f"strategy must be one of {', '.join(SYNC_COLLECTIVES)}, got {strategy!r}")
    return sum(times * busbw_factor(op, world_size) * model_bytes for op, times in SYNC_COLLECTIVES[strategy])


# ----------------------------------------------------------------------------- tensor parallelism, per layer

def tensor_parallel_traffic(batch: int, seq_len: int, n_embd: int, tp: int, sequence: bool = False, *,
                            act_bytes: int = 4, grad_bytes: int = 4, bias: bool = True) -> dict:
    """The collectives one transformer block costs under tensor parallelism over `tp` ranks, for one micro-batch
    of `batch` sequences of `seq_len` tokens: {(phase, kind, bytes): count}, with bytes the collective's whole
    tensor (as nanodist.tp.record_traffic counts it). S = batch x seq_len x n_embd x act_bytes, the activations.

        TP  forward   2 all-reduces of S      (g after attention's and the MLP's row-parallel layer)
            backward  2 all-reduces of S      (f before their column-parallel layers)
        SP  forward   2 all-gathers of S (f) + 2 reduce-scatters of S (g)
            backward  2 all-gathers of S (g's gradient) + 2 reduce-scatters of S (f's gradient)
                      + 2 all-gathers of S: each column-parallel layer gathers its saved shard again for its
                        weight's gradient (it kept 1/tp of its input: SP's memory saving)
                      + one all-reduce per replicated parameter used on a rank's positions only (both LayerNorms'
                        weight and bias, the two row-parallel biases), of n_embd x grad_bytes each

    A ring all-reduce is a reduce-scatter and an all-gather, so SP's forward moves TP's bytes. With tp = 1
    nothing is sent: {}."""
    if tp == 1:
        return {}
    S = batch * seq_len * n_embd * act_bytes
    if not sequence:
        return {("forward", "all-reduce", S): 2, ("backward", "all-reduce", S): 2}
    out = {("forward", "all-gather", S): 2, ("forward", "reduce-scatter", S): 2,
           ("backward", "all-gather", S): 4, ("backward", "reduce-scatter", S): 2}
    out[("backward", "all-reduce", n_embd * grad_bytes)] = 6 if bias else 2
    return out


def ring_bytes(traffic: dict, tp: int) -> float:
    """Bytes each rank sends for `traffic` ({(phase, kind, bytes): count}) on a ring of tp ranks: 2(tp-1)/tp of
    an all-reduce's size, (tp-1)/tp of an all-gather's or a reduce-scatter's."""
    factor = {"all-reduce": "all_reduce", "all-gather": "all_gather", "reduce-scatter": "reduce_scatter"}
    return sum(count * busbw_factor(factor[kind], tp) * nbytes for (_, kind, nbytes), count in traffic.items())


def activation_bytes(batch: int, seq_len: int, n_embd: int, n_head: int, tp: int = 1, sequence: bool = False, *,
                     act_bytes: int = 4) -> dict:
    """What one block of the course's GPT saves for backward, per rank (bytes), with tensor parallelism over tp
    ranks and optionally sequence parallelism: the Megatron-LM activation formula (Korthikanti et al. 2022) for
    this model. Per token and channel (b s h = batch x seq_len x n_embd values):

        replicated under TP   4   the two LayerNorms' inputs, the qkv and fc layers' inputs
        split by TP          12   q, k, v (3), attention's output, which is proj's input (1), GELU's input (4),
                                  the MLP proj's input (4)
        no parallelism:  16 bsh      TP: (4 + 12/tp) bsh      TP + SP: 16/tp bsh   (x act_bytes)

    Megatron's per-layer 34 s b h + 5 a s^2 b is in bytes, fp16: the same 16 values at 2 bytes each, two 1-byte
    dropout masks (none here: dropout 0), and the attention's s x s scores with their softmax and dropout mask
    (the 5 a s^2 b), which the fused attention kernel never stores: it keeps one number per row instead (its
    logsumexp), and writes its output in (b, s, heads, d) order, so proj's input is a view of it, not a copy. The
    formula assumes one dtype throughout (fp32 here; under bf16 autocast the residual stream and the LayerNorms'
    inputs stay fp32). Each LayerNorm
    keeps two numbers per row (mean and 1/std). These small terms: b x s x (heads/tp + 4 (/tp under SP)) fp32
    values. Returns {"main": ..., "small": ..., "total": ...}."""
    bsh = batch * seq_len * n_embd
    main = (16 * bsh / tp if sequence else (4 + 12 / tp) * bsh) * act_bytes
    rows = batch * seq_len
    small = 4 * (rows * n_head / tp + 4 * rows / (tp if sequence else 1))
    return {"main": main, "small": small, "total": main + small}


# ----------------------------------------------------------------------------- how often to checkpoint

def young_daly_interval(save_s: float, mtbf_s: float) -> float:
    """Young's checkpoint interval: seconds of training between saves that minimise the expected time lost,
    sqrt(2 C M) for a save that blocks training C seconds and failures every M seconds on average (Young 1974;
    Daly 2006 refines it when C is not small against M: use it while C < M / 2)."""
    if not save_s > 0 or not mtbf_s > 0:
        raise ValueError(f"the save time and the mean time between failures must be positive seconds, got "
                         f"{save_s!r} and {mtbf_s!r}")
    return math.sqrt(2.0 * save_s * mtbf_s)


def checkpoint_overhead(interval_s: float, save_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """Expected fraction of the run's time lost to checkpointing every `interval_s` seconds of training, to first
    order: the saves (save_s / interval_s) plus, per failure (one every mtbf_s), the work since the last save
    (half an interval on average) and the restart."""
    if not interval_s > 0 or not mtbf_s > 0 or save_s < 0 or restart_s < 0:
        raise ValueError(f"need interval_s > 0, mtbf_s > 0 and non-negative save_s and restart_s, got "
                         f"{interval_s!r}, {mtbf_s!r}, {save_s!r}, {restart_s!r}")
    return save_s / interval_s + (interval_s / 2.0 + restart_s) / mtbf_s
