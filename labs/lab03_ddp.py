"""Lab 3 — data parallel training: nanodist DDP vs torch DDP vs the naive version, speedup and efficiency.

    torchrun --nproc_per_node=2 labs/lab03_ddp.py                       # all of them, plus a 1-rank baseline
    torchrun --nproc_per_node=2 labs/lab03_ddp.py --impl nanodist --steps 200 --wandb
    python labs/lab03_ddp.py --impl single                              # the 1-rank reference run
    torchrun --nproc_per_node=4 labs/lab03_ddp.py --impl nanodist --scaling strong --worlds 1 2 3 4 \
        --total-batch 1536                                              # a scaling curve from one launch
    torchrun --nproc_per_node=2 labs/lab03_ddp.py --impl nanodist --worlds 1 2 --micro-batches 1 4 16

Every implementation trains the same tiny GPT from the same initial weights on the same data
(nanodist.experiment builds them). --scaling weak keeps the micro-batch per rank fixed (more ranks: a
bigger total batch per step); --scaling strong keeps the total batch fixed (more ranks: less work
each). With --baseline (on by default for --impl all) rank 0 also trains alone, as a world of one,
while the other ranks wait: the 1-rank reference measured in the same run, on the same machine.

The implementations take turns in blocks of steps (nanodist.bench), so load from elsewhere on the
machine slows them alike. --worlds and --micro-batches measure one implementation at several world sizes (on
the launch's first N ranks, the others waiting) and micro-batch sizes, in turns, in one launch: Chapter 8's
scaling curves and where communication stops mattering. At the end the lab prints tokens/s per implementation, the throughput ratios
between them, and the speedup and efficiency against the 1-rank baseline, and writes them to
labs/results/lab03_ddp/.
"""
import argparse

import torch
import torch.distributed as dist

import nanodist as nd
from nanodist import diverge, experiment, faults
from nanodist.bench import take_turns
from nanodist.data import TokenStream
from nanodist.model import GPT
from nanodist.results import Recorder, hardware_fingerprint, load_all
from nanodist.sync import LocalFinite

IMPLS = ("nanodist", "nanodist-pg", "torch", "naive", "single")
BLOCK_STEPS = 5  # implementations take turns, this many steps each


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=IMPLS + ("all",), default="all",
                   help="which data-parallel implementation to train (all: torch, nanodist, naive in turn, and "
                        "nanodist-pg when nanodist reduces through shared memory)")
    p.add_argument("--scaling", choices=["weak", "strong"], default="weak")
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=None,
                   help="measure a 1-rank baseline on rank 0 first (default: on for --impl all at 2 or more ranks; at a "
                        "world of one, asked for: plain torch beside the wrapper)")
    p.add_argument("--timeline", action="store_true", help="record nanodist DDP's bucket timeline")
    p.add_argument("--worlds", type=int, nargs="+", default=None,
                   help="measure these world sizes in one launch, each on the first N ranks (one --impl)")
    p.add_argument("--micro-batches", type=int, nargs="+", default=None,
                   help="measure these micro-batch sizes (sequences per rank), at each world size (one --impl)")
    p.add_argument("--verify", action="store_true",
                   help="also check that N ranks x micro-batch train exactly like 1 process x N micro-batches")
    experiment.add_profile_arg(p, "nanodist DDP and torch DDP (those this launch trains)")
    experiment.add_arguments(p, total_batch_help="tokens per optimizer step (default: weak = micro-batch x seq-len "
                                                 "x ranks; strong = micro-batch x seq-len x 4)")
    args = p.parse_args()
    return p, args


def single_only(args, world_size):
    if world_size > 1 and args.impl == "single":
        return "--impl single is the 1-rank reference: run it without torchrun (or use --baseline)"
    if args.worlds is None and args.micro_batches is None:
        return None
    if args.profile:
        return "--profile traces one step of the implementations a launch trains: not with --worlds or --micro-batches"
    if args.impl in ("all", "single") or args.verify:
        return "--worlds and --micro-batches measure one data-parallel --impl (nanodist, torch, naive), " \
               "without --verify"
    if args.timeline and args.impl not in ("nanodist", "nanodist-pg"):
        return "--timeline records nanodist DDP's buckets: use it with --impl nanodist or nanodist-pg"
    return experiment.check_sweep(args, world_size)


