"""Lab 6 — checkpointing: save the whole training state, resume after a crash bit for bit, reshard, measure the cost.

    # train with a checkpoint every 4 steps; rank 1 is killed at step 7; torchrun restarts the group, which resumes
    torchrun --nproc_per_node=2 --max-restarts=1 labs/lab06_checkpoint.py --impl fsdp --steps 12 \\
        --checkpoint-dir /tmp/ck --checkpoint-every 4 --die-at 7
    # the same run at another world size, from the step-8 checkpoint (sharded checkpoints reshard)
    torchrun --nproc_per_node=3 labs/lab06_checkpoint.py --impl fsdp --steps 12 --checkpoint-dir /tmp/ck \\
        --resume /tmp/ck/step_00000008
    # what saving costs: full vs sharded vs asynchronous, save and load time, size on disk
    torchrun --nproc_per_node=2 labs/lab06_checkpoint.py --bench --model medium

Training runs (the default) write, besides the usual steps: a fingerprint (SHA-256 of every parameter and
optimizer-state tensor, whole) at the end and right after a resume, which windows of the data each rank
read (to check that every window of the epoch is read exactly once across a resume at another world size),
and every save's cost. --impl chooses what trains:
  ddp     nanodist.DDP + AdamW
  zero    the bare model + DistMuon for the matrices and DistAdamW for the rest (make_muon_optimizer)
  fsdp    nanodist.FSDP + AdamW
  fsdp2   torch's fully_shard + AdamW
"""
import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import nanodist as nd
from nanodist import experiment, faults
from nanodist.checkpoint import CheckpointManager, fingerprint, load, read_meta
from nanodist.results import Recorder

IMPLS = {"ddp": ("nanodist-pg", "adamw"), "zero": ("none", "dist-muon"), "fsdp": ("fsdp", "adamw"),
         "fsdp2": ("fsdp2", "adamw")}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=list(IMPLS), default="fsdp")
    p.add_argument("--checkpoint-dir", default=None, help="where checkpoints go (training runs need one)")
    p.add_argument("--checkpoint-every", type=int, default=4, help="save every this many steps, and at the end")
    p.add_argument("--checkpoint-format", choices=["full", "sharded"], default="sharded")
    p.add_argument("--async-checkpoint", action="store_true", help="snapshot, then write in the background")
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept (the newest)")
    p.add_argument("--resume", default="auto", help="auto (the newest complete checkpoint, if any), a path, or none")
    p.add_argument("--die-at", type=int, default=None,
                   help="kill --die-rank by SIGKILL just before this step, on the first attempt only (a fault to "
                        "recover from: run under torchrun --max-restarts=1)")
    p.add_argument("--die-rank", type=int, default=1)
    p.add_argument("--bench", action="store_true", help="measure save/load time and size instead of training")
    p.add_argument("--repeats", type=int, default=3, help="--bench: saves and loads of each kind, interleaved")
    experiment.add_arguments(p, steps=12)
    return p, p.parse_args()


def check(args, world_size):
    if not args.bench and args.checkpoint_dir is None:
        return "--checkpoint-dir is required for a training run (or use --bench)"
    if args.checkpoint_dir is not None and not args.checkpoint_dir.strip():
        return "--checkpoint-dir is empty: name a directory (an empty name would put checkpoints in the current one)"
    for name in ("checkpoint_every", "keep", "repeats"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}"
    if args.die_at is not None and not 0 < args.die_at < args.steps:
        return f"--die-at must be a step between 1 and {args.steps - 1}, got {args.die_at}"
    if args.die_at is not None and not 0 <= args.die_rank < world_size:
        return f"--die-rank must be a rank of this run (0..{world_size - 1}), got {args.die_rank}"
    return None


def positions(stream, start: int, stop: int) -> list[int]:
    """The positions in this epoch's window order that this rank read while the cursor went from start to stop."""
    return list(range(start + stream.rank, stop, stream.world_size))


