"""A warm torchrun agent: a process that has imported torch once and forks one torchrun agent per launch (Linux).

    python nanodist/agent_server.py CONTROL_FD LAUNCHER_PID FOLDER   # what nanodist.launch starts, once per process

A cold launch runs `python -m torch.distributed.run ...`, and that agent spends about 1.5 s of every launch
importing torch before it starts a single worker. This server pays the import once; for each launch it forks a
child that *is* the agent, running torchrun's own `main` with the launch's arguments, environment, directory and
output. The workers are torchrun's as before: fresh interpreters started by the agent.

Protocol, over CONTROL_FD (a SOCK_SEQPACKET socket; the launcher holds the other end): a request is one JSON
message {"argv", "env", "cwd"} carrying two file descriptors: the launch's own reply socket and the write end of
its output pipe. On the reply socket the server answers {"pid": agent} at once and {"code": exit} when the agent
has ended (negative: the signal that killed it, as subprocess reports it).

It keeps nanodist.reaper's promises, for every agent at once:
- when the launching process dies, however it dies, the server gets SIGTERM (PR_SET_PDEATHSIG; the launcher
  starts it from a thread that lives as long as the process) or reads the end of the control socket, and
  terminates every descendant: agents, workers and whatever they started;
- it is a child subreaper, so a worker whose agent died stays findable;
- each agent is a subreaper too and, when torchrun's main returns, terminates whatever is left under it (torchrun
  starts each worker in a session of its own); when an agent ends, the server terminates what is still left in
  its session and the orphans it adopted;
- a launcher that hangs up on one launch (closes its reply socket: Ctrl-C, a timeout) ends that launch's agent;
- each agent gets SIGTERM if the server itself dies (PR_SET_PDEATHSIG in the child).

Unlike a cold agent, the forked one has read torch's import-time settings (LOGLEVEL, for its own log lines) from
the launcher's environment when the server started, not from the launch's `env=`.

Warm ranks. The server also forks the ranks themselves (nanodist/rank_client.py is what torchrun starts for
each; it connects to FOLDER/ranks.sock, a socket in a folder only this user can enter, and sends {"argv", "env",
"cwd"} with its standard streams). The forked rank runs the script as `__main__`, as `python -u script` would:
unbuffered streams, the script's folder first on sys.path, torch's thread count from OMP_NUM_THREADS, atexit
handlers and non-daemon threads finished at exit, an uncaught exception through sys.excepthook and exit code
1. The server answers {"pid": rank} and, when the rank has ended, {"code": exit}; a client that hangs up
(killed) has its rank killed. A request whose environment differs from the server's in a variable read when
torch is imported (IMPORT_TIME) is answered {"cold": why}: the client then runs the script in a fresh
interpreter, so a launch's `env=` always takes effect.
"""
from __future__ import annotations

import atexit
import ctypes
import importlib.util
import io
import json
import os
import runpy
import select
import shutil
import signal
import socket
import struct
import sys
import threading
import traceback

import psutil

# Run as a file, Python put this folder first on sys.path: its modules (data, memory, state, ...) must not shadow
# any that torch imports. Only the reaper's helpers are taken from here, by path.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
_spec = importlib.util.spec_from_file_location("_nanodist_reaper", os.path.join(HERE, "reaper.py"))
reaper = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reaper)

MAX_MESSAGE = 1 << 20
torchrun = None  # torch.distributed.run, imported by main() once the death signal is armed

# Read when torch and the libraries it loads are imported, or fixed for an interpreter's life: a rank whose
# environment differs from the server's in one of these must be a fresh interpreter.
IMPORT_TIME = ("ATEN_", "MKL_", "KMP_", "OMP_", "GOMP_", "DNNL_", "ONEDNN_", "OPENBLAS_", "LD_", "MALLOC_",
               "GLIBC_", "PYTHON", "TORCH", "LOGLEVEL")
# ... except what torchrun sets per rank (read at run time), OMP_NUM_THREADS (applied to torch by the rank) and
# PYTHONUNBUFFERED (a rank's streams are always unbuffered, as torchrun's `python -u`)
PER_RANK = ("TORCHELASTIC_", "TORCH_NCCL_", "OMP_NUM_THREADS", "PYTHONUNBUFFERED")


def import_time_difference(env: dict, base: dict) -> str | None:
    """The first variable read at import time whose value differs between `env` and `base`, or None."""
    for name in sorted(set(env) | set(base)):
        if name.startswith(IMPORT_TIME) and not name.startswith(PER_RANK) and env.get(name) != base.get(name):
            return name
    return None


