"""Run a torchrun job from Python (a notebook cell, a test) and get its results back.

    run = nanodist.launch("lab01_ranks", nproc=2)        # a lab name or a script path
    run.results["metrics"]                               # what rank 0 wrote (see nanodist.results)

What it guarantees:
- a free port per launch, so two launches never collide ("Address already in use"). The ranks meet at
  127.0.0.1, but the rendezvous store that torchrun's agent starts on that port listens on every network
  interface -- torch binds its TCPStore to all of them and has no option to do otherwise
  (pytorch/pytorch#173909) -- and asks no credentials: while a launch runs, anyone who can reach this
  machine on that port can read and write the run's keys. Launch on a machine whose firewall keeps the
  network out of unprivileged ports, or inside a private network (a container's own network namespace);
- every line the ranks print, streamed live with a `[rankN]:` prefix;
- on failure, a LaunchError naming the rank torchrun found failing first, how it ended (exit code or
  signal) and what it said last: its traceback, or an argparse "error:" line (a notebook cell fails
  visibly — unlike `!torchrun`, whose exit status a notebook ignores);
- on timeout, KeyboardInterrupt or any error, the whole process tree (torchrun agents and every
  worker, which torchrun starts in sessions of their own) is killed: no orphans;
- if the process running launch dies by any signal (a kernel restart, kill, an out-of-memory kill), the
  agents and workers die within seconds too: the agents run under nanodist's agent server (or, with
  NANODIST_WARM_AGENT=0, each under nanodist.reaper), which ends them all (Linux);
- a warm agent: the first launch starts a server that imports torch once (nanodist/agent_server.py) and
  forks every later launch's torchrun agent, which then starts its workers without first spending about
  1.5 s importing torch itself (Linux; elsewhere, or with NANODIST_WARM_AGENT=0, `python -m
  torch.distributed.run` runs for each launch);
- nnodes > 1 starts that many torchrun agents on this host that meet through a c10d rendezvous:
  multi-node training, on one machine.
"""
from __future__ import annotations

import atexit
import errno
import json
import os
import queue
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from .results import REPO_ROOT, load, new_run_id, results_dir
from .runtime import free_port

LABS_DIR = REPO_ROOT / "labs"
_PREFIX = re.compile(r"^\[rank(\d+)\]:")
_TORCH_PREFIX = re.compile(r"^\[rank\d+\]: ")  # torch's own excepthook prefixes tracebacks once more
_ROOT_CAUSE_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_NODE_TAG = re.compile(r"^\[node\d+\] ")
_DYING_NOISE = ("terminate called", "[W", "[E", "W1", "E1")  # C++ and glog lines from a process being torn down


class LaunchError(RuntimeError):
    """A launched job failed. `.rank` is the failing global rank (or None), `.traceback` its traceback."""

    def __init__(self, message: str, returncode: int | None = None, rank: int | None = None,
                 traceback: str = "", output: str = ""):
        super().__init__(message)
        self.returncode, self.rank, self.traceback, self.output = returncode, rank, traceback, output


class LaunchTimeout(LaunchError):
    """The job ran past its timeout and was killed, with every process it started. Before the kill, every rank
    that called nanodist.init() printed every thread's Python stack (faulthandler, on SIGUSR1): the message
    says where each rank's main thread was, and .output holds the whole dumps."""


STACK_DUMP_S = 6.0  # the longest a timed-out launch waits for its ranks' stack dumps before it kills them
STACK_QUIET_S = 0.5  # once every signalled rank has begun its dump: this long without a line from any ends the wait
_THREAD_HEAD = re.compile(r"(Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):")
_FRAME = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')


def _workers(procs: list[psutil.Process]) -> dict[int, psutil.Process]:
    """The ranks among a launch's processes, by global rank: the processes torchrun started (RANK and LOCAL_RANK
    set), not torchrun's agents (which have them too when the launching process did) and not what a rank started
    itself (a DataLoader worker, a subprocess: they inherit the variables)."""
    ranked = {}
    for p in procs:
        try:
            env = p.environ()
            if "LOCAL_RANK" in env and "RANK" in env and p.is_running():
                cmd = " ".join(p.cmdline())
                if "torch.distributed.run" not in cmd and "torchrun" not in cmd:
                    ranked[p.pid] = (int(env["RANK"]), p)
        except (psutil.Error, ValueError):
            continue
    out = {}
    for rank, p in ranked.values():
        try:
            if p.ppid() not in ranked:  # the top-most process of its rank
                out[rank] = p
        except psutil.Error:
            continue
    return out