def train(args, cfg, group, data) -> None:
    ckpt = CheckpointManager(args.checkpoint_dir, keep=args.keep, format=args.checkpoint_format,
                             async_save=args.async_checkpoint, group=group, record_fingerprint=True)
    path = ckpt.find(args.resume)
    run_id = None
    if path is not None and os.environ.get("NANODIST_RUN_ID_SOURCE") != "user":
        run_id = read_meta(path)["run_id"]  # a resumed run continues its results file and its wandb run
    rec = Recorder("lab06_checkpoint", config={**vars(args), **cfg.to_dict()}, run_id=run_id)
    wrapper, optimizer = IMPLS[args.impl]
    run = experiment.build(cfg, data, group, wrapper=wrapper, optimizer=optimizer, name=args.impl, recorder=rec,
                           checkpoints=ckpt, checkpoint_every=args.checkpoint_every)
    trainer = run.trainer
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    resumed = None
    if path is not None:
        load(path, trainer, group=group)
        resumed = {"path": str(path), "step": trainer.step, "attempt": attempt, "world_size": group.size,
                   "fingerprint": fingerprint(trainer)}
        nd.print0(f"attempt {attempt}: resumed from {path.name} at step {trainer.step} on {group.size} rank(s)")
    epoch, start = run.train.epoch, run.train.consumed
    if args.die_at is not None and attempt == 0:
        trainer.fit(max_steps=args.die_at - trainer.step)
        faults.die(rank=args.die_rank)
    trainer.fit()
    if run.train.epoch != epoch:
        raise RuntimeError("the run crossed an epoch boundary: use fewer steps for the exactly-once check")
    read = group.all_gather_object(positions(run.train, start, run.train.consumed))
    rec.metrics.update(
        impl=args.impl, fingerprint=fingerprint(trainer), losses_this_attempt=[h["loss"] for h in trainer.history],
        resumed=resumed, attempt=attempt, windows={"world_size": group.size, "start": start,
                                                   "stop": run.train.consumed, "positions": read},
        saves=[{"step": r.step, "blocked_s": r.blocked_s, "format": r.format} for r in ckpt.reports])
    nd.print0(f"attempt {attempt}: trained to step {trainer.step}; fingerprint {rec.metrics['fingerprint'][:16]}")
    nd.print0(f"wrote {nd.results.shown(rec.save())}")


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def bench(args, cfg, group, data) -> None:
    """Save the same state as full, sharded, and both asynchronously, taking turns; then load each."""
    rec = Recorder("lab06_checkpoint", config={**vars(args), **cfg.to_dict()})
    run = experiment.build(cfg, data, group, wrapper="fsdp", optimizer="adamw", name="bench")
    run.trainer.fit(max_steps=1)  # the optimizer has its state
    root = Path(group.broadcast_object(tempfile.mkdtemp(prefix="nanodist-ckpt-bench-") if group.is_main else None))
    kinds = {"full": ("full", False), "sharded": ("sharded", False), "full-async": ("full", True),
             "sharded-async": ("sharded", True)}
    managers = {k: CheckpointManager(root / k, keep=1, format=f, async_save=a, group=group)
                for k, (f, a) in kinds.items()}
    out = {k: {"blocked_s": [], "total_s": []} for k in kinds}
    for _ in range(args.repeats):
        for k, m in managers.items():
            group.barrier()
            t0 = time.perf_counter()
            report = m.save(run.trainer)
            m.wait()
            group.barrier()
            out[k]["blocked_s"].append(report.blocked_s)
            out[k]["total_s"].append(time.perf_counter() - t0)
    for k, m in managers.items():
        out[k]["bytes"] = dir_bytes(m.latest()) if group.is_main else None
        out[k]["load_s"] = []
    for _ in range(args.repeats):  # loads take turns too: one load alone is at the mercy of the machine
        for k, m in managers.items():
            group.barrier()
            t0 = time.perf_counter()
            load(m.latest(), run.trainer, group=group)
            group.barrier()
            out[k]["load_s"].append(time.perf_counter() - t0)
    for k in managers:
        out[k] = {key: statistics.median(v) if isinstance(v, list) else v for key, v in out[k].items()}
    if group.is_main:
        shutil.rmtree(root, ignore_errors=True)
    state_mib = out["full"]["bytes"] / 2**20 if group.is_main else 0
    metrics = {"kinds": out, "params": experiment.num_params(run),
               "ratio_sharded_vs_full_save": out["sharded"]["total_s"] / out["full"]["total_s"],
               "ratio_async_blocked_vs_sync_sharded": out["sharded-async"]["blocked_s"] / out["sharded"]["total_s"],
               "ratio_async_blocked_vs_sync_full": out["full-async"]["blocked_s"] / out["full"]["total_s"]}
    rec.metrics.update(metrics)
    nd.print0(f"== {cfg.model} model ({metrics['params'] / 1e6:.1f} M parameters, a checkpoint of {state_mib:.0f} MiB),"
              f" {group.size} rank(s), median of {args.repeats} saves and loads each, fsync included")
    for k, o in out.items():
        size = f"{o['bytes'] / 2**20:6.1f} MiB on disk" if group.is_main else ""
        nd.print0(f"{k:>14}: training blocked {1e3 * o['blocked_s']:8.1f} ms, saved in {1e3 * o['total_s']:8.1f} ms, "
                  f"loaded in {1e3 * o['load_s']:8.1f} ms, {size}")
    nd.print0(f"ratio sharded / full save time: {metrics['ratio_sharded_vs_full_save']:.2f}")
    nd.print0(f"ratio training blocked by an asynchronous sharded save / a synchronous one: "
              f"{metrics['ratio_async_blocked_vs_sync_sharded']:.2f}")
    nd.print0(f"ratio training blocked by an asynchronous full save / a synchronous one: "
              f"{metrics['ratio_async_blocked_vs_sync_full']:.2f}")
    nd.print0(f"wrote {nd.results.shown(rec.save())}")


def main():
    parser, args = parse_args()
    info = experiment.start(parser, args, min_steps=1, extra_check=check)
    cfg = experiment.RunConfig.from_args(args, info.device, shared_memory="off")  # through the process group
    group, data = info.group, experiment.load_data(cfg)
    (bench if args.bench else train)(args, cfg, group, data)
    nd.shutdown()


if __name__ == "__main__":
    main()