def run_rank(request: dict, fds: list[int], libc, server: int, base_path: list[str]) -> None:
    """In the forked child: become one rank, running the script as `python -u script args` would."""
    code = 1
    try:
        os.setsid()  # torchrun starts each rank in a session of its own
        libc.prctl(reaper.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != server:  # the server died before the death signal was armed
            os._exit(1)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        high = [os.dup(fd) for fd in fds]  # received descriptors may themselves be 0, 1 or 2
        for fd in fds:
            os.close(fd)
        for target, fd in enumerate(high):
            os.dup2(fd, target)
            os.close(fd)
        # what `python -u` gives: unbuffered binary layers, text layers that write through
        sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)),
                                                      encoding=sys.stdin.encoding, errors=sys.stdin.errors)
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True,
                                                        encoding=sys.stdout.encoding, errors=sys.stdout.errors)
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                                        encoding=sys.stderr.encoding, errors=sys.stderr.errors)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:  # OpenMP read the variable when the server loaded it
            sys.modules["torch"].set_num_threads(int(threads))
        argv = request["argv"]
        sys.argv = list(argv)
        sys.path[:] = [os.path.dirname(os.path.abspath(argv[0])), *base_path]
        try:
            runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = _exit_status(e)
        except KeyboardInterrupt as e:
            _report(e)
            code = -signal.SIGINT  # the interpreter ends by SIGINT after an uncaught KeyboardInterrupt
        except BaseException as e:
            _report(e)
            code = 1
    finally:
        try:  # the interpreter's exit: wait for non-daemon threads, run atexit handlers, flush
            threading._shutdown()
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            if code < 0:
                signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
            os._exit(code if code >= 0 else 128 - code)


def _exit_status(e: SystemExit) -> int:
    """The status the interpreter exits with for an uncaught SystemExit: its code, or 1 after printing a message
    (sys.exit("message"))."""
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1


