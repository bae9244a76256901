"""Lab 9 — tensor and sequence parallelism: nanodist.tp against one process and torch's TP, its bytes and activation
memory against the formulas, and its step time against data parallelism.

    torchrun --nproc_per_node=4 labs/lab09_tp.py                      # equivalence at TP = 1, 2, 4 and 2 x 2, bytes,
                                                                      # activation memory (sub-groups of one launch)
    torchrun --nproc_per_node=4 labs/lab09_tp.py --parts traffic --tp-sizes 4    # one block's bytes at TP = 4
    torchrun --nproc_per_node=2 labs/lab09_tp.py --parts time         # step time: DP vs TP vs TP + SP, 2 ranks

Parts (--parts, default: equivalence traffic memory):
  equivalence  the course's GPT split over the first n ranks of the launch (n in --tp-sizes), as TP, TP + SP, and
               with the vocabulary split: loss and gradients against the same model in one process; an MLP split
               by nanodist and by torch's parallelize_module; with 4 ranks, the 2 x 2 mesh (torch's FSDP2 or
               nanodist's DDP on the data dimension, nanodist TP on the tensor one) against one process on the
               whole batch
  traffic      one block's collectives, counted in the run (nanodist.tp.record_traffic) as the difference between
               a 2-block and a 1-block model, against costmodel.tensor_parallel_traffic
  memory       what one block saves for backward per rank (autograd's saved-tensor hooks) against
               costmodel.activation_bytes, at every TP size, with and without SP
  time         the same global batch trained by data parallelism (nanodist DDP through the process group, as TP's
               collectives go), by TP over every rank, and by
               TP + SP, taking turns step by step (nanodist.experiment, the Trainer): median step times and
               their ratios
Results go to labs/results/lab09_tp/.
"""
import argparse
import statistics
from collections import Counter

import torch

import nanodist as nd
from nanodist import experiment
from nanodist.bench import take_turns
from nanodist.costmodel import activation_bytes, busbw_factor, ring_bytes, tensor_parallel_traffic
from nanodist.memory import LiveBytes
from nanodist.model import GPT, PRESETS, GPTConfig
from nanodist.results import Recorder
from nanodist.state import full_tensor

PARTS = ("equivalence", "traffic", "memory", "time")
VARIANTS = {"TP": dict(), "TP + SP": dict(sequence=True), "TP, vocabulary split": dict(vocab=True),
            "TP + SP, vocabulary split": dict(vocab=True, sequence=True)}
# fp32: the same sums split differently (partial products added by the all-reduce, heads computed apart): a few
# roundings of O(1) values, ~1e-7 of each tensor's largest value. 1e-5 leaves a margin of 100.
TOL = 1e-5
MIB = 2**20


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", choices=PARTS, default=["equivalence", "traffic", "memory"])
    p.add_argument("--tp-sizes", type=int, nargs="+", default=None,
                   help="tensor-parallel sizes measured, each on the first n ranks (default: 1, 2, 4 up to the world)")
    p.add_argument("--batch", type=int, default=8, help="equivalence, traffic, memory: sequences per batch")
    experiment.add_arguments(p, steps=12)
    return p, p.parse_args()


def check(args, world_size):
    if args.tp > 1 or args.sequence_parallel:
        return "lab 9 sets tensor parallelism itself, part by part (--tp-sizes; --parts time compares DP with TP over " \
               "every rank): leave out --tp and --sequence-parallel"
    sizes = tp_sizes(args, world_size)
    bad = [n for n in sizes if not 1 <= n <= world_size]
    if bad:
        return f"--tp-sizes: {bad[0]} rank(s) cannot be formed from this launch's {world_size}: use 1 to {world_size}"
    if "time" in args.parts and world_size < 2:
        return "--parts time compares data and tensor parallelism over the ranks of the launch: run 2 or more"
    if args.batch < 1:
        return f"--batch must be a positive integer, got {args.batch}"
    heads = PRESETS["tiny" if args.model == "auto" else args.model]["n_head"]
    for n in sizes + ([world_size] if "time" in args.parts else []):
        if heads % n or VOCAB % n or args.seq_len % n:
            return (f"tensor parallelism over {n} ranks splits the heads ({heads}), the vocabulary ({VOCAB}) and, with "
                    f"SP, the sequence (--seq-len {args.seq_len}): {n} must divide all three")
    if world_size == 4 and "equivalence" in args.parts and args.batch % 2:
        return f"--batch {args.batch}: the 2 x 2 mesh gives each of its two data ranks half of it: use an even --batch"
    return None


def tp_sizes(args, world_size):
    return sorted(set(args.tp_sizes or [n for n in (1, 2, 4) if n <= world_size]))


