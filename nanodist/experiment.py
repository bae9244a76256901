"""From a lab's flags to a training run: checked flags, then model, data, wrapper, optimizer, Trainer, recorder.

    parser = argparse.ArgumentParser(); experiment.add_arguments(parser)
    args = parser.parse_args()
    info = experiment.start(parser, args)          # every flag checked, results folder writable, then init()
    data = experiment.load_data(args)              # corpus -> tokenizer -> tokens, once per lab
    run = experiment.build(args, data, info.group, wrapper="nanodist", optimizer="adamw", name="nanodist")
    run.trainer.fit()

Every training lab trains the same GPT from the same seeded weights on the same data; what differs is
who averages the gradients (`wrapper`) and with which optimizer. Building that in one place keeps the
labs short, and makes the comparison fair by construction.

Wrappers: "single" (a world of one: this rank alone, no communication), "nanodist" (nanodist.DDP,
through shared memory on CPU ranks of one machine unless --shared-memory off), "nanodist-pg"
(nanodist.DDP through the process group, like torch), "torch" (torch's DDP), "naive" (NaiveDDP),
"none" (the bare model: the optimizer averages, ZeRO), "fsdp" (nanodist.FSDP, every Block a unit) and
"fsdp2" (torch's fully_shard on every Block and the root, on a CPU or GPU mesh of the group). Optimizers: "adamw" (torch.optim.AdamW),
"dist-adamw" (DistAdamW), "dist-muon" (make_muon_optimizer: Muon for matrices, AdamW for the rest).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
from dataclasses import dataclass

import torch
from torch import nn

from . import perf, results, runtime
from .data import CharTokenizer, TokenStream, load_corpus, train_val_split
from .ddp import DDP, NaiveDDP
from .fsdp import FSDP
from .group import Group
from .memory import measure_memory, tensor_bytes
from .model import GPT, PRESETS, GPTConfig
from .optim import DistAdamW, MuonAdamW, ZeroOptimizer, make_muon_optimizer
from .train import TrainConfig, Trainer, autocast, grad_accum_steps

WRAPPERS = ("single", "nanodist", "nanodist-pg", "torch", "naive", "none", "fsdp", "fsdp2")
# muon: torch's Muon + AdamW (MuonAdamW); zero1-adamw: nanodist's ZeroOptimizer over torch's AdamW (bare model);
# zero-redundancy-adamw: torch's ZeroRedundancyOptimizer over AdamW, behind a DDP wrapper
OPTIMIZERS = ("adamw", "muon", "dist-adamw", "dist-muon", "zero1-adamw", "zero-redundancy-adamw")
SELF_AVERAGING = ("dist-adamw", "dist-muon", "zero1-adamw")  # optimizers that average the gradients themselves
WARMUP_STEPS = 3  # excluded from step times: the first steps pay for allocation and thread start-up


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
    problem = (check_positive(args, ["steps", "micro_batch", "seq_len", "threads"])
               or check_positive(args, ["total_batch"], "a positive number of tokens")
               or check_positive(args, ["lr", "bucket_mb"], "a positive finite number", integer=False))
    if problem:
        return problem
    if args.steps < min_steps:
        why = f" (the first {WARMUP_STEPS} are warm-up, not timed)" if min_steps > 1 else ""
        return f"--steps must be more than {min_steps - 1}{why}"
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
    if args.model == "auto":
        args.model = auto_model(info.device)
        runtime.print0(f"--model auto: the {args.model!r} preset on {info.device.type}")
    return info


def auto_model(device) -> str:
    """--model auto: the smallest model that shows the point on a CPU; a GPU-scale one (GPT-2 small) on a GPU."""
    return "gpt2" if torch.device(device).type == "cuda" else "small"


def total_batch(args, world_size: int) -> int | None:
    """Tokens per optimizer step: --total-batch, or (strong scaling) 4 micro-batches so 1, 2 and 4 ranks divide
    it, or (weak scaling and the default) one micro-batch per rank."""
    if args.total_batch is not None:
        return args.total_batch
    if getattr(args, "scaling", "weak") == "strong":
        return args.micro_batch * args.seq_len * 4
    return None


def use_shared_memory(args, group: Group) -> bool:
    """--shared-memory auto: on when every rank is a CPU process on this machine (gloo would go through TCP)."""
    if args.shared_memory != "auto":
        return args.shared_memory == "on"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", group.size))
    return group.device.type == "cpu" and group.size > 1 and local == group.size


# ----------------------------------------------------------------------------- building a run

@dataclass
class Data:
    tokens: torch.Tensor
    vocab_size: int
    train: torch.Tensor
    val: torch.Tensor


def load_data(args) -> Data:
    """The corpus (--data or the built-in one), a character tokenizer, and the 90/10 train/validation split."""
    text = load_corpus(args.data)
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


def build_model(args, vocab_size: int, device) -> GPT:
    """The lab's GPT from the seeded initial weights: identical for every run and on every rank."""
    torch.manual_seed(args.seed)
    # A preset that names its vocabulary (gpt2: 50304, GPT-2's padded to a multiple of 64) keeps it: the
    # character tokenizer uses the first rows, and the model has the size and the FLOPs of the real one.
    name = auto_model(device) if args.model == "auto" else args.model
    vocab_size = max(vocab_size, PRESETS[name].get("vocab_size", 0))
    cfg = GPTConfig.preset(name, vocab_size=vocab_size, block_size=args.seq_len)
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


