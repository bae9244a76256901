"""Lab 7 — debugging: the classic failures of distributed training, planted on one rank, diagnosed from what the
tools report.

    python labs/lab07_debug.py --fault hang               # launch the ranks, plant the fault on a random one, diagnose
    python labs/lab07_debug.py --fault all                # every fault in turn
    torchrun --nproc_per_node=2 labs/lab07_debug.py --fault nan --rank 1   # the faulty run alone: the tools' raw output
    torchrun --nproc_per_node=2 labs/lab07_debug.py --parity   # the parity harness: two model families, three bugs

Run without torchrun, the lab is the triage: it launches the faulty run (2 ranks, or 3 where only a majority can say
which rank is the odd one out), reads what the tools printed or raised, and prints the diagnosis -- the rank, and
the tensor, step or collective -- with the evidence line it read it from. The diagnosis never reads --rank: it
comes from the tools alone, and the results file records both, so a wrong diagnosis shows. The faults:

  hang        a rank stops before a collective        the divergence detector's watchdog: who is not in a collective
  dead-peer   a rank is killed (SIGKILL)              the launcher's report: the rank and its signal
  nan         a rank's loss turns NaN                 the Trainer's non-finite stop: which rank's loss
  desync      a rank initialised from another seed,   nanodist.check.assert_params_in_sync: the first tensor that
              with no broadcast                       differs and the rank that disagrees with the others
  mismatch    a rank all-reduces a tensor of another  TORCH_DISTRIBUTED_DEBUG=DETAIL: each rank's collective
              shape                                   fingerprint; the odd one out
  uneven-data a rank's shard of the data is short     nanodist.check.check_sampler_exactly_once: each rank's count
  skip-backward  a rank skips a backward (a branch    the watchdog: the collective each rank waits in; the odd
              taken on one rank)                      one out
  set-epoch   a rank never calls sampler.set_epoch    check_sampler_exactly_once at the next epoch: the rank in
                                                      every duplicated index
  port-in-use the rendezvous port is taken            torchrun's rendezvous error (no rank: the port)
  rank-local-metric  a rank logs its own loss, not    nanodist.check.assert_same_across_ranks on the logged
              the average over the ranks              value: the odd one out
  no-sync-forward  torch DDP, gradient accumulation:  torch.distributed.monitored_barrier at the end: the rank
              a rank's forward outside no_sync()      still in an all-reduce the others never called; torch's
                                                      flight recorder: it called more collectives
  memory-blowup  a rank's evaluation keeps its graph  each rank's memory after each step
              alive (no no_grad, total += loss)       (nanodist.memory.process_memory): the one that grows

--parity runs nanodist.parity.harness -- one process against DDP, ZeRO-1/2 and FSDP, nanodist's and torch's --
on two model families (UserModel with AdamW, ConvNet with SGD), then on three bugs planted on one rank by
monkeypatching (BUGS), and prints where each set-up first leaves one process, or that it never did.

Every fault ends in seconds: a hang within the collective timeout the lab sets (NANODIST_TIMEOUT, 5 s here), never
torch's default 30 minutes.
"""
import argparse
import collections
import contextlib
import datetime
import os
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: python labs/lab07_debug.py
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import nanodist as nd  # noqa: E402
from nanodist import check, faults, flight, parity  # noqa: E402
from nanodist.results import Recorder  # noqa: E402

TIMEOUT_S = 5  # the collective timeout of a faulty run: a hang is over well within the demo's 15 s
STEPS = 4
PLANT_AT = 2  # the step at which a fault strikes (--at changes it)
MEMORY_STEPS = 8


@dataclass
class Fault:
    """A failure to plant (`run`, on every rank of a launch of `world` ranks) and how to read the tools' report
    of it (`diagnose(output)` -> (rank, what, evidence line) or None)."""

    name: str
    about: str
    world: int
    run: Callable[[int], None] | None  # None: nothing runs on the ranks (the failure is before them)
    diagnose: Callable[[str], tuple | None]
    env: dict = field(default_factory=dict)
    symptom: str = ""  # what the user sees first
    tool: str = ""  # what names the rank (Chapter 7's decision tree)


# ----------------------------------------------------------------------------- the faulty runs (on every rank)

