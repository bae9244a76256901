"""Lab 3 — data parallel training: nanodist DDP vs torch DDP vs the naive version, speedup and efficiency.

    torchrun --nproc_per_node=2 labs/lab03_ddp.py                       # all three, plus a 1-rank baseline
    torchrun --nproc_per_node=2 labs/lab03_ddp.py --impl nanodist --steps 200 --wandb
    python labs/lab03_ddp.py --impl single                              # the 1-rank reference run

Every implementation trains the same tiny GPT from the same initial weights on the same data.
--scaling weak keeps the micro-batch per rank fixed (more ranks: a bigger total batch per step);
--scaling strong keeps the total batch fixed (more ranks: less work each). With --baseline (on by
default for --impl all) rank 0 first trains alone, as a world of one, while the other ranks wait:
the 1-rank reference measured in the same run, on the same machine, a moment earlier.

At the end the lab prints tokens/s per implementation, the throughput ratios between them, and the
speedup and efficiency against the 1-rank baseline, and writes them to labs/results/lab03_ddp/.
"""
import argparse
import statistics

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import nanodist as nd
from nanodist.data import CharTokenizer, TokenStream, load_corpus, train_val_split
from nanodist.ddp import NaiveDDP
from nanodist.model import GPT, GPTConfig
from nanodist.results import Recorder, load_all
from nanodist.train import TrainConfig, Trainer, grad_accum_steps

IMPLS = ("nanodist", "nanodist-pg", "torch", "naive", "single")
WARMUP_STEPS = 3  # excluded from throughput: first steps pay for allocation and thread start-up
BLOCK_STEPS = 5  # implementations take turns, this many steps each


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=IMPLS + ("all",), default="all",
                   help="which data-parallel implementation to train (all: torch, nanodist, naive in turn, and "
                        "nanodist-pg when nanodist reduces through shared memory)")
    p.add_argument("--shared-memory", choices=["auto", "on", "off"], default="auto",
                   help="nanodist DDP reduces gradients through shared memory (auto: when the ranks are CPU "
                        "processes on one machine); nanodist-pg always uses the process group, like torch DDP")
    p.add_argument("--scaling", choices=["weak", "strong"], default="weak")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps per implementation")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per micro-step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--total-batch", type=int, default=None,
                   help="tokens per optimizer step (default: weak = micro-batch x seq-len x ranks; "
                        "strong = micro-batch x seq-len x 4)")
    p.add_argument("--model", choices=["tiny", "small"], default="small", help="a nanodist.model preset")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket size (nanodist and torch)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--data", default=None, help="a text file to train on (default: the built-in corpus)")
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=None,
                   help="measure a 1-rank baseline on rank 0 first (default: on for --impl all)")
    p.add_argument("--timeline", action="store_true", help="record nanodist DDP's bucket timeline")
    p.add_argument("--verify", action="store_true",
                   help="also check that N ranks x micro-batch train exactly like 1 process x N micro-batches")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads per rank (default 1, as torchrun sets: a 1-rank run then compares fairly)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wandb", action="store_true", help="log to Weights & Biases from rank 0 (offline unless logged in)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    args = p.parse_args()
    if args.steps <= WARMUP_STEPS:
        p.error(f"--steps must be more than {WARMUP_STEPS} (the first {WARMUP_STEPS} are warm-up, not timed)")
    return p, args


def total_batch(args, world_size: int) -> int:
    if args.total_batch is not None:
        return args.total_batch
    # Strong scaling fixes the total batch for every world size: 4 micro-batches, so 1, 2 and 4 ranks divide it.
    ranks = world_size if args.scaling == "weak" else 4
    return args.micro_batch * args.seq_len * ranks


