"""Scaling projections: what a data-parallel strategy does on a cluster you do not have, from parameters you can
name -- and how well that holds against runs someone measured.

    model = published("playbook_dp").model                     # a Transformer: layers, hidden, heads, FFN, vocab
    p = project(model, CLUSTERS["dgx-h100-ib"], gpus=64, strategy="fsdp", micro_batch=1, grad_accum=4,
                compute_efficiency=0.38, overlap=1.0)
    p.tokens_per_s_per_gpu, p.mfu, p.step_s, p.exposed_comm_s, p.memory_GB, p.bottleneck

One optimizer step, per GPU:

    compute  = tokens per GPU per step x FLOPs per token / (peak FLOP/s x compute_efficiency)
    comm     = for each collective the strategy runs: steps x latency + busbw_factor x bytes / bus bandwidth
               (nanodist.costmodel's ring counts; bus bandwidth as nccl-tests defines it)
    hidden   = overlap x the compute that communication can run under (`window`):
               ddp, zero1: the gradient reduction, once a step, under the last micro-batch's backward (2/3 of its
               compute; earlier micro-batches do not synchronise, and keep whole gradients);
               zero2: a reduce-scatter under every micro-batch's backward (only the shard of the gradient is kept);
               ZeRO's parameter all-gather after the update is never hidden;
               fsdp: two all-gathers and a reduce-scatter every micro-batch, under all the step's compute
               (prefetching); with full recomputation the backward is 3/4 of the compute, not 2/3
    update   = the AdamW update: 24 + gradient + weight-copy bytes of HBM traffic per parameter the GPU updates
               (30 with fp32 gradients and bf16 weights) / HBM bandwidth
    step     = compute + update + comm - min(hidden, the comm that can hide)

`compute_efficiency` is the fraction of the GPU's peak the model's FLOPs reach when nothing waits for the network
(MFU of the computation alone); `overlap` (0..1) the fraction of the window communication really hides in. Neither
comes from a datasheet: each is *calibrated*, from runs that are not the ones a projection is judged on
(`calibrate`). Every number a projection uses says where it came from: a GPU's and a link's `source`, a
calibration's rows. The three kinds of source: fitted to the reader's own lab runs (`Link.from_costmodel`),
committed reference results, and published hardware figures and measurements (`published()`, cited in
labs/published/).

Memory per GPU: the model states of nanodist.memory's ZeRO formula (mixed precision AdamW, the gradient in the
dtype it is reduced in) plus activations (`Transformer.activation_bytes`: what each layer keeps for its backward
in 16 bits, counted as Korthikanti et al. 2022 do, with flash attention; with full recomputation only each
layer's input) and the loss's logits.

Latency: a `Cluster` may carry one (`Latency`: NCCL's own tuning model, per call and per hop, inside a node and
across nodes); then every call -- each DDP bucket, each FSDP unit -- pays it, and the all-reduce runs as a ring, a
tree, a hierarchical (2-D) ring or whichever of them is fastest (`Cluster.all_reduce_time`). The clusters of
CLUSTERS carry none: their bandwidths are large-message figures, and charging NCCL's tuning latencies per 25 MB
bucket on top of the Playbook's measured bandwidths misses its 128- and 256-GPU points by 30 % or more (Chapter 8
shows it), so the projections the chapter checks count bandwidth only.
"""
from __future__ import annotations

import json
import math
import random
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from . import costmodel
from .memory import zero_memory_bytes
from .results import REPO_ROOT
from .table import Table

PUBLISHED = REPO_ROOT / "labs" / "published" / "scaling.json"
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
_STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3}
_RING = {"all_reduce": "ring_all_reduce", "reduce_scatter": "ring_reduce_scatter", "all_gather": "ring_all_gather"}