def _train(before=None, backward=None, after=None, steps: int = STEPS) -> None:
    """nanodist DDP + AdamW on a small user-style model. `before(step)` runs on every rank before each step;
    `backward(step, loss)` replaces loss.backward() (a fault may skip it); `after(step, loss)` runs after the
    optimizer step (logging)."""
    group = nd.Group.world()
    model = parity.UserModel(layers=2)
    ddp = nd.DDP(model, find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        if before is not None:
            before(step)
        x, y = parity.batch(step, group.rank, group.size)
        loss = ddp(x, y)[1]
        (backward or (lambda _, loss: loss.backward()))(step, loss)
        opt.step()
        opt.zero_grad()
        if after is not None:
            after(step, loss)
    nd.print0(f"{steps} steps done")


def run_hang(bad: int) -> None:
    _train(before=lambda step: faults.hang(bad, 60) if step == PLANT_AT else None)


def run_dead_peer(bad: int) -> None:
    _train(before=lambda step: faults.die(bad, after_s=0.2) if step == PLANT_AT else None)


def run_skip_backward(bad: int) -> None:
    rank = nd.Group.world().rank

    def backward(step, loss):  # e.g. "if the loss is small, skip the update": a branch taken on one rank only
        if not (step == PLANT_AT and rank == bad):
            loss.backward()

    _train(backward=backward)


def run_set_epoch(bad: int) -> None:
    from torch.utils.data import DistributedSampler
    group = nd.Group.world()
    sampler = DistributedSampler(range(60), num_replicas=group.size, rank=group.rank, shuffle=True, seed=0)
    for epoch in range(2):
        if group.rank != bad:  # the rank that forgot reads epoch 0's order again
            sampler.set_epoch(epoch)
        check.check_sampler_exactly_once(sampler, dataset_len=60)  # every epoch, before training on it


def run_nan(bad: int) -> None:
    from nanodist.train import TrainConfig, Trainer
    group = nd.Group.world()
    model = parity.UserModel(layers=2)
    model.forward = faults.nan_loss(model.forward, bad, call=PLANT_AT + 1)
    ddp = nd.DDP(model, find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def batches():
        step = 0
        while True:
            yield parity.batch(step, group.rank, group.size)
            step += 1

    cfg = TrainConfig(steps=STEPS, micro_batch=parity.GLOBAL_BATCH // group.size, seq_len=parity.SEQ, lr=1e-2,
                      log_every=0, progress=False)
    Trainer(ddp, opt, batches(), cfg, group=group).fit()


def run_desync(bad: int) -> None:
    group = nd.Group.world()
    model = parity.UserModel(layers=2, seed=1 if group.rank == bad else 0)  # its own seed, and no broadcast
    check.assert_params_in_sync(model)


def run_mismatch(bad: int) -> None:
    group = nd.Group.world()
    t = torch.ones(4 if group.rank == bad else 3)  # e.g. a metric vector with one entry more on one rank
    torch.distributed.all_reduce(t)


def run_rank_local_metric(bad: int) -> None:
    """Every rank logs the step's loss for the run (a logger per node, a callback on every rank); on one rank the
    logging code reads its own loss, not the one averaged over the ranks."""
    rank = nd.Group.world().rank

    def log(step, loss):
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean, op=torch.distributed.ReduceOp.AVG)
        logged = loss.detach() if rank == bad else mean  # the bug: this rank's logger reads the local loss
        check.assert_same_across_ranks(logged, f"the logged loss at step {step}")

    _train(after=log)


def run_no_sync_forward(bad: int) -> None:
    """Gradient accumulation under torch DDP, two micro-steps a step: no_sync() around the first. On one rank the
    forward is outside the block (only the backward in it): torch DDP decides in the forward whether the next
    backward synchronises, so that rank all-reduces in every micro-step, the others once a step."""
    group = nd.Group.world()
    model = parity.UserModel(layers=2)
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        for step in range(STEPS):
            for micro in range(2):
                x, y = parity.batch(2 * step + micro, group.rank, group.size)
                if micro == 1:  # the last micro-step synchronises
                    ddp(x, y)[1].backward()
                elif group.rank == bad:  # the bug: the forward outside no_sync()
                    loss = ddp(x, y)[1]
                    with ddp.no_sync():
                        loss.backward()
                else:
                    with ddp.no_sync():
                        ddp(x, y)[1].backward()
            opt.step()
            opt.zero_grad()
        # the end of the run: every rank should arrive with nothing in flight; rank 0 waits for each and names any
        # that does not come (torch 2.13's TORCH_DISTRIBUTED_DEBUG=DETAIL would name the odd collective, but with
        # torch's DDP on gloo it crashes the ranks at DDP's construction)
        torch.distributed.monitored_barrier(timeout=datetime.timedelta(seconds=TIMEOUT_S), wait_all_ranks=True)
    finally:  # whatever happened: what torch's flight recorder holds, the collectives this rank called
        print(flight.summary(group.rank), flush=True)


def run_memory_blowup(bad: int) -> None:
    """An evaluation after every step that sums its loss as a tensor (`val_total += loss`) outside torch.no_grad():
    each evaluation's autograd graph, with the activations it saved, stays alive as long as the running total.
    Bounded here: about 9 MiB a step (the 512 x 4096 activation ReLU saves, and the input) for MEMORY_STEPS steps."""
    from nanodist.memory import process_memory
    group = nd.Group.world()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 256))
    ddp = nd.DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = lambda i: torch.randn(512, 256, generator=torch.Generator().manual_seed(i))  # noqa: E731
    val_total = torch.zeros(())
    for step in range(MEMORY_STEPS):
        ddp(data(step * group.size + group.rank)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if group.rank == bad:  # the bug: no torch.no_grad() around the evaluation, and the loss kept as a tensor
            val_total = val_total + model(data(10_000 + step)).pow(2).mean()
        else:
            with torch.no_grad():
                val_total = val_total + model(data(10_000 + step)).pow(2).mean()
        used = process_memory()
        print(f"memory: rank {group.rank} step {step}: {used['bytes'] / 2**20:.1f} MiB ({used['source']})",
              flush=True)


def run_uneven_data(bad: int) -> None:
    group = nd.Group.world()
    n = 30
    mine = list(range(group.rank, n, group.size))
    if group.rank == bad:
        mine = mine[:-2]  # e.g. a hand-made split that drops a remainder on one rank
    check.check_sampler_exactly_once(iter(mine), dataset_len=n)  # this rank's indices: a collective check


# ----------------------------------------------------------------------------- reading the tools' report

def _majority_odd_one(by_rank: dict) -> int | None:
    """The rank whose value differs from every other rank's, which agree (None when no single rank stands out)."""
    counts = collections.Counter(by_rank.values())
    odd = [r for r, v in by_rank.items() if counts[v] == 1]
    return odd[0] if len(odd) == 1 and len(counts) == 2 and len(by_rank) > 2 else None


def _line(output: str, pattern: str) -> str:
    return next((ln.strip() for ln in output.splitlines() if re.search(pattern, ln)), "")


def diagnose_hang(output: str):
    # the watchdog warns each time the others have waited a stall long; a rank merely slow at first can be named
    # early, the one that hangs is named last (and every time after)
    lines = [ln.strip() for ln in output.splitlines() if re.search(r"rank \d+ is not in a collective", ln)]
    if not lines:
        return None
    rank = int(re.search(r"rank (\d+) is not in a collective", lines[-1]).group(1))
    return rank, "hangs outside any collective while the others wait for it", lines[-1]


def diagnose_dead_peer(output: str):
    # the launcher's report only ("<script> failed on rank N: killed by SIG..."), not a line a rank printed itself
    m = re.search(r"failed on rank (\d+): killed by (SIG[A-Z0-9]+)[^\n]*", output)
    return None if m is None else (int(m.group(1)), f"was killed by {m.group(2)}; its peers lost it", m.group(0).strip())


def diagnose_skip_backward(output: str):
    waits = {int(r): what for r, what in re.findall(r"rank (\d+): waits in collective #\d+ \(([^)]*)\)", output)}
    odd = _majority_odd_one(waits)
    if odd is None:
        return None
    others = next(v for r, v in waits.items() if r != odd)
    return odd, f"waits in {waits[odd]} while the others wait in {others}: it did not run the collectives they " \
                f"did (a backward or a step skipped on that rank)", _line(output, rf"rank {odd}: waits in collective")


def diagnose_set_epoch(output: str):
    listed = [{int(r) for r in group.split(",")} for group in re.findall(r"\(ranks \[([\d, ]+)\]\)", output)]
    if not listed:
        return None
    counts = collections.Counter(r for ranks in listed for r in ranks)
    rank, n = counts.most_common(1)[0]
    if n != len(listed) or sum(1 for c in counts.values() if c == n) != 1:
        return None  # no single rank in every duplicated index

    return rank, "reads samples the other ranks read too (every duplicated index is its): its sampler is in " \
                 "another order (a set_epoch, or a seed, that differs on that rank)", _line(output, "duplicated indices")


def diagnose_port(output: str):
    m = re.search(r"port: (\d+)[^\n]*EADDRINUSE", output)
    return None if m is None else (None, f"port {m.group(1)} was already in use (EADDRINUSE) when torchrun started "
                                         f"its rendezvous", _line(output, "EADDRINUSE"))


def diagnose_nan(output: str):
    m = re.search(r"non-finite values at step (\d+)[^\n]*?the loss was nan on rank (\d+)", output)
    if m is None:
        return None
    return int(m.group(2)), f"its loss was NaN at step {m.group(1)}", _line(output, "non-finite values at step")


def _odd_copy(output: str, kind: str):
    """nanodist.check's report of `kind` ("parameters", "values") out of sync: the rank whose copy differs from the
    others' (which agree), and the tensor's name; None when no single rank stands out."""
    tensor = re.search(rf"{kind} out of sync across \d+ ranks: '([^']+)'", output)
    groups = re.search(r"ranks with identical copies: ([^\n]*)", output)
    if tensor is None or groups is None:
        return None
    by_rank = {int(r): i for i, group in enumerate(groups.group(1).split(";")) for r in re.findall(r"\d+", group)}
    odd = _majority_odd_one(by_rank)
    return None if odd is None else (odd, tensor.group(1))


def diagnose_desync(output: str):
    found = _odd_copy(output, "parameters")
    if found is None:
        return None
    return found[0], f"holds other values of {found[1]} than the others (initialised apart, never broadcast)", \
        _line(output, "ranks with identical copies")


def diagnose_mismatch(output: str):
    shapes = {int(r): s for r, s in re.findall(r"Rank (\d+) is running collective: CollectiveFingerPrint\([^)]*?"
                                              r"TensorShape=\[([^\]]*)\]", output)}
    odd = _majority_odd_one(shapes)
    if odd is None:
        return None
    return odd, f"all-reduces a tensor of shape [{shapes[odd]}] where the others' is " \
                f"[{next(v for r, v in shapes.items() if r != odd)}]", _line(output, "Detected mismatch between collectives")


def diagnose_rank_local_metric(output: str):
    found = _odd_copy(output, "values")
    if found is None:
        return None
    return found[0], f"logs a rank-local value: {found[1]} differs from what the other ranks log (not averaged " \
                     f"over the ranks)", _line(output, "ranks with identical copies")


def diagnose_no_sync_forward(output: str):
    # monitored_barrier at the end: rank 0 names the ranks that did not arrive; when rank 0 is the one, every other
    # rank reached the barrier and reports it could not hear from rank 0
    missing = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", output)
    if missing is not None:
        ranks = [int(r) for r in re.findall(r"\d+", missing.group(1))]
        rank, evidence = (ranks[0], _line(output, "failed to pass monitoredBarrier")) if len(ranks) == 1 else (None, "")
    else:
        heard = {int(r): int(src) for r, src in re.findall(r"Rank (\d+) successfully reached monitoredBarrier, but "
                                                            r"received errors while waiting for send/recv from rank "
                                                            r"(\d+)", output)}
        named = set(heard.values())
        rank = named.pop() if len(named) == 1 and len(heard) >= 2 else None
        evidence = _line(output, "successfully reached monitoredBarrier")
    if rank is None:
        return None
    # torch's flight recorder (TORCH_FR_BUFFER_SIZE): how many collectives each rank called
    called = {int(r): int(n) for r, n in re.findall(r"flight recorder: rank (\d+) called (\d+) collectives", output)}
    count = f" (the flight recorder: it called {called[rank]} collectives, the others " \
            f"{', '.join(str(n) for r, n in sorted(called.items()) if r != rank)})" \
        if rank in called and len(called) > 1 else ""
    return rank, "never reached the final barrier: it was still in a collective no other rank would call -- it " \
                 "called more collectives than they did (its backward all-reduced in a micro-step where theirs " \
                 "stayed local: a forward outside no_sync())" + count, evidence


def diagnose_memory_blowup(output: str):
    # each rank's memory after each step; the rank whose memory keeps growing while the others' stays flat
    seen = collections.defaultdict(dict)
    for r, step, mib in re.findall(r"memory: rank (\d+) step (\d+): ([\d.]+) MiB", output):
        seen[int(r)][int(step)] = float(mib)
    if len(seen) < 2 or any(len(v) < 4 for v in seen.values()):
        return None
    growth = {r: (v[max(v)] - v[1]) / (max(v) - 1) for r, v in seen.items()}  # MiB a step, after the first
    worst = max(growth, key=growth.get)
    rest = [g for r, g in growth.items() if r != worst]
    if growth[worst] < 1.0 or growth[worst] < 4 * max(max(rest), 0.25):
        return None
    return worst, f"its memory grows {growth[worst]:.1f} MiB a step (the others' {max(rest):.1f}): it keeps " \
                  f"something of every step alive (an autograd graph held by a tensor)", \
        _line(output, rf"memory: rank {worst} step {max(seen[worst])}:")


def diagnose_uneven_data(output: str):
    m = re.search(r"rank (\d+) reads (\d+) samples, but a rank's share[^\n]*", output)
    return None if m is None else (int(m.group(1)), f"reads only {m.group(2)} samples", m.group(0).strip())


FAULTS = {f.name: f for f in (
    Fault("hang", "a rank stops before a collective", 2, run_hang, diagnose_hang, {"NANODIST_STALL_S": "1"},
          "the run stops printing; no error until the collective timeout",
          "the divergence detector's watchdog (NANODIST_STALL_S): who is not in a collective, and its stack"),
    Fault("dead-peer", "a rank is killed by SIGKILL", 2, run_dead_peer, diagnose_dead_peer, {},
          "every rank fails with a connection error at once",
          "the launcher's root-cause report: the first rank to fail, and its signal"),
    Fault("nan", "a rank's loss turns NaN", 2, run_nan, diagnose_nan, {},
          "the loss or the gradient norm is nan",
          "the Trainer's non-finite stop: the step, and the rank whose loss was not finite"),
    Fault("skip-backward", "a rank skips a backward (a branch taken on one rank)", 3, run_skip_backward,
          diagnose_skip_backward, {"NANODIST_STALL_S": "1"},
          "the run stops printing; every rank is inside a collective",
          "the watchdog: the collective each rank waits in; the odd one out"),
    Fault("set-epoch", "a rank never calls sampler.set_epoch", 3, run_set_epoch, diagnose_set_epoch, {},
          "no error; from the second epoch, samples are seen twice and others never",
          "nanodist.check.check_sampler_exactly_once: the rank in every duplicated index"),
    Fault("port-in-use", "the rendezvous port is taken by another program", 2, None, diagnose_port, {},
          "torchrun fails before any rank starts",
          "torchrun's rendezvous error: EADDRINUSE and the port"),
    Fault("desync", "a rank initialised from another seed, no broadcast", 3, run_desync, diagnose_desync, {},
          "no error; the loss is worse than one process's and the ranks' weights drift apart",
          "nanodist.check.assert_params_in_sync: the first tensor that differs, the ranks grouped by copy"),
    Fault("mismatch", "a rank all-reduces a tensor of another shape", 3, run_mismatch, diagnose_mismatch,
          {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"},
          "a hang, a crash, or silently wrong values (gloo does not compare shapes)",
          "TORCH_DISTRIBUTED_DEBUG=DETAIL: each rank's collective fingerprint; the odd one out"),
    Fault("uneven-data", "a rank's shard of the data is short", 2, run_uneven_data, diagnose_uneven_data, {},
          "a hang at the end of an epoch (the short rank stops first), or samples never seen",
          "nanodist.check.check_sampler_exactly_once: each rank's count against its share"),
    Fault("rank-local-metric", "a rank logs its own loss, not the average over the ranks", 3,
          run_rank_local_metric, diagnose_rank_local_metric, {},
          "no error; the logged curve depends on which rank logs it",
          "nanodist.check.assert_same_across_ranks on the logged value: the odd one out"),
    Fault("no-sync-forward", "a rank's forward is outside no_sync() (torch DDP, gradient accumulation)", 3,
          run_no_sync_forward, diagnose_no_sync_forward, {"TORCH_FR_BUFFER_SIZE": "2000"},
          "a hang at the end (or at the next checkpoint): one rank ran more all-reduces",
          "torch.distributed.monitored_barrier: the rank that did not arrive; the flight recorder's counts"),
    Fault("memory-blowup", "a rank keeps every evaluation's autograd graph alive (no no_grad, total += loss)", 2,
          run_memory_blowup, diagnose_memory_blowup, {},
          "memory grows every step on one rank, until it is killed (out of memory)",
          "each rank's memory after each step: the one that grows"),
)}


# ----------------------------------------------------------------------------- the environment (Chapter 7's sheet)

GPU_ONLY = "GPU only (NCCL)"
# (variable, what reads it, what it does). Those not GPU_ONLY appear in the installed torch's sources or libraries,
# or in nanodist's (tests/test_lab07.py checks); NCCL's and torch's NCCL-side ones are in builds with CUDA only.
ENVIRONMENT = [
    ("NANODIST_TIMEOUT", "nanodist", "the collective timeout in seconds (300 unless set): a hang becomes an error "
     "on every rank instead of torch's 30 minutes of silence"),
    ("NANODIST_STALL_S", "nanodist", "after this many seconds in one collective (3; 0 turns it off) the watchdog asks "
     "every rank where it is, and names the one that is not in a collective or the ones in another collective"),
    ("NANODIST_CHECK_COLLECTIVES", "nanodist", "nanodist's collectives compare shapes and dtypes across the ranks "
     "before they run (on unless 0)"),
    ("TORCH_DISTRIBUTED_DEBUG", "torch, any backend", "INFO or DETAIL: DETAIL wraps each process group so that before "
     "every collective the ranks pass a monitored barrier and compare a fingerprint (operation, shapes, dtypes) on "
     "a helper gloo group, raising on a mismatch and naming both ranks' calls: two extra exchanges per call. In "
     "torch 2.13 on gloo it crashes torch's own DDP at construction (Lab 7's no-sync-forward uses "
     "monitored_barrier instead)"),
    ("TORCH_FR_BUFFER_SIZE", "torch, any backend", "the flight recorder: each process group keeps its last N "
     "collectives (0, the default: none); gloo's too in torch 2.13 (nanodist.flight reads it)"),
    ("TORCH_SHOW_CPP_STACKTRACES", "torch", "1: an error raised in C++ carries the C++ stack"),
    ("TORCH_CPP_LOG_LEVEL", "torch (c10)", "INFO: c10d's own log lines (process groups created, the store, the "
     "rendezvous)"),
    ("TORCHELASTIC_ERROR_FILE", "torchrun", "where a rank writes its uncaught exception (torchrun sets it; a function "
     "decorated with torch.distributed.elastic's @record writes it), for the root-cause report"),
    ("GLOO_SOCKET_IFNAME", "gloo", "the network interface gloo uses (eth0, ...), when the ranks cannot reach each other "
     "on the one it picks"),
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", GPU_ONLY, "whether a failed or timed-out NCCL collective takes its process "
     "down (the default) rather than leaving it hung"),
    ("TORCH_NCCL_BLOCKING_WAIT", GPU_ONLY, "1: work.wait() blocks the calling thread and raises the timeout there"),
    ("TORCH_NCCL_TRACE_BUFFER_SIZE", "torch, any backend", "TORCH_FR_BUFFER_SIZE's older name, read where that is "
     "not set (it began as NCCL's)"),
    ("TORCH_NCCL_DUMP_ON_TIMEOUT", GPU_ONLY, "1: on a timeout every rank dumps its flight recorder to "
     "TORCH_NCCL_DEBUG_INFO_TEMP_FILE, one file per rank, for torch's fr_trace tool to compare"),
    ("TORCH_NCCL_ENABLE_MONITORING", GPU_ONLY, "the heartbeat monitor that ends a process whose NCCL watchdog is "
     "itself stuck (after TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC)"),
    ("NCCL_DEBUG", GPU_ONLY, "WARN or INFO: NCCL prints its version, the transports and rings it chose, and its "
     "errors (NCCL_DEBUG_SUBSYS=INIT,COLL,NET,... picks which parts speak)"),
    ("NCCL_P2P_DISABLE, NCCL_IB_DISABLE", GPU_ONLY, "1: no peer-to-peer (NVLink, PCIe) or no InfiniBand: to tell a "
     "bad link from a bad program"),
    ("NCCL_SOCKET_IFNAME", GPU_ONLY, "the network interface NCCL's sockets use"),
    ("CUDA_LAUNCH_BLOCKING", "CUDA (GPU only)", "1: every kernel runs synchronously, so an error names the operation "
     "that caused it (slow: for debugging only)"),
]


# ----------------------------------------------------------------------------- the parity harness (--parity)

# two model families, each with its data and optimizer (nanodist.parity.harness's model_fn, batches, optimizer)
FAMILIES = {
    "user": ("UserModel (frozen, tied and bare parameters, buffers) + AdamW", parity.UserModel, parity.batch,
             parity.ADAMW),
    "conv": ("ConvNet (convolutions, group norm) + SGD with momentum", parity.ConvNet, parity.images,
             parity.OptimizerSpec(torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})),
}


