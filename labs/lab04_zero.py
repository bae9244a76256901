"""Lab 4 — ZeRO: DDP + AdamW against DistAdamW (sharded AdamW) and DistMuon, step time, loss and memory per rank.

    torchrun --nproc_per_node=2 labs/lab04_zero.py                    # all three, taking turns step by step
    torchrun --nproc_per_node=2 labs/lab04_zero.py --opt dist-adamw --zero-stage 1
    python labs/lab04_zero.py --opt dist-muon                         # a world of one works too
    torchrun --nproc_per_node=4 labs/lab04_zero.py --memory-only --steps 2     # memory at stages 0, 1, 2
    torchrun --nproc_per_node=3 labs/lab04_zero.py --memory-only --record-pipeline --steps 1

Every optimizer trains the same GPT from the same initial weights on the same data; with --opt all
they take turns, one step each, so that load from elsewhere on the machine slows them alike:
  ddp-adamw   nanodist.DDP + torch.optim.AdamW: gradients all-reduced in backward, state replicated (stage 0)
  dist-adamw  bare model + DistAdamW: reduce-scatter, update this rank's slice, all-gather (stage 2)
  dist-muon   bare model + DistMuon for hidden matrices, DistAdamW for the rest (make_muon_optimizer)

After training, each one takes one more step and measures, on every rank, the bytes of parameters,
gradients and optimizer state (nanodist.memory.measure_memory, right after optimizer.step()). The lab
prints step time, loss and memory for each, the two ratios between DistAdamW and DDP + AdamW measured
in this run, and writes everything to labs/results/lab04_zero/.

--memory-only skips the timed comparison and measures memory at every ZeRO stage instead: DDP + AdamW
(stage 0), then DistAdamW and DistMuon at stages 1 and 2, each trained --steps steps from the same
weights, then measured after one more step (metrics["memory"]). --record-pipeline also records one
DistAdamW step of a toy model small enough to print every number -- each rank's local gradient, its
averaged slice, the updated slice and the all-gathered parameter -- and which of the lab model's
matrices each rank's DistMuon updated (metrics["pipeline"]).
"""
import argparse
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

import nanodist as nd
from nanodist.data import CharTokenizer, TokenStream, load_corpus, train_val_split
from nanodist.memory import measure_memory, zero_memory_bytes
from nanodist.model import GPT, GPTConfig
from nanodist.optim import DistAdamW, make_muon_optimizer
from nanodist.results import Recorder
from nanodist.train import TrainConfig, Trainer, grad_accum_steps

OPTS = ("ddp-adamw", "dist-adamw", "dist-muon")
WARMUP_STEPS = 3  # excluded from step times: the first steps pay for allocations and thread start-up


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--opt", choices=OPTS + ("all",), default="all", help="which optimizer to train (all: each in turn)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per optimizer")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per micro-step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--total-batch", type=int, default=None,
                   help="tokens per optimizer step (default: micro-batch x seq-len x ranks, no accumulation)")
    p.add_argument("--model", choices=["tiny", "small"], default="small", help="a nanodist.model preset")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--muon-lr", type=float, default=0.02, help="Muon learning rate (hidden matrices)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--zero-stage", type=int, choices=[1, 2], default=2, help="for DistAdamW and DistMuon")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP and ZeRO bucket size")
    p.add_argument("--collectives", choices=["auto", "ring", "torch"], default="auto",
                   help="ZeRO's reduce-scatter/all-gather: auto = nanodist's ring on gloo, torch's on nccl")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--data", default=None, help="a text file to train on (default: the built-in corpus)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--memory-only", action="store_true",
                   help="no timed comparison: measure per-rank memory at stage 0 (DDP + AdamW) and at stages 1 and 2 "
                        "(DistAdamW, DistMuon), each after --steps steps (--opt still picks the optimizers)")
    p.add_argument("--record-pipeline", action="store_true",
                   help="also record one DistAdamW step of a toy model (every rank's buffers) and which matrices "
                        "each rank's DistMuon updates")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    args = p.parse_args()
    if args.memory_only and args.steps < 1:
        p.error("--steps must be at least 1 with --memory-only (steps before the measured one)")
    if not args.memory_only and args.steps <= WARMUP_STEPS:
        p.error(f"--steps must be more than {WARMUP_STEPS} (the first {WARMUP_STEPS} are warm-up, not timed)")
    return p, args


