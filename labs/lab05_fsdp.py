"""Lab 5 — FSDP (ZeRO-3): nanodist's FSDP against torch FSDP2, DDP and ZeRO-2; step time, memory per rank, bytes moved.

    torchrun --nproc_per_node=2 labs/lab05_fsdp.py                          # all four, taking turns step by step
    torchrun --nproc_per_node=2 labs/lab05_fsdp.py --budget 20              # which of them fit in 20 MiB a rank
    torchrun --nproc_per_node=4 labs/lab05_fsdp.py --memory-only --steps 1  # model states at stages 0-3
    torchrun --nproc_per_node=2 labs/lab05_fsdp.py --timeline --steps 2     # FSDP's gathers, with and without prefetch
    torchrun --nproc_per_node=2 labs/lab05_fsdp.py --checkpointing-compare  # activation checkpointing: memory vs time
    torchrun --nproc_per_node=4 labs/lab05_fsdp.py --impl fsdp --worlds 1 2 3 4 --total-batch 768 --micro-batch 1 \
        --seq-len 64                                                        # strong scaling, one launch

Every run trains the same GPT from the same weights on the same data (nanodist.experiment):
  ddp     nanodist.DDP + AdamW: everything replicated (stage 0)
  zero1   the bare model + DistAdamW(zero_stage=1): optimizer state sharded (stage 1)
  zero2   the bare model + DistAdamW: optimizer state and gradients sharded (stage 2)
  fsdp    nanodist.FSDP + AdamW, every Block a unit: parameters sharded too (stage 3)
  fsdp2   torch's fully_shard on every Block and the root + AdamW (stage 3, torch's)
They take turns, one step each. Then each takes one more step, measured by nanodist's own accounting
(nanodist.memory: the model states, what is held throughout the step, and the peak of what the step allocates
on top of it),
and FSDP's step is also recorded event by event to count the bytes every rank sends. The lab prints
step times, memory per rank and their ratios, and writes them to labs/results/lab05_fsdp/.
"""
import argparse
import statistics


import nanodist as nd
from nanodist import experiment
from nanodist.bench import take_turns
from nanodist.costmodel import busbw_factor, bytes_per_step
from nanodist.fsdp import FSDPTimeline
from nanodist.memory import zero_memory_bytes
from nanodist.results import Recorder

IMPLS = {"ddp": ("nanodist-pg", "adamw", None), "zero1": ("none", "dist-adamw", 1),
         "zero2": ("none", "dist-adamw", 2), "fsdp": ("fsdp", "adamw", None), "fsdp2": ("fsdp2", "adamw", None)}