@dataclass(frozen=True)
class Transformer:
    """A decoder-only transformer's shape: all a projection needs of a model."""

    name: str
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    seq_len: int
    kv_heads: int | None = None  # None: one key/value head per query head (multi-head attention)
    tied: bool = True  # the output layer is the token embedding
    gated: bool = True  # a gated FFN (SwiGLU, Llama): three matrices; False: two (GPT-2)
    source: str = ""

    def __post_init__(self):
        for name in ("layers", "hidden", "heads", "ffn", "vocab", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Transformer {self.name!r}: {name} must be a positive integer, got {value!r}")
        if self.kv_heads is not None and (not isinstance(self.kv_heads, int) or self.kv_heads < 1):
            raise ValueError(f"Transformer {self.name!r}: kv_heads must be a positive integer or None, "
                             f"got {self.kv_heads!r}")
        if self.hidden % self.heads or self.heads % (self.kv_heads or self.heads):
            raise ValueError(f"Transformer {self.name!r}: heads ({self.heads}) must divide hidden ({self.hidden}), "
                             f"and kv_heads ({self.kv_heads}) must divide heads")

    @property
    def matmul_params(self) -> int:
        """Weights every token multiplies: attention's q, k, v and output projections, the FFN, the output layer."""
        kv = self.hidden // self.heads * (self.kv_heads or self.heads)
        per_layer = 2 * self.hidden * self.hidden + 2 * self.hidden * kv + (3 if self.gated else 2) * self.hidden * self.ffn
        return self.layers * per_layer + self.vocab * self.hidden

    @property
    def params(self) -> int:
        """Every parameter: the matmul weights, the token embedding unless tied, two RMSNorm gains a layer and a final one."""
        return self.matmul_params + (0 if self.tied else self.vocab * self.hidden) + (2 * self.layers + 1) * self.hidden

    def flops_per_token(self) -> float:
        """Training FLOPs per token, forward and backward: 6 per matmul weight, plus attention's 12 L h s (PaLM,
        appendix B; the same count as nanodist.model.GPT.flops_per_token)."""
        return 6 * self.matmul_params + 12 * self.layers * self.hidden * self.seq_len

    def activation_bytes(self, micro_batch: int, recompute: bool = False, tp: int = 1,
                         sequence_parallel: bool = False) -> float:
        """Bytes one micro-batch keeps for its backward on one GPU, 16-bit, counted as Korthikanti et al. (2022)
        count them but with flash attention (no s x s scores) and no dropout, per layer:

            attention   its input (2 s b h), q and the output projection's input (4 s b h); k and v: 4 s b kv
            two norms   their inputs: 4 s b h
            FFN         its input: 2 s b h; gated (SwiGLU): gate, up, activation, product: 8 s b ffn;
                        plain (GELU): the up projection and the activation: 4 s b ffn

        (GPT-2's shape, ffn = 4h: 32 s b h, Korthikanti's 34 less the dropout masks; Llama's with ffn = 4h: 48).
        With full recomputation a layer keeps only its input, 2 s b h. Plus the loss: bf16 logits, their fp32
        copy and its gradient, 10 s b V.

        Tensor parallelism over `tp` GPUs (Megatron's, as nanodist.tp) splits what lies between a column- and a
        row-parallel layer -- q, k, v, the output projection's input, the FFN's inner activations -- and the
        logits (a vocabulary-parallel head); the norms' inputs and the two blocks' inputs (8 s b h) stay whole on
        every GPU unless `sequence_parallel`, which splits them (and a recomputed layer's input) along the
        sequence: everything / tp."""
        sb = self.seq_len * micro_batch
        kv = self.hidden // self.heads * (self.kv_heads or self.heads)
        whole = 8 * self.hidden  # the norms' inputs and the attention's and the FFN's inputs
        split = 4 * self.hidden + 4 * kv + (8 if self.gated else 4) * self.ffn
        if recompute:
            per_layer = 2 * self.hidden / (tp if sequence_parallel else 1)
        else:
            per_layer = (whole + split) / tp if sequence_parallel else whole + split / tp
        return self.layers * sb * per_layer + 10 * sb * self.vocab / tp


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float  # dense bf16 tensor-core rate, FLOP/s
    memory_GB: float  # HBM, 10^9 bytes
    source: str = ""
    hbm_GBps: float | None = None  # HBM bandwidth, 10^9 bytes/s (None: the optimizer step's time is not projected)


# Bytes of HBM traffic per parameter one AdamW update moves with fp32 master weights, fused (one pass), besides the
# gradient it reads and the compute-dtype copy of the weight it writes: the fp32 weight and two moments, read and
# written. With fp32 gradients and a bf16 copy: 24 + 4 + 2 = 30.
ADAMW_STATE_BYTES_PER_PARAM = 24


@dataclass(frozen=True)
class Latency:
    """What a collective pays per call before any byte counts: NCCL's own tuning model (protocol Simple, the one
    large messages use), as src/graph/tuning.cc states it -- a base latency per algorithm and a latency per hop,
    inside a node (NVLink or PCIe) and across nodes (the network):

        ring all-reduce   base + (2(N - 1) - 2 nodes) x intra + 2 nodes x inter   (2 nodes: 0 on one node)
        tree all-reduce   2 x ((GPUs per node - 1) x intra + log2(nodes) x inter)  (NCCL's double binary tree;
                          log2 rounded down, as NCCL's log2i)
        ring reduce-scatter / all-gather   base + (N - nodes) x intra + (nodes - 1) x inter

    These are the figures NCCL's tuner uses to choose an algorithm, not measurements of a cluster; left out are
    the topology's own inter-node latency and the network's per-step post overhead, which NCCL adds on top."""

    ring_base_s: float
    ring_intra_s: float
    ring_inter_s: float
    tree_intra_s: float
    tree_inter_s: float
    source: str = ""

    def __post_init__(self):
        bad = {k: v for k, v in vars(self).items() if k != "source" and not (isinstance(v, (int, float)) and v >= 0)}
        if bad:
            raise ValueError(f"Latency: every latency must be a number of seconds >= 0, got {bad}")


def _check_gpus(gpus) -> None:
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus must be a positive integer, got {gpus!r}")


_NCCL_TUNING = "NCCL src/graph/tuning.cc at b6475625 (2.19 era), protocol Simple (labs/published/SOURCES.md)"
NCCL_NVLINK = Latency(8.4e-6, 3.4e-6, 14.0e-6, 28e-6, 28e-6, source=_NCCL_TUNING + ": NVLink and network hops")
NCCL_PCIE = Latency(8.4e-6, 5.7e-6, 14.0e-6, 28e-6, 28e-6, source=_NCCL_TUNING + ": PCIe and network hops")
ALL_REDUCE_ALGORITHMS = ("ring", "tree", "hierarchical")


@dataclass(frozen=True)
class Link:
    """What a ring collective reaches over a kind of link: bus bandwidth per GPU (nccl-tests' busbw; time =
    busbw_factor x bytes / busbw) and a latency per ring step."""

    name: str
    busbw_GBps: float
    latency_s: float = 0.0
    source: str = ""

    def __post_init__(self):
        if not self.busbw_GBps > 0 or self.latency_s < 0:
            raise ValueError(f"Link {self.name!r}: need busbw_GBps > 0 and latency_s >= 0, "
                             f"got {self.busbw_GBps!r} and {self.latency_s!r}")

    def time(self, collective: str, size_bytes: float, gpus: int) -> float:
        """Seconds one ring `collective` (all_reduce, reduce_scatter, all_gather) of `size_bytes` takes on `gpus`."""
        if collective not in _RING:
            raise ValueError(f"collective must be one of {', '.join(_RING)}, got {collective!r}")
        return costmodel.CostModel.from_link(_RING[collective], self.latency_s, self.busbw_GBps).predict(size_bytes, gpus)

    @classmethod
    def from_costmodel(cls, model: costmodel.CostModel, name: str | None = None) -> "Link":
        """The link a fitted alpha-beta model measured (nanodist.costmodel.fit_results of a lab02 run)."""
        return cls(name or f"{model.backend} on {model.device}", model.bandwidth_GBps, model.alpha_s,
                   source=f"fitted: {model.algorithm} on {model.backend} ({model.device}), {model.n_points} "
                          f"sizes at {model.world_size} ranks")


@dataclass(frozen=True)
class Cluster:
    """GPUs in nodes: one link inside a node, another across nodes -- a bus bandwidth, or one measured for each
    number of nodes (`by_nodes`, interpolated between the node counts measured, never beyond them)."""

    name: str
    gpu: GPU
    gpus_per_node: int
    intra: Link
    inter: Link | None = None
    by_nodes: tuple = ()  # ((nodes, busbw GB/s), ...): measured, for every node count from 1 up
    source: str = ""
    latency: Latency | None = None  # None: collectives cost bandwidth only
    measured_bytes: float = 256e6  # the all-reduce size by_nodes was measured with (its latency is in the figure)

    def __post_init__(self):
        counts = [n for n, _ in self.by_nodes]
        if self.by_nodes and (counts[0] != 1 or counts != sorted(set(counts))):
            raise ValueError(f"Cluster {self.name!r}: by_nodes must start at 1 node and grow, got node counts {counts}")
        if not self.measured_bytes > 0:
            raise ValueError(f"Cluster {self.name!r}: measured_bytes must be positive, got {self.measured_bytes!r}")
        for n, bw in self.by_nodes:  # a latency the measurements cannot hold fails here, not at a later projection
            self._without_latency(n, bw)

    def _without_latency(self, nodes: int, busbw_GBps: float) -> float:
        """A bus bandwidth measured with one all-reduce of `measured_bytes` at `nodes` nodes, less that call's
        latency (the faster of ring and tree, the two algorithms NCCL's tuner picks between for an all-reduce; the
        hierarchical one is this module's, not NCCL's) when the cluster models latency."""
        if self.latency is None or nodes == 1:
            return busbw_GBps
        gpus = nodes * self.gpus_per_node
        f = costmodel.busbw_factor("all_reduce", gpus)
        took = f * self.measured_bytes / (busbw_GBps * 1e9)
        lat = min(self.all_reduce_latency(gpus, a) for a in ("ring", "tree"))
        if lat >= took:
            raise ValueError(f"{self.name}: at {nodes} nodes the measured all-reduce took {took:.2e} s, no more "
                             f"than the modelled latency ({lat:.2e} s): the latency model does not fit it")
        return f * self.measured_bytes / (took - lat) / 1e9

    def all_reduce_latency(self, gpus: int, algorithm: str) -> float:
        """Seconds one all-reduce call on `gpus` GPUs pays in latency under `algorithm` (ring, tree,
        hierarchical; see Latency). 0 when the cluster models no latency."""
        if algorithm not in ALL_REDUCE_ALGORITHMS:
            raise ValueError(f"algorithm must be one of {', '.join(ALL_REDUCE_ALGORITHMS)}, got {algorithm!r}")
        _check_gpus(gpus)
        if self.latency is None or gpus == 1:
            return 0.0
        lat, nodes = self.latency, math.ceil(gpus / self.gpus_per_node)
        local = min(gpus, self.gpus_per_node)
        if algorithm == "ring":
            inter = 2 * nodes if nodes > 1 else 0
            return lat.ring_base_s + (2 * (gpus - 1) - inter) * lat.ring_intra_s + inter * lat.ring_inter_s
        if algorithm == "tree":
            return 2 * ((local - 1) * lat.tree_intra_s + (nodes.bit_length() - 1) * lat.tree_inter_s)  # log2, floored
        # hierarchical: a ring reduce-scatter inside the node, a ring all-reduce of the shard across nodes (one
        # ring per local rank, side by side), a ring all-gather inside the node
        inside = 2 * (lat.ring_base_s + (local - 1) * lat.ring_intra_s) if local > 1 else 0.0
        across = lat.ring_base_s + 2 * (nodes - 1) * lat.ring_inter_s if nodes > 1 else 0.0
        return inside + across

    def all_reduce_time(self, size_bytes: float, gpus: int, algorithm: str = "ring", calls: int = 1) -> dict:
        """One all-reduce of `size_bytes` in all, split into `calls` equal calls, on `gpus` GPUs under `algorithm`:
        {"latency_s", "bandwidth_s", "s"}.

            ring          latency: see Latency;  bandwidth: 2 (N - 1)/N x S / busbw of the ring over N GPUs
            tree          NCCL's tree moves 2 S through each GPU's link: 2 S / busbw
            hierarchical  reduce-scatter and all-gather inside the node, (g - 1)/g x S / NVLink's busbw each, and an
                          all-reduce of S/g across nodes on each of the g local ranks' rings, which share the node's
                          network: 2 (n - 1)/n x S / the network's busbw
        The bandwidths are the ones `link` gives (measured by node count where the cluster has them)."""
        _check_gpus(gpus)
        if not isinstance(calls, int) or calls < 1:
            raise ValueError(f"calls must be a positive integer, got {calls!r}")
        latency = calls * self.all_reduce_latency(gpus, algorithm)
        link = self.link(gpus)
        nodes, local = math.ceil(gpus / self.gpus_per_node), min(gpus, self.gpus_per_node)
        if algorithm == "ring" or gpus == 1:
            bandwidth = costmodel.busbw_factor("all_reduce", gpus) * size_bytes / (link.busbw_GBps * 1e9)
        elif algorithm == "tree":
            bandwidth = 2 * size_bytes / (link.busbw_GBps * 1e9)
        else:
            inside = 2 * (local - 1) / local * size_bytes / (self.intra.busbw_GBps * 1e9)
            across = 2 * (nodes - 1) / nodes * size_bytes / (link.busbw_GBps * 1e9) if nodes > 1 else 0.0
            bandwidth = inside + across
        return {"latency_s": latency, "bandwidth_s": bandwidth, "s": latency + bandwidth}

    def ring_latency(self, collective: str, gpus: int) -> float:
        """Latency of one ring call of `collective`: an all-reduce's (see Latency); a reduce-scatter or an
        all-gather runs N - 1 steps of which nodes - 1 cross between nodes (NCCL's count)."""
        if collective not in _RING:
            raise ValueError(f"collective must be one of {', '.join(_RING)}, got {collective!r}")
        if collective == "all_reduce":
            return self.all_reduce_latency(gpus, "ring")
        _check_gpus(gpus)
        if self.latency is None or gpus == 1:
            return 0.0
        lat, nodes = self.latency, math.ceil(gpus / self.gpus_per_node)
        return lat.ring_base_s + (gpus - nodes) * lat.ring_intra_s + (nodes - 1) * lat.ring_inter_s

    def link(self, gpus: int) -> Link:
        """The link a ring over `gpus` GPUs runs at: the node's own for one node; across nodes, the measured
        bandwidth at that node count, else the slower of the node's link and the network's."""
        if not isinstance(gpus, int) or gpus < 1:
            raise ValueError(f"gpus must be a positive integer, got {gpus!r}")
        nodes = math.ceil(gpus / self.gpus_per_node)
        if nodes == 1:
            return self.intra
        if self.by_nodes:
            measured = {n: self._without_latency(n, bw) for n, bw in self.by_nodes}
            if nodes in measured:
                return Link(f"{self.name}, {nodes} nodes (measured)", measured[nodes], source=self.source)
            counts = sorted(measured)
            if nodes > counts[-1]:
                raise ValueError(f"{self.name}: bandwidth measured for 1 to {counts[-1]} nodes, not {nodes} "
                                 f"({gpus} GPUs): a projection there would extrapolate a measurement")
            lo = max(c for c in counts if c < nodes)
            hi = min(c for c in counts if c > nodes)
            w = math.log(nodes / lo) / math.log(hi / lo)  # log-log between the node counts measured
            bw = math.exp((1 - w) * math.log(measured[lo]) + w * math.log(measured[hi]))
            return Link(f"{self.name}, {nodes} nodes (interpolated)", bw, source=self.source)
        if self.inter is None:
            raise ValueError(f"{self.name}: one node of {self.gpus_per_node} GPUs, no network: {gpus} GPUs do not fit")
        slower = min((self.intra, self.inter), key=lambda link: link.busbw_GBps)
        return Link(f"{self.intra.name} + {self.inter.name}", slower.busbw_GBps,
                    max(self.intra.latency_s, self.inter.latency_s), source=slower.source)


@dataclass(frozen=True)
class Projection:
    """One projected configuration. Every field is a projection, not a measurement."""

    model: str
    cluster: str
    strategy: str
    gpus: int
    micro_batch: int
    grad_accum: int
    link: Link
    tokens_per_gpu_step: float  # a GPU's share: a data-parallel rank's tokens / tp
    compute_s: float
    optimizer_s: float  # the AdamW update, bound by HBM bandwidth (0 when the GPU's is not given)
    comm_s: float  # all communication of one step, hidden or not
    exposed_comm_s: float  # what the step waits for
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    memory_GB: float
    fits: bool
    recompute: bool = False  # full activation recomputation
    collectives: dict = field(repr=False, default_factory=dict)  # collective -> bytes each one moves per step
    tp: int = 1  # tensor-parallel size (inside a node); the data-parallel strategy runs over gpus / tp
    sequence_parallel: bool = False
    tp_comm_s: float = 0.0  # tensor parallelism's collectives (part of comm_s, all exposed)

    @property
    def bottleneck(self) -> str:
        """"memory" if the states and activations do not fit, "communication" when the step waits for the network
        at least a tenth of its time, else "compute"."""
        if not self.fits:
            return "memory"
        return "communication" if self.exposed_comm_s >= 0.1 * self.step_s else "compute"

    def row(self) -> dict:
        """A table row, rounded for reading."""
        return {"strategy": self.strategy + (f" x TP {self.tp}" + (" + SP" if self.sequence_parallel else "")
                                             if self.tp > 1 else ""), "GPUs": self.gpus, "link": self.link.name,
                "micro-batch x accumulation": f"{self.micro_batch} x {self.grad_accum}",
                "step (s)": round(self.step_s, 3), "exposed comm (s)": round(self.exposed_comm_s, 3),
                "tokens/s/GPU": round(self.tokens_per_s_per_gpu), "MFU %": round(100 * self.mfu, 1),
                "memory/GPU (GB)": round(self.memory_GB, 1), "recompute": self.recompute,
                "bottleneck": self.bottleneck}


def communication(strategy: str, params: int, gpus: int, link: Link, micro_batches: int = 1,
                  grad_bytes: float = 4, param_bytes: float = 2, cluster: Cluster | None = None,
                  algorithm: str = "best", bucket_bytes: float = 25 * 2**20, units: int = 1) -> dict:
    """Seconds of each collective `strategy` runs in one optimizer step on `gpus` ranks, and which of them can hide
    under compute: {"hideable": [...], "exposed": [...]} of (collective, bytes, seconds).

        ddp     all-reduce the gradients once (the last micro-batch)          hideable
        zero1   reduce-scatter the gradients once; all-gather the updated
                parameters after the update                                   hideable; exposed
        zero2   reduce-scatter every micro-batch's gradients (only the shard
                is kept); all-gather the updated parameters                   hideable; exposed
        fsdp    every micro-batch: all-gather the parameters for forward and
                again for backward, reduce-scatter the gradients              all hideable
    Gradients move in `grad_bytes` per element, parameters in `param_bytes`.

    With a `cluster` that models latency, every call pays it: DDP and ZeRO send buckets of `bucket_bytes`
    (DDP's 25 MiB by default, torch's bucket_cap_mb), FSDP one call per unit (`units`: its wrapped layers) for each collective; the
    all-reduce runs under `algorithm` (ring, tree, hierarchical, or "best": the fastest of them for this size, as
    NCCL's tuner chooses), reduce-scatter and all-gather as rings.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be a positive integer, got {micro_batches!r}")
    grads, weights = params * grad_bytes, params * param_bytes

    if algorithm not in ALL_REDUCE_ALGORITHMS + ("best",):
        raise ValueError(f"algorithm must be one of {', '.join(ALL_REDUCE_ALGORITHMS)} or best, got {algorithm!r}")
    if not bucket_bytes > 0 or not isinstance(units, int) or units < 1:
        raise ValueError(f"need bucket_bytes > 0 and units a positive integer, got {bucket_bytes!r} and {units!r}")

    def op(collective: str, size: float, times: int = 1) -> tuple:
        if cluster is None or cluster.latency is None:
            return collective, times * size, times * link.time(collective, size, gpus)
        calls = units if strategy == "fsdp" else max(1, math.ceil(size / bucket_bytes))
        if collective == "all_reduce":
            algos = ALL_REDUCE_ALGORITHMS if algorithm == "best" else (algorithm,)
            seconds = min(cluster.all_reduce_time(size, gpus, a, calls)["s"] for a in algos)
        else:
            seconds = calls * cluster.ring_latency(collective, gpus) + \
                costmodel.busbw_factor(collective, gpus) * size / (link.busbw_GBps * 1e9)
        return collective, times * size, times * seconds

    if strategy == "ddp":
        return {"hideable": [op("all_reduce", grads)], "exposed": []}
    if strategy == "zero1":
        return {"hideable": [op("reduce_scatter", grads)], "exposed": [op("all_gather", weights)]}
    if strategy == "zero2":
        return {"hideable": [op("reduce_scatter", grads, micro_batches)], "exposed": [op("all_gather", weights)]}
    return {"hideable": [op("all_gather", weights, 2 * micro_batches), op("reduce_scatter", grads, micro_batches)],
            "exposed": []}


def optimizer_seconds(params: int, gpus: int, strategy: str, gpu: GPU, grad_bytes: float = 4,
                      param_bytes: float = 2) -> float:
    """The AdamW update's time on one GPU: for each parameter the GPU updates (all of them under DDP; its 1/N
    shard under ZeRO and FSDP), ADAMW_STATE_BYTES_PER_PARAM + grad_bytes (the gradient read) + param_bytes (the
    compute copy written) bytes of HBM traffic, at the GPU's HBM bandwidth. 0 when the GPU does not say its
    bandwidth."""
    if gpu.hbm_GBps is None:
        return 0.0
    local = params if strategy == "ddp" else params / gpus
    return (ADAMW_STATE_BYTES_PER_PARAM + grad_bytes + param_bytes) * local / (gpu.hbm_GBps * 1e9)


def window(strategy: str, grad_accum: int, recompute: bool = False) -> float:
    """The fraction of a step's compute that `strategy`'s hideable communication can run under: the backward is
    2/3 of the compute (3/4 with full recomputation, which runs the forward again inside it); DDP and ZeRO-1 sync
    under the last micro-batch's backward only, ZeRO-2 under every micro-batch's, FSDP under all of the compute."""
    backward = 3 / 4 if recompute else 2 / 3
    return {"ddp": backward / grad_accum, "zero1": backward / grad_accum, "zero2": backward, "fsdp": 1.0}[strategy]


def tensor_parallel_seconds(model: Transformer, cluster: Cluster, tp: int, micro_batch: int, grad_accum: int,
                            sequence_parallel: bool = False, recompute: bool = False, act_bytes: float = 2) -> float:
    """Seconds one GPU spends per step in tensor parallelism's collectives, inside a node: for every micro-batch
    and layer, what costmodel.tensor_parallel_traffic counts (2 all-reduces of the activations forward and 2
    backward; with SP all-gathers and reduce-scatters, one more pair of all-gathers backward), 16-bit, on the
    node's link; a recomputed forward repeats the forward's. All of it is exposed here: the collectives sit
    between a layer's matmuls (Megatron overlaps some of them; this projection does not)."""
    if tp == 1:
        return 0.0
    per_layer = costmodel.tensor_parallel_traffic(micro_batch, model.seq_len, model.hidden, tp, sequence_parallel,
                                                  act_bytes=act_bytes, grad_bytes=4)
    kinds = {"all-reduce": "all_reduce", "all-gather": "all_gather", "reduce-scatter": "reduce_scatter"}
    seconds = 0.0
    for (phase, kind, nbytes), count in per_layer.items():
        times = count * (2 if recompute and phase == "forward" else 1)
        seconds += times * cluster.intra.time(kinds[kind], nbytes, tp)
    return seconds * model.layers * grad_accum


