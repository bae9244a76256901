"""Lab 2: how fast are the collectives? torch's own against the from-scratch ones, over message sizes.

    torchrun --nproc_per_node=2 labs/lab02_allreduce.py                          # 4 KiB .. 64 MiB
    torchrun --nproc_per_node=2 labs/lab02_allreduce.py --max-bytes 1M --repeats 3
    torchrun --nproc_per_node=4 labs/lab02_allreduce.py --demo                   # what each collective does
    run = nanodist.launch("lab02_allreduce", nproc=2); run.results["metrics"]    # from a notebook

For each message size S: --warmup untimed calls of each op, then --repeats rounds in which every op is
timed once (taking turns, so background load hits all ops alike). Each rank times its own call, after a
barrier; a collective lasts as long as its slowest rank, so a call's time is the max over ranks, and we
report the median call. Bandwidths follow nccl-tests:
    algbw = S / t                      (S: the all-reduce tensor, the reduce-scatter input, the all-gather output)
    busbw = algbw * 2(n-1)/n           for all-reduce, algbw * (n-1)/n for reduce-scatter and all-gather
busbw is what each rank's link carried per second: comparable across ops and world sizes, and with
the memcpy bandwidth measured alongside (one large tensor copy), this machine's physical reference.
The results record holds every measurement (metrics["sweep"]), alpha-beta fits (nanodist.costmodel)
and the two ratios the chapter discusses, printed last.

--demo measures nothing: it runs each collective once on small integer tensors (broadcast, reduce,
all-reduce, reduce-scatter, all-gather, all-to-all), a barrier, an async all-reduce read before its
wait(), and nanodist's ring all-reduce traced step by step, and records every rank's buffers before and
after (metrics["demo"]) -- the chapter's pictures.
"""
import argparse
import math
import re
import statistics
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

import nanodist
from nanodist import collectives, costmodel
from nanodist.bench import time_calls
from nanodist.costmodel import busbw_factor
from nanodist.results import Recorder, ResultsError, check_writable

# torch >= 2.13 renamed these two (same operation); use whichever this torch has, without warnings.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# op -> (collective, call(big, small)). `big` is the S-byte tensor, `small` one rank's S/n share.
OPS = {
    "dist.all_reduce": ("all_reduce", lambda big, small: dist.all_reduce(big)),
    "ring_all_reduce": ("all_reduce", lambda big, small: collectives.ring_all_reduce(big, check=False)),
    "naive_all_reduce": ("all_reduce", lambda big, small: collectives.naive_all_reduce(big, check=False)),
    "recursive_doubling_all_reduce": ("all_reduce",
                                      lambda big, small: collectives.recursive_doubling_all_reduce(big, check=False)),
    "dist.reduce_scatter_tensor": ("reduce_scatter", lambda big, small: _reduce_scatter(small, big)),
    "ring_reduce_scatter": ("reduce_scatter",
                            lambda big, small: collectives.ring_reduce_scatter(small, big, check=False)),
    "dist.all_gather_into_tensor": ("all_gather", lambda big, small: _all_gather(big, small)),
    "ring_all_gather": ("all_gather", lambda big, small: collectives.ring_all_gather(big, small, check=False)),
}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
RATIO_SIZE = 32 * 2**20  # the size the two benchmark ratios are read at (or the nearest one swept)


