"""Lab 4 — ZeRO: DDP + AdamW against DistAdamW (sharded AdamW), DistMuon against DDP + torch's Muon: step time,
optimizer-step time, loss and memory per rank.

    torchrun --nproc_per_node=2 labs/lab04_zero.py                    # all three, taking turns step by step
    torchrun --nproc_per_node=2 labs/lab04_zero.py --opt dist-adamw --zero-stage 1
    python labs/lab04_zero.py --opt dist-muon                         # a world of one works too
    python labs/lab04_zero.py --opt dist-muon ddp-muon                # DistMuon against torch's Muon
    torchrun --nproc_per_node=4 labs/lab04_zero.py --memory-only --steps 2     # memory at stages 0, 1, 2
    torchrun --nproc_per_node=4 labs/lab04_zero.py --memory-only --worlds 1 2 4   # ... at 1, 2 and 4 ranks
    torchrun --nproc_per_node=3 labs/lab04_zero.py --memory-only --record-pipeline --steps 1

Every optimizer trains the same GPT from the same initial weights on the same data (nanodist.experiment);
with --opt all they take turns, one step each, so that load from elsewhere on the machine slows them alike:
  ddp-adamw   nanodist.DDP + torch.optim.AdamW: gradients all-reduced in backward, state replicated (stage 0)
  dist-adamw  bare model + DistAdamW: reduce-scatter in backward, update this rank's slice, all-gather (stage 2)
  dist-muon   bare model + one optimizer with Muon for hidden matrices and AdamW for the rest
  ddp-muon    nanodist.DDP + torch.optim.Muon for the same matrices and torch.optim.AdamW for the rest (MuonAdamW)
Both kinds of run move their gradients the same way (--shared-memory: through shared memory on CPU ranks
of one machine, else the process group), so the step-time ratio compares the algorithms.

After training, each one takes one more step and measures, on every rank, the bytes of parameters,
gradients and optimizer state (nanodist.memory.measure_memory, right after optimizer.step()). The lab
prints step time, optimizer-step time (the update alone, all-gather included), loss and memory for each;
the ratios between DistAdamW and DDP + AdamW (step time, optimizer-state bytes) and between DistMuon and
DDP + torch's Muon (optimizer-step time); and writes everything to labs/results/lab04_zero/. On a GPU,
AdamW is torch's fused kernel everywhere (DistAdamW's too).

--memory-only skips the timed comparison and measures memory at every ZeRO stage instead, through the
process group (a shared-memory transport's buffers are not part of the algorithm's memory): DDP + AdamW
(stage 0), then DistAdamW and DistMuon at stages 1 and 2, each trained --steps steps, then measured after
one more step (metrics["memory"]). --record-pipeline also records one DistAdamW step of a toy model small
enough to print every number -- each rank's local gradient, its averaged slice, the updated slice and the
all-gathered parameter -- and which of the lab model's matrices each rank's Muon groups update.
"""
import argparse
import statistics

import torch
import torch.nn.functional as F

import nanodist as nd
from nanodist import experiment
from nanodist.bench import take_turns
from nanodist.memory import zero_memory_bytes
from nanodist.optim import DistAdamW, make_muon_optimizer
from nanodist.results import Recorder

OPTS = {"ddp-adamw": ("nanodist", "adamw"), "dist-adamw": ("none", "dist-adamw"), "dist-muon": ("none", "dist-muon"),
        "ddp-muon": ("nanodist", "muon")}
# --opt zero1: ZeRO-1 over torch's AdamW three ways, taking turns -- nanodist's ZeroOptimizer (bare model), torch DDP
# + torch's ZeroRedundancyOptimizer, and torch DDP + the unsharded AdamW
ZERO1 = {"zero1-adamw": ("none", "zero1-adamw"), "torch-zero-adamw": ("torch", "zero-redundancy-adamw"),
         "torch-adamw": ("torch", "adamw")}
