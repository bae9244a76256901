"""Lab 1 — who am I? Every rank reports its identity, then the ranks exchange their first messages.

    python labs/lab01_ranks.py                              # a world of one
    torchrun --nproc_per_node=2 labs/lab01_ranks.py         # two ranks on this machine
    torchrun --nnodes=2 --nproc_per_node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 labs/lab01_ranks.py

Each rank prints one line; rank 0 gathers every rank's report and writes them, with the timings of
a broadcast and an all-reduce, to labs/results/lab01_ranks/<run-id>.jsonl.
"""
import argparse
import os
import socket
import time

import torch
import torch.distributed as dist

import nanodist as nd
from nanodist.results import Recorder, ResultsError, check_writable

ENV_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
            "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None, help="default: nccl with a GPU per rank, else gloo")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: follows the backend")
    p.add_argument("--seed", type=int, default=0, help="model-init seed, identical on every rank")
    p.add_argument("--numel", type=int, default=1 << 20, help="elements in the timed all-reduce (float32)")
    p.add_argument("--repeats", type=int, default=5, help="timed all-reduces")
    args = p.parse_args()
    for name in ("numel", "repeats"):  # checked before anything starts: a bad flag is one line, on every rank
        if getattr(args, name) < 1:
            p.error(f"--{name} must be a positive integer, got {getattr(args, name)}")
    try:
        check_writable()
    except ResultsError as e:
        p.error(str(e))
    return args


def main():
    args = parse_args()
    info = nd.init(backend=args.backend, device=args.device, seed=args.seed)

    # Seeding: the global generator (seeded identically) gives every rank the same "weights";
    # a generator seeded with info.data_seed gives each rank its own data order.
    same = torch.randn(3, generator=None)
    own = torch.randn(3, generator=torch.Generator().manual_seed(info.data_seed))

    # First broadcast: rank 0's tensor reaches everyone.
    payload = (torch.arange(4, dtype=torch.float32) + 100 * (info.rank + 1)).to(info.device)
    dist.broadcast(payload, src=0)
    # First all-reduce: every rank contributes rank + 1, so everyone ends with 1 + 2 + ... + W.
    contribution = torch.tensor([info.rank + 1.0], device=info.device)
    dist.all_reduce(contribution)

    # Process groups: one group per node. Every rank must create every group, in the same order,
    # even the groups it is not in; then collectives can run inside a group only.
    per_node = info.local_world_size
    node_groups = [dist.new_group(list(range(n * per_node, (n + 1) * per_node)))
                   for n in range(info.world_size // per_node)]
    in_node = torch.tensor([info.rank + 1.0], device=info.device)
    dist.all_reduce(in_node, group=node_groups[info.node_rank])

    rec = Recorder("lab01_ranks", config=vars(args))
    big = torch.ones(args.numel, device=info.device)
    for i in range(args.repeats):
        dist.barrier()
        nd.runtime.synchronize(info.device)
        t0 = time.perf_counter()
        dist.all_reduce(big)
        nd.runtime.synchronize(info.device)
        rec.step(step=i, time_s=time.perf_counter() - t0, bytes=big.numel() * big.element_size())

    report = {
        "rank": info.rank, "local_rank": info.local_rank, "node_rank": info.node_rank,
        "world_size": info.world_size, "local_world_size": info.local_world_size,
        "backend": info.backend, "device": str(info.device), "pid": os.getpid(), "host": socket.gethostname(),
        "env": {k: os.environ.get(k) for k in ENV_VARS},
        "broadcast": payload.cpu().tolist(), "all_reduce": contribution.item(), "node_all_reduce": in_node.item(),
        "init_randn": [round(x, 4) for x in same.tolist()], "data_randn": [round(x, 4) for x in own.tolist()],
    }
    print(f"rank {info.rank}/{info.world_size} local_rank {info.local_rank} node {info.node_rank} "
          f"{info.backend}/{info.device} pid {report['pid']} host {report['host']}: "
          f"broadcast got {report['broadcast'][0]:.0f}, all_reduce got {report['all_reduce']:.0f}")

    reports = [None] * info.world_size
    dist.all_gather_object(reports, report)
    expected_sum = info.world_size * (info.world_size + 1) / 2
    rec.metrics.update(
        ranks=sorted(reports, key=lambda r: r["rank"]),
        broadcast_ok=all(r["broadcast"] == reports[0]["broadcast"] for r in reports)
        and reports[0]["broadcast"][0] == 100.0,
        all_reduce_ok=all(r["all_reduce"] == expected_sum for r in reports),
        init_seed_identical=all(r["init_randn"] == reports[0]["init_randn"] for r in reports),
        data_seed_distinct=len({tuple(r["data_randn"]) for r in reports}) == info.world_size,
    )
    path = rec.save()
    nd.print0(f"wrote {nd.results.shown(path)}")
    nd.shutdown()


if __name__ == "__main__":
    main()