STAGES = (("ddp", 0, "DDP + AdamW"), ("zero1", 1, "DistAdamW"), ("zero2", 2, "DistAdamW"), ("fsdp", 3, "FSDP + AdamW"))
MIB = 2**20
BLOCK_STEPS = 5  # a --worlds sweep's configurations take turns, this many steps each


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=list(IMPLS) + ["all"], default="all")
    p.add_argument("--budget", type=float, default=None, help="per-rank memory budget in MiB: which runs fit")
    p.add_argument("--param-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="FSDP's compute dtype (bf16: gather and compute in bf16, reduce in fp32)")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing of every Block")
    p.add_argument("--no-prefetch", action="store_true", help="nanodist FSDP gathers each unit only when it runs")
    p.add_argument("--memory-only", action="store_true",
                   help="no timed comparison: model states per rank at stages 0-3 after --steps steps")
    p.add_argument("--worlds", type=int, nargs="+", default=None,
                   help="measure at these world sizes, on the first N ranks of this launch each (one launch instead "
                        "of one per size): with --memory-only the model states, else one --impl's step time "
                        "(strong scaling with --total-batch)")
    p.add_argument("--timeline", action="store_true", help="record one FSDP step with prefetch and one without")
    p.add_argument("--checkpointing-compare", action="store_true",
                   help="FSDP with and without activation checkpointing: saved activations, peak, step time")
    experiment.add_profile_arg(p, "nanodist FSDP and torch FSDP2 (those this launch trains)")
    experiment.add_arguments(p, steps=20)
    return p, p.parse_args()


def check_budget(args, world_size):
    if args.profile and (args.memory_only or args.timeline or args.checkpointing_compare or args.worlds is not None):
        return "--profile traces one step of the implementations a timed comparison trains: not with --memory-only, " \
               "--timeline, --checkpointing-compare or --worlds"
    if args.budget is not None and not args.budget > 0:
        return f"--budget must be a positive number of MiB, got {args.budget}"
    if args.worlds is not None and not args.memory_only:  # a timed sweep: one set-up at several world sizes
        if args.impl == "all" or args.timeline or args.checkpointing_compare or args.budget is not None:
            return "--worlds without --memory-only times one --impl (ddp, zero1, zero2, fsdp, fsdp2) at each world " \
                   "size; not with --timeline, --checkpointing-compare or --budget"
        return experiment.check_sweep(args, world_size)
    return experiment.check_worlds(args, world_size)


def model_states(memory: dict) -> int:
    """Parameters + gradients + optimizer state of one rank, as measured in its step."""
    return memory["params"] + memory["grads"] + memory["optimizer_state"]


def fsdp_bytes_sent(events: list[dict], world_size: int) -> int:
    """Bytes this rank sent in one FSDP step, from its recorded gathers and reduce-scatters (ring algorithms)."""
    per = busbw_factor("all_gather", world_size)  # (N-1)/N of each gathered buffer or reduced gradient
    return int(sum(per * e["bytes"] for e in events if e["event"] in ("gather_started", "reduce_started")))


def one_step(events: list[dict]) -> list[dict]:
    """The training step's events: up to the first gather after the last reduce-scatter (an evaluation's)."""
    last = max((i for i, e in enumerate(events) if e["event"] == "reduced"), default=len(events) - 1)
    after = next((i for i in range(last, len(events)) if events[i]["event"] == "gather_started"), len(events))
    return events[:after]


def peak_bound(run, memory: dict) -> dict:
    """What FSDP's peak per rank should stay under, with prefetch: the shards (parameters, gradients, optimizer
    state) + the two largest units and the root gathered + one unit's full gradient (alive from its backward
    until its reduce-scatter) + the largest saved activations; each term measured or read from the units."""
    root = [u.full_bytes for u in run.model.units if u.name == "root"]
    blocks = sorted((u.full_bytes for u in run.model.units if u.name != "root"), reverse=True)
    parts = {"shards": model_states(memory), "units": sum(blocks[:2]) + sum(root),
             "unit_grad": max(blocks[:1] + root), "activations": memory["activations_max"]}
    return {**parts, "bound": sum(parts.values()), "peak": memory["peak"]}


def memory_stages(cfg, data, group) -> list[dict]:
    """Parameters, gradients and optimizer state per rank at stages 0-3, measured after a step, with the formula."""
    num_params = experiment.build_model(cfg, data.vocab_size, "meta").num_params()  # before any wrapper shards it
    out = []
    for name, stage, label in STAGES:
        wrapper, opt, zero_stage = IMPLS[name]
        run = experiment.build(cfg, data, group, wrapper=wrapper, optimizer=opt, name=name, zero_stage=zero_stage)
        run.trainer.fit(max_steps=cfg.steps)
        memory = experiment.measure_memory_step(run)
        out.append({"impl": name, "stage": stage, "label": label, "world_size": group.size, "num_params": num_params,
                    "formula": zero_memory_bytes(num_params, group.size, stage, 4, 4, 8),  # fp32 AdamW
                    "memory": group.all_gather_object(memory)})
    return out


def record_timeline(cfg, data, group) -> dict:
    """The events of FSDP's last step (gathers, frees, reduce-scatters, with times), with prefetch and without."""
    out = {}
    for prefetch in (True, False):
        timeline = FSDPTimeline()
        run = experiment.build(cfg.replace(prefetch=prefetch), data, group, wrapper="fsdp", name="fsdp",
                               observer=timeline)
        run.trainer.fit(max_steps=cfg.steps - 1)
        timeline.events.clear()
        run.trainer.fit(max_steps=1)
        out["prefetch" if prefetch else "no_prefetch"] = {
            "events": one_step(timeline.events), "step_s": run.trainer.history[-1]["time_s"],
            "units": [{"name": u.name, "bytes": u.full_bytes} for u in run.model.units]}
        if prefetch:  # and its memory, operation by operation, next to DDP's
            out["memory_trace"] = {"fsdp": experiment.measure_peak_step(run, trace=True)}
    ddp = experiment.build(cfg, data, group, wrapper="nanodist-pg", name="ddp")
    ddp.trainer.fit(max_steps=cfg.steps)
    out["memory_trace"]["ddp"] = experiment.measure_peak_step(ddp, trace=True)
    return out


def checkpointing_compare(cfg, data, group) -> dict:
    """FSDP without and with activation checkpointing of every Block: memory of one step, median step time."""
    out = {}
    for ckpt in (False, True):
        run = experiment.build(cfg.replace(checkpointing=ckpt), data, group, wrapper="fsdp", name=f"fsdp-ckpt{int(ckpt)}")
        run.trainer.fit(max_steps=cfg.steps)
        times = [h["time_s"] for h in run.trainer.history[experiment.WARMUP_STEPS:]]
        out["on" if ckpt else "off"] = {**experiment.measure_peak_step(run), "median_step_s": statistics.median(times)}
    return out


def sweep(args, cfg, data, group) -> dict:
    """--worlds (timed): one implementation at each world size, in turns (experiment.sweep); strong scaling when
    --total-batch is given (the same batch at every world size), weak otherwise."""
    wrapper, optimizer, stage = IMPLS[args.impl]
    scaling = "strong" if cfg.total_batch is not None else "weak"
    nd.print0(f"== {args.impl}, {scaling} scaling: world sizes {args.worlds}, {cfg.steps} steps each, taking turns "
              f"every {BLOCK_STEPS} steps, gradients through the process group")
    rows = experiment.sweep(cfg, data, group, args.worlds, [cfg.micro_batch], cfg.steps, BLOCK_STEPS,
                            wrapper=wrapper, optimizer=optimizer, zero_stage=stage)
    if not group.is_main:
        return {}
    for row in rows:
        nd.print0(f"W={row['world_size']}: {row['tokens_per_s']:9.0f} tokens/s  step {1e3 * row['median_step_s']:8.2f} ms"
                  + (f"  {scaling}-scaling speedup {row['speedup']:.2f}" if "speedup" in row else ""))
    return {"sweep": rows, "impl": args.impl, "scaling": scaling}


def compare(args, cfg, data, group, rec) -> dict:
    """DDP, ZeRO-2, nanodist FSDP and torch FSDP2 taking turns step by step; then one measured step each."""
    impls = list(IMPLS) if args.impl == "all" else [args.impl]
    timeline = FSDPTimeline()
    runs = {name: experiment.build(cfg, data, group, wrapper=IMPLS[name][0], optimizer=IMPLS[name][1], name=name,
                                   zero_stage=IMPLS[name][2], recorder=rec if name == impls[0] else None,
                                   observer=timeline if name == "fsdp" else None) for name in impls}
    nd.print0(f"== {', '.join(impls)}: {group.size} rank(s), {cfg.model} model, micro-batch {cfg.micro_batch}, "
              f"{cfg.steps} steps each, taking turns step by step, gradients through the process group")
    take_turns({name: (lambda r=r: r.trainer.fit(max_steps=1)) for name, r in runs.items()}, rounds=cfg.steps,
               group=group)
    results = {}
    for name, run in runs.items():
        timeline.events.clear()
        peak = experiment.measure_peak_step(run)
        results[name] = {**experiment.summarize(run), "memory": group.all_gather_object(peak)}
        if name == "fsdp":
            results[name]["bytes_sent"] = fsdp_bytes_sent(one_step(timeline.events), group.size)
            results[name]["peak_bound"] = group.all_gather_object(peak_bound(run, peak))
    model_bytes = 4 * results[impls[0]]["params"]
    metrics = {"impls": results, "budget_mib": args.budget,
               "formula_fp32_adamw": {f"stage{s}": zero_memory_bytes(results[impls[0]]["params"], group.size, s, 4, 4, 8)
                                      for s in range(4)},
               "bytes_per_step_predicted": {k: bytes_per_step(k, model_bytes, group.size) for k in ("ddp", "fsdp")}}
    for name, r in results.items():
        worst = max(r["memory"], key=lambda m: m["peak"])
        fits = ""
        if args.budget is not None:
            r["fits_budget"] = worst["peak"] <= args.budget * MIB
            fits = "  fits" if r["fits_budget"] else f"  does not fit in {args.budget:g} MiB"
        cuda = ""
        if "cuda_step_peak" in worst:  # on a GPU: torch's allocator beside nanodist's accounting, the same step
            r["ratio_step_peak_vs_cuda"] = worst["step_peak"] / worst["cuda_step_peak"]
            cuda = (f" (the step's own peak {worst['step_peak'] / MIB:.2f} MiB; torch.cuda.max_memory_allocated "
                    f"counts {worst['cuda_step_peak'] / MIB:.2f} MiB, ratio {r['ratio_step_peak_vs_cuda']:.2f}: "
                    f"what operations allocate and free inside themselves, and workspaces, are not seen)")
        nd.print0(f"{name:>6}: step {1e3 * r['median_step_s']:7.2f} ms  {experiment.use_line(r)}  "
                  f"loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}  per rank: model states "
                  f"{model_states(worst) / MIB:.2f} MiB, peak {worst['peak'] / MIB:.2f} MiB{cuda}{fits}")
    if "fsdp" in results and "fsdp2" in results:
        metrics["ratio_step_fsdp_vs_fsdp2"] = results["fsdp"]["median_step_s"] / results["fsdp2"]["median_step_s"]
        nd.print0(f"ratio nanodist FSDP / torch FSDP2 step time: {metrics['ratio_step_fsdp_vs_fsdp2']:.2f}")
    if "fsdp" in results:
        b = max(results["fsdp"]["peak_bound"], key=lambda b: b["peak"] / b["bound"])
        metrics["ratio_peak_vs_bound_fsdp"] = b["peak"] / b["bound"]
        metrics["ratio_peak_vs_shards_units_activations_fsdp"] = b["peak"] / (b["bound"] - b["unit_grad"])
        nd.print0(f"nanodist FSDP peak per rank {b['peak'] / MIB:.2f} MiB; shards {b['shards'] / MIB:.2f} + 2 units "
                  f"and the root {b['units'] / MIB:.2f} + activations {b['activations'] / MIB:.2f} = "
                  f"{(b['bound'] - b['unit_grad']) / MIB:.2f} MiB (ratio "
                  f"{metrics['ratio_peak_vs_shards_units_activations_fsdp']:.2f}); + one unit's gradient "
                  f"{b['unit_grad'] / MIB:.2f} = {b['bound'] / MIB:.2f} MiB (ratio {metrics['ratio_peak_vs_bound_fsdp']:.2f})")
    if "fsdp" in results and "ddp" in results:
        states = lambda n: max(model_states(m) for m in results[n]["memory"])  # noqa: E731
        metrics["ratio_states_fsdp_vs_ddp"] = states("fsdp") / states("ddp")
        nd.print0(f"ratio parameters + gradients + optimizer state per rank, FSDP / DDP: "
                  f"{metrics['ratio_states_fsdp_vs_ddp']:.2f}")
        ddp_sent = metrics["bytes_per_step_predicted"]["ddp"]  # DDP all-reduces every gradient once: the model
        if group.size > 1:
            metrics["ratio_bytes_sent_fsdp_vs_ddp"] = results["fsdp"]["bytes_sent"] / ddp_sent
            nd.print0(f"ratio bytes each rank sends per step, FSDP / DDP: "
                      f"{metrics['ratio_bytes_sent_fsdp_vs_ddp']:.2f} (the cost model: "
                      f"{bytes_per_step('fsdp', 1, group.size) / bytes_per_step('ddp', 1, group.size):.2f})")
        else:
            nd.print0("bytes sent per step: none with one rank (no ratio: run with --nproc_per_node=2 or more)")
    if args.profile:
        metrics["profile"] = experiment.profile_runs(runs, ("fsdp", "fsdp2"), rec, group)
    return metrics


def main():
    parser, args = parse_args()
    timed = not (args.memory_only or args.timeline or args.checkpointing_compare)
    info = experiment.start(parser, args, min_steps=experiment.WARMUP_STEPS + 1 if timed or args.checkpointing_compare
                            else 1, extra_check=check_budget)
    # every run through the process group: like for like with FSDP2
    cfg = experiment.RunConfig.from_args(args, info.device, shared_memory="off")
    group, data = info.group, experiment.load_data(cfg)
    rec = Recorder("lab05_fsdp", config={**vars(args), **cfg.to_dict()})
    if args.memory_only:
        runs = []
        for n, sub in experiment.first_ranks(group, args.worlds or [group.size]).items():  # rank 0 records them all
            if sub is not None:
                runs += memory_stages(cfg, data, sub)
            group.barrier()
        rec.metrics["memory"] = runs
        for r in runs:
            worst, f = max(r["memory"], key=lambda m: m["total"]), r["formula"]
            nd.print0(f"stage {r['stage']} {r['label']:>12}: per rank params {worst['params']} B (formula "
                      f"{f['params']:.0f})  grads {worst['grads']} B ({f['grads']:.0f})  optimizer state "
                      f"{worst['optimizer_state']} B ({f['optimizer_state']:.0f})")
    if args.timeline:
        t = rec.metrics["timeline"] = record_timeline(cfg, data, group)
        nd.print0(f"FSDP step with prefetch {1e3 * t['prefetch']['step_s']:.1f} ms ({len(t['prefetch']['events'])} "
                  f"events), without {1e3 * t['no_prefetch']['step_s']:.1f} ms")
    if args.checkpointing_compare:
        c = rec.metrics["checkpointing"] = checkpointing_compare(cfg, data, group)
        nd.print0(f"activation checkpointing: saved activations {c['off']['activations_max'] / MIB:.2f} -> "
                  f"{c['on']['activations_max'] / MIB:.2f} MiB, peak per rank {c['off']['peak'] / MIB:.2f} -> "
                  f"{c['on']['peak'] / MIB:.2f} MiB, step {1e3 * c['off']['median_step_s']:.1f} -> "
                  f"{1e3 * c['on']['median_step_s']:.1f} ms")
    if timed and args.worlds is not None:
        rec.metrics.update(sweep(args, cfg, data, group))
    elif timed:
        rec.metrics.update(compare(args, cfg, data, group, rec))
    nd.print0(f"wrote {nd.results.shown(rec.save())}")
    nd.shutdown()


if __name__ == "__main__":
    main()
