"""From a lab's flags to a training run: checked flags, a typed configuration, then model, data, wrapper,
optimizer, Trainer, recorder.

    parser = argparse.ArgumentParser(); experiment.add_arguments(parser)
    args = parser.parse_args()
    info = experiment.start(parser, args)          # every flag checked, results folder writable, then init()
    cfg = experiment.RunConfig.from_args(args)     # the run's settings, typed and frozen (args stays as parsed)
    data = experiment.load_data(cfg)               # corpus -> tokenizer -> tokens, once per lab
    run = experiment.build(cfg, data, info.group, wrapper="nanodist", optimizer="adamw", name="nanodist")
    run.trainer.fit()
    other = experiment.build(cfg.replace(bucket_mb=1.0), data, info.group, wrapper="torch")  # a variant

Every training lab trains the same GPT from the same seeded weights on the same data; what differs is
who averages the gradients (the *wrapper*) and with which *optimizer*. Building that in one place keeps the
labs short, and makes the comparison fair by construction.

Both come from registries (WRAPPERS, OPTIMIZERS) that a lab or a later chapter extends without touching this
file:

    @experiment.register_wrapper("my-ddp", doc="my DDP")
    def _(raw, ctx):                               # ctx: BuildContext (config, group, shared memory, ...)
        return MyDDP(raw, group=ctx.group)

Wrappers: "single" (a world of one: this rank alone, no communication), "nanodist" (nanodist.DDP,
through shared memory on CPU ranks of one machine unless --shared-memory off), "nanodist-pg"
(nanodist.DDP through the process group, like torch), "torch" (torch's DDP), "naive" (NaiveDDP),
"none" (the bare model: the optimizer averages, ZeRO), "fsdp" (nanodist.FSDP, every Block a unit) and
"fsdp2" (torch's fully_shard on every Block and the root, on a CPU or GPU mesh of the group). With --tp n the
world becomes a mesh of world/n data ranks x n tensor ranks, nanodist.tp splits every block over the tensor
dimension, and the wrapper ("nanodist", "nanodist-pg", "fsdp2"; "tp" when the data dimension has one rank)
averages over the data one.
Optimizers: "adamw" (torch.optim.AdamW), "muon" (MuonAdamW), "dist-adamw" (DistAdamW), "dist-muon"
(make_muon_optimizer: Muon for matrices, AdamW for the rest), "zero1-adamw" (ZeroOptimizer over AdamW),
"zero-redundancy-adamw" (torch's ZeroRedundancyOptimizer over AdamW, behind a DDP wrapper).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import warnings
import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from . import perf, results, runtime
from .bench import take_turns
from .data import CharTokenizer, TokenStream, load_corpus, train_val_split
from .ddp import DDP, NaiveDDP
from .fsdp import FSDP
from .group import Group
from .memory import measure_memory, tensor_bytes
from .model import GPT, PRESETS, GPTConfig
from .optim import DistAdamW, MuonAdamW, ZeroOptimizer, make_muon_optimizer
from .train import TrainConfig, Trainer, autocast, grad_accum_steps

WARMUP_STEPS = 3  # excluded from step times: the first steps pay for allocation and thread start-up


# ----------------------------------------------------------------------------- the run's configuration

@dataclass(frozen=True)
class RunConfig:
    """Everything build() reads, typed and frozen: one value per run, never a flag namespace edited between runs.
    A variant is `cfg.replace(field=value)`. Field names are the flags' (--micro-batch -> micro_batch), so
    RunConfig.from_args(args) takes a lab's parsed flags, and the lab's own flags stay on args."""

    steps: int = 50
    micro_batch: int = 8
    seq_len: int = 64
    total_batch: int | None = None  # tokens per optimizer step; None: one micro-batch per rank (see total_batch())
    scaling: str = "weak"  # "strong": the default total batch is 4 micro-batches, whatever the world size
    model: str = "small"  # a nanodist.model preset ("auto" is resolved by from_args)
    lr: float = 3e-3
    muon_lr: float = 0.02
    dtype: str = "fp32"  # autocast dtype of forward/backward
    param_dtype: str = "fp32"  # FSDP: the dtype units are gathered in
    compile: bool = False
    bucket_mb: float = 25.0
    shared_memory: str = "auto"  # "auto", "on", "off" (use_shared_memory)
    collectives: str = "auto"  # ShardedOptimizer's transport
    zero_stage: int = 2
    prefetch: bool = True  # FSDP: gather the next unit while this one computes
    checkpointing: bool = False  # activation checkpointing of every Block
    threads: int = 1
    data: str | None = None
    seed: int = 0
    wandb: bool = False
    tp: int = 1  # tensor-parallel size: the world becomes a mesh of (world / tp) data ranks x tp tensor ranks
    sequence_parallel: bool = False  # with tp > 1: nanodist.tp's sequence parallelism too

    @classmethod
    def from_args(cls, args, device=None, **changes) -> "RunConfig":
        """The fields a lab's flags set (any it lacks keep their defaults), then `changes`. --model auto becomes
        the preset for `device` (default: this process's device, after nanodist.init())."""
        given = vars(args) if not isinstance(args, dict) else dict(args)
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in given.items() if k in names}
        if "no_prefetch" in given:
            values["prefetch"] = not given["no_prefetch"]
        values.update(changes)
        if values.get("model", "auto") == "auto":
            values["model"] = auto_model(device if device is not None else Group.world().device)
        return cls(**values)

    def replace(self, **changes) -> "RunConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _config(cfg) -> RunConfig:
    return cfg if isinstance(cfg, RunConfig) else RunConfig.from_args(cfg)


# ----------------------------------------------------------------------------- flags, checked in one place

def add_arguments(p: argparse.ArgumentParser, *, steps: int = 50, total_batch_help: str | None = None) -> None:
    """The flags every training lab shares."""
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps per run")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per micro-step")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--total-batch", type=int, default=None, help=total_batch_help or
                   "tokens per optimizer step (default: micro-batch x seq-len x ranks, no accumulation)")
    p.add_argument("--model", choices=["auto", *PRESETS], default="auto",
                   help="a nanodist.model preset; auto: 'small' on a CPU, 'gpt2' (124 M parameters) on a GPU")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (FSDP: the layers inside each unit); compiling happens in the "
                        "warm-up steps, which the timings leave out")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size (DDP and ZeRO)")
    p.add_argument("--shared-memory", choices=["auto", "on", "off"], default="auto",
                   help="nanodist's gradient reduction through shared memory (auto: when every rank is a CPU "
                        "process on this machine); torch DDP and nanodist-pg always use the process group")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads per rank (default 1, as torchrun sets: a 1-rank run then compares fairly)")
    p.add_argument("--data", default=None, help="a UTF-8 text file to train on (default: the built-in corpus)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel size: nanodist.tp splits every block over tp ranks; the world is a mesh of "
                        "world/tp data ranks x tp tensor ranks (the wrapper averages over the data dimension)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: split the LayerNorms, dropouts and residual stream along the sequence too")
    p.add_argument("--wandb", action="store_true", help="log to Weights & Biases from rank 0 (offline unless logged in)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")