def verify_equivalence(cfg, data, group, steps: int = 5) -> dict:
    """Averaging gradients over N ranks == one process on the N-times bigger batch: run both, compare.

    Every rank trains nanodist DDP on its own micro-batch; rank 0 also trains a plain copy of the model
    on all ranks' micro-batches concatenated. Both use SGD, whose update is linear in the gradient, so
    rounding differences stay rounding-sized (Adam's g / sqrt(v) turns the noise in a near-zero gradient
    into a full-size step of either sign). Returns the largest gradient and parameter differences per step.
    """
    model = experiment.build_model(cfg, data.vocab_size, group.device)
    big = GPT(model.config).to(group.device)
    big.load_state_dict(model.state_dict())
    planted = GPT(model.config).to(group.device)  # the same, with a bug: rank 0's gradient 1.001 x too large
    planted.load_state_dict(model.state_dict())
    ddp = nd.DDP(model, bucket_cap_mb=cfg.bucket_mb, group=group)
    planted_ddp = nd.DDP(planted, bucket_cap_mb=cfg.bucket_mb, group=group)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, big)]
    stream = TokenStream(data.tokens, batch_size=cfg.micro_batch, block_size=cfg.seq_len,
                                    rank=group.rank, world_size=group.size, seed=cfg.seed, device=group.device)
    grad_diffs, param_diffs, planted_diff = [], [], None
    for step in range(steps):
        x, y = next(stream)
        ddp(x, y)[1].backward()
        if step == 0:
            faults.scale_grad(planted_ddp(x, y)[1], rank=0).backward()
        xs = [torch.empty_like(x) for _ in range(group.size)]
        ys = [torch.empty_like(y) for _ in range(group.size)]
        dist.all_gather(xs, x, group=group.pg)
        dist.all_gather(ys, y, group=group.pg)
        if group.is_main:
            big(torch.cat(xs), torch.cat(ys))[1].backward()  # the mean over N*b sequences
            grad_diffs.append(max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(),
                                                                                      big.parameters())))
            if step == 0:
                planted_diff = max((p.grad - q.grad).abs().max().item() for p, q in zip(planted.parameters(),
                                                                                       big.parameters()))
            opts[1].step()
            opts[1].zero_grad()
        opts[0].step()
        opts[0].zero_grad()
        if group.is_main:
            param_diffs.append(max((p - q).abs().max().item() for p, q in zip(model.parameters(), big.parameters())))
    return {"steps": steps, "grad_max_abs_diff": grad_diffs, "max_abs_diff": param_diffs,
            "planted_grad_max_abs_diff": planted_diff, "global_batch": cfg.micro_batch * group.size}


def baseline_from_files(cfg, group, impl: str) -> dict | None:
    """The latest 1-rank run of this lab with the same model and batch, on this machine (the whole hardware
    fingerprint, not the hostname: virtual machines share names like "vm"), with the same backend and device,
    from the reader's own results (never the committed references of other machines), if one exists."""
    here, world_size = hardware_fingerprint(), group.size
    backend = group.backend if group.backend != "local" else "gloo"  # as the results file records it
    keys = ("model", "micro_batch", "seq_len", "scaling", "dtype", "threads")
    same = [r for r in load_all("lab03_ddp", include_reference=False) if r["world_size"] == 1
            and r["hardware"] == here and (r["backend"], r["device"]) == (backend, group.device.type)
            and all(r["config"].get(k) == getattr(cfg, k) for k in keys)
            and (cfg.scaling == "weak" or r["config"].get("total_batch_tokens") ==
                 experiment.total_batch(cfg, world_size))]
    for r in reversed(same):
        for name in (impl, "single"):
            if name in r["metrics"].get("impls", {}):
                return r["metrics"]["impls"][name]
    return None