def run_agent(argv: list[str], env: dict, cwd: str, out_fd: int, libc, server: int) -> None:
    """In the forked child: become the agent of one launch and exit with torchrun's status."""
    code = 1
    try:
        os.setsid()  # a session of its own, as a cold launch's start_new_session: no terminal signal reaches it
        libc.prctl(reaper.PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != server:  # the server died before the death signal was armed
            os._exit(1)
        # torchrun starts each worker in a session of its own: as a subreaper the agent keeps the workers' own
        # children findable, and ends whatever is left when it ends (what nanodist.reaper does for a cold agent)
        libc.prctl(reaper.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)
        # a cold agent runs with PYTHONUNBUFFERED=1: every line its tee threads copy from the ranks leaves at once
        sys.stdout.reconfigure(line_buffering=True, write_through=True)
        sys.stderr.reconfigure(line_buffering=True, write_through=True)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.argv = ["torchrun", *argv]
        try:
            torchrun.main(argv)
            code = 0
        except SystemExit as e:
            code = _exit_status(e)
        except BaseException:  # what `python -m torch.distributed.run` would print before exiting 1
            traceback.print_exc()
            code = 1
        reaper.kill_descendants()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _report(e: BaseException) -> None:
    """An uncaught exception, as the interpreter reports it: through sys.excepthook (torch.distributed installs
    its own, with a `[rankN]:` prefix), its traceback starting at the script, not in this server or runpy."""
    tb = e.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename == os.path.abspath(__file__)
                              or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")):
        tb = tb.tb_next
    e = e.with_traceback(tb or e.__traceback__)
    sys.excepthook(type(e), e, e.__traceback__)


def main(control_fd: int, launcher: int, folder: str) -> int:
    global torchrun
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(reaper.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    libc.prctl(reaper.PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != launcher:  # the launcher died before the death signal was armed
        return 1
    base_env, base_path = dict(os.environ), list(sys.path)
    ranks_listen = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ranks_listen.bind(os.path.join(folder, "ranks.sock"))  # bound before torch's import: the first launch's
    ranks_listen.listen(64)                                # ranks find it however soon they start

    def stop(signum, _frame):
        reaper.kill_descendants()
        shutil.rmtree(folder, ignore_errors=True)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    import torch.distributed.run
    torchrun = torch.distributed.run  # the import every cold launch (and every cold rank) pays, once
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup byte is written
    control = socket.socket(fileno=control_fd)
    agents: dict[int, socket.socket] = {}  # agent pid -> its launch's reply socket
    ranks: dict[int, socket.socket] = {}  # warm rank pid -> its client's socket
    hung_up: set[int] = set()  # children whose launcher or client closed its end: being ended, no longer watched

    def end_agent(pid: int) -> None:
        """The launcher hung up on a launch (Ctrl-C, a timeout while waiting for the agent), or a rank's client
        died: end that agent or rank. What it started first (psutil polls them, it never reaps them); the agent
        or rank itself by a signal only, so that reap() collects it, answers nobody and forgets it."""
        try:
            below = psutil.Process(pid).children(recursive=True)
        except psutil.Error:
            below = []
        reaper.terminate_then_kill(below, reaper.GRACE_S)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def left_by(p: psutil.Process, pid: int) -> bool:
        """Whether p is what the ended agent or rank `pid` left behind; False for a process that is gone."""
        try:
            return _session(p.pid) == pid or (p.ppid() == os.getpid() and p.pid not in agents and p.pid not in ranks)
        except psutil.Error:  # it ended while we looked (with many short-lived ranks, it happens)
            return False

    def reap() -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            reply = agents.pop(pid, None) or ranks.pop(pid, None)
            hung_up.discard(pid)
            if reply is None:
                continue  # an orphan this subreaper inherited
            # what the agent or rank left: its session, and children of this server that are no agent or rank
            # (orphans adopted from one that was killed before it could end them)
            try:
                left = [p for p in psutil.Process().children(recursive=True) if left_by(p, pid)]
                if left:
                    reaper.terminate_then_kill(left, reaper.GRACE_S)
            except Exception:  # whatever happens here, the launcher or client below gets its answer
                traceback.print_exc()
            try:
                reply.send(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode())
            except OSError:
                pass  # the launcher gave up on this launch
            reply.close()

    def close_in_child() -> None:
        """In a forked agent or rank: what belongs to the server, and every other launch's and rank's socket
        (their end-of-file must not wait for this child)."""
        signal.set_wakeup_fd(-1)  # first: a signal must not write into a closed (or reused) descriptor
        os.close(wake_r)
        os.close(wake_w)
        control.close()
        ranks_listen.close()
        for other in (*agents.values(), *ranks.values()):
            other.close()

    def start_rank() -> None:
        try:
            client, _ = ranks_listen.accept()
        except OSError:
            return
        fds: list[int] = []
        try:
            uid = struct.unpack("3i", client.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
            if uid != os.getuid():  # the folder is private: only this user could have connected
                return
            client.settimeout(10)
            message, fds, _, _ = socket.recv_fds(client, MAX_MESSAGE, 3)
            client.settimeout(None)
            request = json.loads(message)
            differs = import_time_difference(request["env"], base_env)
            if differs or len(fds) != 3:
                client.send(json.dumps({"cold": f"{differs} differs from the server's" if differs
                                        else "three standard streams expected"}).encode())
                return
            pid = os.fork()
            if pid == 0:
                close_in_child()
                client.close()
                run_rank(request, fds, libc, os.getppid(), base_path)
            ranks[pid], client = client, None
            ranks[pid].send(json.dumps({"pid": pid}).encode())
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a client that went away or spoke nonsense: it runs cold, or nothing was started for it
        finally:
            for fd in fds:
                os.close(fd)
            if client is not None:
                client.close()

    def survive(step, *args) -> None:
        """One piece of the loop's work; an error in it is printed, never the end of the server (and of every
        launch it runs)."""
        try:
            step(*args)
        except Exception:
            traceback.print_exc()

    while True:
        watched = [reply for pid, reply in (*agents.items(), *ranks.items()) if pid not in hung_up]
        ready, _, _ = select.select([control, ranks_listen, wake_r, *watched], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            survive(reap)
        for pid, reply in [*agents.items(), *ranks.items()]:
            if reply in ready and pid not in hung_up:  # readable: the launcher or the rank's client hung up
                hung_up.add(pid)
                survive(end_agent, pid)
        if ranks_listen in ready:
            survive(start_rank)
        if control not in ready:
            continue
        try:
            message, fds, _, _ = socket.recv_fds(control, MAX_MESSAGE, 2)
        except OSError:
            message, fds = b"", []
        if not message:  # the launcher is gone
            reaper.kill_descendants()
            shutil.rmtree(folder, ignore_errors=True)
            return 0
        reply_fd, out_fd = fds
        reply = socket.socket(fileno=reply_fd)
        request = json.loads(message)
        if select.select([reply], [], [], 0)[0]:  # the launcher hung up before the agent was started
            reply.close()
            os.close(out_fd)
            continue
        pid = os.fork()
        if pid == 0:
            close_in_child()
            reply.close()
            run_agent(request["argv"], request["env"], request["cwd"], out_fd, libc, server=os.getppid())
        os.close(out_fd)
        agents[pid] = reply
        try:
            reply.send(json.dumps({"pid": pid}).encode())
        except OSError:
            pass


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