@contextlib.contextmanager
def _loud_bucket(bad: int, rank: int, scale: float = 1.001):
    """DDP's bucket all-reduce: rank `bad` sends its gradients `scale` times too large (0.1 % by default)."""
    import nanodist.ddp
    real = nanodist.ddp.all_reduce_sum

    def loud(buffer, group, what="all-reduce"):
        if rank == bad and what.startswith("DDP all-reduce of bucket"):
            buffer.mul_(scale)
        return real(buffer, group, what)
    nanodist.ddp.all_reduce_sum = loud
    try:
        yield {"setups": ("ddp",)}
    finally:
        nanodist.ddp.all_reduce_sum = real


@contextlib.contextmanager
def _same_rows(bad: int, rank: int):
    """The data: rank `bad` reads the next rank's rows of the batch (a shard index that ignores the rank)."""
    yield {"setups": ("ddp",), "batches": lambda s, r, w: parity.batch(s, (r + 1) % w if r == bad else r, w)}


@contextlib.contextmanager
def _fast_shard(bad: int, rank: int):
    """ZeRO-2's update: rank `bad` steps its shard of the parameters with a learning rate 1 % too large (1.01, or
    1.01^2 where one patched update function calls another). DDP beside it trains with torch's AdamW: unaffected."""
    import nanodist.optim.adamw as nd_adamw
    real = {k: getattr(nd_adamw, k) for k in ("update", "foreach_update", "fused_update")}
    for k, fn in real.items():
        setattr(nd_adamw, k, lambda group, items, fn=fn: fn({**group, "lr": group["lr"] * (1.01 if rank == bad else 1)},
                                                             items))
    try:
        yield {"setups": ("zero2", "ddp")}
    finally:
        for k, fn in real.items():
            setattr(nd_adamw, k, fn)