def make_trainer(impl: str, args, info, tokens, vocab: int, record_timeline=False, progress=True):
    """A Trainer for `impl`, starting from the seeded initial weights (identical for every impl and rank)."""
    group = nd.Group.local(info.device) if impl == "single" else info.group
    world = group.size
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig.preset(args.model, vocab_size=vocab, block_size=args.seq_len)).to(info.device)
    raw = model
    if impl in ("nanodist", "nanodist-pg"):
        model = nd.DDP(model, bucket_cap_mb=args.bucket_mb, record_timeline=record_timeline,
                       shared_memory=impl == "nanodist" and use_shared_memory(args, info))
    elif impl == "torch":
        model = TorchDDP(model, bucket_cap_mb=args.bucket_mb,
                         device_ids=[info.device.index] if info.device.type == "cuda" else None)
    elif impl == "naive":
        model = NaiveDDP(model)
    optimizer = torch.optim.AdamW(raw.configure_param_groups(weight_decay=0.1), lr=args.lr, betas=(0.9, 0.95))
    train_tokens, val_tokens = train_val_split(tokens)
    stream = lambda toks, seed: TokenStream(toks, batch_size=args.micro_batch, block_size=args.seq_len,
                                            rank=group.rank, world_size=world, seed=seed, device=info.device)
    cfg = TrainConfig(steps=args.steps, total_batch_tokens=total_batch(args, world), micro_batch=args.micro_batch,
                      seq_len=args.seq_len, lr=args.lr, warmup_steps=5, dtype=args.dtype, eval_batches=2,
                      log_every=0, progress=progress and not args.no_progress, wandb=args.wandb,
                      run_name=f"lab03-{impl}-{world}ranks")
    return Trainer(model, optimizer, stream(train_tokens, args.seed), cfg,
                   val_data=stream(val_tokens, args.seed + 1), group=group)


def use_shared_memory(args, info) -> bool:
    """auto: shared memory when every rank is a CPU process on this machine (gloo would go through TCP)."""
    if args.shared_memory != "auto":
        return args.shared_memory == "on"
    return info.device.type == "cpu" and info.world_size > 1 and info.local_world_size == info.world_size


def summarize(impl: str, trainer) -> dict:
    """Throughput (median over the steps after warm-up), losses and, for nanodist, the bucket timeline."""
    timed = trainer.history[WARMUP_STEPS:]
    step_s = statistics.median(h["time_s"] for h in timed)
    model = trainer.model
    out = {
        "impl": impl, "world_size": trainer.group.size, "grad_accum": trainer.grad_accum,
        "tokens_per_step": trainer.tokens_per_step, "median_step_s": step_s,
        "tokens_per_s": trainer.tokens_per_step / step_s,
        "losses": [round(h["loss"], 5) for h in trainer.history],
        "val_loss": trainer.history[-1].get("val_loss"),
        "params": sum(p.numel() for p in model.parameters()),
        "history": trainer.history,
    }
    if isinstance(model, nd.DDP):
        out["transport"] = "shared memory" if model.shared_memory else "the process group"
    if isinstance(model, nd.DDP) and model.record_timeline:
        out["timeline"] = model.timeline
        out["buckets"] = [b.numel for b in model.buckets]
    return out