def build(args, data: Data, group: Group, *, wrapper: str, optimizer: str = "adamw", name: str | None = None,
          zero_stage: int | None = None, record_timeline: bool = False, recorder=None,
          weight_decay: float = 0.1, observer=None, checkpoints=None, checkpoint_every: int = 0) -> Run:
    """A Run: model (wrapped as `wrapper`), optimizer, data streams of this rank, and its Trainer."""
    if wrapper not in WRAPPERS or optimizer not in OPTIMIZERS:
        raise ValueError(f"wrapper must be one of {WRAPPERS} and optimizer one of {OPTIMIZERS}, got {wrapper!r}, "
                         f"{optimizer!r}")
    if (wrapper == "none") != (optimizer in SELF_AVERAGING) or (optimizer == "muon" and wrapper.startswith("fsdp")):
        raise ValueError(f"wrapper='none' (the bare model) goes with a sharded optimizer ({', '.join(SELF_AVERAGING)}), "
                         f"which averages the gradients itself, and every other wrapper with 'adamw' (or, but for "
                         f"FSDP, whose flat shards are no matrices, 'muon'); got "
                         f"wrapper={wrapper!r} with optimizer={optimizer!r}")
    group = Group.local(group.device) if wrapper == "single" else group
    name = name or wrapper
    raw = build_model(args, data.vocab_size, group.device)
    shm = use_shared_memory(args, group)
    model: nn.Module = raw
    if wrapper in ("nanodist", "nanodist-pg"):
        model = DDP(raw, bucket_cap_mb=args.bucket_mb, group=group, record_timeline=record_timeline,
                    shared_memory=wrapper == "nanodist" and shm)
    elif wrapper == "torch":
        model = torch.nn.parallel.DistributedDataParallel(
            raw, bucket_cap_mb=args.bucket_mb, process_group=group.pg,
            device_ids=[group.device.index] if group.device.type == "cuda" else None)
    elif wrapper == "naive":
        model = NaiveDDP(raw, group=group)
    elif wrapper == "fsdp":
        lp = torch.bfloat16 if getattr(args, "param_dtype", "fp32") == "bf16" else None
        model = FSDP(raw, units=list(raw.blocks), group=group, param_dtype=lp, observer=observer,
                     prefetch=not getattr(args, "no_prefetch", False))
    elif wrapper == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        lp = torch.bfloat16 if getattr(args, "param_dtype", "fp32") == "bf16" else None
        mp = MixedPrecisionPolicy(param_dtype=lp, reduce_dtype=torch.float32 if lp else None)
        for block in raw.blocks:
            fully_shard(block, mesh=group.device_mesh, mp_policy=mp)  # the mesh of this group, on its device
        model = fully_shard(raw, mesh=group.device_mesh, mp_policy=mp)
    raw.activation_checkpointing = getattr(args, "checkpointing", False)
    if getattr(args, "compile", False):
        compile_model(raw, wrapper)
    zero = dict(zero_stage=zero_stage or getattr(args, "zero_stage", 2), bucket_cap_mb=args.bucket_mb,
                collectives="shm" if shm else getattr(args, "collectives", "auto"), group=group)
    if optimizer == "adamw":
        groups = (model if wrapper == "fsdp" else raw).configure_param_groups(weight_decay)
        fused = group.device.type == "cuda" or None  # torch's fused kernel on a GPU, as the GPU baselines use
        opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=fused)
    elif optimizer == "muon":
        opt = MuonAdamW(raw, lr=args.lr, muon_lr=getattr(args, "muon_lr", 0.02), weight_decay=weight_decay,
                        betas=(0.9, 0.95))
    elif optimizer == "dist-adamw":
        opt = DistAdamW(raw.configure_param_groups(weight_decay), lr=args.lr, betas=(0.9, 0.95), **zero)
    elif optimizer == "zero1-adamw":
        opt = ZeroOptimizer(raw.configure_param_groups(weight_decay), torch.optim.AdamW, group=group,
                            bucket_cap_mb=args.bucket_mb, lr=args.lr, betas=(0.9, 0.95))
    elif optimizer == "zero-redundancy-adamw":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        groups = [{k: v for k, v in g.items() if k != "param_names"} for g in raw.configure_param_groups(weight_decay)]
        opt = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, process_group=group.pg, lr=args.lr,
                                      betas=(0.9, 0.95))
    else:
        opt = make_muon_optimizer(raw, lr=args.lr, muon_lr=getattr(args, "muon_lr", 0.02),
                                  weight_decay=weight_decay, betas=(0.9, 0.95), **zero)

    def stream(tokens, seed):
        return TokenStream(tokens, batch_size=args.micro_batch, block_size=args.seq_len, rank=group.rank,
                           world_size=group.size, seed=seed, device=group.device)

    train = stream(data.train, args.seed)
    cfg = TrainConfig(steps=args.steps, total_batch_tokens=total_batch(args, group.size),
                      micro_batch=args.micro_batch, seq_len=args.seq_len, lr=args.lr, warmup_steps=5,
                      dtype=args.dtype, eval_batches=2, log_every=0, progress=False, wandb=args.wandb,
                      run_name=name, checkpoint_every=checkpoint_every)
    trainer = Trainer(model, opt, train, cfg, val_data=stream(data.val, args.seed + 1), recorder=recorder,
                      group=group, checkpoints=checkpoints)
    return Run(name, raw, model, opt, trainer, train)