BUGS = {  # planted by monkeypatching, on one rank: nothing in nanodist.parity knows of them
    "loud-bucket": ("DDP's bucket all-reduce sends one rank's gradients {loud_pct:g} % too large", _loud_bucket),
    "same-rows": ("one rank reads another rank's rows of each batch", _same_rows),
    "fast-shard": ("one rank's ZeRO-2 shard steps with a learning rate 1 % too large", _fast_shard),
}


def parity_demo(bad: int, rank: int, steps: int = 4, cases=None, loud: float = 1.001) -> dict:
    """The parity harness on both families (correct set-ups: every one of nanodist's and torch's), then on each
    planted bug (on rank `bad`, the set-ups it touches; the loud bucket's scale `loud`); {case: harness report}.
    `cases`: which of FAMILIES and BUGS (default: all). A collective: every rank."""
    out = {}
    for name, (_, model_fn, batches, optimizer) in FAMILIES.items():
        if cases is None or name in cases:
            out[name] = parity.harness(model_fn=model_fn, batches=batches, optimizer=optimizer, steps=steps)
    if nd.Group.world().size > 1:
        for name, (_, plant) in BUGS.items():
            if cases is None or name in cases:
                with plant(bad, rank, **({"scale": loud} if name == "loud-bucket" else {})) as kwargs:
                    out[name] = parity.harness(steps=steps, **kwargs)
    return out