def project(model: Transformer, cluster: Cluster, gpus: int, strategy: str, micro_batch: int, grad_accum: int,
            compute_efficiency: float, overlap: float, grad_bytes: float = 4, param_bytes: float = 2,
            recompute: bool = False, algorithm: str = "best", bucket_MB: float = 25, tp: int = 1,
            sequence_parallel: bool = False) -> Projection:
    """Project one optimizer step of `strategy` on `gpus` GPUs of `cluster` (see the module's docstring).
    `algorithm` and `bucket_MB` (MiB, as torch's bucket_cap_mb) matter only on a cluster that models latency (see
    `communication`).

    tp > 1: a 2-D mesh. Tensor parallelism over tp GPUs of one node (Chapter 9) splits every layer's matmuls and
    parameters; `strategy` runs over the gpus / tp data-parallel ranks, on the parameters' 1/tp, through the
    network as before. A data-parallel rank's micro_batch x grad_accum sequences are computed by its tp GPUs
    together: each does 1/tp of the FLOPs, and waits for TP's collectives (`tensor_parallel_seconds`)."""
    for name, value in (("micro_batch", micro_batch), ("grad_accum", grad_accum), ("tp", tp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not 0 < compute_efficiency <= 1 or not 0 <= overlap <= 1:
        raise ValueError(f"need 0 < compute_efficiency <= 1 and 0 <= overlap <= 1, "
                         f"got {compute_efficiency!r} and {overlap!r}")
    if gpus % tp or tp > cluster.gpus_per_node or model.heads % tp:
        raise ValueError(f"tp={tp} must divide the GPUs ({gpus}) and the heads ({model.heads}) and stay inside a node "
                         f"({cluster.gpus_per_node} GPUs): its collectives run on every layer's critical path")
    if sequence_parallel and tp == 1:
        raise ValueError("sequence_parallel splits the sequence over the tensor-parallel GPUs: give tp > 1 with it")
    dp = gpus // tp
    link = cluster.link(gpus)
    tokens = micro_batch * grad_accum * model.seq_len  # one data-parallel rank's, shared by its tp GPUs
    compute = tokens * model.flops_per_token() / tp / (cluster.gpu.peak_flops * compute_efficiency)
    if recompute:  # the forward runs again in the backward: 8 FLOPs per weight and token where 6 were counted
        compute *= 4 / 3
    params = model.params if tp == 1 else model.params / tp  # what each GPU holds before the data-parallel strategy shards it further
    comm = communication(strategy, params, dp, link, grad_accum, grad_bytes, param_bytes, cluster=cluster,
                         algorithm=algorithm, bucket_bytes=bucket_MB * 2**20, units=model.layers + 1) if dp > 1 \
        else {"hideable": [], "exposed": []}
    tp_s = tensor_parallel_seconds(model, cluster, tp, micro_batch, grad_accum, sequence_parallel, recompute)
    hideable = sum(s for _, _, s in comm["hideable"])
    exposed = sum(s for _, _, s in comm["exposed"]) + tp_s
    waits = exposed + hideable - min(overlap * window(strategy, grad_accum, recompute) * compute, hideable)
    update = optimizer_seconds(params, dp, strategy, cluster.gpu, grad_bytes, param_bytes)
    step = compute + update + waits
    states = zero_memory_bytes(params, dp, _STAGE[strategy], param_bytes=param_bytes, grad_bytes=grad_bytes,
                               optim_bytes_per_param=12)["total"]
    memory = (states + model.activation_bytes(micro_batch, recompute, tp, sequence_parallel)) / 1e9
    per_gpu = tokens if tp == 1 else tokens / tp
    return Projection(
        model=model.name, cluster=cluster.name, strategy=strategy, gpus=gpus, micro_batch=micro_batch,
        grad_accum=grad_accum, link=link, tokens_per_gpu_step=per_gpu, compute_s=compute, optimizer_s=update,
        comm_s=hideable + exposed, exposed_comm_s=waits, step_s=step, tokens_per_s_per_gpu=per_gpu / step,
        mfu=per_gpu / step * model.flops_per_token() / cluster.gpu.peak_flops, memory_GB=memory,
        fits=memory <= cluster.gpu.memory_GB, recompute=recompute,
        collectives={c: b for c, b, _ in comm["hideable"] + comm["exposed"]}, tp=tp,
        sequence_parallel=sequence_parallel, tp_comm_s=tp_s)


# ----------------------------------------------------------------------------- calibration and checking

@dataclass(frozen=True)
class Calibration:
    """compute_efficiency and overlap, and the measured rows they were taken from (never the judged ones)."""

    compute_efficiency: float
    overlap: float | None  # None: no calibration row can tell (its communication hides either way)
    rows: tuple
    how: str


def calibrate(model: Transformer, cluster: Cluster, strategy: str, rows, grad_bytes: float = 4,
              param_bytes: float = 2, overlap: float | None = None, algorithm: str = "best",
              bucket_MB: float = 25) -> Calibration:
    """compute_efficiency and overlap from measured rows (gpus, micro_batch, grad_accum, tokens_per_s_per_gpu, ...).

    The anchor is the row whose communication is the smallest share of its step. For each overlap in [0, 1]
    (steps of 0.01), the compute efficiency is the one that makes the anchor's projected step exactly its
    measured one; the overlap kept is the one whose projections of all rows have the least squared log error.
    The overlap is None when the rows cannot tell (one row, or the error the same for every overlap): then
    calibrate again with overlap= given (0 and 1 bracket what any overlap would project).
    """
    rows = [tuple(r) for r in rows]
    if not rows:
        raise ValueError("calibrate: no measured rows")

    def comm(r) -> tuple[float, float]:  # (hideable, exposed: the update's time counted in)
        c = communication(strategy, model.params, r[0], cluster.link(r[0]), r[2], grad_bytes, param_bytes,
                          cluster=cluster, algorithm=algorithm, bucket_bytes=bucket_MB * 2**20,
                          units=model.layers + 1) if r[0] > 1 else {"hideable": [], "exposed": []}
        return sum(x[2] for x in c["hideable"]), sum(x[2] for x in c["exposed"]) + \
            optimizer_seconds(model.params, r[0], strategy, cluster.gpu, grad_bytes, param_bytes)

    def step(r) -> float:
        return r[1] * r[2] * model.seq_len / r[3]

    anchor = min(rows, key=lambda r: sum(comm(r)) / step(r))
    hideable, exposed = comm(anchor)
    k = window(strategy, anchor[2])  # the hiding window, as a fraction of the compute

    def efficiency(overlap: float) -> float:
        compute = step(anchor) - exposed  # everything hides (overlap x window >= hideable) ...
        if overlap * k * compute < hideable:  # ... or only overlap x window of it does
            compute = (step(anchor) - exposed - hideable) / (1 - overlap * k) if overlap * k < 1 else 0.0
        if compute <= 0:
            raise ValueError(f"calibrate: the anchor row {anchor} is no slower than its own communication: with "
                             f"this link and overlap {overlap:g} no compute time is left; check the link's bandwidth")
        e = anchor[1] * anchor[2] * model.seq_len * model.flops_per_token() / (cluster.gpu.peak_flops * compute)
        if e > 1:
            raise ValueError(f"calibrate: the anchor row {anchor} would run at {e:.2f} x the GPU's peak: check "
                             f"the peak ({cluster.gpu.peak_flops:.3g} FLOP/s) and the model's shape")
        return e

    def error(overlap: float) -> float:
        e = efficiency(overlap)
        return sum(math.log(project(model, cluster, r[0], strategy, r[1], r[2], e, overlap, grad_bytes,
                                    param_bytes, algorithm=algorithm, bucket_MB=bucket_MB).tokens_per_s_per_gpu
                            / r[3]) ** 2 for r in rows)

    share = 100 * (hideable + exposed) / step(anchor)
    source = (f"compute efficiency from the {anchor[0]}-GPU row (micro-batch {anchor[1]} x {anchor[2]}), whose "
              f"communication is {share:.1f} % of its step; overlap ")
    if overlap is not None:
        if not 0 <= overlap <= 1:
            raise ValueError(f"calibrate: overlap must be in [0, 1], got {overlap!r}")
        return Calibration(efficiency(overlap), overlap, tuple(rows), source + f"{overlap:g}, given")
    grid = [i / 100 for i in range(101)]
    errors = [error(o) for o in grid]
    best = grid[errors.index(min(errors))]
    tells = max(errors) - min(errors) > 1e-6
    how = source + (f"{best:.2f}: least squares over {len(rows)} rows" if tells else
                     "undetermined: the rows project alike whatever it is")
    return Calibration(efficiency(best if tells else 0.0), best if tells else None, tuple(rows), how)


def check(model: Transformer, cluster: Cluster, strategy: str, judged, calibration: Calibration,
          grad_bytes: float = 4, param_bytes: float = 2, tolerance: float = 0.20, algorithm: str = "best",
          bucket_MB: float = 25) -> list[dict]:
    """Project every judged row with the calibrated parameters and compare: one dict per row, with the
    residual (projected / measured - 1) and whether it is within `tolerance`."""
    o = calibration.overlap
    if o is None:
        raise ValueError("check: the calibration could not determine the overlap; calibrate with overlap= given "
                         "(0 and 1 bracket it)")
    if any(tuple(r[:3]) in {c[:3] for c in calibration.rows} for r in judged):
        raise ValueError("check: a judged row is one the parameters were calibrated on; judge other rows")
    out = []
    for r in judged:
        p = project(model, cluster, r[0], strategy, r[1], r[2], calibration.compute_efficiency, o, grad_bytes,
                    param_bytes, algorithm=algorithm, bucket_MB=bucket_MB)
        residual = p.tokens_per_s_per_gpu / r[3] - 1
        out.append({"GPUs": r[0], "micro-batch x accumulation": f"{r[1]} x {r[2]}", "measured tokens/s/GPU": round(r[3]),
                    "projected": round(p.tokens_per_s_per_gpu), "residual %": round(100 * residual, 1),
                    "within": abs(residual) <= tolerance, "exposed comm (s)": round(p.exposed_comm_s, 3),
                    "step (s)": round(p.step_s, 3)})
    return out


# ----------------------------------------------------------------------------- published figures

GIB = 2**30 / 1e9  # a GPU's "80 GB" is 80 GiB: 85.9 GB
GPUS = {
    "H100 SXM": GPU("H100 SXM", 989e12, 80 * GIB, "NVIDIA H100 datasheet: 989 TFLOP/s dense BF16, 80 GB HBM3, "
                                                 "3.35 TB/s", hbm_GBps=3350),
    "H100 PCIe": GPU("H100 PCIe", 756e12, 80 * GIB, "NVIDIA H100 datasheet: 756 TFLOP/s dense BF16, 80 GB HBM2e, "
                                                   "2.0 TB/s", hbm_GBps=2000),
    "H100 96GB": GPU("H100 96GB", 989e12, 96 * GIB, "torchtitan's benchmark GPUs (Grand Teton: 96 GB HBM2e, 500 W); "
                                                   "its MFU uses the SXM peak, as here; HBM bandwidth assumed the "
                                                   "SXM's 3.35 TB/s (torchtitan does not state it)", hbm_GBps=3350),
}
NVLINK = Link("NVLink 4 (NVSwitch)", 370.0, source="nccl-tests #212: ~370 GB/s ring bus bandwidth on 8 x H100 "
                                                  "(450 GB/s line rate less ~20 % protocol)")
IB_NDR_8 = Link("InfiniBand NDR, 8 x 400 Gb/s a node", 8 * 46.0,
                source="nccl-tests #290/#267: 46-49 GB/s per 400 Gb/s NIC; a ring over nodes with one NIC per GPU "
                       "reaches the node's 8 NICs together")
PCIE_GEN5 = Link("PCIe Gen5 x16 (no NVLink)", 0.8 * 64,
                 source="assumed: 64 GB/s per direction (PCIe Gen5 x16 line rate) less 20 % protocol, "
                        "as NVLink loses; not a measurement")
IB_NDR_1 = Link("InfiniBand NDR, 1 x 400 Gb/s a node", 46.0, source="nccl-tests #290/#267: 46-49 GB/s per 400 Gb/s NIC")

CLUSTERS = {
    "dgx-h100-ib": Cluster("DGX H100, InfiniBand", GPUS["H100 SXM"], 8, NVLINK, IB_NDR_8,
                           source="NVLink inside a node, 8 NDR NICs a node (DGX H100)"),
    "pcie-h100": Cluster("8 x H100 PCIe, one NIC", GPUS["H100 PCIe"], 8, PCIE_GEN5, IB_NDR_1,
                         source="PCIe only inside a node, one NDR NIC a node"),
    "grand-teton-h100": Cluster("Grand Teton H100 (torchtitan)", GPUS["H100 96GB"], 8, NVLINK,
                                Link("RDMA, 400 Gb/s a GPU", 8 * 46.0, source="torchtitan: 'backend RDMA network with "
                                     "400 Gb/s per GPU'; 46 GB/s per 400 Gb/s NIC (nccl-tests #290)"),
                                source="torchtitan's benchmark hosts"),
}


@dataclass(frozen=True)
class PointSet:
    """A published point set: its model, cluster, measured rows (calibration and judged) and citation."""

    name: str
    model: Transformer
    cluster: Cluster
    strategy: str
    calibration: tuple
    judged: tuple
    columns: tuple
    about: str
    citation: str
    settings: dict


def published(name: str | None = None, path: Path = PUBLISHED):
    """The published point sets of labs/published/scaling.json ("playbook_dp",
    "torchtitan_fsdp"), or all of them as a dict."""
    data = json.loads(Path(path).read_text())
    clusters = dict(CLUSTERS)
    clusters["playbook-h100-efa"] = Cluster(
        "Playbook's H100 cluster (EFA)", GPUS["H100 SXM"], 8,
        Link("NVLink, 1 node (measured)", dict(data["playbook_allreduce_busbw_GBps"]["by_nodes"])[1],
             source=data["sources"]["playbook"]),
        by_nodes=tuple(tuple(r) for r in data["playbook_allreduce_busbw_GBps"]["by_nodes"]),
        source="measured all-reduce bus bandwidth at 256 MB by node count (all-reduce only: the same figure's "
               "reduce-scatter and all-gather reach less) -- " + data["sources"]["playbook"])
    sets = {}
    for key, strategy in (("playbook_dp", "ddp"), ("torchtitan_fsdp", "fsdp")):
        d = data[key]
        m = dict(d["model"])
        model = Transformer(**{**m, "source": data["sources"][m["source"]]})
        sets[key] = PointSet(key, model, clusters[d["cluster"]], strategy,
                             tuple(tuple(r) for r in d["calibration"]), tuple(tuple(r) for r in d["judged"]),
                             tuple(d["columns"]), d["about"], data["sources"][d["source"]], d["settings"])
    if name is None:
        return sets
    if name not in sets:
        raise ValueError(f"no published point set {name!r}: there are {', '.join(sets)}")
    return sets[name]


# ----------------------------------------------------------------------------- the reader's own runs

def amdahl_fit(world_sizes, speedups) -> tuple[float, float]:
    """The serial fraction s of Amdahl's law, speedup(N) = 1 / (s + (1 - s) / N), fitted to strong-scaling
    speedups by least squares on 1/speedup - 1/N = s (1 - 1/N); and its standard error (0 with one point).
    Points at N = 1 carry no information and are skipped; s < 0 (superlinear) is kept, not clipped."""
    pts = [(n, s) for n, s in zip(world_sizes, speedups) if n > 1]
    if not pts:
        raise ValueError("amdahl_fit: need a speedup measured at more than one rank")
    if any(s <= 0 for _, s in pts):
        raise ValueError(f"amdahl_fit: speedups must be positive, got {[s for _, s in pts]}")
    xs = [1 - 1 / n for n, _ in pts]
    ys = [1 / s - 1 / n for n, s in pts]
    sxx = sum(x * x for x in xs)
    serial = sum(x * y for x, y in zip(xs, ys)) / sxx
    if len(pts) < 2:
        return serial, 0.0
    rss = sum((y - serial * x) ** 2 for x, y in zip(xs, ys))
    return serial, math.sqrt(rss / (len(pts) - 1) / sxx)


def serial_fraction(sweep: list[dict], max_world: int | None = None, draws: int = 1000, seed: int = 0) -> dict:
    """Amdahl's serial fraction from a strong-scaling sweep (lab03 --worlds: rows with world_size, median_step_s
    and the timed step_times_s, the same global batch at every world size), fitted on the world sizes up to
    `max_world` (the machine's cores: beyond them ranks wait for a core, which Amdahl's law does not model).
    Its uncertainty is a bootstrap: the steps of every world size resampled `draws` times, the fit redone, the
    standard deviation of the fits. Returns {"serial", "stderr", "worlds"}."""
    rows = sorted((r for r in sweep if max_world is None or r["world_size"] <= max_world), key=lambda r: r["world_size"])
    if not rows or rows[0]["world_size"] != 1 or len(rows) < 2:
        raise ValueError("serial_fraction: need the 1-rank run and at least one more world size "
                         f"{'up to ' + str(max_world) + ' ' if max_world else ''}in the sweep")

    def fit(steps: list[float]) -> float:
        return amdahl_fit([r["world_size"] for r in rows], [steps[0] / t for t in steps])[0]

    serial = fit([r["median_step_s"] for r in rows])
    rng = random.Random(seed)
    fits = []
    for _ in range(draws):
        medians = []
        for r in rows:
            times = r["step_times_s"]
            sample = sorted(rng.choice(times) for _ in times)
            medians.append(sample[len(sample) // 2] if len(sample) % 2 else
                           (sample[len(sample) // 2 - 1] + sample[len(sample) // 2]) / 2)
        fits.append(fit(medians))
    mean = sum(fits) / len(fits)
    stderr = math.sqrt(sum((f - mean) ** 2 for f in fits) / (len(fits) - 1))
    return {"serial": serial, "stderr": stderr, "worlds": [r["world_size"] for r in rows]}


def amdahl(serial: float, world_size) -> float:
    """Amdahl's strong-scaling speedup on `world_size` ranks with serial fraction `serial`."""
    return 1 / (serial + (1 - serial) / world_size)


def overlap_threshold_tokens(flops_per_token: float, params: int, flops: float, busbw_GBps: float, *,
                             grad_bytes: float, gpus: int | None = None) -> float:
    """Tokens per GPU in the micro-batch that synchronises (DDP's last) above which its gradient all-reduce can
    hide under its backward pass, computing at `flops` FLOP/s (a peak, or a peak x compute efficiency).

    The backward does 4/6 of the FLOPs: tokens x (2/3) x flops_per_token / flops seconds; the all-reduce moves
    busbw_factor x params x grad_bytes bytes at busbw. They are equal at

        tokens* = 1.5 x busbw_factor x params x grad_bytes x flops / (flops_per_token x busbw)

    and with flops_per_token ~ 6 x params, busbw_factor ~ 2 and 2-byte gradients: tokens* ~ flops / busbw (in
    FLOP per byte), the ratio the JAX scaling book compares a batch with. gpus=None takes busbw_factor's limit, 2.
    """
    factor = 2.0 if gpus is None else costmodel.busbw_factor("all_reduce", gpus)
    return 1.5 * factor * params * grad_bytes * flops / (flops_per_token * busbw_GBps * 1e9)



def knee(rows: list[dict]) -> dict:
    """The overlap criterion's T*, measured: the tokens per rank whose backward work takes as long as the gradient
    all-reduce. `rows`: a lab03 sweep at one world size above 1 over several micro-batches, without accumulation,
    recorded with --timeline and one bucket, so that the all-reduce leaves at the end of the backward and the two
    are timed apart (backward_s; comm_s, the transfer without waiting for a slower peer, or exposed_comm_s where a
    row has no comm_s).

    The backward is fitted as a line in the tokens per rank, a + b T (least squares): b is what each token costs,
    a what every backward pays whatever the batch (launching the kernels, allocating the gradients: on a CPU, far
    from nothing). The all-reduce's time C is the median over the rows (its size does not depend on the batch).
    Returns {"tokens": C / b, the criterion's T* (which counts the work that grows with the tokens, as the FLOPs
    it compares with the bytes do), "crossing_tokens": (C - a) / b, where the measured backward itself reaches
    the all-reduce (0 when it always does), "comm_s", "backward_per_token_s", "backward_fixed_s", "world_size"}."""
    worlds = {r["world_size"] for r in rows}
    if len(worlds) != 1 or min(worlds) < 2 or any("backward_s" not in r for r in rows) or \
            len({r["tokens_per_step"] for r in rows}) < 2:
        raise ValueError("knee: need a sweep of two or more micro-batches at one world size above 1, recorded with "
                         "--timeline (lab03 --worlds N --micro-batches ... --timeline)")
    if any(r.get("grad_accum", 1) != 1 or r.get("buckets", 1) != 1 for r in rows):
        raise ValueError("knee: every row must be one micro-batch a step in one bucket (the backward timed is the "
                         "synchronising one, the all-reduce leaves after it): drop --total-batch, and give --bucket-mb "
                         "more than the model's gradients")
    world = worlds.pop()
    xs = [r["tokens_per_step"] / world for r in rows]
    ys = [r["backward_s"] for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    if slope <= 0:
        raise ValueError(f"knee: the backward did not grow with the batch ({', '.join(f'{y:.3g} s' for y in ys)}): "
                         f"sweep micro-batches further apart")
    comm = statistics.median(r["comm_s"] if "comm_s" in r else r["exposed_comm_s"] for r in rows)
    fixed = my - slope * mx
    return {"tokens": comm / slope, "crossing_tokens": max(0.0, (comm - fixed) / slope), "comm_s": comm,
            "backward_per_token_s": slope, "backward_fixed_s": fixed, "world_size": world}


# ----------------------------------------------------------------------------- choosing a strategy

MODELS = {
    "Playbook 1B": Transformer("Playbook 1B", 16, 2048, 32, 8192, 131072, 4096,
                               source="the Playbook's benchmark model (nanotron's scaling_benchmarks.py)"),
    "Llama 2 7B": Transformer("Llama 2 7B", 32, 4096, 32, 11008, 32000, 4096, tied=False,
                              source="Touvron et al. 2023, Llama 2 (its 7B configuration)"),
    "Llama 3.1 8B": Transformer("Llama 3.1 8B", 32, 4096, 32, 14336, 128256, 8192, kv_heads=8, tied=False,
                                source="torchtitan's llama3_8b configuration"),
    "Llama 3 70B": Transformer("Llama 3 70B", 80, 8192, 64, 28672, 128256, 8192, kv_heads=8, tied=False,
                               source="Grattafiori et al. 2024, The Llama 3 Herd of Models (its 70B configuration)"),
}


def best_strategy(model: Transformer, cluster: Cluster, gpus: int, global_batch_tokens: int,
                  compute_efficiency: float, overlap: float, strategies=STRATEGIES, tp_sizes=(1,)) -> Projection | None:
    """The fastest strategy that fits in memory for a global batch of `global_batch_tokens` (micro-batches of
    one sequence, accumulated to the batch; with or without full recomputation, which costs a forward pass),
    or None when nothing fits or the batch gives a data-parallel rank less than one sequence. `tp_sizes`: the
    tensor-parallel sizes to try too (each with sequence parallelism when above 1): a data-parallel rank is then
    tp GPUs, so the same batch spreads over tp times more GPUs. Of the set-ups within 1 % of the fastest, the
    simplest wins (no recomputation first, then the smallest tp, then DDP before ZeRO before FSDP)."""
    fits, uneven = [], []
    for tp in tp_sizes:
        if not isinstance(tp, int) or tp < 1 or gpus % tp or tp > cluster.gpus_per_node or model.heads % tp:
            continue  # a TP size this cluster or model cannot have (project says why)
        dp = gpus // tp
        if global_batch_tokens % (dp * model.seq_len) and global_batch_tokens >= dp * model.seq_len:
            uneven.append(f"{dp} data-parallel ranks")
            continue
        per_rank = global_batch_tokens // (dp * model.seq_len)
        if per_rank < 1:
            continue
        fits += [p for recompute in (False, True)
                 for p in [project(model, cluster, gpus, s, 1, per_rank, compute_efficiency, overlap,
                                   recompute=recompute, tp=tp, sequence_parallel=tp > 1) for s in strategies] if p.fits]
    if not fits and uneven:
        raise ValueError(f"best_strategy: a global batch of {global_batch_tokens} tokens does not split into "
                         f"{' or '.join(uneven)} x sequences of {model.seq_len}")
    if not fits:
        return None
    fastest = max(p.tokens_per_s_per_gpu for p in fits)
    # within 1 % of the fastest, the simplest: no recomputation, the smallest tp, the first strategy in order
    near = [p for p in fits if p.tokens_per_s_per_gpu >= 0.99 * fastest]
    return min(near, key=lambda p: (p.recompute, p.tp, strategies.index(p.strategy)))


def strategy_table(model: Transformer, cluster: Cluster, gpus: int, micro_batch: int, grad_accum: int,
                   compute_efficiency: float, overlap: float, recompute: bool = False):
    """One projected row per strategy for the same configuration (a nanodist.table.Table)."""
    return Table(project(model, cluster, gpus, s, micro_batch, grad_accum, compute_efficiency, overlap,
                         recompute=recompute).row() for s in STRATEGIES)


def calculator(model: str = "Llama 2 7B", cluster: str = "dgx-h100-ib", gpus: int = 64, micro_batch: int = 1,
               grad_accum: int = 4, compute_efficiency: float = 0.38, overlap: float = 1.0):
    """An ipywidgets what-if calculator: a model, a cluster, a number of GPUs, the batch, the compute efficiency
    and the overlap; it shows `strategy_table` for the choice -- every strategy, projected. Display it in
    JupyterLab or Jupyter Notebook (it needs a live kernel); its text form is a one-line summary."""
    import ipywidgets as w

    # bad arguments fail here, with their message, before any widget exists
    strategy_table(MODELS[model], CLUSTERS[cluster], gpus, micro_batch, grad_accum, compute_efficiency, overlap)
    controls = {
        "model": w.Dropdown(options=list(MODELS), value=model, description="model"),
        "cluster": w.Dropdown(options=list(CLUSTERS), value=cluster, description="cluster"),
        "gpus": w.SelectionSlider(options=sorted({2 ** k for k in range(3, 14)} | {gpus}), value=gpus,
                                  description="GPUs", continuous_update=False),
        "micro_batch": w.IntSlider(value=micro_batch, min=1, max=16, description="micro-batch",
                                   continuous_update=False),
        "grad_accum": w.IntSlider(value=grad_accum, min=1, max=64, description="accumulation",
                                  continuous_update=False),
        "compute_efficiency": w.FloatSlider(value=compute_efficiency, min=0.1, max=0.8, step=0.01,
                                            description="compute eff.", continuous_update=False),
        "overlap": w.FloatSlider(value=overlap, min=0.0, max=1.0, step=0.05, description="overlap",
                                 continuous_update=False),
    }
    result = w.HTML()

    def choice() -> dict:
        c = {k: v.value for k, v in controls.items()}
        return {**c, "model": MODELS[c["model"]], "cluster": CLUSTERS[c["cluster"]]}

    def summary() -> str:  # short: ipywidgets cuts a widget's text form at 110 characters
        c = {k: v.value for k, v in controls.items()}
        return f"{c['model']} on {c['gpus']} GPUs of {c['cluster']}, micro-batch {c['micro_batch']} x {c['grad_accum']}"

    def update(_=None) -> None:
        try:
            table = strategy_table(**choice())._repr_html_()
        except ValueError as e:
            table = f"<p><b>{e}</b></p>"
        result.value = f"<p>{summary()}: projections, not measurements</p>{table}"

    for control in controls.values():
        control.observe(update, names="value")
    update()

    class ScalingCalculator(w.VBox):
        def __repr__(self) -> str:
            return f"scaling calculator: {summary()}"

    return ScalingCalculator(list(controls.values()) + [result])
