"""A rank started warm: what torchrun starts, under nanodist.launch, in place of `python -u script.py args` (Linux).

    python -S -u nanodist/rank_client.py script.py args...     # torchrun --no-python, one per rank

A fresh interpreter spends about 2 s importing torch before a rank does anything, and torchrun starts one per
rank: two ranks on two cores cost a launch 2 s of wall time. This client, which imports nothing but the standard
library, asks the agent server of its launch (NANODIST_RANK_SERVER, a socket in a private folder) to fork the
rank from a process that has imported torch already. The forked rank then *is* the rank: it runs the script as
`__main__` with this client's arguments, environment, working directory and standard streams, and the client
stands in for it toward torchrun:
- every signal torchrun (or anyone) sends the client -- SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2 --
  is passed on to the rank;
- the client ends as the rank ended: the same exit code, or killed by the same signal (a rank that SIGKILLs
  itself is reported by torchrun as SIGKILL, as before);
- if the client is killed (SIGKILL cannot be passed on), the server kills the rank and what it started.

When the server cannot give a rank that behaves as a fresh interpreter would -- no server, or the launch's
environment changes a variable read when torch is imported (ATEN_CPU_CAPABILITY, OMP_*, MKL_*, TORCH_*,
PYTHONPATH, ...) -- the client replaces itself with `python -u script.py args`, exactly what torchrun runs
without nanodist.
"""
import json
import os
import signal
import socket
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def cold(argv: list[str]) -> None:
    """Become `python -u script args`, what torchrun runs for a rank."""
    os.execv(sys.executable, [sys.executable, "-u", *argv])


def end_as(code: int) -> None:
    """Exit as the rank did: its exit code, or the signal that killed it (negative, as subprocess reports it)."""
    sys.stdout.flush()
    if code < 0:
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be caught, nor their handler reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code  # a signal whose default is not to die (none the server reports): exit as a shell would
    os._exit(code)


def main(argv: list[str]) -> None:
    path = os.environ.get("NANODIST_RANK_SERVER")
    if not argv or not path:
        cold(argv)
    fds = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:
            fds.append(os.open(os.devnull, os.O_RDWR))  # a closed stream: the rank gets what Popen would give
    request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        server.connect(path)
        socket.send_fds(server, [request], fds)
        reply = json.loads(server.recv(65536) or b'{"cold": "the server is gone"}')
    except (OSError, ValueError):
        reply = {"cold": "no server"}
    if "cold" in reply:
        server.close()
        cold(argv)
    rank = reply["pid"]

    def forward(signum, _frame):
        try:
            os.kill(rank, signum)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    # who the rank really is, for tools that read a process (py-spy, under a timed-out nanodist.launch); removed
    # when the rank ends
    note = os.path.join(os.path.dirname(path), f"rank-of-{os.getpid()}")
    try:
        with open(note, "w") as f:
            f.write(str(rank))
    except OSError:
        pass
    message = server.recv(4096)  # retried after each forwarded signal (PEP 475)
    try:
        os.unlink(note)
    except OSError:
        pass
    # no message: the server died, and the rank with it (its death signal is SIGKILL)
    end_as(json.loads(message)["code"] if message else -signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv[1:])