def build(opt: str, args, info, vocab: int, stage: int | None = None):
    """The model (wrapped or not) and its optimizer, from the seeded initial weights (stage: default --zero-stage)."""
    torch.manual_seed(args.seed)  # identical initial weights for every optimizer, on every rank
    raw = GPT(GPTConfig.preset(args.model, vocab_size=vocab, block_size=args.seq_len)).to(info.device)
    zero = dict(zero_stage=args.zero_stage if stage is None else stage, bucket_cap_mb=args.bucket_mb,
                collectives=args.collectives)
    if opt == "ddp-adamw":
        model = nd.DDP(raw, bucket_cap_mb=args.bucket_mb) if dist.is_initialized() else raw
        optimizer = torch.optim.AdamW(raw.configure_param_groups(args.weight_decay), lr=args.lr, betas=(0.9, 0.95))
    elif opt == "dist-adamw":
        model = raw  # no DDP: DistAdamW averages the gradients itself
        optimizer = DistAdamW(raw.configure_param_groups(args.weight_decay), lr=args.lr, betas=(0.9, 0.95), **zero)
    else:
        model = raw
        optimizer = make_muon_optimizer(raw, lr=args.lr, muon_lr=args.muon_lr, weight_decay=args.weight_decay,
                                        betas=(0.9, 0.95), **zero)
    return raw, model, optimizer


def measure_step(model, optimizer, stream, dtype: str, device) -> dict:
    """One more step, measured right after optimizer.step(): parameters, gradients and state all alive."""
    from nanodist.train import autocast
    x, y = next(stream)
    with autocast(dtype, device):
        _, loss = model(x, y)
    loss.backward()
    optimizer.step()
    report = measure_memory(model, optimizer).to_dict()
    optimizer.zero_grad(set_to_none=True)
    return report


def make_trainer(opt: str, args, info, tokens, vocab: int, stage: int | None = None) -> dict:
    """A Trainer for `opt` from the seeded initial weights, and what measuring its memory needs."""
    raw, model, optimizer = build(opt, args, info, vocab, stage)
    train_tokens, val_tokens = train_val_split(tokens)
    stream = lambda toks, seed: TokenStream(toks, batch_size=args.micro_batch, block_size=args.seq_len,  # noqa: E731
                                            rank=info.rank, world_size=info.world_size, seed=seed, device=info.device)
    cfg = TrainConfig(steps=args.steps, total_batch_tokens=args.total_batch, micro_batch=args.micro_batch,
                      seq_len=args.seq_len, lr=args.lr, warmup_steps=5, dtype=args.dtype, eval_batches=2,
                      log_every=0, progress=False, run_name=f"lab04-{opt}")
    train = stream(train_tokens, args.seed)
    trainer = Trainer(model, optimizer, train, cfg, val_data=stream(val_tokens, args.seed + 1))
    return {"opt": opt, "raw": raw, "trainer": trainer, "train": train}


def train_all(opts: list[str], args, info, tokens, vocab: int) -> dict:
    """Train every optimizer for args.steps steps, taking turns one step at a time.

    Taking turns means a burst of load from elsewhere on the machine slows all of them alike, so the
    step-time ratios measured in one run stay meaningful on a shared computer. Each run is still its
    own: own model, optimizer and data stream, the same trajectory as if it trained alone.
    """
    runs = [make_trainer(opt, args, info, tokens, vocab) for opt in opts]
    bar = None
    if not args.no_progress and info.is_main:  # one bar for all optimizers
        from tqdm.auto import tqdm
        bar = tqdm(total=len(opts) * args.steps, desc=" + ".join(opts), leave=False)
    for _ in range(args.steps):
        for r in runs:
            r["trainer"].fit(max_steps=1)  # the last call also evaluates
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    results = {}
    for r in runs:
        trainer, history = r["trainer"], r["trainer"].history
        memory = measure_step(trainer.model, trainer.optimizer, r["train"], args.dtype, info.device)
        per_rank = [memory]
        if info.world_size > 1:
            per_rank = [None] * info.world_size
            dist.all_gather_object(per_rank, memory)
        step_s = statistics.median(h["time_s"] for h in history[WARMUP_STEPS:])
        results[r["opt"]] = {
            "opt": r["opt"], "world_size": info.world_size, "params": r["raw"].num_params(),
            "median_step_s": step_s, "tokens_per_s": trainer.tokens_per_step / step_s,
            "losses": [round(h["loss"], 5) for h in history],
            "val_loss": history[-1].get("val_loss"),
            "memory": per_rank,  # one MemoryReport dict per rank
            "history": history,
        }
    return results


