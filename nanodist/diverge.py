"""The divergence detector: when ranks stop doing the same thing, an error names the rank and what differed
within seconds -- never a silently wrong step, never a wait for the collective timeout (300 s).

Every collective nanodist's wrappers issue (DDP, ZeRO, FSDP: nanodist.sync's functions) is *tracked*: the rank
counts it and folds its description -- "FSDP all-gather of unit blocks.1", "DDP all-reduce of bucket 2" -- into a
running digest, and keeps the last few descriptions. Two layers use that record:

1. The step's agreement. Every wrapper already runs one small all-reduce a step (DDP its control numbers, ZeRO
   its gradient flags, FSDP its unit flags); the digest d travels with it as d and d^2. Summed over N ranks,
   N * sum(d^2) == (sum d)^2 exactly when every rank's d is the same, i.e. when the ranks issued the same
   collectives in the same order. If not, every rank learns it from the same sums, so every rank stops: they
   exchange their recent histories and raise a DivergenceError naming the rank whose collective differed, which
   collective, and what the others did instead. This catches what hangs nothing: two units of equal size run in
   another order on one rank pair their all-gathers silently, and train a wrong model.

2. The watchdog, a thread, for what hangs. When this rank has waited in one tracked collective longer than
   NANODIST_STALL_S seconds (3 by default; 0 turns the watchdog off), it asks every rank of the group, through
   the rendezvous store (the process group is the thing that is stuck), what it is doing: the collective it
   waits in, its recent ones and its Python stack. Ranks that wait in *different* collectives prove a divergence:
   each prints the report and ends its process with exit code 3 -- a thread cannot interrupt a rank blocked in a
   collective, and torch's own NCCL watchdog ends the process the same way. A peer woken by the broken connection
   raises a DivergenceError carrying the same report. Ranks that all wait in the *same* collective, or a rank
   busy outside any collective (a long save, a slow step), are reported once as a warning and not stopped: slow
   is not wrong.

Cost: counting a collective is a dictionary lookup and two integer operations; the digest rides on an
all-reduce that runs anyway; the watchdog wakes twice a second and touches the store only when a rank is stuck.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import json
import os
import sys
import threading
import time
import traceback
import zlib

MOD = 1_048_573  # a prime below 2**20: d^2 summed over up to 8192 ranks stays exact in float64
HISTORY = 64  # descriptions each rank keeps for the report
EXIT_CODE = 3  # a process ended by the watchdog
POLL_S = 0.5
HEARTBEAT_S = 1.0

_codes: dict[str, int] = {}
_trackers: dict[tuple, "Tracker"] = {}
_lock = threading.Lock()
_watchdog: threading.Thread | None = None
_stopping = threading.Event()
fatal_hooks: list = []  # functions(report) called before the watchdog ends the process (nanodist.testing's)


class DivergenceError(RuntimeError):
    """The ranks stopped issuing the same collectives; the message names the rank and what differed."""


def stall_seconds() -> float:
    try:
        return float(os.environ.get("NANODIST_STALL_S", "3"))
    except ValueError:
        return 3.0


def _code(desc: str) -> int:
    c = _codes.get(desc)
    if c is None:
        c = _codes[desc] = zlib.crc32(desc.encode()) % MOD + 1
    return c


class Tracker:
    """One group's record on this rank: how many collectives, their digest, the last HISTORY descriptions, and the
    collective the main thread waits in (with since when)."""

    def __init__(self, group):
        self.group = group
        self.key = "-".join(map(str, group.ranks))
        self.seq = 0
        self.digest = 0
        self.history: collections.deque = collections.deque(maxlen=HISTORY)
        self.waiting: tuple | None = None  # (seq, desc, since)
        self.asked = 0  # the last request for states this rank answered
        self.warned = None  # the stall already reported as a warning
        self.notes: collections.deque = collections.deque(maxlen=3)  # what the wrappers saw this rank do oddly
        self.published = (0, 0.0)  # (seq, monotonic time) of the last heartbeat
        self.asked_for = None  # the stall this rank has asked the others about

    def issue(self, desc: str) -> int:
        self.seq += 1
        self.digest = (self.digest * 31 + _code(desc)) % MOD
        self.history.append(desc)
        return self.seq

    @contextlib.contextmanager
    def waiting_in(self, seq: int, desc: str):
        self.waiting = (seq, desc, time.monotonic())
        try:
            yield
        except RuntimeError as e:  # the connection broke: a peer ended itself (with a report), or died
            report = _report_from_store(self) or _report_after_failure(self, seq, desc, e)
            if report is not None:
                raise DivergenceError(report) from e
            raise
        finally:
            self.waiting = None

    def entries(self) -> list[tuple[int, str]]:
        """(seq, description) of the kept history."""
        first = self.seq - len(self.history) + 1
        return [(first + i, d) for i, d in enumerate(self.history)]


def tracker(group) -> Tracker | None:
    """The tracker of a group with several ranks (None for a world of one), starting the watchdog once."""
    if group.size == 1:
        return None
    t = _trackers.get(group.ranks)
    if t is None:
        with _lock:
            t = _trackers.setdefault(group.ranks, Tracker(group))
        _start_watchdog()
    return t


def note(group, text: str) -> None:
    """A wrapper saw this rank do something the others may not have (FSDP: units run out of order): kept for the
    divergence report, which then says which rank did what."""
    t = tracker(group)
    if t is not None and (not t.notes or t.notes[-1] != text):
        t.notes.append(text)


def issue(group, desc: str) -> tuple | None:
    """Count a collective about to be issued on `group`; returns what waiting() needs."""
    t = tracker(group)
    if t is None:
        return None
    return t, t.issue(desc), desc


@contextlib.contextmanager
def waiting(ticket):
    """Mark the main thread as waiting for the collective `ticket` (from issue) to finish."""
    if ticket is None:
        yield
        return
    t, seq, desc = ticket
    with t.waiting_in(seq, desc):
        yield


def tracking_cost_s(n: int = 20_000) -> float:
    """Seconds one tracked collective costs this process in bookkeeping (counting it, folding it into the digest,
    marking the wait), measured over n of them on a private tracker."""
    from .group import Group
    t = Tracker(Group(rank=0, size=2, backend="gloo", ranks=(0, 1)))
    start = time.perf_counter()
    for _ in range(n):
        with t.waiting_in(t.issue("DDP all-reduce of bucket 0"), "DDP all-reduce of bucket 0"):
            pass
    return (time.perf_counter() - start) / n


# ----------------------------------------------------------------------------- layer 1: the step's agreement

def agreement_values(group) -> tuple[float, float]:
    """(d, d^2) for this rank's digest, to be summed with the step's agreement all-reduce."""
    t = tracker(group)
    d = float(t.digest) if t is not None else 0.0
    return d, d * d


def check_agreement(group, summed_d: float, summed_d2: float, where: str) -> None:
    """After the agreement: raise on every rank if the ranks' digests differed (a collective; see the module
    docstring). `where` names the wrapper, for the message."""
    if group.size > 1 and group.size * summed_d2 != summed_d * summed_d:
        raise_divergence(group, where)


class PendingCheck:
    """Check an agreement's summed (d, d^2) without making a step wait for the device. On the CPU at once (a read
    costs nothing there). On a GPU -- or wherever `deferred` is set -- the sums are copied, without waiting, into
    one of two host buffers (pinned on a GPU) and checked at the next step's agreement, when they have long
    arrived: every rank does the same, so every rank raises at the same step, one step late."""

    def __init__(self, where: str, deferred: bool | None = None):
        self.where, self.deferred = where, deferred
        self.buffers = None  # the two host buffers, used in turn
        self.pending = None  # (buffer, event) of the last step's sums

    def submit(self, sums, group) -> None:
        import torch
        deferred = self.deferred if self.deferred is not None else sums.device.type == "cuda"
        if not deferred:
            check_agreement(group, *sums.tolist(), self.where)
            return
        cuda = sums.device.type == "cuda"
        if self.buffers is None:
            self.buffers = [torch.empty(2, dtype=sums.dtype, pin_memory=cuda) for _ in range(2)]
        host = self.buffers[0] if self.pending is None or self.pending[0] is self.buffers[1] else self.buffers[1]
        host.copy_(sums, non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        previous, self.pending = self.pending, (host, event)
        if previous is not None:
            if previous[1] is not None:
                previous[1].synchronize()  # recorded a step ago: done by now
            check_agreement(group, *previous[0].tolist(), self.where)


def raise_divergence(group, where: str) -> None:
    """Every rank calls this when the sums disagree: exchange histories, name the odd rank, raise."""
    t = tracker(group)
    mine = {"seq": t.seq, "entries": t.entries(), "notes": list(t.notes)}
    everyone = group.all_gather_object(mine)
    raise DivergenceError(f"{where}: the ranks did not issue the same collectives since the last step. "
                          f"{describe(everyone, group)}{_notes(everyone, group)}")


def _notes(states: list[dict], group) -> str:
    said = [f"\n  rank {group.global_rank(r)}: {'; '.join(s['notes'])}" for r, s in enumerate(states) if s.get("notes")]
    return "".join(said)


def describe(states: list[dict], group) -> str:
    """Where the ranks' collective sequences first part: per collective number, who did what."""
    by_seq = [dict(s["entries"]) for s in states]
    common = set.intersection(*(set(b) for b in by_seq)) if by_seq else set()
    for seq in sorted(common):
        descs = [b[seq] for b in by_seq]
        if len(set(descs)) > 1:
            return f"Collective #{seq}: " + _who(descs, group) + "."
    counts = [s["seq"] for s in states]
    if len(set(counts)) > 1:
        return "They issued different numbers of collectives: " + ", ".join(
            f"rank {group.global_rank(r)} {c} (last: {states[r]['entries'][-1][1] if states[r]['entries'] else '-'})"
            for r, c in enumerate(counts)) + "."
    return "Their recent collectives look alike; they differed earlier than this record reaches."