def parse_bytes(text: str) -> int:
    """'4096', '4K', '64M', '1G', '32MB' -> bytes (powers of 1024: K = KiB, M = MiB)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)I?B?\s*", text.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write e.g. 4096, 4K, 64M or 1G")
    return int(m.group(1)) * 1024 ** " KMG".index(m.group(2) or " ")


def parse_ops(text: str) -> list[str]:
    ops = [o.strip() for o in text.split(",") if o.strip()]
    unknown = [o for o in ops if o not in OPS]
    if unknown or not ops:
        raise argparse.ArgumentTypeError(f"unknown op(s) {unknown or text!r}: choose from {', '.join(OPS)}")
    return ops


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-bytes", type=parse_bytes, default=parse_bytes("4K"), help="smallest message (default 4K)")
    p.add_argument("--max-bytes", type=parse_bytes, default=parse_bytes("64M"), help="largest message (default 64M)")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per op and size (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first (connections, caches, buffers)")
    p.add_argument("--ops", type=parse_ops, default=list(OPS), help=f"comma-separated, from: {', '.join(OPS)}")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--demo", action="store_true",
                   help="instead of the sweep: run each collective once on small integer tensors and record every "
                        "rank's buffers before and after (metrics['demo'])")
    args = p.parse_args(argv)
    if not 1 <= args.min_bytes <= args.max_bytes:
        p.error(f"need 1 <= --min-bytes <= --max-bytes, got {args.min_bytes} and {args.max_bytes}")
    if args.repeats < 1 or args.warmup < 0:
        p.error(f"need --repeats >= 1 and --warmup >= 0, got {args.repeats} and {args.warmup}")
    return args


def sizes(lo: int, hi: int) -> list[int]:
    """Powers of two from lo to hi (both rounded to the power of two at or below them)."""
    return [2**k for k in range(int(math.log2(lo)), int(math.log2(hi)) + 1)]


# ----------------------------------------------------------------------------- --demo

BARRIER_WORK_S = 0.05  # in the barrier demo, rank r "works" r * this long before it arrives
ASYNC_NUMEL = 2**22    # 16 MiB of float32: an all-reduce long enough to catch it half done


def demo(info) -> dict:
    """Each collective once; {name: {"before", "after"}} of this rank, plus its barrier and async timings.

    Rank r starts from [10r, 10r+1, ..., 10r+n-1]: the tens digit says whose number it is (n <= 10).
    The reduce-scatter's output is the all-gather's input: the two together are an all-reduce.
    """
    n, rank, dev = info.world_size, info.rank, nanodist.Group.world().comm_device  # gloo: host memory
    mine = torch.arange(n, device=dev) + 10 * rank  # int64: sums are exact, pictures readable
    t, shard, full = mine.clone(), mine.new_empty(1), mine.new_empty(n)
    out = {}
    for name, before, call, after in [
        ("broadcast", mine, lambda: dist.broadcast(t.copy_(mine), src=0), t),
        ("reduce", mine, lambda: dist.reduce(t.copy_(mine), dst=0), t),
        ("all_reduce", mine, lambda: dist.all_reduce(t.copy_(mine)), t),
        ("reduce_scatter", mine, lambda: _reduce_scatter(shard, mine), shard),
        ("all_gather", shard, lambda: _all_gather(full, shard), full),
        ("all_to_all", mine, lambda: dist.all_to_all_single(full, mine), full),
    ]:
        was = before.tolist()
        call()
        out[name] = {"before": was, "after": after.tolist()}

    # Wall-clock times, so that ranks on one machine share a clock (across machines: as well as theirs agree).
    dist.barrier()
    start = time.time()
    time.sleep(BARRIER_WORK_S * rank)
    arrive = time.time()
    dist.barrier()
    out["barrier"] = {"work_ms": 1e3 * BARRIER_WORK_S * rank, "start_s": start, "arrive_s": arrive,
                      "leave_s": time.time()}

    big = torch.full((ASYNC_NUMEL,), float(rank + 1), device=dev)
    final = n * (n + 1) / 2
    work = dist.all_reduce(big, async_op=True)  # returns at once; the reduction runs in the background
    done_early = work.is_completed()
    reads = []  # reading before wait(), at once and then until it completes: [share still original, share final]
    while len(reads) < 100:
        seen = big.clone()  # one snapshot per read, so that both shares describe the same moment
        reads.append([(seen == rank + 1).float().mean().item(), (seen == final).float().mean().item()])
        if work.is_completed():
            break
    work.wait()
    rs_work = _reduce_scatter(shard, mine, async_op=True)
    try:
        rs_work.get_future()
        future = "available"
    except RuntimeError as e:  # gloo's reduce-scatter is an all-reduce plus a copy, wrapped without a future
        future = f"RuntimeError: {e}"
    rs_work.wait()
    out["async"] = {"completed_at_once": done_early, "reads": reads, "original_before_wait": reads[0][0],
                    "final_before_wait": reads[0][1], "completed_after_wait": work.is_completed(),
                    "correct_after_wait": bool((big == final).all()), "reduce_scatter_get_future": future}

    # nanodist's ring all-reduce, recorded after every step: rank r starts from n copies of 10^r.
    ring = torch.full((n,), 10 ** rank, device=dev)
    start, trace = ring.tolist(), []
    reference = ring.clone()
    collectives.ring_all_reduce(ring, trace=trace)
    dist.all_reduce(reference)  # torch's, on the same input: the ring must give the same numbers
    out["ring"] = {"start": start, "trace": [{"phase": t["phase"], "step": t["step"], "send": t["send"],
                                              "buffer": t["buffer"].tolist()} for t in trace],
                   "result": ring.tolist(), "torch": reference.tolist()}
    return out


DEMO_CALLS = {  # in the order demo() runs them
    "broadcast": "dist.broadcast(t, src=0)", "reduce": "dist.reduce(t, dst=0)", "all_reduce": "dist.all_reduce(t)",
    "reduce_scatter": "dist.reduce_scatter_tensor(out, t)", "all_gather": "dist.all_gather_into_tensor(out, t)",
    "all_to_all": "dist.all_to_all_single(out, t)",
}


def run_demo(info, rec: Recorder) -> None:
    """Gather every rank's demo() on rank 0 and record it by collective: before/after lists indexed by rank."""
    mine = demo(info)
    everyone = [None] * info.world_size if info.is_main else None
    dist.gather_object(mine, everyone, dst=0)
    if not info.is_main:
        return
    by_name = {name: {"call": call, "reduces": name in ("reduce", "all_reduce", "reduce_scatter"),
                      "before": [r[name]["before"] for r in everyone], "after": [r[name]["after"] for r in everyone],
                      # after dist.reduce only the root's buffer is defined; the others hold scratch
                      "defined": [name != "reduce" or r == 0 for r in range(info.world_size)]}
               for name, call in DEMO_CALLS.items()}
    per_rank = lambda part: {k: [r[part][k] for r in everyone] for k in everyone[0][part]}  # noqa: E731
    b = per_rank("barrier")
    t0 = min(b["start_s"])  # the first rank out of the previous barrier
    ms = lambda key: [1e3 * (t - t0) for t in b[key]]  # noqa: E731
    rec.metrics["sweep"] = []  # no measurements in this run
    rec.metrics["demo"] = {"world_size": info.world_size, "values": "10 * rank + index", "collectives": by_name,
                           "barrier": {"call": "dist.barrier()", "work_ms": b["work_ms"], "start_ms": ms("start_s"),
                                       "arrive_ms": ms("arrive_s"), "leave_ms": ms("leave_s")},
                           "async": {"call": "dist.all_reduce(t, async_op=True)", "numel": ASYNC_NUMEL,
                                     **per_rank("async")},
                           "ring": {"call": "nanodist.collectives.ring_all_reduce(t, trace=trace)",
                                    "start": [r["ring"]["start"] for r in everyone],
                                    "traces": [r["ring"]["trace"] for r in everyone],
                                    "result": [r["ring"]["result"] for r in everyone],
                                    "dist.all_reduce": [r["ring"]["torch"] for r in everyone]}}
    for name, d in by_name.items():
        print(d["call"])
        for r, (was, now) in enumerate(zip(d["before"], d["after"])):
            print(f"  rank {r}: {was} -> {now}" + ("" if d["defined"][r] else "  (not defined: scratch)"))
    bar = rec.metrics["demo"]["barrier"]
    print("dist.barrier(): arrived at " + ", ".join(f"{t:.0f}" for t in bar["arrive_ms"]) + " ms; left at "
          + ", ".join(f"{t:.0f}" for t in bar["leave_ms"]) + " ms")