def run_parity(args) -> None:
    """--parity under torchrun: the demo, each case's report printed by rank 0 and recorded."""
    nd.init()
    group = nd.Group.world()
    bad = args.rank if args.rank is not None else group.size - 1
    if not 0 <= bad < group.size:
        raise SystemExit(f"lab07: --rank {bad}: this launch has ranks 0 to {group.size - 1}")
    out = parity_demo(bad, group.rank, cases=args.cases, loud=args.loud)
    about = {k: v[0] for k, v in FAMILIES.items()} | {
        k: f"{v[0].format(loud_pct=100 * (args.loud - 1))} (rank {bad})" for k, v in BUGS.items()}
    if group.rank == 0:
        for name, report in out.items():
            print(f"== {name}: {about[name]}")
            parity.print_harness(report)
    rec = Recorder("lab07_debug", config=vars(args), group=group)
    rec.metrics["parity"] = {"planted_rank": bad, "about": about, "reports": out}
    nd.print0(f"wrote {nd.results.shown(rec.save())}")
    nd.shutdown()


# ----------------------------------------------------------------------------- triage: launch, read, diagnose

def triage(fault: Fault, bad: int) -> dict:
    """Launch the faulty run, then diagnose it from its output alone (the launcher's report included)."""
    t0 = time.monotonic()
    env = {"NANODIST_TIMEOUT": str(TIMEOUT_S), **fault.env}
    if fault.run is None:  # port-in-use: torchrun itself, on a port another program holds (nd.launch would avoid it)
        output, failed = _taken_port_run(fault.world)
    else:
        output, failed = _launch(fault, bad, env)
    took = time.monotonic() - t0
    found = fault.diagnose(output)
    row = {"fault": fault.name, "world_size": fault.world, "planted_rank": bad if fault.run else None,
           "seconds": round(took, 1), "launch_failed": failed, "diagnosed_rank": None, "diagnosis": None,
           "evidence": None, "log": tool_lines(output)}
    if found is not None:
        who = "no rank" if found[0] is None else f"rank {found[0]}"
        row.update(diagnosed_rank=found[0], diagnosis=f"{who}: {found[1]}", evidence=found[2])
    return row


