"""torch's flight recorder, read on any backend: the last collectives this rank called, in order, with their
sequence numbers -- who called more, or other, collectives than its peers, after the fact.

    TORCH_FR_BUFFER_SIZE=2000 torchrun ...  # set before the process group is made: the entries each rank keeps
    flight.entries()                        # this rank's recorded collectives, oldest first
    print(flight.summary())                 # one line: how many, and the last (what a triage compares)

What torch 2.13 records on gloo (checked here): one entry per collective with its sequence number, its name
("gloo:all_reduce", "gloo:broadcast", ...) and its tensors' sizes; the state stays "scheduled" -- gloo does not
report completion to the recorder -- so on gloo it says which collectives a rank *called*, not which finished.
On NCCL (GPU-only) the states move to "started" and "completed", and torch can dump the recorder by itself on a
watchdog timeout (TORCH_NCCL_DUMP_ON_TIMEOUT=1, TORCH_FR_DUMP_TEMP_FILE=<prefix>), read with
`python -m torch.distributed.flight_recorder.fr_trace <folder>`.
"""
from __future__ import annotations

import os
import pickle

import torch


def enabled() -> bool:
    """Whether this process records (TORCH_FR_BUFFER_SIZE > 0 when the process group was made)."""
    try:
        return int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0")) > 0
    except ValueError:
        return False


def entries() -> list[dict]:
    """This rank's recorded collectives, oldest first: {"seq", "op", "sizes", "state"}; [] when not recording."""
    if not enabled():
        return []
    raw = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, False, False))
    return [{"seq": e.get("collective_seq_id"), "op": e.get("profiling_name"), "sizes": e.get("input_sizes"),
             "state": e.get("state")} for e in raw.get("entries", [])]


def summary(rank: int | None = None) -> str:
    """One line for a log: how many collectives this rank called, and the last one."""
    if rank is None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if not enabled():
        return f"flight recorder: rank {rank}: off (set TORCH_FR_BUFFER_SIZE before the process group is made)"
    got = entries()
    if not got:
        return f"flight recorder: rank {rank} called 0 collectives"
    last = got[-1]
    return (f"flight recorder: rank {rank} called {last['seq']} collectives; the last #{last['seq']} {last['op']} "
            f"sizes {last['sizes']} ({last['state']})")