def _catches_sigusr1(p: psutil.Process) -> bool:
    """Whether a process has a handler for SIGUSR1 (Linux: /proc/<pid>/status SigCgt). One that has none would be
    killed by it: a rank still importing torch, or a script that never called nanodist.init()."""
    try:
        with open(f"/proc/{p.pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
        return bool(mask >> (signal.SIGUSR1 - 1) & 1)
    except (OSError, StopIteration, ValueError, AttributeError):
        return False


def _real_rank(p: psutil.Process) -> psutil.Process:
    """The process that runs a rank: a warm rank's client (nanodist/rank_client.py) stands in for a process the
    agent server forked, and wrote down which (signals reach it through the client; py-spy must read it). The
    note is trusted only if it names a child of an agent server started after the client."""
    try:
        server = p.environ().get("NANODIST_RANK_SERVER")
        if server and "rank_client.py" in " ".join(p.cmdline()):
            real = psutil.Process(int(Path(os.path.dirname(server), f"rank-of-{p.pid}").read_text()))
            if "agent_server.py" in " ".join(real.parent().cmdline()) and real.create_time() >= p.create_time():
                return real
    except (psutil.Error, OSError, ValueError, AttributeError):
        pass
    return p


def _dump_stacks(procs: list[psutil.Process], lines: queue.Queue, output: list[str]) -> str:
    """Ask every rank for its threads' stacks (SIGUSR1: faulthandler, which nanodist.init() registers), collect
    what they print, and say where each rank's main thread was (its innermost frames)."""
    ranks = _workers(procs)
    signalled = []
    for r, p in ranks.items():
        # a warm rank's client passes SIGUSR1 on to the rank it stands for: that one must catch it
        if _catches_sigusr1(p) and _catches_sigusr1(_real_rank(p)):
            try:
                p.send_signal(signal.SIGUSR1)
                signalled.append(r)
            except psutil.Error:
                pass
    if not ranks:
        return ""
    # Wait for the dumps: until every rank signalled has printed some of its own and the output has been quiet
    # for STACK_QUIET_S, or STACK_DUMP_S at most (a loaded machine: the dumps reach us through torchrun's tailing
    # of each rank's log file, which polls).
    first = len(output)
    begun: set[int] = set()
    start = last = time.monotonic()
    while time.monotonic() - start < STACK_DUMP_S:
        if begun >= set(signalled) and time.monotonic() - last > STACK_QUIET_S:
            break
        try:
            line = lines.get(timeout=0.1)
        except queue.Empty:
            continue
        if line is not None:
            output.append(line)
            last = time.monotonic()
            begun.update(r for r, text in _rank_pieces(line) if _DUMP_LINE_START.match(text))
    where = stacks_from_output(output[first:])
    spied = _py_spy(ranks, output)

    def no_stack(r: int) -> str:
        if r not in signalled:
            return "(no stack: it does not catch SIGUSR1 -- it had not called nanodist.init() -- so it was not asked)"
        return f"(no stack: asked, it printed none within {STACK_DUMP_S:g} s)"

    said = [f"  rank {r}: " + (" <- ".join(where[r][:4]) if r in where else no_stack(r)) for r in sorted(ranks)]
    return ("\nWhere each rank was (its main thread, innermost frame first; every thread's stack is in .output"
            + (", and py-spy's dump of each rank" if spied else "") + "):\n" + "\n".join(said))


def _py_spy(ranks: dict[int, psutil.Process], output: list[str]) -> bool:
    """`py-spy dump` of every rank, into the output as [rankN]:py-spy: lines, where py-spy is installed (a PyPI
    wheel; it reads another process's memory, so it needs ptrace rights: root, or the same user with
    kernel.yama.ptrace_scope 0). Returns whether any dump came back."""
    beside = Path(sys.executable).parent / "py-spy"
    spy = str(beside) if beside.exists() else shutil.which("py-spy")
    if spy is None:
        return False
    procs = {}
    for r, p in sorted(ranks.items()):
        try:
            procs[r] = subprocess.Popen([spy, "dump", "--pid", str(_real_rank(p).pid)], stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
        except OSError:  # a py-spy that cannot run: faulthandler's dumps are what there is
            return False
    got = False
    for r, proc in procs.items():
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        got |= proc.returncode == 0
        output.extend(f"[rank{r}]:py-spy: {line}" for line in out.splitlines())
    return got


_HEADER = re.compile(r"\[rank(\d+)\]:")
_DUMP_LINE_START = re.compile(r'  File "|Current thread 0x|Thread 0x')  # faulthandler's first write of a line


def _rank_pieces(line: str) -> list[tuple[int, str]]:
    """A line of a launch's output as (rank, text) pieces. torchrun tails each rank's log file and writes what
    each read returns behind the rank's header: a read that met a line half written (faulthandler writes a
    frame's line in several writes) gives a piece with no end of line, so the rest of that line -- or another
    rank's line -- follows it, each behind its own header, on the same output line. A line that does not start
    with a header is no rank's."""
    heads = list(_HEADER.finditer(line))
    if not heads or heads[0].start() != 0:
        return []
    return [(int(h.group(1)), line[h.end():heads[i + 1].start() if i + 1 < len(heads) else len(line)])
            for i, h in enumerate(heads)]


def stacks_from_output(lines: list[str]) -> dict[int, list[str]]:
    """From faulthandler dumps in a launch's output ([rankN]:-prefixed lines): each rank's main thread, as
    "file:line function", innermost first. The main thread is the one whose outermost frame is not a thread's
    start (threading.py's _bootstrap): faulthandler's "Current thread" is whichever thread took the signal, and
    CPython lists the threads newest first, so the main one last."""
    threads: dict[int, list[list[str]]] = {}
    pieces: dict[int, str] = {}  # a rank's last piece that was no whole line of a dump
    for rank, text in (piece for line in lines for piece in _rank_pieces(line)):
        if not (_THREAD_HEAD.search(text) or _FRAME.search(text)):
            joined = pieces.pop(rank, "") + text
            if not (_THREAD_HEAD.search(joined) or _FRAME.search(joined)):
                # keep what may be the start of a dump's line, for the rest to join
                kept = next((t for t in (joined, text) if _DUMP_LINE_START.match(t) and len(t) < 4096), None)
                if kept is not None:
                    pieces[rank] = kept
                continue
            text = joined
        else:
            pieces.pop(rank, None)
        if _THREAD_HEAD.search(text):
            threads.setdefault(rank, []).append([])
            continue
        frame = _FRAME.search(text)
        if frame and threads.get(rank):
            threads[rank][-1].append(f"{os.path.basename(frame.group(1))}:{frame.group(2)} {frame.group(3)}")
    out = {}
    for r, ts in threads.items():
        main = [t for t in ts if t and not t[-1].endswith("_bootstrap")]
        chosen = main[-1] if main else (ts[-1] if ts else [])
        if chosen:
            out[r] = chosen
    return out


@dataclass
class LaunchResult:
    """A finished job: the results record rank 0 wrote (None if it wrote none), and its output."""

    results: dict | None
    output: str
    run_id: str
    port: int
    returncode: int
    elapsed_s: float
    command: list = field(repr=False, default_factory=list)
    restarts: int = 0  # how many times torchrun restarted the group (launch(restarts=...))

    def lines(self, rank: int) -> list[str]:
        """The lines rank `rank` printed (prefix removed)."""
        return rank_lines(self.output).get(rank, [])


# ----------------------------------------------------------------------------- helpers

def resolve_script(script: str | os.PathLike) -> Path:
    """A script path, or a lab name such as 'lab01_ranks' (looked up in labs/)."""
    p = Path(script)
    candidates = [p, LABS_DIR / p, LABS_DIR / f"{p}.py"] if not p.is_absolute() else [p]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    labs = ", ".join(sorted(q.stem for q in LABS_DIR.glob("lab*.py")))
    raise FileNotFoundError(f"no script {str(script)!r}: give a path to a .py file or a lab name ({labs})")


def rank_lines(output: str) -> dict[int, list[str]]:
    """Split launcher output into the lines each global rank printed."""
    out: dict[int, list[str]] = {}
    for line in output.splitlines():
        m = _PREFIX.match(line)
        if m:
            out.setdefault(int(m.group(1)), []).append(_TORCH_PREFIX.sub("", line[m.end():], count=1))
    return out


def _failures(output: str) -> list[dict]:
    """Every failure torchrun's agents reported, in their "Failures" and "Root Cause" entries: rank, exit code,
    the signal if one killed it, and whether torchrun took it for the root cause."""
    failures: list[dict] = []
    root = None  # None: outside a report; else whether the entries read now are torchrun's root cause
    for line in output.splitlines():
        line = _NODE_TAG.sub("", line, count=1)  # nnodes > 1: each agent's lines carry its node
        if "Root Cause" in line:
            root = True
        elif line.strip() == "Failures:":
            root = False
        elif line.startswith("====="):
            root = None
        elif root is not None and re.match(r"^\[\d+\]:\s*$", line):
            failures.append({"root": root})
        elif root is not None and failures:
            entry = failures[-1]
            m = _ROOT_CAUSE_RANK.match(line)
            if m and "rank" not in entry:
                entry["rank"] = int(m.group(1))
            m = re.match(r"^\s*exitcode\s*:\s*(-?\d+)", line)
            if m and "exitcode" not in entry:
                entry["exitcode"] = int(m.group(1))
                sig = re.search(r"\((SIG[A-Z0-9]+)\)", line)
                entry["signal"] = sig.group(1) if sig else _signal_name(entry["exitcode"])
    return [f for f in failures if "rank" in f]


def _signal_name(exitcode: int) -> str | None:
    """The signal behind a negative exit code (-9: SIGKILL). torch 2.13 writes the name beside the exit code, torch
    2.11 only on the traceback line ("Signal 9 (SIGKILL) received by PID ..."): the code says it in both."""
    import signal
    try:
        return signal.Signals(-exitcode).name if exitcode < 0 else None
    except ValueError:
        return None


# What a rank says when another rank died under it (gloo, NCCL, the TCP store): it failed because of the other.
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing", "Broken pipe",
              "NCCL communicator was aborted", "remote process exited", "DistNetworkError")


def _lost_a_peer(lines: list[str]) -> bool:
    """Whether a rank's last error says a peer went away (so it is not the cause of the failure)."""
    tail = "\n".join(lines[-40:])
    return any(p in tail for p in _PEER_LOST)


def _failing_rank(output: str) -> tuple[int | None, str]:
    """The rank that failed first and its traceback: a rank a signal killed, if torchrun saw one fail (the ranks
    that then lost their peer fail in the same instant, and torchrun's clock, in whole seconds, cannot order
    them); else a rank that raised an error of its own rather than one saying a peer went away; else the rank
    torchrun names as the root cause; else the first rank with a traceback."""
    per_rank = rank_lines(output)
    failures = _failures(output)
    # SIGTERM is how torchrun (or launch) stops ranks, and how agents of other "nodes" (nnodes > 1) end
    killed = [f for f in failures if f.get("signal") not in (None, "SIGTERM")]
    roots = [f for f in failures if f["root"]]
    # of ranks that raised in the same instant, the ones whose error says a peer vanished are its victims
    raised = sorted((f for f in failures if f.get("signal") is None), key=lambda f: not f["root"])
    culprits = [f for f in raised if not _lost_a_peer(per_rank.get(f["rank"], []))]
    real = (sorted(killed, key=lambda f: not f["root"]) or culprits
            or [c for c in roots if c.get("signal") != "SIGTERM"] or roots)
    rank = real[0]["rank"] if real else None
    if rank is None:
        with_tb = [r for r, lines in per_rank.items() if any(l.startswith("Traceback") for l in lines)]
        rank = min(with_tb, key=lambda r: _first_tb_index(output, r)) if with_tb else None
    if rank is None or rank not in per_rank:
        return rank, ""
    lines = per_rank[rank]
    starts = [i for i, l in enumerate(lines) if l.startswith("Traceback")]
    if not starts:
        return rank, ""
    # From the first traceback (chained ones included) to the end of what the rank printed: the exception
    # message may span several lines. Native noise printed while the process dies is left out, unless it is
    # gloo's hint that the ranks called different collectives.
    kept = [l for l in lines[starts[0]:] if not l.startswith(_DYING_NOISE) or "mismatch" in l.lower()]
    return rank, "\n".join(kept).rstrip()


def _last_words(lines: list[str], n: int = 3) -> list[str]:
    """A rank's last meaningful lines: an argparse "error:" line if there is one, else its last n lines."""
    errors = [l for l in lines if ": error: " in l]
    if errors:
        return errors[-1:]
    useful = [l for l in lines if l.strip() and (not l.startswith(_DYING_NOISE) or "mismatch" in l.lower())]
    return useful[-n:]


def _failure_message(script: str, output: str, agent_code: int) -> tuple[str, int | None, str, int]:
    """(message, failing rank, its traceback, its exit code) for a failed job."""
    rank, tb = _failing_rank(output)
    causes = [c for c in _failures(output) if c["rank"] == rank and "exitcode" in c]
    code = causes[0]["exitcode"] if causes else agent_code
    sig = causes[0].get("signal") if causes else None
    where = f"rank {rank}" if rank is not None else "a rank"
    if sig:
        why = f"killed by {sig} (exit code {code})"
        if sig == "SIGKILL":
            why += ": the kernel's out-of-memory killer, or kill -9"
        last = _last_words(rank_lines(output).get(rank, []))
        tail = ("\nits last lines:\n" + "\n".join(last)) if last else ""
        return f"{script} failed on {where}: {why}{tail}", rank, tb, code
    if tb.strip():
        return f"{script} failed on {where} (exit code {code}): {_exception_line(tb)}\n\n{tb}", rank, tb, code
    last = _last_words(rank_lines(output).get(rank, []))
    said = " | ".join(last) if last else "it printed nothing; see .output"
    return f"{script} failed on {where} (exit code {code}): {said}", rank, tb, code


def _exception_line(traceback: str) -> str:
    """The 'SomeError: message' line that closes the last traceback."""
    lines = traceback.splitlines()
    last = max((i for i, l in enumerate(lines) if l.startswith("Traceback")), default=-1)
    return next((l for l in lines[last + 1:] if l and not l[0].isspace()), lines[-1] if lines else "")


def _first_tb_index(output: str, rank: int) -> int:
    m = re.search(rf"^\[rank{rank}\]:(\[rank{rank}\]: )?Traceback", output, re.M)
    return m.start() if m else len(output)


def _kill_tree(procs: list[psutil.Process], grace_s: float = 3.0) -> int:
    """SIGTERM every process still running, then SIGKILL those left after `grace_s`. Returns how many."""
    from .reaper import terminate_then_kill
    return terminate_then_kill(procs, grace_s)


# ----------------------------------------------------------------------------- launch

def _agent_commands(script: Path, nproc: int, nnodes: int, port: int, run_id: str, args: list[str],
                    restarts: int = 0, reaped: bool = True) -> list[list]:
    # Each cold agent runs under nanodist.reaper: if this process dies, however it dies, the reaper ends the
    # agent, its workers and whatever they started (Linux; elsewhere the agent runs directly). A warm agent's
    # server does the same for all of them, and forks the ranks too: torchrun starts nanodist/rank_client.py
    # (standard library only, `-S`: no site-packages to scan) for each rank, which has the server fork it.
    from . import reaper as _reaper
    # run as a file, not `-m nanodist.reaper`: that would import the package, and with it torch (2 s a launch)
    reaper = [sys.executable, _reaper.__file__, "--"] if reaped and _reaper.available() else []
    base = reaper + [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                     f"--max-restarts={restarts}", "--tee=3"]
    tail = [str(script), *map(str, args)]
    if not reaped:
        tail = ["--no-python", sys.executable, "-S", "-u", str(Path(__file__).with_name("rank_client.py")), *tail]
    if nnodes == 1:
        return [base + ["--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={port}"] + tail]
    return [base + [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                    f"--rdzv-id={run_id}", f"--rdzv-conf=is_host={int(i == 0)}", "--local-addr=127.0.0.1"] + tail
            for i in range(nnodes)]


# ----------------------------------------------------------------------------- warm agents

class _WarmAgent:
    """One launch's agent, forked by the agent server: what _launch_once needs of a subprocess.Popen."""

    def __init__(self, pid: int, reply: socket.socket, stdout):
        self.pid, self.stdout, self.returncode, self._reply = pid, stdout, None, reply
        try:  # the server reaps its agents at once: a pid can be reused, a psutil.Process notices
            self.process = psutil.Process(pid)
        except psutil.Error:
            self.process = None

    def _read(self, timeout: float | None) -> None:
        if self.returncode is not None:
            return
        ready, _, _ = select.select([self._reply], [], [], timeout)
        if not ready:
            raise subprocess.TimeoutExpired(f"agent {self.pid}", timeout)
        message = self._reply.recv(4096)
        # no message: the server itself died, and the agent with it (its death signal)
        self.returncode = json.loads(message)["code"] if message else -signal.SIGKILL
        self._reply.close()

    def poll(self) -> int | None:
        try:
            self._read(0)
        except subprocess.TimeoutExpired:
            pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._read(timeout)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None and self.process is not None:
            try:
                self.process.kill()
            except psutil.Error:
                pass


class _AgentServer:
    """This process's agent server (nanodist/agent_server.py): started at the first launch, it has imported torch
    once and forks each launch's torchrun agent and its ranks, saving their own imports of torch (about 2 s a
    launch each). Linux only; NANODIST_WARM_AGENT=0 turns it off (each launch then runs `python -m
    torch.distributed.run`, which starts `python -u script` for each rank)."""

    _lock = threading.Lock()  # the class's state belongs to this process: a forked child forgets it (_forget)
    _proc: subprocess.Popen | None = None
    _control: socket.socket | None = None
    _folder: str | None = None  # the private folder of the server's rank socket
    _starter: queue.Queue | None = None

    @classmethod
    def enabled(cls) -> bool:
        from . import reaper
        return reaper.available() and os.environ.get("NANODIST_WARM_AGENT", "1") != "0"

    @classmethod
    def _forget(cls) -> None:
        """In a child forked from a launching process: the parent's server, lock and thread are not ours."""
        if cls._control is not None:
            try:
                cls._control.close()
            except OSError:
                pass
        cls._lock, cls._proc, cls._control, cls._folder, cls._starter = threading.Lock(), None, None, None, None

    @classmethod
    def _start(cls) -> None:
        # The server's death signal fires when the *thread* that started it ends: start it from a thread that
        # lives as long as this process, never from the caller's (a notebook's or a test's short-lived thread).
        if cls._starter is None:
            cls._starter = queue.Queue()
            threading.Thread(target=cls._starter_loop, args=(cls._starter,), daemon=True,
                             name="nanodist-agent-server").start()
        done: queue.Queue = queue.Queue()
        cls._starter.put(done)
        started = done.get()
        if isinstance(started, BaseException):
            raise started
        cls._proc, cls._control, cls._folder = started

    @staticmethod
    def _starter_loop(requests: queue.Queue) -> None:
        server = Path(__file__).with_name("agent_server.py")  # run as a file: importing it would import torch
        while True:
            done = requests.get()
            try:
                folder = tempfile.mkdtemp(prefix="nanodist-ranks-")  # mode 0700: only this user reaches the socket
                atexit.register(_remove_folder, folder, os.getpid())  # the server removes it, unless it was killed
                ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                try:
                    proc = subprocess.Popen([sys.executable, str(server), str(theirs.fileno()), str(os.getpid()),
                                             folder], pass_fds=[theirs.fileno()], start_new_session=True,
                                            stdout=subprocess.DEVNULL, stderr=None)
                finally:
                    theirs.close()
                done.put((proc, ours, folder))
            except BaseException as e:  # e.g. out of file descriptors: the caller raises it, this thread goes on
                done.put(e)

    @classmethod
    def spawn(cls, cmd: list[str], env: dict) -> _WarmAgent:
        """Fork an agent running `torchrun` with cmd's arguments (cmd as for a cold launch)."""
        argv = cmd[cmd.index("torch.distributed.run") + 1:]
        out_r, out_w = os.pipe()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with cls._lock:
                for attempt in range(2):
                    if cls._proc is None or cls._proc.poll() is not None:
                        cls._start()
                    env = {**env, "NANODIST_RANK_SERVER": os.path.join(cls._folder, "ranks.sock")}
                    message = json.dumps({"argv": argv, "env": env, "cwd": os.getcwd()}).encode()
                    try:
                        socket.send_fds(cls._control, [message], [theirs.fileno(), out_w])
                        break
                    except OSError as e:
                        if e.errno == errno.EMSGSIZE:
                            raise RuntimeError(f"launch: this launch's environment ({len(message)} bytes) is too "
                                               f"large for nanodist's agent server; set NANODIST_WARM_AGENT=0 to "
                                               f"launch through `python -m torch.distributed.run`") from e
                        if attempt or cls._proc.poll() is None and e.errno not in _SERVER_GONE:
                            raise
                        cls._proc = None  # the server died since the last launch: start another
        except BaseException:
            os.close(out_r)
            ours.close()
            raise
        finally:
            os.close(out_w)
            theirs.close()
        stdout = os.fdopen(out_r, "r", errors="replace")
        try:
            ready, _, _ = select.select([ours], [], [], 120)  # the first launch waits for the server's import
            message = ours.recv(4096) if ready else b""
            if not message:
                raise RuntimeError("launch: nanodist's agent server did not start an agent; set "
                                   "NANODIST_WARM_AGENT=0 to launch through `python -m torch.distributed.run` instead")
            return _WarmAgent(json.loads(message)["pid"], ours, stdout)
        except BaseException:  # Ctrl-C while waiting, too: hanging up tells the server to end this launch's agent
            stdout.close()
            ours.close()
            raise


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_AgentServer._forget)