def _who(descs: list[str], group, verb: str = "ran") -> str:
    """Group ranks by what they did, the odd one(s) first: "rank 1 ran X, while ranks 0, 2 ran Y"."""
    groups: dict[str, list[int]] = {}
    for r, d in enumerate(descs):
        groups.setdefault(d, []).append(group.global_rank(r))
    ordered = sorted(groups.items(), key=lambda kv: (len(kv[1]), kv[1]))
    parts = [f"{_ranks(rs)} {verb} {d!r}" for d, rs in ordered]
    return parts[0] + ", while " + "; ".join(parts[1:])


def _ranks(rs: list[int]) -> str:
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


# ----------------------------------------------------------------------------- layer 2: the watchdog

def _store():
    import torch.distributed as dist
    try:
        base = dist.distributed_c10d._get_default_store()
    except Exception:
        return None
    return dist.PrefixStore("nanodist/diverge/", base)


def _start_watchdog() -> None:
    global _watchdog
    if _watchdog is not None or stall_seconds() <= 0:
        return
    with _lock:
        if _watchdog is None:
            _stopping.clear()
            _watchdog = threading.Thread(target=_watch, name="nanodist-divergence-watchdog", daemon=True)
            _watchdog.start()
            atexit.register(stop)


def stop() -> None:
    """Stop the watchdog and forget the trackers: before the process group and its store go away (nanodist's
    shutdown calls it, and so does the interpreter's exit), so that no store call is left running while the
    process tears them down (a store call failing during teardown ends the process with SIGABRT)."""
    global _watchdog
    thread = _watchdog
    if thread is not None:
        _stopping.set()
        if thread is not threading.current_thread():
            thread.join(timeout=5)
    _watchdog = None
    _trackers.clear()