OPTS.update(ZERO1)
MEMORY_RUNS = (("ddp-adamw", 0, "DDP + AdamW"), ("dist-adamw", 1, "DistAdamW"), ("dist-adamw", 2, "DistAdamW"),
               ("dist-muon", 1, "DistMuon + DistAdamW"), ("dist-muon", 2, "DistMuon + DistAdamW"),
               ("zero1-adamw", 1, "ZeroOptimizer + AdamW"))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--opt", choices=list(OPTS) + ["all", "zero1"], nargs="+", default=["all"],
                   help="which optimizers to train, taking turns (all: DDP+AdamW, DistAdamW, DistMuon, DDP+Muon; "
                        "zero1: nanodist's ZeroOptimizer beside torch's ZeroRedundancyOptimizer and DDP+AdamW)")
    p.add_argument("--muon-lr", type=float, default=0.02, help="Muon learning rate (hidden matrices)")
    p.add_argument("--zero-stage", type=int, choices=[1, 2], default=2, help="for DistAdamW and DistMuon")
    p.add_argument("--collectives", choices=["auto", "ring", "torch"], default="auto",
                   help="ZeRO's reduce-scatter/all-gather through the process group: auto = nanodist's ring on gloo, "
                        "torch's on nccl")
    p.add_argument("--memory-only", action="store_true",
                   help="no timed comparison: measure per-rank memory at stage 0 (DDP + AdamW) and at stages 1 and 2 "
                        "(DistAdamW, DistMuon), each after --steps steps (--opt still picks the optimizers)")
    p.add_argument("--worlds", type=int, nargs="+", default=None,
                   help="--memory-only: measure at these world sizes, on the first N ranks of this launch each (one "
                        "launch instead of one per size; default: this launch's size)")
    p.add_argument("--record-pipeline", action="store_true",
                   help="also record one DistAdamW step of a toy model (every rank's buffers) and which matrices "
                        "each rank's Muon groups update")
    experiment.add_profile_arg(p, "DistAdamW (ZeRO-2) and DDP + AdamW (those this launch trains)")
    experiment.add_arguments(p, steps=30)
    return p, p.parse_args()


def check(args, world_size):
    if args.profile and args.memory_only:
        return "--profile traces one timed step of DistAdamW (ZeRO-2): not with --memory-only"
    return (experiment.check_worlds(args, world_size)
            or experiment.check_positive(args, ["muon_lr"], "a positive finite number", integer=False))


def record_pipeline(cfg, data, group) -> dict:
    """One DistAdamW step of a toy model, every buffer of every rank; and the matrices each rank's Muon owns.

    The toy model is an nn.Linear(5, 2): a (2, 5) weight and a (2,) bias, 12 numbers in all, so that a figure
    can print each one. Every rank feeds it its own random batch, so the local gradients differ.
    """
    torch.manual_seed(cfg.seed)
    toy = torch.nn.Linear(5, 2).to(group.device)
    names = ["weight", "bias"]
    before = [p.detach().cpu().flatten().tolist() for p in toy.parameters()]
    opt = DistAdamW([{"params": list(toy.parameters()), "param_names": names}], lr=0.1, weight_decay=0.0,
                    zero_stage=2, collectives=cfg.collectives, group=group)
    g = torch.Generator().manual_seed(nd.dist_info().data_seed)  # a different batch on every rank
    x, y = torch.randn(4, 5, generator=g).to(group.device), torch.randn(4, 2, generator=g).to(group.device)
    opt.record_next_step()  # before backward: the gradients are reduce-scattered (and freed) while it runs
    F.mse_loss(toy(x), y).backward()
    opt.step()
    flat = lambda t: None if t is None else t.detach().cpu().flatten().tolist()  # noqa: E731
    mine = [{"name": e["name"], "shape": list(e["shape"]), "grad": flat(e["grad"]),
             "piece": None if e["piece"] is None else list(e["piece"]), "grad_shard": flat(e["grad_shard"]),
             "updated_shard": flat(e["updated_shard"]), "param": flat(e["param"])} for e in opt.recorded]

    model = experiment.build_model(cfg, data.vocab_size, group.device)
    opt = make_muon_optimizer(model, collectives=cfg.collectives, group=group)
    idx = torch.randint(0, data.vocab_size, (2, cfg.seq_len), generator=g).to(group.device)
    model(idx, idx)[1].backward()
    opt.step()
    named = [(n, p) for grp in opt.param_groups if grp["kind"] == "muon" for n, p in zip(grp["param_names"], grp["params"])]
    owned = [{"name": n, "shape": list(p.shape), "numel": p.numel()} for n, p in named if opt.state.get(p)]
    return {"toy": {"before": before, "names": names, "ranks": group.all_gather_object(mine)},
            "muon": {"model": cfg.model, "matrices": [{"name": n, "shape": list(p.shape), "numel": p.numel()}
                                                        for n, p in named],
                     "owned": group.all_gather_object(owned)}}