def train_interleaved(impls, args, info, tokens, vocab: int) -> dict:
    """Train every impl, taking turns in blocks of steps (and rotating who goes first each round), so that a
    drift in the machine's load (another program, frequency scaling) hits every implementation alike: a fair
    comparison in one run. "single", the 1-rank baseline, runs on rank 0 alone while the others wait."""
    trainers = {impl: make_trainer(impl, args, info, tokens, vocab, record_timeline=args.timeline, progress=False)
                for impl in impls if impl != "single" or info.is_main}
    bar = None
    if info.is_main and not args.no_progress:  # one bar for all implementations
        from tqdm.auto import tqdm
        bar = tqdm(total=len(impls) * args.steps, desc=" + ".join(impls), leave=False)
    for round_ in range(-(-args.steps // BLOCK_STEPS)):
        for impl in impls[round_ % len(impls):] + impls[:round_ % len(impls)]:
            t = trainers.get(impl)
            before = t.step if t is not None else 0
            if t is not None:
                t.fit(max_steps=BLOCK_STEPS)
            if impl == "single" and info.world_size > 1:
                dist.barrier()  # the other ranks wait out rank 0's solo block (seconds, far below the timeout)
            if bar is not None:
                bar.update(t.step - before)
    if bar is not None:
        bar.close()
    return {impl: summarize(impl, t) for impl, t in trainers.items()}


def verify_equivalence(args, info, tokens, vocab: int, steps: int = 5) -> dict:
    """Averaging gradients over N ranks == one process on the N-times bigger batch: run both, compare.

    Every rank trains nanodist DDP on its own micro-batch; rank 0 also trains a plain copy of the model
    on all ranks' micro-batches concatenated. Both use SGD, whose update is linear in the gradient, so
    rounding differences stay rounding-sized (Adam's g / sqrt(v) turns the noise in a near-zero gradient
    into a full-size step of either sign). Returns the largest gradient and parameter differences per step.
    """
    torch.manual_seed(args.seed)
    cfg = GPTConfig.preset(args.model, vocab_size=vocab, block_size=args.seq_len)
    model = GPT(cfg).to(info.device)
    big = GPT(cfg).to(info.device)
    big.load_state_dict(model.state_dict())
    ddp = nd.DDP(model, bucket_cap_mb=args.bucket_mb)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, big)]
    stream = TokenStream(tokens, batch_size=args.micro_batch, block_size=args.seq_len, rank=info.rank,
                         world_size=info.world_size, seed=args.seed, device=info.device)
    grad_diffs, param_diffs = [], []
    for _ in range(steps):
        x, y = next(stream)
        ddp(x, y)[1].backward()
        xs = [torch.empty_like(x) for _ in range(info.world_size)]
        ys = [torch.empty_like(y) for _ in range(info.world_size)]
        dist.all_gather(xs, x)
        dist.all_gather(ys, y)
        if info.is_main:
            big(torch.cat(xs), torch.cat(ys))[1].backward()  # the mean over N*b sequences
            grad_diffs.append(max((p.grad - q.grad).abs().max().item()
                                  for p, q in zip(model.parameters(), big.parameters())))
            opts[1].step()
            opts[1].zero_grad()
        opts[0].step()
        opts[0].zero_grad()
        if info.is_main:
            param_diffs.append(max((p - q).abs().max().item() for p, q in zip(model.parameters(), big.parameters())))
    return {"steps": steps, "grad_max_abs_diff": grad_diffs, "max_abs_diff": param_diffs,
            "global_batch": args.micro_batch * info.world_size}


def baseline_from_files(args, info, impl: str) -> dict | None:
    """The latest 1-rank run of this lab with the same model and batch, on this machine, if one exists."""
    from nanodist.results import hardware_fingerprint
    host = hardware_fingerprint()["hostname"]
    same = [r for r in load_all("lab03_ddp") if r["world_size"] == 1 and r["hardware"].get("hostname") == host
            and all(r["config"].get(k) == getattr(args, k) for k in ("model", "micro_batch", "seq_len", "scaling", "dtype", "threads"))
            and (args.scaling == "weak" or r["config"].get("total_batch_tokens") == total_batch(args, info.world_size))]
    for r in reversed(same):
        for name in (impl, "single"):
            if name in r["metrics"].get("impls", {}):
                return r["metrics"]["impls"][name]
    return None