def _main_stack(limit: int = 6) -> str:
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "(no stack)"
    frames = traceback.extract_stack(frame)[-limit:]
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames))


def _state(t: Tracker) -> dict:
    w = t.waiting
    return {"seq": t.seq, "entries": t.entries(), "stack": _main_stack(), "notes": list(t.notes),
            "waiting": None if w is None else [w[0], w[1], round(time.monotonic() - w[2], 1)]}


def _watch() -> None:
    store = None
    while not _stopping.wait(POLL_S):
        try:
            if store is None:
                store = _store()
                if store is None:
                    continue
            for t in list(_trackers.values()):
                _look(store, t)
        except Exception:  # the store is gone (the run ended): nothing left to watch
            if os.environ.get("NANODIST_DEBUG_WATCHDOG"):
                traceback.print_exc()
            return


def _look(store, t: Tracker) -> None:
    rank = t.group.rank
    w = t.waiting
    now = time.monotonic()
    stuck = w is not None and now - w[2] > stall_seconds()
    if t.seq != t.published[0] and now - t.published[1] >= HEARTBEAT_S:
        # A heartbeat: where this rank is, at most once a second, so that a rank that dies (gloo ends a process
        # whose collective does not match its peers' in size) still leaves its recent collectives behind.
        store.set(f"{t.key}/beat/{rank}", json.dumps({"seq": t.seq, "entries": t.entries(), "notes": list(t.notes)}))
        t.published = (t.seq, now)
    asked = store.add(f"{t.key}/ask", 0)
    if stuck and t.asked_for != w:
        asked = store.add(f"{t.key}/ask", 1)  # a new request, once per stall: every rank publishes its state
        t.asked_for = w
    if asked != t.asked or stuck:
        store.set(f"{t.key}/state/{rank}", json.dumps({"ask": asked, **_state(t)}))
        t.asked = asked
    if not stuck:
        return
    states = {}
    for q in range(t.group.size):
        k = f"{t.key}/state/{q}"
        if store.check([k]):
            s = json.loads(store.get(k))
            if s["ask"] == asked:
                states[q] = s
    waits = {q: tuple(s["waiting"][:2]) for q, s in states.items() if s["waiting"]}
    if len(states) < t.group.size and time.monotonic() - w[2] < 2 * stall_seconds():
        return  # give the others a poll or two to answer: the report then says who differs from the rest
    if len(set(waits.values())) > 1:
        _end(store, t, states)
    if t.warned == (w[0], w[1]):
        return
    t.warned = (w[0], w[1])
    silent = [t.group.global_rank(q) for q in range(t.group.size) if q not in states]
    others = [f"rank {t.group.global_rank(q)} is not in a collective (last: #{s['seq']} "
              f"{s['entries'][-1][1] if s['entries'] else '-'}; now at {s['stack']})"
              for q, s in sorted(states.items()) if not s["waiting"]]
    what = "; ".join(others) or ("every rank waits in it too: a slow collective, or a broken link" if not silent
                                 else "the others have not answered")
    if silent:
        what += f"; no answer from {_ranks(silent)}"
    print(f"[rank {t.group.global_rank(rank)}] nanodist: waited {time.monotonic() - w[2]:.0f} s in collective "
          f"#{w[0]} ({w[1]}): {what}", file=sys.stderr, flush=True)