def sweep(args, cfg, data, group) -> None:
    """--worlds / --micro-batches: one implementation at each world size x micro-batch, in turns (experiment.sweep);
    rank 0 records throughput, and the speedup over 1 rank at each micro-batch."""
    worlds, batches = args.worlds or [group.size], args.micro_batches or [cfg.micro_batch]
    rec = Recorder("lab03_ddp", config={**vars(args), **cfg.to_dict()})
    nd.print0(f"== {args.impl}, {args.scaling} scaling: world sizes {worlds} x micro-batches {batches}, "
              f"{args.steps} steps each, taking turns every {BLOCK_STEPS} steps")
    rows = experiment.sweep(cfg, data, group, worlds, batches, args.steps, BLOCK_STEPS, wrapper=args.impl,
                            record_timeline=args.timeline)
    if group.is_main:
        for row in rows:
            nd.print0(f"W={row['world_size']} micro-batch={row['micro_batch']:>3}: {row['tokens_per_s']:9.0f} tokens/s"
                      f"  step {1e3 * row['median_step_s']:8.2f} ms" +
                      (f"  {args.scaling}-scaling speedup {row['speedup']:.2f}" if "speedup" in row else "") +
                      (f"  backward {1e3 * row['backward_s']:.2f} ms, then waits {1e3 * row['exposed_comm_s']:.2f} ms"
                       " for its buckets" if "backward_s" in row else ""))
        rec.metrics.update({"sweep": rows, "impl": args.impl, "scaling": args.scaling})
    nd.print0(f"wrote {nd.results.shown(rec.save())}")
    nd.shutdown()