# the lines a tool printed (the launcher, the watchdog, nanodist.check, torch's errors and barriers, the flight
# recorder), as against tracebacks' frames and torchrun's boilerplate
_TOOL_LINE = re.compile(r"nanodist: |waits in collective|failed on rank|\w+Error: |monitoredBarrier|flight recorder:|"
                        r"memory: rank|out of sync across|ranks with identical copies|duplicated indices|"
                        r"reads \d+ samples|EADDRINUSE|Timed out")
_DEVICE_TYPES = re.compile(r"TensorDeviceTypes=TensorOptions\((?:[^()]|\([^()]*\))*\)")  # DETAIL's long tail
_RANK_PREFIX = re.compile(r"^(\[rank\d+\]:)+ *")
_CPP_LOG = re.compile(r"\[[EWI]\d{4} [\d:.]+ [\w.]+:\d+\] ")  # c10d's "[E1127 02:22:30.04 ProcessGroupGloo.cpp:67] "


def tool_lines(output: str, limit: int = 24, width: int = 400) -> list[str]:
    """What the tools said in a faulty run's output: their lines, in order, each once (a line every rank printed
    alike is kept once, with its first rank's prefix), at most `limit` lines of at most `width` characters."""
    seen, out = set(), []
    for line in output.splitlines():
        line = line.strip()
        if not _TOOL_LINE.search(line) or line.startswith("File "):
            continue
        line = _CPP_LOG.sub("", _DEVICE_TYPES.sub("TensorDeviceTypes=[...]", line))
        key = _RANK_PREFIX.sub("", line)
        if key in seen:
            continue
        seen.add(key)
        out.append(line if len(line) <= width else line[:width - 5] + " [...]")
    return out[:limit]