def check_positive(args, names: list[str], what: str = "a positive integer", integer: bool = True) -> str | None:
    for name in names:
        value = getattr(args, name, None)
        if value is None:
            continue
        ok = (value >= 1) if integer else (math.isfinite(value) and value > 0)
        if not ok:
            return f"--{name.replace('_', '-')} must be {what}, got {value}"
    return None


def check_args(args, world_size: int, min_steps: int = WARMUP_STEPS + 1) -> str | None:
    """Every shared flag against what it must be, before any work: a one-line message saying what is wrong and
    what to do, or None. Sizes are checked against the world size the run will have, and the data against
    both of its splits."""
    problem = (check_positive(args, ["steps", "micro_batch", "seq_len", "threads", "tp"])
               or check_positive(args, ["total_batch"], "a positive number of tokens")
               or check_positive(args, ["lr", "bucket_mb"], "a positive finite number", integer=False))
    if problem:
        return problem
    if args.steps < min_steps:
        why = f" (the first {WARMUP_STEPS} are warm-up, not timed)" if min_steps > 1 else ""
        return f"--steps must be more than {min_steps - 1}{why}"
    problem = check_tensor_parallel(args, world_size)
    if problem:
        return problem
    world_size //= getattr(args, "tp", 1)  # the data dimension splits the batches
    try:
        grad_accum_steps(total_batch(args, world_size), args.micro_batch, args.seq_len, world_size)
        text = load_corpus(args.data)
    except (ValueError, OSError) as e:
        return str(e)
    tokens = len(text)
    train, val = int(tokens * 0.9), tokens - int(tokens * 0.9)
    need = args.micro_batch * world_size * args.seq_len + 1  # one batch for every rank
    for name, n in (("training split (the first 90 %)", train), ("validation split (the last 10 %)", val)):
        if n < need:
            return (f"token stream too small: the text's {name} has {n} tokens, but one batch on {world_size} "
                    f"rank(s) needs "
                    f"{args.micro_batch} x {world_size} x {args.seq_len} + 1 = {need}: use a text of at least "
                    f"{math.ceil(need / (0.1 if 'validation' in name else 0.9))} characters, or a smaller "
                    f"--micro-batch or --seq-len")
    return None


def check_tensor_parallel(args, world_size: int) -> str | None:
    """--tp and --sequence-parallel against the world and the model, or why not."""
    tp, sequence = getattr(args, "tp", 1), getattr(args, "sequence_parallel", False)
    if world_size % tp:
        return (f"--tp {tp} does not divide the {world_size} rank(s) of this launch into a mesh of data x tensor "
                f"ranks: use a --tp that divides {world_size}")
    if sequence and tp == 1:
        return "--sequence-parallel splits the sequence over the tensor-parallel ranks: give --tp 2 or more with it"
    if sequence and args.seq_len % tp:
        return f"--sequence-parallel gives each of the {tp} tensor ranks seq-len/{tp} positions: --seq-len " \
               f"{args.seq_len} is not a multiple of {tp}"
    model = getattr(args, "model", "auto")
    if tp > 1 and model in PRESETS and PRESETS[model]["n_head"] % tp:
        return f"--tp {tp} splits the attention heads, and the {model} model has {PRESETS[model]['n_head']}: " \
               f"use a --tp that divides it"
    return None


def start(parser: argparse.ArgumentParser, args, *, min_steps: int = WARMUP_STEPS + 1,
          extra_check=None) -> runtime.DistInfo:
    """Check the flags and the results folder before any process group starts (a bad flag costs nothing and
    prints one line), then nanodist.init(). `extra_check(args, world_size)` adds a lab's own checks."""
    try:
        env = runtime.read_env()
    except runtime.DistConfigError as e:  # a partial torchrun environment: one line, as for a bad flag
        parser.exit(2, f"{parser.prog}: {e}\n")
    world = env["world_size"] if env else 1
    problem = check_args(args, world, min_steps) or (extra_check(args, world) if extra_check else None)
    if problem:
        parser.error(problem)
    try:
        results.check_writable()
    except results.ResultsError as e:
        parser.error(str(e))
    info = runtime.init(seed=args.seed)
    torch.set_num_threads(args.threads)
    if args.model == "auto":  # RunConfig.from_args resolves it the same way; args stays as parsed
        runtime.print0(f"--model auto: the {auto_model(info.device)!r} preset on {info.device.type}")
    return info


def auto_model(device) -> str:
    """--model auto: the smallest model that shows the point on a CPU; a GPU-scale one (GPT-2 small) on a GPU."""
    return "gpt2" if torch.device(device).type == "cuda" else "small"


def total_batch(cfg, world_size: int) -> int | None:
    """Tokens per optimizer step: --total-batch, or (strong scaling) 4 micro-batches so 1, 2 and 4 ranks divide
    it, or (weak scaling and the default) one micro-batch per rank."""
    if cfg.total_batch is not None:
        return cfg.total_batch
    if getattr(cfg, "scaling", "weak") == "strong":
        return cfg.micro_batch * cfg.seq_len * 4
    return None


def use_shared_memory(cfg, group: Group) -> bool:
    """--shared-memory auto: on when every rank of the group is a CPU process on this machine (gloo would go
    through TCP): when the whole job runs on this machine, any group of it (a 2-D mesh's data group too)."""
    if cfg.shared_memory != "auto":
        return cfg.shared_memory == "on"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", group.size))
    world = int(os.environ.get("WORLD_SIZE", group.size))
    return group.device.type == "cpu" and group.size > 1 and local == world