def main():
    args = get_args()
    try:
        check_writable()  # before any work: a lab always gets to write its results
    except ResultsError as e:
        sys.stderr.write(f"lab02_allreduce.py: error: {e}\n")
        sys.exit(2)
    info = nanodist.init(seed=args.seed)
    n, dtype = info.world_size, DTYPES[args.dtype]
    # The buffers live where the backend moves them from: GPU memory for nccl, host memory for gloo -- gloo's
    # point-to-point calls cannot read GPU memory, so ranks sharing a GPU through gloo measure gloo itself.
    dev = nanodist.Group.world().comm_device
    if dev != info.device:
        nanodist.print0(f"gloo moves host memory: the collectives below run on buffers on {dev.type}, "
                        f"while this run computes on {info.device}")
    rec = Recorder("lab02_allreduce", config=vars(args))
    rec.metrics["buffers_device"] = dev.type
    if args.demo:
        run_demo(info, rec)
        rec.save()
        nanodist.shutdown()
        return
    elem = torch.empty(0, dtype=dtype).element_size()
    swept = sizes(args.min_bytes, args.max_bytes)
    bar = tqdm(total=len(swept), desc="lab02", unit="size", disable=not (info.is_main and sys.stderr.isatty()))

    rows, step = [], 0
    for size in swept:
        numel = max(n, size // elem // n * n)  # a multiple of n, so reduce-scatter and all-gather can split it
        nbytes = numel * elem
        big = torch.randn(numel, device=dev).to(dtype)  # shared by every op at this size
        small = torch.randn(numel // n, device=dev).to(dtype)
        calls = {op: (lambda call=OPS[op][1]: call(big, small)) for op in args.ops}
        for op, times in time_calls(calls, args.repeats, args.warmup).items():
            collective, t = OPS[op][0], statistics.median(times)
            algbw = nbytes / t / 1e9
            rows.append({"op": op, "collective": collective, "algorithm": costmodel.ALIASES.get(op, op),
                         "size_bytes": nbytes, "numel": numel, "dtype": args.dtype, "time_s": t,
                         "time_min_s": min(times), "algbw_GBps": algbw,
                         "busbw_GBps": algbw * busbw_factor(collective, n), "repeats": len(times)})
            for i, ti in enumerate(times):
                rec.step(step=step, time_s=ti, op=op, size_bytes=nbytes, repeat=i)
                step += 1
        bar.update()
    bar.close()
    del big, small
    collectives.free_buffers()

    # The physical reference: how fast this device copies memory (bytes copied per second).
    src = torch.randn(max(1, args.max_bytes // elem), device=dev).to(dtype)
    dst = torch.empty_like(src)
    copy_t = statistics.median(time_calls({"memcpy": lambda: dst.copy_(src)}, args.repeats, args.warmup)["memcpy"])
    memcpy = {"size_bytes": src.numel() * elem, "time_s": copy_t, "GBps": src.numel() * elem / copy_t / 1e9}
    rec.metrics.update(sweep=rows, memcpy=memcpy, memcpy_GBps=memcpy["GBps"])

    # What nanodist's collective metadata check (on by default) costs: the ring all-reduce with and without it,
    # at the smallest, a middle and the largest size swept.
    if n > 1 and "ring_all_reduce" in args.ops:
        rec.metrics["check_cost"] = []
        for size in sorted({swept[0], swept[len(swept) // 2], swept[-1]}):
            t = torch.randn(max(n, size // elem // n * n), device=dev).to(dtype)
            times = time_calls({"unchecked": lambda: collectives.ring_all_reduce(t, check=False),
                                "checked": lambda: collectives.ring_all_reduce(t, check=True)}, args.repeats, args.warmup)
            off, on = statistics.median(times["unchecked"]), statistics.median(times["checked"])
            rec.metrics["check_cost"].append({"size_bytes": t.numel() * elem, "time_unchecked_s": off,
                                              "time_checked_s": on, "overhead": on / off - 1})

    if n > 1:
        fits = costmodel.fit_results({"metrics": {"sweep": rows}, "world_size": n, "backend": info.backend,
                                      "device": dev.type})
        rec.metrics["fits"] = {op: {"algorithm": m.algorithm, "alpha_s": m.alpha_s,
                                    "beta_s_per_byte": m.beta_s_per_byte, "bandwidth_GBps": m.bandwidth_GBps,
                                    "rel_rmse": m.rel_rmse} for op, m in fits.items()}
    report(rows, rec.metrics, n, info)
    rec.save()
    nanodist.shutdown()


def _size_label(size: int) -> str:
    return f"{size / 2**20:.3g}M" if size >= 2**20 else f"{size / 2**10:.3g}K" if size >= 2**10 else f"{size}"


def _at(rows, op, size):
    return next((r for r in rows if r["op"] == op and r["size_bytes"] == size), None)


def report(rows, metrics, n, info):
    """Print a busbw table, the fits, and the two benchmark ratios (also stored in metrics)."""
    ops = list(dict.fromkeys(r["op"] for r in rows))
    swept = sorted({r["size_bytes"] for r in rows})
    near = min(swept, key=lambda s: abs(math.log2(s / RATIO_SIZE)))
    label = _size_label(near) + "B"
    ratios = {}
    pairs = {"ratio_ring_all_reduce_busbw": ("ring_all_reduce", "dist.all_reduce"),
             "ratio_ring_reduce_scatter_time": ("ring_reduce_scatter", "dist.reduce_scatter_tensor")}
    for key, (ours, theirs) in pairs.items():
        a, b = _at(rows, ours, near), _at(rows, theirs, near)
        if a and b:  # busbw ratio = inverse time ratio (same bytes); computed from times so n=1 works too
            ratios[key] = b["time_s"] / a["time_s"] if key.endswith("busbw") else a["time_s"] / b["time_s"]
    metrics.update(ratios, ratio_size_bytes=near)
    if not info.is_main:
        return
    print(f"{n} ranks, {info.backend} on {info.device.type}: busbw in GB/s (median of {rows[0]['repeats']} calls); "
          f"memcpy {metrics['memcpy_GBps']:.2f} GB/s")
    width = max(len(o) for o in ops)
    print(f"{'op':<{width}}" + "".join(f"{_size_label(s):>8}" for s in swept))
    for op in ops:
        print(f"{op:<{width}}" + "".join(f"{_at(rows, op, s)['busbw_GBps']:>8.3f}" for s in swept))
    for op, f in metrics.get("fits", {}).items():
        print(f"fit {op:<{width}} alpha {f['alpha_s'] * 1e6:8.1f} us   bandwidth {f['bandwidth_GBps']:7.2f} GB/s   "
              f"rel. error {f['rel_rmse']:.2f}")
    if "check_cost" in metrics:
        print("the collective metadata check costs " + ", ".join(
            f"{100 * c['overhead']:+.0f}% at {_size_label(c['size_bytes'])}B" for c in metrics["check_cost"])
              + " of a ring_all_reduce")
    if "ratio_ring_all_reduce_busbw" in ratios:
        print(f"ratio ring_all_reduce/dist.all_reduce busbw @{label}: {ratios['ratio_ring_all_reduce_busbw']:.2f}")
    if "ratio_ring_reduce_scatter_time" in ratios:
        print(f"ratio ring_reduce_scatter/dist.reduce_scatter_tensor time @{label}: "
              f"{ratios['ratio_ring_reduce_scatter_time']:.2f}")


if __name__ == "__main__":
    main()