def main():
    parser, args = parse_args()
    info = nd.init(seed=args.seed)
    torch.set_num_threads(args.threads)
    try:  # bad sizes or data: a clear message on every rank, before any training starts
        grad_accum_steps(total_batch(args, info.world_size), args.micro_batch, args.seq_len, info.world_size)
        text = load_corpus(args.data)
        tok = CharTokenizer(text)
        tokens = torch.tensor(tok.encode(text), dtype=torch.int64)
        for part in train_val_split(tokens):
            TokenStream(part, batch_size=args.micro_batch, block_size=args.seq_len, rank=info.rank,
                        world_size=info.world_size)
    except (ValueError, OSError) as e:
        parser.error(str(e))
    impls = ["torch", "nanodist", "naive"] if args.impl == "all" else [args.impl]
    if args.impl == "all" and use_shared_memory(args, info):
        impls.insert(2, "nanodist-pg")  # the like-for-like comparison: the same transport as torch DDP
    if info.world_size > 1 and "single" in impls:
        parser.error("--impl single is the 1-rank reference: run it without torchrun (or use --baseline)")
    baseline = args.baseline if args.baseline is not None else args.impl == "all"

    rec = Recorder("lab03_ddp", config={**vars(args), "total_batch_tokens": total_batch(args, info.world_size)})
    if baseline and info.world_size > 1:
        impls = ["single"] + impls
        nd.print0("== baseline: rank 0 trains alone, in turns with the others, while the other ranks wait")
    nd.print0(f"== {', '.join(impls)}: {info.world_size} rank(s), {args.scaling} scaling, {args.steps} steps each, "
              f"taking turns every {BLOCK_STEPS} steps")
    results = train_interleaved(impls, args, info, tokens, tok.vocab_size)

    verified = None
    if args.verify:
        verified = verify_equivalence(args, info, tokens, tok.vocab_size)
        if info.is_main:
            nd.print0(f"N x b == 1 x Nb: largest gradient / parameter difference per step: "
                      f"{', '.join(f'{g:.1e}/{d:.1e}' for g, d in zip(verified['grad_max_abs_diff'], verified['max_abs_diff']))}")
    for name, r in results.items():
        how = f"  (gradients through {r['transport']})" if "transport" in r else ""
        nd.print0(f"{name:>11}: {r['world_size']} rank(s)  {r['tokens_per_s']:9.0f} tokens/s  "
                  f"step {1e3 * r['median_step_s']:7.2f} ms  loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}{how}")
    main_impl = "nanodist" if args.impl == "all" else args.impl
    for h in results[main_impl]["history"]:
        rec.step(**{k: v for k, v in h.items()})
    metrics = {"impls": {k: {kk: vv for kk, vv in v.items() if kk != "history"} for k, v in results.items()},
               "main_impl": main_impl, "tokens_per_s": results[main_impl]["tokens_per_s"]}
    if "torch" in results and "nanodist" in results:
        metrics["ratio_nanodist_vs_torch"] = results["nanodist"]["tokens_per_s"] / results["torch"]["tokens_per_s"]
        nd.print0(f"ratio nanodist/torch DDP throughput: {metrics['ratio_nanodist_vs_torch']:.2f} (target >= 1.0)")
    if "torch" in results and "nanodist-pg" in results:
        metrics["ratio_nanodist_pg_vs_torch"] = results["nanodist-pg"]["tokens_per_s"] / results["torch"]["tokens_per_s"]
        nd.print0(f"ratio nanodist-pg/torch DDP throughput (both through the process group): "
                  f"{metrics['ratio_nanodist_pg_vs_torch']:.2f}")
    if "torch" in results and "naive" in results:
        metrics["ratio_naive_vs_torch"] = results["naive"]["tokens_per_s"] / results["torch"]["tokens_per_s"]
        nd.print0(f"ratio naive/torch DDP throughput: {metrics['ratio_naive_vs_torch']:.2f} (target <= 0.6)")
    base = results.get("single")
    source = "same run"
    if base is None and info.world_size > 1:
        base, source = baseline_from_files(args, info, main_impl), "an earlier 1-rank run"
    if base is not None and info.world_size > 1:
        speedup = results[main_impl]["tokens_per_s"] / base["tokens_per_s"]
        metrics.update(speedup=speedup, efficiency=speedup / info.world_size, baseline_source=source)
        nd.print0(f"{args.scaling}-scaling speedup ({main_impl}, {info.world_size} ranks vs 1, {source}): {speedup:.2f}")
        nd.print0(f"{args.scaling}-scaling efficiency ({main_impl}, {info.world_size} ranks vs 1, {source}): "
                  f"{speedup / info.world_size:.2f} (target >= 0.8)")
    if verified is not None:
        metrics["verify"] = verified
    rec.metrics.update(metrics)
    path = rec.save()
    nd.print0(f"wrote {path}")
    nd.shutdown()


if __name__ == "__main__":
    main()