def check_worlds(args, world_size: int) -> str | None:
    """A lab's --worlds (memory at several world sizes from one launch, with --memory-only), or why not."""
    worlds = getattr(args, "worlds", None)
    if worlds is not None and not getattr(args, "memory_only", False):
        return "--worlds goes with --memory-only"
    bad = [n for n in worlds or [] if not 1 <= n <= world_size]
    if bad:
        return f"--worlds: {bad[0]} rank(s) cannot be formed from this launch's {world_size}: use 1 to {world_size}"
    return None


def check_sweep(args, world_size: int) -> str | None:
    """A timed sweep's --worlds and --micro-batches (one set-up at several world sizes and micro-batch sizes), or
    why not: every world size formable from the launch, distinct positive integers, a total batch that splits."""
    worlds, batches = args.worlds or [world_size], getattr(args, "micro_batches", None) or [args.micro_batch]
    bad = [n for n in worlds if not 1 <= n <= world_size]
    if bad:
        return f"--worlds: {bad[0]} rank(s) cannot be formed from this launch's {world_size}: use 1 to {world_size}"
    if any(b < 1 for b in batches) or len(set(worlds)) < len(worlds) or len(set(batches)) < len(batches):
        return "--worlds and --micro-batches take distinct positive integers"
    for n in worlds:
        for b in batches:
            total = total_batch(RunConfig.from_args(args, "cpu").replace(micro_batch=b), n)
            if total is not None and total % (n * b * args.seq_len):
                return (f"the total batch of {total} tokens does not split into {n} rank(s) x micro-batches of "
                        f"{b} x {args.seq_len} tokens: give --total-batch a multiple of every world size x "
                        f"micro-batch x seq-len")
    return None


def exposed_communication(timeline: list[dict], buckets: int) -> list[dict]:
    """From nanodist DDP's bucket timeline (`buckets` entries per backward), one dict per timed backward: the
    autograd time from its first gradient (backward_s), the wait after it until every bucket had arrived
    (exposed_s: the communication the step did not hide, including any wait for a slower rank), the time from
    the first bucket's launch to the last one's arrival (span_s), and from the last bucket's launch until the
    gradients were synchronised (after_last_launch_s)."""
    backwards = [timeline[i:i + buckets] for i in range(0, len(timeline), buckets)]
    return [{"backward_s": b[0]["autograd_end_s"], "exposed_s": b[0]["synced_s"] - b[0]["autograd_end_s"],
             "span_s": max(e["done_s"] for e in b) - min(e["launch_s"] for e in b),
             "after_last_launch_s": b[0]["synced_s"] - max(e["launch_s"] for e in b)}
            for b in backwards[WARMUP_STEPS:] or backwards]