def measure_stages(opts, cfg, data, group) -> list[dict]:
    """--memory-only: each configuration trains --steps steps, then memory is measured after one more."""
    out = []
    for opt, stage, label in MEMORY_RUNS:
        if opt in opts:
            run = experiment.build(cfg, data, group, wrapper=OPTS[opt][0], optimizer=OPTS[opt][1], name=opt,
                                   zero_stage=stage or None)
            run.trainer.fit(max_steps=cfg.steps)
            memory = experiment.measure_memory_step(run)
            out.append({"opt": opt, "stage": stage, "label": label, "world_size": group.size,
                        "num_params": run.raw.num_params(), "loss": round(run.trainer.history[-1]["loss"], 5),
                        "memory": group.all_gather_object(memory)})  # one MemoryReport dict per rank
    return out


def main():
    parser, args = parse_args()
    info = experiment.start(parser, args, min_steps=1 if args.memory_only else experiment.WARMUP_STEPS + 1,
                            extra_check=check)
    # --memory-only: the memory of the algorithm, not of a transport's buffers
    cfg = experiment.RunConfig.from_args(args, info.device, **({"shared_memory": "off"} if args.memory_only else {}))
    group, data = info.group, experiment.load_data(cfg)
    named = [o for o in args.opt if o not in ("all", "zero1")]
    opts = list(dict.fromkeys(([o for o in OPTS if o not in ZERO1] if "all" in args.opt else []) +
                              (list(ZERO1) if "zero1" in args.opt else []) + named))
    rec = Recorder("lab04_zero", config={**vars(args), **cfg.to_dict()})
    if args.record_pipeline:
        pipeline = rec.metrics["pipeline"] = record_pipeline(cfg, data, group)
        for r, owned in enumerate(pipeline["muon"]["owned"]):
            nd.print0(f"DistMuon rank {r}: {len(owned)} matrices, {sum(m['numel'] for m in owned)} elements")
    if args.memory_only:
        worlds = args.worlds or [group.size]
        runs = []
        for n, sub in experiment.first_ranks(group, worlds).items():  # rank 0 is in each, and records them all
            if sub is not None:
                runs += measure_stages(opts, cfg, data, sub)
            group.barrier()
        rec.metrics["memory"] = runs
        for run in runs:
            worst = max(run["memory"], key=lambda m: m["total"])
            nd.print0(f"{run['world_size']} rank(s), stage {run['stage']} {run['label']:>20}: per rank (max) params "
                      f"{worst['params']} B  grads {worst['grads']} B  optimizer state {worst['optimizer_state']} B")
        nd.print0(f"wrote {nd.results.shown(rec.save())}")
        return nd.shutdown()

    main_opt = "dist-adamw" if "dist-adamw" in opts else opts[0]
    if len(opts) > 1 and any(o in ZERO1 for o in opts) and group.size == 1:
        opts = [o for o in opts if o not in ("torch-zero-adamw", "torch-adamw")]  # torch's need a process group
    runs = {opt: experiment.build(cfg, data, group, wrapper=OPTS[opt][0], optimizer=OPTS[opt][1], name=opt,
                                  recorder=rec if opt == main_opt else None) for opt in opts}
    how = runs[main_opt]
    nd.print0(f"== {', '.join(opts)}: {group.size} rank(s), {cfg.model} model, {args.steps} steps each, taking turns "
              f"step by step; gradients through {experiment.transport(how)}")
    bar = None
    if group.is_main and not args.no_progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(opts) * args.steps, desc=" + ".join(opts), leave=False)
    take_turns({opt: (lambda r=r: r.trainer.fit(max_steps=1)) for opt, r in runs.items()}, rounds=args.steps,
               group=group, progress=bar and (lambda _: bar.update(1)))
    if bar is not None:
        bar.close()
    results = {}
    for opt, run in runs.items():
        memory = experiment.measure_memory_step(run)
        results[opt] = {**experiment.summarize(run), "opt": opt,
                        "median_step_s": statistics.median(h["time_s"] for h in run.trainer.history[
                            experiment.WARMUP_STEPS:]),
                        "memory": group.all_gather_object(memory)}  # one MemoryReport dict per rank
    mib = lambda b: b / 2**20  # noqa: E731
    for name, r in results.items():
        worst = max(r["memory"], key=lambda m: m["total"])
        nd.print0(f"{name:>10}: step {1e3 * r['median_step_s']:7.2f} ms  optimizer step "
                  f"{1e3 * r['median_optimizer_step_s']:6.2f} ms  {experiment.use_line(r)}  "
                  f"loss {r['losses'][0]:.3f} -> "
                  f"{r['losses'][-1]:.3f}  per rank (max): params {mib(worst['params']):.2f} MiB  grads "
                  f"{mib(worst['grads']):.2f} MiB  optimizer state {mib(worst['optimizer_state']):.2f} MiB")
    metrics = {"opts": results, "main_opt": main_opt}
    n = next(iter(results.values()))["params"]
    metrics["formula_fp32_adamw"] = {f"stage{s}": zero_memory_bytes(n, group.size, s, 4, 4, 8) for s in range(4)}
    if "ddp-adamw" in results and "dist-adamw" in results:
        ddp, zero = results["ddp-adamw"], results["dist-adamw"]
        metrics["ratio_step_time_dist_adamw_vs_ddp_adamw"] = zero["median_step_s"] / ddp["median_step_s"]
        state = lambda r: max(m["optimizer_state"] for m in r["memory"])  # noqa: E731  (the worst rank)
        metrics["ratio_optimizer_state_dist_adamw_vs_adamw"] = state(zero) / state(ddp)
        nd.print0(f"ratio DistAdamW/DDP+AdamW step time: {metrics['ratio_step_time_dist_adamw_vs_ddp_adamw']:.2f}")
        nd.print0(f"ratio optimizer-state bytes per rank DistAdamW/AdamW: "
                  f"{metrics['ratio_optimizer_state_dist_adamw_vs_adamw']:.2f}")
    if "zero1-adamw" in results:
        z = results["zero1-adamw"]
        for other, key, label in (("torch-zero-adamw", "ratio_step_time_zero1_vs_torch_zero_redundancy",
                                   "ZeroOptimizer / torch DDP + ZeroRedundancyOptimizer (both AdamW)"),
                                  ("torch-adamw", "ratio_step_time_zero1_vs_torch_ddp_adamw",
                                   "ZeroOptimizer / torch DDP + AdamW")):
            if other in results:
                metrics[key] = z["median_step_s"] / results[other]["median_step_s"]
                nd.print0(f"ratio {label} step time: {metrics[key]:.2f}")
        state = lambda r: max(m["optimizer_state"] for m in r["memory"])  # noqa: E731  (the worst rank)
        full = 2 * 4 * z["params"]  # AdamW unsharded: two fp32 moments per element
        metrics["ratio_optimizer_state_zero1_vs_adamw"] = state(z) / full
        nd.print0(f"ratio optimizer-state bytes per rank ZeroOptimizer/AdamW: "
                  f"{metrics['ratio_optimizer_state_zero1_vs_adamw']:.2f}")
    if "dist-muon" in results and "ddp-muon" in results:
        ratio = results["dist-muon"]["median_optimizer_step_s"] / results["ddp-muon"]["median_optimizer_step_s"]
        metrics["ratio_optimizer_step_dist_muon_vs_torch_muon"] = ratio
        nd.print0(f"ratio DistMuon/torch Muon optimizer step time (both with AdamW for the rest): {ratio:.2f}")
    if args.profile:
        metrics["profile"] = experiment.profile_runs(runs, ("dist-adamw", "ddp-adamw"), rec, group)
    rec.metrics.update(metrics)
    nd.print0(f"wrote {nd.results.shown(rec.save())}")
    nd.shutdown()


if __name__ == "__main__":
    main()