def gather(obj, info) -> list:
    """`obj` from every rank, in rank order (a list of one without a process group)."""
    if info.world_size == 1:
        return [obj]
    out = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


MEMORY_RUNS = (("ddp-adamw", 0, "DDP + AdamW"), ("dist-adamw", 1, "DistAdamW"), ("dist-adamw", 2, "DistAdamW"),
               ("dist-muon", 1, "DistMuon + DistAdamW"), ("dist-muon", 2, "DistMuon + DistAdamW"))


def measure_stages(opts: list[str], args, info, tokens, vocab: int) -> list[dict]:
    """--memory-only: each configuration trains --steps steps, then memory is measured after one more."""
    out = []
    for opt, stage, label in MEMORY_RUNS:
        if opt not in opts:
            continue
        r = make_trainer(opt, args, info, tokens, vocab, stage)
        r["trainer"].fit(max_steps=args.steps)
        memory = measure_step(r["trainer"].model, r["trainer"].optimizer, r["train"], args.dtype, info.device)
        out.append({"opt": opt, "stage": stage, "label": label, "world_size": info.world_size,
                    "num_params": r["raw"].num_params(), "loss": round(r["trainer"].history[-1]["loss"], 5),
                    "memory": gather(memory, info)})  # one MemoryReport dict per rank
    return out


def record_pipeline(args, info, vocab: int) -> dict:
    """One DistAdamW step of a toy model, every buffer of every rank; and the matrices each rank's DistMuon owns.

    The toy model is an nn.Linear(5, 2): a (2, 5) weight and a (2,) bias, 12 numbers in all, so that a figure
    can print each one. Every rank feeds it its own random batch, so the local gradients differ.
    """
    torch.manual_seed(args.seed)
    toy = torch.nn.Linear(5, 2).to(info.device)
    names = ["weight", "bias"]
    before = [p.detach().cpu().flatten().tolist() for p in toy.parameters()]
    opt = DistAdamW([{"params": list(toy.parameters()), "param_names": names}], lr=0.1, weight_decay=0.0,
                    zero_stage=2, collectives=args.collectives)
    g = torch.Generator().manual_seed(info.data_seed)  # a different batch on every rank
    x, y = torch.randn(4, 5, generator=g).to(info.device), torch.randn(4, 2, generator=g).to(info.device)
    opt.record_next_step()  # before backward: the gradients are reduce-scattered (and freed) while it runs
    F.mse_loss(toy(x), y).backward()
    opt.step()
    flat = lambda t: None if t is None else t.detach().cpu().flatten().tolist()  # noqa: E731
    mine = [{"name": e["name"], "shape": list(e["shape"]), "grad": flat(e["grad"]),
             "piece": None if e["piece"] is None else list(e["piece"]), "grad_shard": flat(e["grad_shard"]),
             "updated_shard": flat(e["updated_shard"]), "param": flat(e["param"])} for e in opt.recorded]

    # DistMuon on the lab's model: one step, then the matrices whose momentum lives on this rank.
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig.preset(args.model, vocab_size=vocab, block_size=args.seq_len)).to(info.device)
    opt = make_muon_optimizer(model, collectives=args.collectives)
    idx = torch.randint(0, vocab, (2, args.seq_len), generator=g).to(info.device)
    model(idx, idx)[1].backward()
    opt.step()
    named = [(n, p) for group in opt.param_groups if group["kind"] == "muon"
             for n, p in zip(group["param_names"], group["params"])]
    owned = [{"name": n, "shape": list(p.shape), "numel": p.numel()} for n, p in named if opt.state.get(p)]
    return {"toy": {"before": before, "names": names, "ranks": gather(mine, info)},
            "muon": {"model": args.model, "matrices": [{"name": n, "shape": list(p.shape), "numel": p.numel()}
                                                        for n, p in named],
                     "owned": gather(owned, info)}}