def sweep(cfg, data, group: Group, worlds, micro_batches, steps: int, block_steps: int = 5,
          **build_kwargs) -> list[dict] | None:
    """One set-up (`build`'s keyword arguments) at every world size x micro-batch, in one launch: each world on
    the launch's first N ranks while the others wait, the configurations taking turns in blocks of `block_steps`
    steps so that the machine's background load falls on all of them alike. Returns, on rank 0 (a member of
    every world), one row per configuration: world_size, micro_batch, grad_accum, params, tokens_per_step,
    median_step_s, tokens_per_s, step_times_s (the timed steps), speedup and efficiency against the 1-rank row of
    the same micro-batch when there is one, and with record_timeline=True (nanodist DDP, world sizes above 1) the
    medians over the timed steps of rank 0's backward_s, exposed_comm_s and comm_span_s (`exposed_communication`)
    and comm_s: each step's shortest time from the last bucket's launch to the synchronised gradients, over the
    ranks (the rank that launched last waits for the transfer alone), and the number of buckets; None on the other
    ranks."""
    subs = first_ranks(group, sorted(set(worlds)))
    runs, only = {}, {}
    for n in worlds:
        for b in micro_batches:
            name = f"W={n} micro-batch={b}"
            only[name] = n
            if subs[n] is not None:
                runs[name] = build(cfg.replace(micro_batch=b), data, subs[n], name=name, **build_kwargs)
    take_turns({name: (lambda r=runs.get(name): r and r.trainer.fit(max_steps=block_steps)) for name in only},
               rounds=-(-steps // block_steps), rotate=True, only=only, group=group)
    waits = {}  # with a timeline: every rank's backwards, gathered on the world's members (the same order on all)
    for n in worlds:
        for b in micro_batches:
            run = runs.get(f"W={n} micro-batch={b}")
            if run is not None and n > 1 and isinstance(run.model, DDP) and run.model.record_timeline:
                waits[n, b] = subs[n].all_gather_object(exposed_communication(run.model.timeline,
                                                                              len(run.model.buckets)))
    if not group.is_main:
        return None
    rows = []
    for n in worlds:
        for b in micro_batches:
            run = runs[f"W={n} micro-batch={b}"]
            r = summarize(run)
            rows.append({"world_size": n, "micro_batch": b, "grad_accum": r["grad_accum"], "params": r["params"],
                         "tokens_per_step": r["tokens_per_step"], "median_step_s": r["median_step_s"],
                         "tokens_per_s": r["tokens_per_s"], "flops_per_token": r["flops_per_token"],
                         "step_times_s": [h["time_s"] for h in run.trainer.history[WARMUP_STEPS:]]})
            if (n, b) in waits:  # medians over the timed steps
                ranks, med = waits[n, b], statistics.median
                rows[-1].update({
                    "backward_s": med(x["backward_s"] for x in ranks[0]),
                    "exposed_comm_s": med(x["exposed_s"] for x in ranks[0]),  # rank 0's, as its step saw it
                    "comm_span_s": med(x["span_s"] for x in ranks[0]),
                    # from the last launch, on the rank that launched last (the shortest such wait of the step):
                    # the transfer without waiting for a slower peer
                    "comm_s": med(min(x["after_last_launch_s"] for x in step) for step in zip(*ranks)),
                    "buckets": len(run.model.buckets)})
    one = {row["micro_batch"]: row for row in rows if row["world_size"] == 1}
    for row in rows:
        if row["micro_batch"] in one:
            row["speedup"] = row["tokens_per_s"] / one[row["micro_batch"]]["tokens_per_s"]
            row["efficiency"] = row["speedup"] / row["world_size"]
    return rows


def first_ranks(group: Group, sizes) -> dict[int, Group | None]:
    """For each n in `sizes`: the group of `group`'s first n ranks on its members, None on the others -- so one
    launch measures what launches at several world sizes would (a memory table at 1, 2 and 4 ranks). Collective:
    every rank of `group` calls it with the same sizes (torch.distributed.new_group's rule)."""
    import torch.distributed as dist
    out = {}
    for n in sizes:
        if not 1 <= n <= group.size:
            raise ValueError(f"a world of {n} rank(s) cannot be formed from {group.size}: use sizes from 1 to "
                             f"{group.size}, or launch more ranks")
        if n == group.size:
            out[n] = group
            continue
        pg = dist.new_group([group.global_rank(r) for r in range(n)], backend=group.backend)
        out[n] = Group.of(pg) if group.rank < n else None
    return out


# ----------------------------------------------------------------------------- building a run

@dataclass
class Data:
    tokens: torch.Tensor
    vocab_size: int
    train: torch.Tensor
    val: torch.Tensor


def load_data(cfg) -> Data:
    """The corpus (--data or the built-in one), a character tokenizer, and the 90/10 train/validation split."""
    text = load_corpus(cfg.data)
    tok = CharTokenizer(text)
    tokens = torch.tensor(tok.encode(text), dtype=torch.int64)
    train, val = train_val_split(tokens)
    return Data(tokens, tok.vocab_size, train, val)


@dataclass
class Run:
    """One model in training: the bare model, what trains (wrapped or not), the optimizer, the Trainer."""

    name: str
    raw: nn.Module
    model: nn.Module
    optimizer: torch.optim.Optimizer
    trainer: Trainer
    train: TokenStream


def build_model(cfg, vocab_size: int, device) -> GPT:
    """The lab's GPT from the seeded initial weights: identical for every run and on every rank."""
    torch.manual_seed(cfg.seed)
    # A preset that names its vocabulary (gpt2: 50304, GPT-2's padded to a multiple of 64) keeps it: the
    # character tokenizer uses the first rows, and the model has the size and the FLOPs of the real one.
    name = auto_model(device) if cfg.model == "auto" else cfg.model
    vocab_size = max(vocab_size, PRESETS[name].get("vocab_size", 0))
    cfg = GPTConfig.preset(name, vocab_size=vocab_size, block_size=cfg.seq_len)
    if torch.device(device).type == "meta":  # shapes only, no memory (.to("meta") would untie the embedding)
        with torch.device("meta"):
            return GPT(cfg)
    return GPT(cfg).to(device)


def compile_model(raw: nn.Module, wrapper: str) -> None:
    """torch.compile in place (Module.compile: the parameters keep their names, so checkpoints do not change).
    Under FSDP the layers inside each unit are compiled, not the unit: its hooks gather and free the unit's
    parameters around the compiled code. The wrappers that average gradients in hooks on the parameters (DDP,
    the sharded optimizers) run them outside the compiled code by themselves."""
    if wrapper in ("fsdp", "fsdp2"):
        for block in raw.blocks:
            for layer in block.children():
                layer.compile()
    else:
        raw.compile()


# ----------------------------------------------------------------------------- the registries of set-ups

@dataclass
class BuildContext:
    """What a wrapper's or an optimizer's builder gets: the configuration, this run's group, and build()'s
    keyword arguments."""

    cfg: RunConfig
    group: Group
    shared_memory: bool  # nanodist's reduction through shared memory (use_shared_memory)
    weight_decay: float
    zero_stage: int
    record_timeline: bool = False
    observer: object = None
    wrapper: "WrapperSpec | None" = None  # the wrapper this optimizer goes with


@dataclass(frozen=True)
class WrapperSpec:
    """A way to wrap the bare model. wrap(raw, ctx) returns the module that trains (the bare model itself for
    "none"). averages: the wrapper averages the gradients (False: the optimizer must, ZeRO); flat_shards: the
    parameters become shards (no optimizer that needs whole parameters); local: it trains alone, in a world of
    one; param_groups_from_wrapper: the optimizer's param groups come from the wrapped module (nanodist.FSDP's
    local views), not the bare model; tensor_parallel: it takes a model split by nanodist.tp (--tp), averaging
    over the mesh's data dimension."""

    name: str
    wrap: Callable
    doc: str = ""
    averages: bool = True
    flat_shards: bool = False
    local: bool = False
    param_groups_from_wrapper: bool = False
    tensor_parallel: bool = False  # it averages a tensor-parallel model's DTensor parameters over the data dimension


@dataclass(frozen=True)
class OptimizerSpec:
    """A way to build the optimizer: make(raw, model, ctx). self_averaging: it averages the gradients itself
    (goes with the "none" wrapper); whole_parameters: it needs every parameter whole (Muon orthogonalises whole
    matrices; ZeroRedundancyOptimizer broadcasts whole parameters), so not with a wrapper that shards them."""

    name: str
    make: Callable
    doc: str = ""
    self_averaging: bool = False
    whole_parameters: bool = False


WRAPPERS: dict[str, WrapperSpec] = {}
OPTIMIZERS: dict[str, OptimizerSpec] = {}


def register_wrapper(name: str, *, doc: str = "", replace: bool = False, **flags):
    """Decorator: register wrap(raw, ctx) -> module under `name` (flags: WrapperSpec's). A name is taken once
    unless replace=True."""
    def add(fn):
        if name in WRAPPERS and not replace:
            raise ValueError(f"a wrapper named {name!r} is registered already: pick another name, or replace=True")
        WRAPPERS[name] = WrapperSpec(name, fn, doc, **flags)
        return fn
    return add


def register_optimizer(name: str, *, doc: str = "", replace: bool = False, **flags):
    """Decorator: register make(raw, model, ctx) -> optimizer under `name` (flags: OptimizerSpec's)."""
    def add(fn):
        if name in OPTIMIZERS and not replace:
            raise ValueError(f"an optimizer named {name!r} is registered already: pick another name, or replace=True")
        OPTIMIZERS[name] = OptimizerSpec(name, fn, doc, **flags)
        return fn
    return add


def self_averaging() -> tuple[str, ...]:
    """The registered optimizers that average the gradients themselves."""
    return tuple(n for n, o in OPTIMIZERS.items() if o.self_averaging)


def check_setup(wrapper: str, optimizer: str, tp: int = 1) -> None:
    """A ValueError naming what does not go together (or what is not registered)."""
    if wrapper not in WRAPPERS or optimizer not in OPTIMIZERS:
        raise ValueError(f"wrapper must be one of {tuple(WRAPPERS)} and optimizer one of {tuple(OPTIMIZERS)}, got "
                         f"{wrapper!r}, {optimizer!r}")
    w, o = WRAPPERS[wrapper], OPTIMIZERS[optimizer]
    if w.averages == o.self_averaging:
        raise ValueError(f"wrapper={wrapper!r} with optimizer={optimizer!r}: exactly one of them must average the "
                         f"gradients. The bare model ('none') goes with an optimizer that averages itself "
                         f"({', '.join(self_averaging())}); every other wrapper with one that does not")
    if o.whole_parameters and w.flat_shards:
        raise ValueError(f"optimizer={optimizer!r} needs whole parameters, and wrapper={wrapper!r} shards each of "
                         f"them (flat slices or DTensor rows): use 'adamw' with it (Chapter 5 explains why)")
    if tp > 1 and o.whole_parameters:
        raise ValueError(f"tp={tp}: optimizer={optimizer!r} needs whole parameters, and tensor parallelism splits "
                         f"them over the tensor dimension: use 'adamw'")
    if tp > 1 and not w.tensor_parallel:
        takes = ", ".join(n for n, spec in WRAPPERS.items() if spec.tensor_parallel)
        raise ValueError(f"tp={tp}: wrapper={wrapper!r} cannot average a model split by tensor parallelism (its "
                         f"parameters are DTensors): use {takes}")


@register_wrapper("none", doc="the bare model: the optimizer averages (ZeRO)", averages=False)
@register_wrapper("single", doc="this rank alone, in a world of one", local=True)
def _bare(raw, ctx):
    return raw


@register_wrapper("tp", doc="no data parallelism: the model split by --tp over every rank", tensor_parallel=True)
def _tensor_only(raw, ctx):
    if ctx.group.size != 1:
        raise ValueError(f"wrapper 'tp' averages nothing, and the data dimension has {ctx.group.size} ranks: give "
                         f"--tp the world size, or use 'fsdp2' to average over the data dimension")
    return raw


@register_wrapper("nanodist", doc="nanodist.DDP (shared memory on CPU ranks of one machine)", tensor_parallel=True)
def _nanodist_ddp(raw, ctx):
    return DDP(raw, bucket_cap_mb=ctx.cfg.bucket_mb, group=ctx.group, record_timeline=ctx.record_timeline,
               shared_memory=ctx.shared_memory)


@register_wrapper("nanodist-pg", doc="nanodist.DDP through the process group, like torch", tensor_parallel=True)
def _nanodist_pg(raw, ctx):
    return DDP(raw, bucket_cap_mb=ctx.cfg.bucket_mb, group=ctx.group, record_timeline=ctx.record_timeline,
               shared_memory=False)


@register_wrapper("torch", doc="torch's DistributedDataParallel")
def _torch_ddp(raw, ctx):
    g = ctx.group
    return torch.nn.parallel.DistributedDataParallel(raw, bucket_cap_mb=ctx.cfg.bucket_mb, process_group=g.pg,
                                                     device_ids=[g.device.index] if g.device.type == "cuda" else None)


@register_wrapper("naive", doc="NaiveDDP: one all-reduce per parameter after backward")
def _naive(raw, ctx):
    return NaiveDDP(raw, group=ctx.group)


def _low_precision(cfg: RunConfig):
    return torch.bfloat16 if cfg.param_dtype == "bf16" else None


@register_wrapper("fsdp", doc="nanodist.FSDP, every Block a unit", flat_shards=True, param_groups_from_wrapper=True)
def _fsdp(raw, ctx):
    return FSDP(raw, units=list(raw.blocks), group=ctx.group, param_dtype=_low_precision(ctx.cfg),
                observer=ctx.observer, prefetch=ctx.cfg.prefetch)


@register_wrapper("fsdp2", doc="torch's fully_shard on every Block and the root", flat_shards=True,
                  tensor_parallel=True)
def _fsdp2(raw, ctx):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    lp = _low_precision(ctx.cfg)
    mp = MixedPrecisionPolicy(param_dtype=lp, reduce_dtype=torch.float32 if lp else None)
    for block in raw.blocks:
        fully_shard(block, mesh=ctx.group.device_mesh, mp_policy=mp)  # the mesh of this group, on its device
    return fully_shard(raw, mesh=ctx.group.device_mesh, mp_policy=mp)


BETAS = (0.9, 0.95)


@register_optimizer("adamw", doc="torch.optim.AdamW (fused on a GPU)")
def _adamw(raw, model, ctx):
    groups = (model if ctx.wrapper.param_groups_from_wrapper else raw).configure_param_groups(ctx.weight_decay)
    fused = ctx.group.device.type == "cuda" or None  # torch's fused kernel on a GPU, as the GPU baselines use
    return torch.optim.AdamW(groups, lr=ctx.cfg.lr, betas=BETAS, fused=fused)


@register_optimizer("muon", doc="MuonAdamW: torch's Muon on the hidden matrices, AdamW on the rest",
                    whole_parameters=True)
def _muon(raw, model, ctx):
    return MuonAdamW(raw, lr=ctx.cfg.lr, muon_lr=ctx.cfg.muon_lr, weight_decay=ctx.weight_decay, betas=BETAS)


def _zero_kwargs(ctx) -> dict:
    return dict(zero_stage=ctx.zero_stage, bucket_cap_mb=ctx.cfg.bucket_mb,
                collectives="shm" if ctx.shared_memory else ctx.cfg.collectives, group=ctx.group)


@register_optimizer("dist-adamw", doc="DistAdamW: ZeRO-1/2, every tensor sliced", self_averaging=True)
def _dist_adamw(raw, model, ctx):
    return DistAdamW(raw.configure_param_groups(ctx.weight_decay), lr=ctx.cfg.lr, betas=BETAS, **_zero_kwargs(ctx))


@register_optimizer("dist-muon", doc="make_muon_optimizer: sharded Muon for matrices, AdamW for the rest",
                    self_averaging=True, whole_parameters=True)
def _dist_muon(raw, model, ctx):
    return make_muon_optimizer(raw, lr=ctx.cfg.lr, muon_lr=ctx.cfg.muon_lr, weight_decay=ctx.weight_decay,
                               betas=BETAS, **_zero_kwargs(ctx))


@register_optimizer("zero1-adamw", doc="ZeroOptimizer over torch.optim.AdamW: ZeRO-1, whole parameters dealt",
                    self_averaging=True)
def _zero1_adamw(raw, model, ctx):
    return ZeroOptimizer(raw.configure_param_groups(ctx.weight_decay), torch.optim.AdamW, group=ctx.group,
                         bucket_cap_mb=ctx.cfg.bucket_mb, lr=ctx.cfg.lr, betas=BETAS)


@register_optimizer("zero-redundancy-adamw", doc="torch's ZeroRedundancyOptimizer over AdamW (behind a DDP wrapper)",
                    whole_parameters=True)
def _zero_redundancy(raw, model, ctx):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    groups = [{k: v for k, v in g.items() if k != "param_names"} for g in raw.configure_param_groups(ctx.weight_decay)]
    return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, process_group=ctx.group.pg,
                                   lr=ctx.cfg.lr, betas=BETAS)


# ----------------------------------------------------------------------------- building a run

def build(cfg, data: Data, group: Group, *, wrapper: str, optimizer: str = "adamw", name: str | None = None,
          zero_stage: int | None = None, record_timeline: bool = False, recorder=None,
          weight_decay: float = 0.1, observer=None, checkpoints=None, checkpoint_every: int = 0) -> Run:
    """A Run: model (wrapped as `wrapper`), optimizer, data streams of this rank, and its Trainer. cfg: a
    RunConfig (a lab's parsed flags are read through RunConfig.from_args)."""
    cfg = _config(cfg)
    check_setup(wrapper, optimizer, cfg.tp)
    spec = WRAPPERS[wrapper]
    group = Group.local(group.device) if spec.local else group
    name = name or wrapper
    raw = build_model(cfg, data.vocab_size, group.device)
    mesh = None
    if cfg.tp > 1:  # data x tensor: nanodist.tp splits the blocks over "tensor"; the rest sees the "data" group
        from .tp import tensor_parallel
        if group.size % cfg.tp:
            raise ValueError(f"tp={cfg.tp} does not divide the group's {group.size} ranks: use a tp that divides it")
        mesh = group.mesh({"data": group.size // cfg.tp, "tensor": cfg.tp})
        tensor_parallel(raw, mesh["tensor"], sequence=cfg.sequence_parallel)
        group = mesh["data"]
    ctx = BuildContext(cfg, group, shared_memory=use_shared_memory(cfg, group) and wrapper != "nanodist-pg",
                       weight_decay=weight_decay, zero_stage=zero_stage or cfg.zero_stage,
                       record_timeline=record_timeline, observer=observer, wrapper=spec)
    model = spec.wrap(raw, ctx)
    raw.activation_checkpointing = cfg.checkpointing
    if cfg.compile:
        compile_model(raw, wrapper)
    opt = OPTIMIZERS[optimizer].make(raw, model, ctx)

    def stream(tokens, seed):
        return TokenStream(tokens, batch_size=cfg.micro_batch, block_size=cfg.seq_len, rank=group.rank,
                           world_size=group.size, seed=seed, device=group.device)

    train = stream(data.train, cfg.seed)
    tcfg = TrainConfig(steps=cfg.steps, total_batch_tokens=total_batch(cfg, group.size),
                       micro_batch=cfg.micro_batch, seq_len=cfg.seq_len, lr=cfg.lr, warmup_steps=5,
                       dtype=cfg.dtype, eval_batches=2, log_every=0, progress=False, wandb=cfg.wandb,
                       run_name=name, checkpoint_every=checkpoint_every)
    where = {"mesh": mesh} if mesh is not None else {"group": group}
    trainer = Trainer(model, opt, train, tcfg, val_data=stream(data.val, cfg.seed + 1), recorder=recorder,
                      checkpoints=checkpoints, **where)
    return Run(name, raw, model, opt, trainer, train)


# ----------------------------------------------------------------------------- what a run measured

def summarize(run: Run) -> dict:
    """Throughput (median over the steps after warm-up), losses, and the wrapper's transport and timeline."""
    trainer = run.trainer
    timed = trainer.history[WARMUP_STEPS:] or trainer.history
    step_s = statistics.median(h["time_s"] for h in timed)
    out = {"impl": run.name, "world_size": trainer.world.size, "grad_accum": trainer.grad_accum,
           "compiled": any(getattr(m, "_compiled_call_impl", None) is not None for m in run.raw.modules()),
           "tokens_per_step": trainer.tokens_per_step, "median_step_s": step_s,
           "tokens_per_s": trainer.tokens_per_step / step_s,
           "median_optimizer_step_s": statistics.median(h["optimizer_s"] for h in timed), "losses": [round(h["loss"], 5) for h in trainer.history],
           "grad_norms": [h.get("grad_norm") for h in trainer.history],
           "val_loss": trainer.history[-1].get("val_loss") if trainer.history else None,
           "params": num_params(run)}
    out.update(hardware_use(run, out["tokens_per_s"], out["params"]))
    if isinstance(run.model, DDP) or hasattr(run.optimizer, "transport"):
        out["transport"] = transport(run)
    if isinstance(run.model, DDP) and run.model.record_timeline:
        out["timeline"] = run.model.timeline
        out["buckets"] = [b.numel for b in run.model.buckets]
    return out


def hardware_use(run: Run, tokens_per_s: float, params: int) -> dict:
    """The model's FLOPs per token, the TFLOP/s each rank reached, and MFU against the device's peak
    (nanodist.perf: a GPU's datasheet rate, a CPU's measured matmul rate), with where the peak comes from."""
    cfg, world = run.trainer.cfg, run.trainer.world.size
    fpt = run.raw.flops_per_token(cfg.seq_len, num_params=params)
    peak = perf.peak_flops(run.trainer.group.device, cfg.dtype)
    return {"flops_per_token": fpt, "tflops_per_rank": tokens_per_s * fpt / world / 1e12,
            "mfu": perf.mfu(tokens_per_s, fpt, world, peak.flops), "peak_flops": peak.flops, "peak_source": peak.source}


def use_line(r: dict) -> str:
    """'0.012 TFLOP/s/rank  MFU 21.3 %' for a summarize() result (or why there is no MFU)."""
    mfu = f"MFU {100 * r['mfu']:.1f} %" if r.get("mfu") is not None else "MFU n/a"
    return f"{r['tflops_per_rank']:.3f} TFLOP/s/rank  {mfu}"


def num_params(run: Run) -> int:
    """The model's parameters, counted whole (a tied one once) whatever shards them."""
    if isinstance(run.model, FSDP):  # the bare model has handed its parameters to the units
        return sum(unit.numel for unit in run.model.units)
    return sum(p.numel() for p in run.raw.parameters())  # a DTensor (FSDP2) counts its global size


def transport(run: Run) -> str:
    """How this run's gradients travel: "shared memory", "the process group", or "none" (a world of one)."""
    if run.trainer.group.size == 1:
        return "none"
    if isinstance(run.model, DDP):
        return "shared memory" if run.model.shared_memory else "the process group"
    return getattr(run.optimizer, "transport", "the process group")


def measure_memory_step(run: Run) -> dict:
    """One more step, measured right after optimizer.step(): parameters, gradients and state all alive."""
    x, y = next(run.train)
    device = run.trainer.group.device
    with autocast(run.trainer.cfg.dtype, device):
        _, loss = run.model(x, y)
    loss.backward()
    run.optimizer.step()
    report = measure_memory(run.model, run.optimizer).to_dict()
    run.optimizer.zero_grad(set_to_none=True)
    return report


def measure_peak_step(run: Run, trace: bool = False, max_points: int = 1500) -> dict:
    """One more step, its memory per rank by our own accounting: the model states (params or shards, the
    gradients the optimizer finds after backward, optimizer state); what is held throughout ("held": params,
    optimizer state and gradient buffers kept between steps, as DDP's buckets); the peak of what the step
    allocates on top of that (activations, gradients, gathered units, temporaries) from
    nanodist.memory.AllocationTracker, and "peak" = held + that; the largest saved activations and gathered
    units from LiveBytes.

    trace=True adds "trace": the bytes allocated after each operation of the step ("total"), with the saved
    activations and gathered units at the same moments and where forward, backward and the optimizer began
    ("phases", as operation indices); at most max_points points (each the largest of the operations it covers).
    On a GPU, "cuda_step_peak" is the same peak as torch's allocator counts it (torch.cuda.max_memory_allocated
    over the step, less what was allocated when it began), to set beside "step_peak": ours counts the outputs of
    operations, so it cannot see what an operation allocates and frees inside itself, nor library workspaces."""
    from .memory import AllocationTracker, LiveBytes, allocated_peak
    x, y = next(run.train)
    run.optimizer.zero_grad(set_to_none=True)
    states = measure_memory(run.model, run.optimizer)
    held = states.params + states.optimizer_state
    alloc = AllocationTracker()
    live = LiveBytes(clock=lambda: len(alloc.timeline))
    gpu = next((p.device for p in run.model.parameters() if p.device.type == "cuda"), None)
    fsdp = run.model if isinstance(run.model, FSDP) else None
    if fsdp is not None:  # FSDP's events say which bytes are gathered units
        saved = _add_observer(fsdp, live)
    phases = {}
    # On a GPU, the allocator's own count of the same step (above what was allocated when it began: other runs'
    # models alive beside this one are not the step's), to set beside ours.
    with (allocated_peak() if gpu is not None else contextlib.nullcontext({})) as cuda, alloc, live.track(), \
            autocast(run.trainer.cfg.dtype, run.trainer.group.device):
        phases["forward"] = len(alloc.timeline)
        _, loss = run.model(x, y)
        phases["backward"] = len(alloc.timeline)
        loss.backward()
        grads = measure_memory(run.model, run.optimizer).grads  # the gradients as the optimizer will find them
        # Gradient memory allocated before the step and kept (DDP's buckets, ZeRO's shards) is held throughout.
        kept = [g for g in _gradients(run) if not alloc.is_new(g)]
        phases["optimizer"] = len(alloc.timeline)
        run.optimizer.step()
    if fsdp is not None:
        fsdp.observer = saved
    run.optimizer.zero_grad(set_to_none=True)
    acts = live.summary()
    held += tensor_bytes(kept)
    out = {"held": held, "params": states.params, "grads": grads, "optimizer_state": states.optimizer_state,
           "step_peak": alloc.peak, "peak": held + alloc.peak, "activations_max": acts["max"]["activations"],
           "gathered_max": acts["max"]["gathered"]}
    if gpu is not None:
        out["cuda_step_peak"] = cuda["peak"]
    if trace:
        out["trace"] = _memory_trace(alloc.timeline, live.events, phases, max_points)
    return out


def _gradients(run: Run) -> list[torch.Tensor]:
    grads = [p.grad for p in run.model.parameters() if p.grad is not None]
    grads += list(getattr(run.optimizer, "gradient_buffers", lambda: [])())
    return [g.to_local() if hasattr(g, "to_local") else g for g in grads]  # a DTensor's memory is its local shard


def _add_observer(fsdp: FSDP, observer) -> object:
    """Let `observer` see FSDP's events beside those it has already (one, a list, or none); returns what was there,
    to put back."""
    saved = fsdp.observer
    fsdp.observer = [observer] + (list(saved) if isinstance(saved, (list, tuple)) else [saved] if saved else [])
    return saved


def _memory_trace(total: list[int], events: list[tuple], phases: dict, max_points: int) -> dict:
    """Per operation: bytes allocated, and the saved activations and gathered units then (LiveBytes' events,
    stamped with the operation count); kept to max_points by taking each window's largest total."""
    kinds = {"activations": 0, "gathered": 0}
    at = {k: [0] * len(total) for k in kinds}
    j = 0
    for i in range(len(total)):
        while j < len(events) and events[j][2] <= i + 1:
            kinds[events[j][0]] += events[j][1]
            j += 1
        for k in kinds:
            at[k][i] = kinds[k]
    stride = max(1, math.ceil(len(total) / max_points))
    keep = [max(range(s, min(s + stride, len(total))), key=total.__getitem__) for s in range(0, len(total), stride)]
    return {"index": keep, "total": [total[i] for i in keep], "activations": [at["activations"][i] for i in keep],
            "gathered": [at["gathered"][i] for i in keep], "phases": phases}


# ----------------------------------------------------------------------------- --profile

def add_profile_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--profile", action="store_true",
                   help=f"after the timed runs, one more step of {what} under torch.profiler: a Chrome trace per rank "
                        "(chrome://tracing or https://ui.perfetto.dev), the overlap of communication with compute "
                        "read off it, checked against nanodist's own record of the step; its time beside unprofiled "
                        "steps")


def _own_record(run: Run):
    """nanodist's own record of the next step's collectives, from its observers: (detach, read) where read() gives
    [(kind, numel)] in launch order; None for what keeps no record (torch's DDP and FSDP2, ZeRO-1)."""
    from .fsdp import FSDPTimeline
    from .sync import BucketTimeline
    ours = isinstance(run.model, (DDP, FSDP)) or hasattr(run.optimizer, "observe")
    if ours and run.trainer.group.size == 1:  # nanodist's wrappers and optimizers launch nothing in a world of one
        return (lambda: None), (lambda: [])
    # DDP all-reduces each bucket as the backward fills it; ZeRO-2 reduce-scatters it (world size x its row)
    owner, kind = ((run.model, "all_reduce") if isinstance(run.model, DDP) else
                   (run.optimizer, "reduce_scatter") if getattr(run.optimizer, "zero_stage", None) == 2
                   and hasattr(run.optimizer, "observe") else (None, None))
    if owner is not None:
        tl, saved = BucketTimeline(), getattr(owner, "_observer", None)  # DDP.observe(None) puts its own back
        owner.observe(tl)
        return (lambda: owner.observe(saved),
                lambda: [(kind, e["numel"]) for e in sorted(tl.entries, key=lambda e: e["launch_s"])])
    if isinstance(run.model, FSDP):
        tl = FSDPTimeline()
        saved = _add_observer(run.model, tl)
        kinds = {"gather_started": "all_gather", "reduce_started": "reduce_scatter"}
        return (lambda: setattr(run.model, "observer", saved),
                lambda: [(kinds[e["event"]], e["numel"]) for e in tl.events if e["event"] in kinds])
    return None


def profile_step(run: Run, path, unprofiled: int = 3) -> dict:
    """One more training step of `run` under torch.profiler (the CPU, and CUDA on a GPU; shapes recorded), its
    Chrome trace written to `path`, beside `unprofiled` steps timed without it; and what the trace says
    (nanodist.profile): the collectives in launch order, the compute and communication lanes, the fraction of
    communication under compute, and whether nanodist's own record of the step (DDP's and ZeRO-2's bucket
    timeline, FSDP's events) shows the same collectives in the same order. The extra steps are not the run's:
    its results file and progress bar do not see them. A collective call on every rank (each profiles its own)."""
    import time

    from torch.profiler import ProfilerActivity, profile

    from . import profile as prof
    trainer, group = run.trainer, run.trainer.group
    cuda = group.device.type == "cuda"
    saved_cfg, saved_recorder = trainer.cfg, trainer.recorder
    # room for the steps below, and one more: the last step of a run evaluates, and none of these should
    trainer.cfg = dataclasses.replace(saved_cfg, steps=trainer.step + unprofiled + 2, progress=False)
    trainer.recorder = None

    def step() -> float:
        if cuda:
            torch.cuda.synchronize(group.device)
        t = time.perf_counter()
        trainer.fit(max_steps=1)
        if cuda:
            torch.cuda.synchronize(group.device)
        return time.perf_counter() - t

    try:
        times = [step() for _ in range(unprofiled)]
        own = _own_record(run)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        try:
            with warnings.catch_warnings():  # torch 2.11 warns that a one-cycle profile keeps one cycle's events
                warnings.filterwarnings("ignore", message=".*Profiler clears events")
                with profile(activities=activities, record_shapes=True) as p:
                    with prof.step_marker():
                        profiled = step()
        finally:
            if own is not None:
                own[0]()
    finally:
        trainer.cfg, trainer.recorder = saved_cfg, saved_recorder
    p.export_chrome_trace(str(path))
    trace = prof.read_trace(path)
    record = own[1]() if own is not None else None
    unprofiled_s = statistics.median(times)
    return {"impl": run.name, "trace": os.path.basename(str(path)), "device": trace.device,
            "profiled_step_s": profiled, "unprofiled_step_s": unprofiled_s,
            "ratio_profiled_vs_unprofiled": profiled / unprofiled_s,
            "step_s": trace.step_s, "compute_s": trace.busy_s("compute"), "communication_s": trace.busy_s("communication"),
            "overlap": trace.overlap(),
            "collectives": [dataclasses.asdict(c) for c in trace.collectives],
            "own_record": record,
            "agreement": prof.agree(trace.collectives, record) if record is not None and group.size > 1 else None}


def profile_line(p: dict) -> str:
    """One printed line for a profile_step result."""
    overlap = "no communication" if p["overlap"] is None else f"{100 * p['overlap']:.0f} % of it under compute"
    a = p["agreement"]
    if a is None and p["own_record"] == []:
        check = "nanodist's own record: no collectives either (nothing travels in a world of one)"
    elif a is None:
        check = "nanodist keeps no record of this implementation's collectives to compare"
    elif a["missing"] is None and not a["agrees"]:
        check = "nanodist's own record DISAGREES: it holds no collective at all"
    elif a["agrees"]:
        check = f"nanodist's own record of its {a['of']} collective(s): the same, in the same order"
    else:
        check = (f"nanodist's own record DISAGREES: its collective {a['matched'] + 1} of {a['of']}, "
                 f"{a['missing'][0]} of {a['missing'][1]} elements, is not in the trace where expected")
    return (f"profile {p['impl']}: profiled step {1e3 * p['profiled_step_s']:.1f} ms, unprofiled "
            f"{1e3 * p['unprofiled_step_s']:.1f} ms (ratio {p['ratio_profiled_vs_unprofiled']:.2f}); "
            f"compute {1e3 * p['compute_s']:.1f} ms, communication {1e3 * p['communication_s']:.1f} ms, {overlap}; "
            f"{len(p['collectives'])} collective(s) traced; {check}")


def profile_runs(runs: dict, names, recorder, group: Group) -> dict:
    """--profile: profile_step for each of `names` that `runs` has, one after another, traces beside the run's
    results file; prints a line each on rank 0 and returns {name: [each rank's profile_step result]}."""
    out, run_id = {}, group.broadcast_object(recorder.run_id)  # the results file's: rank 0's
    if not any(name in runs for name in names):
        runtime.print0(f"--profile: none of {', '.join(names)} trained in this launch: nothing profiled")
    for name in names:
        if name not in runs:
            continue
        mine = profile_step(runs[name], recorder.trace_path(name, group.rank, run_id))
        out[name] = group.all_gather_object(mine)
        runtime.print0(profile_line(mine))
    if out:
        runtime.print0(f"traces: {results.shown(recorder.trace_path(next(iter(out)), 0, run_id).parent)}"
                       f"/{run_id}.*{results.TRACE_SUFFIX} (chrome://tracing or https://ui.perfetto.dev)")
    return out
