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
    """Whether this process asked to record: TORCH_FR_BUFFER_SIZE > 0 in its environment (torch reads it when a
    process group is made; set it before, as the environment of the launch)."""
    try:
        return int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0")) > 0
    except ValueError:
        return False


def entries(group=None) -> list[dict]:
    """This rank's recorded collectives on `group` (default: the default group; every process group records into
    the one buffer, each with its own sequence), oldest first: {"seq", "op", "sizes", "state"}. [] when not
    recording, or where this torch has no recorder to read (it appeared in the 2.x series)."""
    if not enabled():
        return []
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)
    if dump is None:
        return []
    raw = pickle.loads(dump(True, False, False))
    name = None
    if torch.distributed.is_initialized():
        name = torch.distributed.distributed_c10d._get_process_group_name(group or torch.distributed.group.WORLD)
    out = []
    for e in raw.get("entries", []):
        pg = e.get("process_group")
        if name is not None and isinstance(pg, (list, tuple)) and pg and pg[0] != name:
            continue
        if e.get("collective_seq_id") is None or e.get("is_p2p"):  # point-to-point messages have their own count
            continue
        out.append({"seq": e["collective_seq_id"], "op": e.get("profiling_name"), "sizes": e.get("input_sizes"),
                    "state": e.get("state")})
    return out


def summary(rank: int | None = None) -> str:
    """One line for a log: how many collectives this rank called, and the last one."""
    if rank is None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if not enabled():
        return f"flight recorder: rank {rank}: off (set TORCH_FR_BUFFER_SIZE before the process group is made)"
    got = entries()
    if not got:
        return f"flight recorder: rank {rank} called 0 collectives"
    last = max(got, key=lambda e: e["seq"])
    return (f"flight recorder: rank {rank} called {last['seq']} collectives; the last #{last['seq']} {last['op']} "
            f"sizes {last['sizes']} ({last['state']})")