def main():
    parser, args = parse_args()
    info = nd.init(seed=args.seed)
    try:
        grad_accum_steps(args.total_batch, args.micro_batch, args.seq_len, info.world_size)
    except ValueError as e:
        parser.error(str(e))
    text = load_corpus(args.data)
    tok = CharTokenizer(text)
    tokens = torch.tensor(tok.encode(text), dtype=torch.int64)
    opts = list(OPTS) if args.opt == "all" else [args.opt]

    rec = Recorder("lab04_zero", config=vars(args))
    if args.record_pipeline:
        pipeline = record_pipeline(args, info, tok.vocab_size)
        rec.metrics["pipeline"] = pipeline
        for r, owned in enumerate(pipeline["muon"]["owned"]):
            nd.print0(f"DistMuon rank {r}: {len(owned)} matrices, {sum(m['numel'] for m in owned)} elements")
    if args.memory_only:
        runs = measure_stages(opts, args, info, tokens, tok.vocab_size)
        for run in runs:
            worst = max(run["memory"], key=lambda m: m["total"])
            nd.print0(f"stage {run['stage']} {run['label']:>20}: per rank (max) params {worst['params']} B  grads "
                      f"{worst['grads']} B  optimizer state {worst['optimizer_state']} B")
        rec.metrics["memory"] = runs
        path = rec.save()
        nd.print0(f"wrote {path}")
        nd.shutdown()
        return
    nd.print0(f"== {', '.join(opts)}: {info.world_size} rank(s), {args.model} model, {args.steps} steps each, "
              f"taking turns step by step")
    results = train_all(opts, args, info, tokens, tok.vocab_size)

    mb = lambda b: b / 2**20  # noqa: E731
    for name, r in results.items():
        worst = max(r["memory"], key=lambda m: m["total"])
        nd.print0(f"{name:>10}: step {1e3 * r['median_step_s']:7.2f} ms  loss {r['losses'][0]:.3f} -> "
                  f"{r['losses'][-1]:.3f}  per rank (max): params {mb(worst['params']):.2f} MiB  grads "
                  f"{mb(worst['grads']):.2f} MiB  optimizer state {mb(worst['optimizer_state']):.2f} MiB")
    main_opt = "dist-adamw" if "dist-adamw" in results else opts[0]
    for h in results[main_opt]["history"]:
        rec.step(**h)
    metrics = {"opts": {k: {kk: vv for kk, vv in v.items() if kk != "history"} for k, v in results.items()},
               "main_opt": main_opt}
    n = next(iter(results.values()))["params"]
    metrics["formula_fp32_adamw"] = {f"stage{s}": zero_memory_bytes(n, info.world_size, s, 4, 4, 8) for s in range(4)}
    if "ddp-adamw" in results and "dist-adamw" in results:
        ddp, zero = results["ddp-adamw"], results["dist-adamw"]
        metrics["ratio_step_time_dist_adamw_vs_ddp_adamw"] = zero["median_step_s"] / ddp["median_step_s"]
        state = lambda r: max(m["optimizer_state"] for m in r["memory"])  # noqa: E731  (the worst rank)
        metrics["ratio_optimizer_state_dist_adamw_vs_adamw"] = state(zero) / state(ddp)
        nd.print0(f"ratio DistAdamW/DDP+AdamW step time: {metrics['ratio_step_time_dist_adamw_vs_ddp_adamw']:.2f} "
                  f"(target <= 1.10)")
        nd.print0(f"ratio optimizer-state bytes per rank DistAdamW/AdamW: "
                  f"{metrics['ratio_optimizer_state_dist_adamw_vs_adamw']:.2f} (target <= 0.52)")
    rec.metrics.update(metrics)
    path = rec.save()
    nd.print0(f"wrote {path}")
    nd.shutdown()


if __name__ == "__main__":
    main()
