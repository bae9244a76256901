"""A warm torchrun agent: a process that has imported torch once and forks one torchrun agent per launch (Linux).

    python nanodist/agent_server.py CONTROL_FD LAUNCHER_PID   # what nanodist.launch starts, once per process

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
the launcher's environment when the server started, not from the launch's `env=`; the ranks are fresh
interpreters and see all of it.
"""
from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import select
import signal
import socket
import sys
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
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)  # as the interpreter does with sys.exit("message")
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


def main(control_fd: int, launcher: int) -> int:
    global torchrun
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(reaper.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    libc.prctl(reaper.PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != launcher:  # the launcher died before the death signal was armed
        return 1

    def stop(signum, _frame):
        reaper.kill_descendants()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    import torch.distributed.run
    torchrun = torch.distributed.run  # the import every cold launch pays, once
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup byte is written
    control = socket.socket(fileno=control_fd)
    agents: dict[int, socket.socket] = {}  # agent pid -> its launch's reply socket
    hung_up: set[int] = set()  # agents whose launcher closed its end: being ended, their sockets no longer watched

    def end_agent(pid: int) -> None:
        """The launcher hung up on a launch (Ctrl-C, a timeout while waiting for the agent): end its agent. Its
        workers first (not this server's children: psutil polls them, it never reaps them); the agent itself by
        a signal only, so that reap() collects it, answers nobody and forgets it."""
        try:
            below = psutil.Process(pid).children(recursive=True)
        except psutil.Error:
            below = []
        reaper.terminate_then_kill(below, reaper.GRACE_S)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def reap() -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            reply = agents.pop(pid, None)
            hung_up.discard(pid)
            if reply is None:
                continue  # an orphan this subreaper inherited
            # what the agent left: its session, and children of this server that are no agent (orphans adopted
            # from an agent that was killed before it could end them)
            left = [p for p in psutil.Process().children(recursive=True)
                    if _session(p.pid) == pid or (p.ppid() == os.getpid() and p.pid not in agents)]
            if left:
                reaper.terminate_then_kill(left, reaper.GRACE_S)
            try:
                reply.send(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode())
            except OSError:
                pass  # the launcher gave up on this launch
            reply.close()

    while True:
        watched = [reply for pid, reply in agents.items() if pid not in hung_up]
        ready, _, _ = select.select([control, wake_r, *watched], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            reap()
        for pid, reply in list(agents.items()):
            if reply in ready and pid not in hung_up:  # readable: the launcher closed its end of this launch
                hung_up.add(pid)
                end_agent(pid)
        if control not in ready:
            continue
        try:
            message, fds, _, _ = socket.recv_fds(control, MAX_MESSAGE, 2)
        except OSError:
            message, fds = b"", []
        if not message:  # the launcher is gone
            reaper.kill_descendants()
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
            signal.set_wakeup_fd(-1)  # first: a signal must not write into a closed (or reused) descriptor
            os.close(wake_r)
            os.close(wake_w)
            control.close()
            reply.close()
            for other in agents.values():  # other launches' reply sockets: their EOF must not wait for this agent
                other.close()
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
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