def _remove_folder(folder: str, owner: int) -> None:
    if os.getpid() == owner:  # not in a forked child that exits through atexit
        shutil.rmtree(folder, ignore_errors=True)


def launch(script: str | os.PathLike, nproc: int = 2, args=(), timeout: float = 600, nnodes: int = 1,
           env: dict | None = None, echo: bool = True, restarts: int = 0) -> LaunchResult:
    """Run `script` under torchrun with `nproc` ranks per node on `nnodes` local "nodes".

    Returns a LaunchResult whose `.results` is the results file rank 0 wrote (nanodist.results),
    or None if the script wrote none. Raises LaunchError (with `.rank` and `.traceback`) if any rank
    fails, LaunchTimeout after `timeout` seconds. Either way no process it started is left running.
    `args` is a list, or a string split as a shell would ("--steps 5 --data 'my file.txt'").
    `env` adds or overrides environment variables of the ranks; `echo=False` keeps output quiet.
    A LaunchError names the rank torchrun found failing first, how it ended (its exit code, or the signal
    that killed it) and what it said last: its exception, or an "error:" line such as argparse's.
    `restarts` is torchrun's --max-restarts: when a rank dies, torchrun stops every rank and starts the
    whole group again, up to that many times (a script that resumes from its checkpoint then goes on);
    `.restarts` of the result says how many happened.
    """
    for name, value in (("nproc", nproc), ("nnodes", nnodes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"launch: {name} must be a positive integer, got {value!r}")
    if not timeout or timeout <= 0:
        raise ValueError(f"launch: timeout must be a positive number of seconds, got {timeout!r}")
    if not isinstance(restarts, int) or isinstance(restarts, bool) or restarts < 0:
        raise ValueError(f"launch: restarts must be a non-negative integer, got {restarts!r}")
    script = resolve_script(script)
    args = shlex.split(args) if isinstance(args, str) else [str(a) for a in args]
    for attempt in range(3):
        try:
            return _launch_once(script, nproc, list(args), timeout, nnodes, env, echo, port=free_port(),
                                restarts=restarts)
        except LaunchError as e:
            # free_port() released the port before torchrun could bind it: another program may have taken it
            # in between. Rare, and then the job never started: try again on another port.
            if attempt == 2 or isinstance(e, LaunchTimeout) or not _PORT_TAKEN.search(e.output):
                raise
            if echo:
                print("[launch] port was taken before torchrun could use it; retrying on another", flush=True)


_PORT_TAKEN = re.compile(r"EADDRINUSE|[Aa]ddress already in use")
_SERVER_GONE = (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF)


def _launch_once(script: Path, nproc: int, args: list, timeout: float, nnodes: int, env: dict | None, echo: bool,
                 port: int, restarts: int = 0) -> LaunchResult:
    chosen = "NANODIST_RUN_ID" in (env or {})
    run_id = env["NANODIST_RUN_ID"] if chosen else new_run_id()
    child_env = dict(os.environ)
    child_env.update({
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": child_env.get("OMP_NUM_THREADS", "1"),  # what torchrun would set, without its warning
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]:",
        "NANODIST_RUN_ID": run_id,
        "NANODIST_RUN_ID_SOURCE": "user" if chosen else "launch",  # a resumed run keeps its checkpoint's id
        "NANODIST_LAUNCH_ID": run_id,  # how this launch finds the results file, whichever run id it got
        "NANODIST_NNODES": str(nnodes),
        "NANODIST_RESULTS_DIR": str(results_dir()),
    })
    child_env.update({k: str(v) for k, v in (env or {}).items()})
    warm = _AgentServer.enabled()
    commands = _agent_commands(script, nproc, nnodes, port, run_id, args, restarts, reaped=not warm)

    lines: queue.Queue = queue.Queue()
    agents: list[subprocess.Popen] = []
    seen: dict[int, psutil.Process] = {}
    output: list[str] = []
    start = time.monotonic()

    def pump(proc: subprocess.Popen, node: int) -> None:
        tag = f"[node{node}] " if nnodes > 1 else ""
        for line in proc.stdout:
            line = line.rstrip("\n")
            lines.put(line if _PREFIX.match(line) else tag + line)
        lines.put(None)

    def track() -> None:
        for a in agents:
            if a.poll() is not None:
                continue  # ended: its pid may belong to another process by now
            try:
                for p in [psutil.Process(a.pid)] + psutil.Process(a.pid).children(recursive=True):
                    seen.setdefault(p.pid, p)
            except psutil.Error:
                pass

    try:
        for node, cmd in enumerate(commands):
            if warm:
                proc = _AgentServer.spawn([str(c) for c in cmd], child_env)
            else:
                proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, errors="replace", env=child_env, start_new_session=True)
            agents.append(proc)
            threading.Thread(target=pump, args=(proc, node), daemon=True).start()
        open_streams, last_track = len(agents), 0.0
        while open_streams:
            if time.monotonic() - start > timeout:
                track()
                before = len(output)
                stacks = _dump_stacks(list(seen.values()), lines, output)
                killed = _kill_tree(list(seen.values()))
                tail = "\n".join(output[max(0, before - 20):before])
                raise LaunchTimeout(
                    f"{script.name} did not finish within {timeout:g} s and was stopped ({killed} processes "
                    f"killed). A rank may be stuck in a collective that another rank never called, or the "
                    f"job needs a larger timeout=. Last output:\n{tail}" + stacks, output="\n".join(output))
            if time.monotonic() - last_track > 0.5:
                track()
                last_track = time.monotonic()
                if nnodes > 1 and any(a.poll() not in (None, 0) for a in agents):
                    # One "node" failed: the others' workers would wait in a collective until their timeout.
                    _kill_tree(list(seen.values()))
            try:
                line = lines.get(timeout=0.1)
            except queue.Empty:
                continue
            if line is None:
                open_streams -= 1
                continue
            output.append(line)
            if echo:
                print(line, flush=True)
        codes = [a.wait() for a in agents]
    except BaseException:  # timeout, KeyboardInterrupt, anything: leave nothing behind
        track()
        _kill_tree(list(seen.values()))
        raise
    finally:
        _kill_tree(list(seen.values()))  # workers a dead agent may have left
        for a in agents:
            try:
                a.wait(timeout=10)  # reap the agents: no zombies either
            except subprocess.TimeoutExpired:
                a.kill()
                a.wait()
            if a.stdout:
                a.stdout.close()
    text, elapsed = "\n".join(output), time.monotonic() - start
    returncode = next((c for c in codes if c != 0), 0)
    if returncode != 0:
        message, rank, tb, code = _failure_message(script.name, text, returncode)
        raise LaunchError(message, returncode=code, rank=rank, traceback=tb, output=text)
    found = _find_results(Path(child_env["NANODIST_RESULTS_DIR"]), run_id)
    results = load(found) if found else None
    return LaunchResult(results=results, output=text, run_id=results["run_id"] if results else run_id, port=port,
                        returncode=0, elapsed_s=elapsed, command=commands,
                        restarts=len(_RESTARTED.findall(text)))


_RESTARTED = re.compile(r"failed \(exitcode: -?\d+\) local_rank")  # a worker failure torchrun recovered from


def _find_results(directory: Path, launch_id: str) -> Path | None:
    """The results file this launch wrote: named by its run id, or -- a run resumed from a checkpoint continues
    the checkpoint's run -- the file whose header or resume line carries this launch's id."""
    named = sorted(directory.glob(f"*/{launch_id}.jsonl"))
    if named:
        return named[0]
    needle = f'"launch_id": "{launch_id}"'
    for path in sorted(directory.glob("*/*.jsonl"), key=lambda p: p.stat().st_mtime, reverse=True)[:200]:
        try:
            if needle in path.read_text(errors="replace"):
                return path
        except OSError:
            continue
    return None