def _end(store, t: Tracker, states: dict) -> None:
    g = t.group
    lines = [f"rank {g.global_rank(q)}: " + (f"waits in collective #{s['waiting'][0]} ({s['waiting'][1]}) for "
                                            f"{s['waiting'][2]:.0f} s" if s["waiting"] else "in no collective")
             + "".join(f"; {n}" for n in s.get("notes", ())) + f"; at {s['stack']}" for q, s in sorted(states.items())]
    lines += [f"rank {g.global_rank(q)}: no answer yet" for q in range(g.size) if q not in states]
    sub = _Sub(g, sorted(states))
    first = describe([states[q] for q in sorted(states)], sub)
    report = (f"nanodist: the ranks diverged -- they wait in different collectives, which will never pair up. "
              f"{first}\n  " + "\n  ".join(lines) +
              "\nEvery rank must run the same modules, backward passes and collectives in the same order "
              "(Chapter 7: debugging).")
    try:
        store.set(f"{t.key}/report", report)
    except Exception:
        pass
    print(f"[rank {g.global_rank(g.rank)}] {report}", file=sys.stderr, flush=True)
    for hook in fatal_hooks:
        try:
            hook(report)
        except Exception:
            pass
    os._exit(EXIT_CODE)


class _Sub:
    """The group's ranks that answered, for naming them."""

    def __init__(self, group, members: list[int]):
        self.members, self.group = members, group

    def global_rank(self, i: int) -> int:
        return self.group.global_rank(self.members[i])


def _report_after_failure(t: Tracker, seq: int, desc: str, error: Exception) -> str | None:
    """A collective failed (a peer's connection closed) with no report from a watchdog: compare this rank's
    collectives with the others' last heartbeats; a difference is a divergence, and says who."""
    store = _store()
    if store is None or t.group.size == 1:
        return None
    states = []
    try:
        for q in range(t.group.size):
            if q == t.group.rank:
                states.append({"seq": t.seq, "entries": t.entries(), "notes": list(t.notes)})
            elif store.check([f"{t.key}/beat/{q}"]):
                states.append(json.loads(store.get(f"{t.key}/beat/{q}")))
            else:
                return None
    except Exception:
        return None
    for s in states:  # a heartbeat may be up to a second old: compare only the collectives every rank reported
        s["entries"] = [e for e in s["entries"] if e[0] <= min(x["seq"] for x in states)]
    first = describe(states, t.group)
    if not first.startswith("Collective #"):
        return None
    return (f"nanodist: collective #{seq} ({desc}) failed on rank {t.group.global_rank(t.group.rank)} because a peer "
            f"closed its connection ({str(error).splitlines()[0][:160]}), and the ranks had diverged before: {first} "
            f"(gloo ends a process whose collective does not match its peers' in size: look for 'EnforceNotMet' in "
            f"the other ranks' output.){_notes(states, t.group)}\nEvery rank must run the same modules, backward "
            f"passes and collectives in the same order (Chapter 7: debugging).")


def _report_from_store(t: Tracker, wait_s: float = 1.0) -> str | None:
    store = _store()
    if store is None:
        return None
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if store.check([f"{t.key}/report"]):
                return store.get(f"{t.key}/report").decode()
        except Exception:
            return None
        time.sleep(0.1)
    return None
