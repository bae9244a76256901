"""Run a command so that nothing it starts outlives it, or the process that asked for it (Linux).

    python nanodist/reaper.py -- python -m torch.distributed.run ... lab.py     # what nanodist.launch runs

(Run as a file: it needs only psutil, and `python -m nanodist.reaper` would import the package, torch with it.)

torchrun's agent starts the workers, and the workers may start processes of their own. If the program
that launched the job dies -- a Jupyter kernel restart, `kill`, `timeout`, an out-of-memory kill -- no
code of its runs, and the agent and workers would run on: to the end of the job, or forever if it
hangs. This small process sits between the launcher and the agent and prevents that:

- it asks the kernel for SIGTERM when its parent dies (prctl PR_SET_PDEATHSIG), whatever killed it;
- it is a "child subreaper" (PR_SET_CHILD_SUBREAPER): a process whose parent dies is re-parented to
  it rather than to init, so every descendant stays findable even after the agent is gone;
- on that signal, on SIGTERM from the launcher, or when the command ends, it terminates every
  descendant (SIGTERM, then SIGKILL after 3 s) and exits with the command's exit code.

Elsewhere than Linux the command runs directly; then only nanodist.launch's own clean-up (timeout,
Ctrl-C, errors) applies, and a launcher killed outright can leave the job running.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

import psutil

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
GRACE_S = 3.0


def available() -> bool:
    """Whether this platform has the two prctl calls (Linux)."""
    return sys.platform.startswith("linux")


def terminate_then_kill(procs: list[psutil.Process], grace_s: float = GRACE_S) -> int:
    """SIGTERM every process of `procs` still running, then SIGKILL those left after grace_s; returns how many
    were running. (nanodist.launch uses it too, for the processes it saw.)"""
    alive = []
    for p in procs:
        try:
            if p.is_running():
                p.terminate()
                alive.append(p)
        except psutil.Error:
            pass
    _, left = psutil.wait_procs(alive, timeout=grace_s)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=grace_s)
    return len(alive)


def kill_descendants(grace_s: float = GRACE_S) -> int:
    """SIGTERM every descendant of this process, then SIGKILL those left after grace_s; returns how many."""
    return terminate_then_kill(psutil.Process().children(recursive=True), grace_s)


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print("usage: python -m nanodist.reaper -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the death signal was armed
        return 1

    def stop(signum, _frame):
        kill_descendants()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    child = subprocess.Popen(argv)
    code = child.wait()
    kill_descendants()  # whatever the command left behind (a worker's own child, say)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