def unlabelled(row: dict) -> list[str]:
    """A row's tool lines with the lab's own names masked (a stack dump shows the lab's functions, run_hang, ...):
    what an exercise shows when it asks the reader for the cause and the rank. The tools' words stay."""
    return [re.sub(r"lab07_debug\.py:\d+ [\w<>]+|\brun_\w+|--fault [\w-]+", "[...]", line) for line in row["log"]]


def _taken_port_run(world: int) -> tuple[str, bool]:
    """torchrun on a port this process holds: it must fail at its rendezvous. Were the port free after all, the
    ranks would run the quickest fault (uneven-data, a second); either way at most 60 s, and nothing left behind."""
    import signal
    import socket
    import subprocess
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
                                 "--master_addr=127.0.0.1", f"--master_port={port}", __file__, "--fault",
                                 "uneven-data", "--rank", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True,
                                env={**os.environ, "NANODIST_TIMEOUT": str(TIMEOUT_S)})
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            out += "\n(lab07: torchrun ran past 60 s and was killed with its process group)"
    return out, proc.returncode != 0


def _launch(fault: Fault, bad: int, env: dict) -> tuple[str, bool]:
    try:
        run = nd.launch(__file__, nproc=fault.world, timeout=60, env=env, echo=False,
                        args=["--fault", fault.name, "--rank", str(bad), "--at", str(PLANT_AT)])
        return run.output, False
    except nd.LaunchTimeout as e:
        return f"{e}\n{e.output}\n(lab07: the faulty run ran past 60 s and was killed)", True
    except nd.LaunchError as e:
        return f"{e}\n{e.output}", True