VOCAB = 64  # the parts' GPT reads random tokens of this vocabulary (the time part: the corpus's)


def gpt(cfg, seed=0, **changes):
    torch.manual_seed(seed)
    return GPT(GPTConfig.preset(cfg.model, vocab_size=VOCAB, block_size=cfg.seq_len, **changes))


def batch(cfg, size, step=0):
    g = torch.Generator().manual_seed(10 + step)
    x = torch.randint(0, VOCAB, (size, cfg.seq_len + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def worst(pairs) -> float:
    """The largest difference over (got, want) pairs, relative to each tensor's largest value."""
    return max(float((g - w).abs().max()) / max(float(w.abs().max()), 1e-3) for g, w in pairs)


def equivalence(cfg, args, group, sub, n, device):
    """One forward and backward of the GPT split over `sub` (n ranks) against the same GPT in one process."""
    rows = []
    x, y = (t.to(device) for t in batch(cfg, args.batch))
    plain = gpt(cfg).to(device)
    _, want = plain(x, y)
    want.backward()
    for name, how in VARIANTS.items():
        model = nd.tensor_parallel(gpt(cfg).to(device), sub, **how)
        _, loss = model(x, y)
        loss.backward()
        grads = [(full_tensor(p.grad), q.grad) for p, q in zip(model.parameters(), plain.parameters())]
        rows.append({"tp": n, "set-up": name, "loss": float(loss.detach()), "loss_one_process": float(want.detach()),
                     "worst_gradient": worst(grads), "tolerance": TOL})
    rows.append(torch_mlp(cfg, args, sub, n, device))
    return rows


def torch_mlp(cfg, args, sub, n, device):
    """The GPT's MLP split by nanodist (ColumnParallelLinear, RowParallelLinear) and by torch's parallelize_module
    (ColwiseParallel, RowwiseParallel): outputs and gradients."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from nanodist.model import MLP
    mcfg = GPTConfig.preset(cfg.model, vocab_size=VOCAB, block_size=cfg.seq_len)
    torch.manual_seed(0)
    ours, theirs = MLP(mcfg).to(device), MLP(mcfg).to(device)
    theirs.load_state_dict(ours.state_dict())
    ours.fc, ours.proj = nd.ColumnParallelLinear(ours.fc, sub), nd.RowParallelLinear(ours.proj, sub)
    parallelize_module(theirs, sub.device_mesh, {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
    x = torch.randn(args.batch, cfg.seq_len, mcfg.n_embd, generator=torch.Generator().manual_seed(3)).to(device)
    a, b = ours(x), theirs(x)
    a.square().sum().backward()
    b.square().sum().backward()
    pairs = [(a.detach(), b.detach())] + [(full_tensor(p.grad), full_tensor(q.grad))
                                          for p, q in zip(ours.parameters(), theirs.parameters())]
    return {"tp": n, "set-up": "MLP: nanodist vs torch's parallelize_module", "worst_gradient": worst(pairs),
            "tolerance": TOL}


def mesh_2x2(cfg, args, group, device):
    """Data x tensor on a 2 x 2 mesh -- torch's FSDP2 or nanodist's DDP on the data dimension, nanodist TP (and TP +
    SP) on the tensor one -- against one process on the whole batch: each data rank takes half of it, and the data
    dimension averages the two halves' gradients."""
    from torch.distributed.fsdp import fully_shard
    mesh = group.mesh({"data": 2, "tensor": 2})
    x, y = (t.to(device) for t in batch(cfg, args.batch))
    plain = gpt(cfg).to(device)
    _, want = plain(x, y)
    want.backward()
    half = args.batch // 2
    mine = slice(mesh["data"].rank * half, (mesh["data"].rank + 1) * half)
    rows = []
    for data in ("FSDP2", "nanodist DDP"):
        for name, how in (("nanodist TP", {}), ("nanodist TP + SP", dict(sequence=True))):
            model = nd.tensor_parallel(gpt(cfg).to(device), mesh["tensor"], **how)
            if data == "FSDP2":
                for block in model.blocks:
                    fully_shard(block, mesh=mesh.device_mesh["data"])
                trained = fully_shard(model, mesh=mesh.device_mesh["data"])
            else:
                trained = nd.DDP(model, group=mesh["data"])
            _, loss = trained(x[mine], y[mine])
            loss.backward()
            grads = [(full_tensor(p.grad), q.grad) for p, q in zip(model.parameters(), plain.parameters())]
            losses = mesh["data"].all_gather_object(float(loss.detach()))
            rows.append({"tp": 2, "data": 2, "set-up": f"2 x 2: {data} x {name}", "loss": sum(losses) / 2,
                         "loss_one_process": float(want.detach()), "worst_gradient": worst(grads),
                         "tolerance": TOL})
    return rows


def block_traffic(cfg, args, sub, sequence, device):
    """One block's collectives: what a 2-block model sends minus what a 1-block one does (the same embeddings,
    norm and head), forward and backward, as {(phase, kind, bytes): count}."""
    counted = []
    for layers in (1, 2):
        model = nd.tensor_parallel(gpt(cfg, n_layer=layers).to(device), sub, sequence=sequence)
        x, y = (t.to(device) for t in batch(cfg, args.batch))
        with nd.record_traffic() as sent:
            _, loss = model(x, y)
            forward = len(sent)
            loss.backward()
        counted.append(Counter(("forward" if i < forward else "backward", s.kind, s.nbytes)
                               for i, s in enumerate(sent)))
    return counted[1] - counted[0]


def traffic(cfg, args, group, sub, n, device):
    rows = []
    C = GPTConfig.preset(cfg.model).n_embd
    for sequence in (False, True):
        got = block_traffic(cfg, args, sub, sequence, device)
        want = tensor_parallel_traffic(args.batch, cfg.seq_len, C, n, sequence)
        rows.append({"tp": n, "sequence_parallel": sequence, "counted": sorted([*k, c] for k, c in got.items()),
                     "formula": sorted([*k, c] for k, c in want.items()), "equal": dict(got) == want,
                     "ring_bytes_counted": ring_bytes(got, n), "ring_bytes_formula": ring_bytes(want, n),
                     "activation_bytes": args.batch * cfg.seq_len * C * 4})
    return rows


def saved_by_block(model, x, y) -> int:
    """The bytes block 0 saves for backward on this rank (autograd's saved-tensor hooks, parameters left out)."""
    live = LiveBytes(parameters=model.parameters())
    with live.track_module(model.blocks[0]):
        model(x, y)
    return live.saved_bytes()


def memory(cfg, args, group, sub, n, device):
    rows = []
    mcfg = GPTConfig.preset(cfg.model)
    x, y = (t.to(device) for t in batch(cfg, args.batch))
    for sequence in ((False, True) if n > 1 else (False,)):
        model = gpt(cfg).to(device)
        if n > 1:
            nd.tensor_parallel(model, sub, sequence=sequence)
        got = sub.all_gather_object(saved_by_block(model, x, y))
        want = activation_bytes(args.batch, cfg.seq_len, mcfg.n_embd, mcfg.n_head, n, sequence)
        rows.append({"tp": n, "sequence_parallel": sequence, "measured_per_rank": got, "formula": want})
    return rows


def timed(args, cfg, data, group):
    """The same global batch (micro-batch x world sequences per step) by DDP over every rank, by TP over every
    rank (each rank the whole batch, 1/world of each block), and by TP + SP; taking turns step by step."""
    W = group.size
    every = cfg.micro_batch * W  # sequences per step, whoever computes them
    setups = {"DP (nanodist DDP)": (cfg, "nanodist-pg"),  # through gloo, as TP's collectives
              f"TP = {W}": (cfg.replace(tp=W, micro_batch=every), "tp"),
              f"TP = {W} + SP": (cfg.replace(tp=W, micro_batch=every, sequence_parallel=True), "tp")}
    runs = {name: experiment.build(c, data, group, wrapper=wrapper, name=name) for name, (c, wrapper) in setups.items()}
    nd.print0(f"== step time, {W} ranks, {cfg.model} model, {every} x {cfg.seq_len} tokens per step, {cfg.steps} "
              f"steps each, taking turns")
    take_turns({name: (lambda r=r: r.trainer.fit(max_steps=1)) for name, r in runs.items()}, rounds=cfg.steps,
               group=group)
    out = {}
    for name, run in runs.items():
        r = experiment.summarize(run)
        out[name] = {k: r[k] for k in ("median_step_s", "tokens_per_s", "tokens_per_step", "losses", "world_size")}
        out[name]["step_times_s"] = [h["time_s"] for h in run.trainer.history[experiment.WARMUP_STEPS:]]
    # what each sends per step, from the formulas: DP one all-reduce of the fp32 gradients, TP four all-reduces of
    # the activations per block (and SP the same bytes, plus its backward's re-gathers and small all-reduces)
    shape = GPTConfig.preset(cfg.model)
    params = experiment.summarize(runs["DP (nanodist DDP)"])["params"]
    bytes_per_step = {"dp": busbw_factor("all_reduce", W) * 4 * params,
                      "tp": shape.n_layer * ring_bytes(tensor_parallel_traffic(every, cfg.seq_len, shape.n_embd, W), W),
                      "tp_sp": shape.n_layer * ring_bytes(tensor_parallel_traffic(every, cfg.seq_len, shape.n_embd, W,
                                                                                  sequence=True), W)}
    nd.print0("bytes each rank sends per step (formulas): " + ", ".join(f"{k} {v / 1024:.0f} KiB"
                                                                       for k, v in bytes_per_step.items()))
    # and how many collectives each issues a step: DDP one per bucket and one of its control numbers; TP's counted
    # over one more forward and backward of each split model (after the timed steps)
    calls = {"dp": len(runs["DP (nanodist DDP)"].model.buckets) + 1}
    x, y = next(runs[f"TP = {W}"].train)
    for key, name in (("tp", f"TP = {W}"), ("tp_sp", f"TP = {W} + SP")):
        raw = runs[name].raw
        with nd.record_traffic() as issued:
            raw(x, y)[1].backward()
        raw.zero_grad(set_to_none=True)
        calls[key] = len(issued)
    nd.print0("collectives per step: " + ", ".join(f"{k} {v}" for k, v in calls.items()))
    dp = out["DP (nanodist DDP)"]["median_step_s"]
    ratios = {f"ratio_step_{'tp_sp' if 'SP' in name else 'tp'}_vs_dp": r["median_step_s"] / dp
              for name, r in out.items() if name.startswith("TP")}
    for name, r in out.items():
        nd.print0(f"{name:>18}: step {1e3 * r['median_step_s']:8.2f} ms  {r['tokens_per_s']:9.0f} tokens/s  loss "
                  f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}")
    for k, v in ratios.items():
        nd.print0(f"{k}: {v:.2f}")
    return {"runs": out, **ratios, "world_size": W, "params": params, "bytes_per_step": bytes_per_step,
            "collectives_per_step": calls}


def main():
    parser, args = parse_args()
    info = experiment.start(parser, args, min_steps=experiment.WARMUP_STEPS + 1 if "time" in args.parts else 1,
                            extra_check=check)
    group, device = info.group, info.device
    # --model auto: the tiny GPT on a CPU (seconds for every part), the small one on a GPU
    model = args.model if args.model != "auto" else ("tiny" if device.type == "cpu" else "small")
    cfg = experiment.RunConfig.from_args(args, device, model=model)
    rec = Recorder("lab09_tp", config={**vars(args), **cfg.to_dict()})
    sizes = tp_sizes(args, group.size)
    subs = experiment.first_ranks(group, sizes)
    for part in ("equivalence", "traffic", "memory"):
        if part not in args.parts:
            continue
        rows = []
        for n, sub in subs.items():
            if sub is not None:
                rows += {"equivalence": equivalence, "traffic": traffic, "memory": memory}[part](
                    cfg, args, group, sub, n, device)
            group.barrier()
        if part == "equivalence" and group.size == 4:
            rows += mesh_2x2(cfg, args, group, device)
        rec.metrics[part] = rows
        report(part, rows)
    if "time" in args.parts:
        rec.metrics["time"] = timed(args, cfg, experiment.load_data(cfg), group)
    rec.metrics["tp_sizes"] = sizes
    rec.metrics["device"] = device.type
    nd.print0(f"wrote {nd.results.shown(rec.save())}")
    nd.shutdown()


def report(part, rows):
    """Rank 0's lines for one part (its rows: the first n ranks of each size include rank 0)."""
    for r in rows:
        if part == "equivalence":
            loss = f"loss {r['loss']:.6f} (one process {r['loss_one_process']:.6f})  " if "loss" in r else ""
            nd.print0(f"TP={r['tp']} {r['set-up']:>44}: {loss}worst gradient difference {r['worst_gradient']:.1e} "
                      f"(tolerance {r['tolerance']:.0e})")
        elif part == "traffic":
            nd.print0(f"TP={r['tp']} {'SP' if r['sequence_parallel'] else 'TP'}: one block sends "
                      f"{r['ring_bytes_counted'] / MIB:.3f} MiB per rank (formula {r['ring_bytes_formula'] / MIB:.3f}); "
                      f"collectives {'equal to' if r['equal'] else 'DIFFERENT FROM'} the formula's")
        else:
            nd.print0(f"TP={r['tp']} {'+ SP' if r['sequence_parallel'] else '    '}: one block saves "
                      f"{max(r['measured_per_rank']) / MIB:.3f} MiB per rank (formula "
                      f"{r['formula']['total'] / MIB:.3f})")


if __name__ == "__main__":
    main()