def main():
    parser, args = parse_args()
    info = experiment.start(parser, args, extra_check=single_only)
    cfg = experiment.RunConfig.from_args(args, info.device)
    group, data = info.group, experiment.load_data(cfg)
    if args.worlds is not None or args.micro_batches is not None:
        return sweep(args, cfg, data, group)
    impls = ["torch", "nanodist", "naive"] if args.impl == "all" else [args.impl]
    shm = experiment.use_shared_memory(cfg, group)
    if args.impl == "all" and shm:
        impls.insert(2, "nanodist-pg")  # the like-for-like comparison: the same transport as torch DDP
    if args.baseline or (args.baseline is None and args.impl == "all" and group.size > 1):  # at a world of one:
        # asked for, the 1-rank reference beside one wrapper (--compile: compiled plain torch, the MFU to reach)
        impls = ["single"] + impls
        nd.print0("== baseline: rank 0 trains alone, in turns with the others, while the other ranks wait")
    main_impl = "nanodist" if args.impl == "all" else args.impl
    rec = Recorder("lab03_ddp", config={**vars(args), **cfg.to_dict(),
                                       "total_batch_tokens": experiment.total_batch(cfg, group.size)})
    nd.print0(f"== {', '.join(impls)}: {group.size} rank(s), {args.scaling} scaling, {args.steps} steps each, "
              f"taking turns every {BLOCK_STEPS} steps")
    runs = {impl: experiment.build(cfg, data, group, wrapper=impl, name=impl, record_timeline=args.timeline,
                                   recorder=rec if impl == main_impl else None)
            for impl in impls if impl != "single" or group.is_main}
    bar = None
    if group.is_main and not args.no_progress:  # one bar for all implementations
        from tqdm.auto import tqdm
        bar = tqdm(total=len(impls) * args.steps, desc=" + ".join(impls), leave=False)
    take_turns({impl: (lambda r=runs.get(impl): r and r.trainer.fit(max_steps=BLOCK_STEPS)) for impl in impls},
               rounds=-(-args.steps // BLOCK_STEPS), rotate=True, solo={"single"}, group=group,
               progress=bar and (lambda _: bar.update(BLOCK_STEPS)))
    if bar is not None:
        bar.close()
    results = {impl: experiment.summarize(r) for impl, r in runs.items()}

    metrics = {"impls": results, "main_impl": main_impl, "tokens_per_s": results[main_impl]["tokens_per_s"]}
    if args.verify:
        v = metrics["verify"] = verify_equivalence(cfg, data, group)
        nd.print0("N x b == 1 x Nb: largest gradient / parameter difference per step: " +
                  ", ".join(f"{g:.1e}/{d:.1e}" for g, d in zip(v["grad_max_abs_diff"], v["max_abs_diff"])))
        if group.is_main:  # (rank 0 computed the comparison)
            nd.print0(f"the same with a planted bug (rank 0's gradient x 1.001): largest gradient difference at "
                      f"step 0 {v['planted_grad_max_abs_diff']:.1e}")
    for name, r in results.items():
        how = f"  (gradients through {r['transport']})" if "transport" in r else ""
        nd.print0(f"{name:>11}: {r['world_size']} rank(s)  {r['tokens_per_s']:9.0f} tokens/s  "
                  f"{experiment.use_line(r)}  step {1e3 * r['median_step_s']:7.2f} ms  "
                  f"loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}{how}")
    nd.print0(f"MFU against {results[main_impl]['peak_source']}")
    for key, impl, label in (("ratio_nanodist_vs_torch", "nanodist", "nanodist/torch DDP throughput"),
                             ("ratio_nanodist_pg_vs_torch", "nanodist-pg",
                              "nanodist-pg/torch DDP throughput (both through the process group)"),
                             ("ratio_naive_vs_torch", "naive", "naive/torch DDP throughput")):
        if "torch" in results and impl in results:
            metrics[key] = results[impl]["tokens_per_s"] / results["torch"]["tokens_per_s"]
            nd.print0(f"ratio {label}: {metrics[key]:.2f}")
    if group.size == 1 and "single" in results and main_impl != "single":  # --baseline at a world of one
        metrics["ratio_vs_one_process"] = results[main_impl]["tokens_per_s"] / results["single"]["tokens_per_s"]
        nd.print0(f"ratio {main_impl}/plain torch throughput (a world of one, the same run): "
                  f"{metrics['ratio_vs_one_process']:.2f}")
    if "nanodist" in runs and group.size > 1:
        # The divergence detector stays on: what its bookkeeping costs a step, from the collectives DDP tracks
        # (its buckets, the control numbers, the buffer broadcast) and the cost of one, measured here.
        ddp = runs["nanodist"].model
        per_step = len(ddp.buckets) + 2  # at most: a bucket through shared memory is not a tracked collective
        cost = diverge.tracking_cost_s()
        metrics["ratio_divergence_tracking_vs_step"] = per_step * cost / results["nanodist"]["median_step_s"]
        nd.print0(f"ratio divergence-detector bookkeeping / nanodist DDP step: "
                  f"{metrics['ratio_divergence_tracking_vs_step']:.4f} (at most {per_step} tracked collectives a step x "
                  f"{1e6 * cost:.1f} us)")
        # And the check that names the rank of a non-finite gradient (one sum per bucket, kept on the device).
        check = LocalFinite.cost_s([b.extra["grads"] for b in ddp.buckets])
        metrics["ratio_local_finite_check_vs_step"] = check / results["nanodist"]["median_step_s"]
        nd.print0(f"ratio local-gradient finiteness check / nanodist DDP step: "
                  f"{metrics['ratio_local_finite_check_vs_step']:.4f} ({1e6 * check:.0f} us a step)")
    base, source = results.get("single"), "same run"
    if base is None and group.size > 1:
        base, source = baseline_from_files(cfg, group, main_impl), "an earlier 1-rank run"
    if base is None and group.size > 1:
        nd.print0("no speedup: no earlier 1-rank run of this set-up among your results on this machine (the same "
                  "hardware fingerprint, torch, backend and device): run --impl single first, or add --baseline")
    if base is not None and group.size > 1:
        speedup = results[main_impl]["tokens_per_s"] / base["tokens_per_s"]
        metrics.update(speedup=speedup, efficiency=speedup / group.size, baseline_source=source)
        what = f"({main_impl}, {group.size} ranks vs 1, {source})"
        nd.print0(f"{args.scaling}-scaling speedup {what}: {speedup:.2f}")
        nd.print0(f"{args.scaling}-scaling efficiency {what}: {speedup / group.size:.2f}")
    if args.profile:
        metrics["profile"] = experiment.profile_runs(runs, ("nanodist", "torch"), rec, group)
    rec.metrics.update(metrics)
    nd.print0(f"wrote {nd.results.shown(rec.save())}")
    nd.shutdown()


if __name__ == "__main__":
    main()