def main() -> int:
    global PLANT_AT
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--fault", nargs="+", choices=list(FAULTS) + ["all"],
                      help="one fault (under torchrun), or several, or all (the triage)")
    what.add_argument("--parity", action="store_true", help="under torchrun: the parity harness on two model "
                      "families, correct and with three bugs planted on --rank (default: the last rank)")
    p.add_argument("--rank", type=int, default=None, help="the rank to plant the fault on (default: a random one)")
    p.add_argument("--seed", type=int, default=None, help="seed of the random choice of rank")
    p.add_argument("--at", type=int, default=PLANT_AT, help=f"the step at which hang, dead-peer, nan and "
                   f"skip-backward strike (0 to {STEPS - 1}; default {PLANT_AT})")
    p.add_argument("--cases", nargs="+", choices=list(FAMILIES) + list(BUGS), default=None,
                   help="--parity: the families and bugs to run (default: all)")
    p.add_argument("--loud", type=float, default=1.001,
                   help="--parity: the factor the loud-bucket bug scales one rank's gradients by (default 1.001)")
    args = p.parse_args()
    if not 0 <= args.at < STEPS:
        p.error(f"--at {args.at}: a fault strikes at a step from 0 to {STEPS - 1}")
    PLANT_AT = args.at  # read by the faulty runs below, and passed on by the triage
    if args.parity:
        if "RANK" not in os.environ:
            p.error("--parity runs on every rank: torchrun --nproc_per_node=2 labs/lab07_debug.py --parity")
        run_parity(args)
        return 0
    if "RANK" in os.environ:  # a rank of the faulty run
        if len(args.fault) != 1 or args.fault == ["all"] or args.rank is None:
            p.error("under torchrun, give one --fault and its --rank")
        name = args.fault[0]
        fault, world = FAULTS[name], int(os.environ["WORLD_SIZE"])
        if fault.run is None:
            p.error(f"--fault {name} happens before any rank starts: run it without torchrun")
        if not 0 <= args.rank < world:
            p.error(f"--rank {args.rank}: this launch has ranks 0 to {world - 1}")
        if world != fault.world:
            print(f"lab07: {name} is diagnosed from {fault.world} ranks; at {world} the tools' report may not "
                  f"single out one rank", file=sys.stderr)
        os.environ.setdefault("NANODIST_TIMEOUT", str(TIMEOUT_S))
        nd.init()
        fault.run(args.rank)
        nd.shutdown()
        return 0
    names = list(FAULTS) if "all" in args.fault else list(dict.fromkeys(args.fault))
    too_big = [n for n in names if FAULTS[n].run and not 0 <= (args.rank or 0) < FAULTS[n].world]
    if args.rank is not None and too_big:
        p.error(f"--rank {args.rank}: {', '.join(f'{n} runs on ranks 0 to {FAULTS[n].world - 1}' for n in too_big)}")
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    rng = random.Random(seed)
    if args.rank is None:
        print(f"== the faulty rank is drawn at random (--seed {seed} draws the same again)")
    rec = Recorder("lab07_debug", config=vars(args))
    rows = []
    for name in names:
        fault = FAULTS[name]
        bad = args.rank if args.rank is not None else rng.randrange(fault.world)
        print(f"== {name}: {fault.about}, on one of {fault.world} ranks", flush=True)
        row = triage(fault, bad)
        rows.append(row)
        planted = "" if row["planted_rank"] is None else f"; planted on rank {row['planted_rank']}"
        if row["diagnosis"] is None:
            print(f"   no diagnosis: the tools' output did not name the cause ({row['seconds']} s{planted})")
        else:
            print(f"   the tools said: {row['evidence']}")
            print(f"   diagnosis: {row['diagnosis']} ({row['seconds']} s{planted})")
    rec.metrics["faults"] = rows
    print(f"wrote {nd.results.shown(rec.save())}")
    return 0 if all(r["diagnosis"] is not None and r["diagnosed_rank"] == r["planted_rank"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