# ----------------------------------------------------------------------------- what a run measured

def summarize(run: Run) -> dict:
    """Throughput (median over the steps after warm-up), losses, and the wrapper's transport and timeline."""
    trainer = run.trainer
    timed = trainer.history[WARMUP_STEPS:] or trainer.history
    step_s = statistics.median(h["time_s"] for h in timed)
    out = {"impl": run.name, "world_size": trainer.group.size, "grad_accum": trainer.grad_accum,
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
    cfg, world = run.trainer.cfg, run.trainer.group.size
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
    ("phases", as operation indices); at most max_points points (each the largest of the operations it covers)."""
    from .memory import AllocationTracker, LiveBytes
    x, y = next(run.train)
    run.optimizer.zero_grad(set_to_none=True)
    states = measure_memory(run.model, run.optimizer)
    held = states.params + states.optimizer_state
    alloc = AllocationTracker()
    live = LiveBytes(clock=lambda: len(alloc.timeline))
    fsdp = run.model if isinstance(run.model, FSDP) else None
    if fsdp is not None:  # FSDP's events say which bytes are gathered units
        saved = fsdp.observer
        fsdp.observer = [live] + (list(saved) if isinstance(saved, (list, tuple)) else [saved] if saved else [])
    phases = {}
    with alloc, live.track(), autocast(run.trainer.cfg.dtype, run.trainer.group.device):
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
    if trace:
        out["trace"] = _memory_trace(alloc.timeline, live.events, phases, max_points)
    return out


def _gradients(run: Run) -> list[torch.Tensor]:
    grads = [p.grad for p in run.model.parameters() if p.grad is not None]
    grads += list(getattr(run.optimizer, "gradient_buffers", lambda: [])())
    return [g.to_local() if hasattr(g, "to_local") else g for g in grads]  # a DTensor's memory is its local shard


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
