"""nanodist.launch: results back, failures carry the failing rank's traceback, and nothing is left running."""
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

import nanodist as nd
from nanodist.launch import _exception_line, _failing_rank, _failure_message, _failures, rank_lines, resolve_script

SCRIPTS = Path(__file__).parent / "scripts"
pytestmark = pytest.mark.dist


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_for_pid_files(pid_dir: Path, n: int, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = list(pid_dir.glob("*.pids"))
        if len(files) == n and all(f.read_text().endswith("\n") for f in files):
            return [int(p) for f in files for p in f.read_text().split()]
        time.sleep(0.2)
    raise AssertionError(f"the ranks did not start within {timeout} s")


def test_two_ranks_stream_output_and_return_rank0_results(results_dir, capsys):
    run = nd.launch(SCRIPTS / "ok.py", nproc=2, timeout=120)
    assert run.results["metrics"]["rank_sum"] == 1.0
    assert run.results["world_size"] == 2 and run.results["backend"] == "gloo"
    assert Path(run.results["_path"]).parent == results_dir / "test_ok"
    assert run.lines(0) == ["sum of ranks is 1"] and run.lines(1) == ["sum of ranks is 1"]
    printed = capsys.readouterr().out
    assert "[rank0]:sum of ranks is 1" in printed and "[rank1]:sum of ranks is 1" in printed


def test_failing_rank_traceback_is_in_the_exception(results_dir):
    with pytest.raises(nd.LaunchError) as err:
        nd.launch(SCRIPTS / "fail.py", nproc=2, timeout=120, echo=False)
    e = err.value
    assert e.rank == 1
    assert e.traceback.startswith("Traceback (most recent call last):")
    assert e.traceback.rstrip().endswith("ZeroDivisionError: rank one divides by zero on purpose")
    assert "failed on rank 1" in str(e) and "fail.py" in e.traceback
    assert e.returncode != 0


def test_timeout_kills_every_process(results_dir, tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    with pytest.raises(nd.LaunchTimeout, match="did not finish within 12 s"):
        nd.launch(SCRIPTS / "hang.py", nproc=2, timeout=12, env={"PID_DIR": pid_dir}, echo=False)
    pids = wait_for_pid_files(pid_dir, 2, timeout=1)  # the ranks had started: the test is not vacuous
    assert len(pids) == 4  # two workers, each with a grandchild of its own
    time.sleep(0.5)
    assert [p for p in pids if alive(p)] == []


def test_a_timeout_says_where_each_rank_was(tmp_path):
    """Before the kill, every rank dumps its threads' stacks (faulthandler on SIGUSR1, registered by
    nanodist.init); the message names each rank's innermost frames: the one stuck in Python, the others in the
    barrier it never reached. py-spy's dumps join them where py-spy can read the ranks."""
    from nanodist.launch import STACK_DUMP_S, stacks_from_output
    t0 = time.monotonic()
    with pytest.raises(nd.LaunchTimeout) as e:
        # 3 ranks on 2 cores must all be in place (the barrier, or stuck) before the launch times out
        nd.launch(SCRIPTS / "hang_one_rank.py", nproc=3, timeout=15, echo=False, env={"NANODIST_TIMEOUT": "120"})
    assert time.monotonic() - t0 < 15 + STACK_DUMP_S + 10 + 10  # the timeout, the dumps, py-spy, the kill
    msg = str(e.value)
    assert re.search(r"rank 1: hang_one_rank\.py:\d+ stuck_in_python <- hang_one_rank\.py:\d+ <module>", msg), msg
    for r in (0, 2):
        assert re.search(rf"rank {r}: distributed_c10d\.py:\d+ barrier", msg), msg
    where = stacks_from_output(e.value.output.splitlines())
    assert sorted(where) == [0, 1, 2] and where[1][0].endswith("stuck_in_python")
    if "py-spy's dump" in msg:  # installed with the test extras; it needs ptrace rights
        assert re.search(r"\[rank1\]:py-spy: .*stuck_in_python", e.value.output), e.value.output[-3000:]


def test_stacks_are_read_from_faulthandlers_dumps():
    from nanodist.launch import stacks_from_output
    # CPython lists the newest thread first; "Current thread" is whichever took the signal (here a watchdog's)
    lines = ["[rank0]:Current thread 0x00007f01 (most recent call first):",
             '[rank0]:  File "/x/threading.py", line 359 in wait',
             '[rank0]:  File "/x/threading.py", line 1030 in _bootstrap',
             "[rank0]:Thread 0x00007f02 (most recent call first):",
             '[rank0]:  File "/x/train.py", line 10 in step',
             '[rank0]:  File "/x/train.py", line 20 in <module>',
             "[rank1]:Thread 0x00007f03 (most recent call first):",
             '[rank1]:  File "/x/h.py", line 5 in stuck',
             "[rank2]:nothing of faulthandler's"]
    assert stacks_from_output(lines) == {0: ["train.py:10 step", "train.py:20 <module>"], 1: ["h.py:5 stuck"]}


def test_stacks_survive_lines_that_torchrun_split():
    """torchrun tails each rank's log file and writes each read behind the rank's header: a read that meets a
    dump half written leaves the line's start on one output line, with the next piece -- its rest, or another
    rank's line -- behind its own header. The pieces of a rank are joined again; nothing is given to the wrong
    rank."""
    from nanodist.launch import stacks_from_output
    lines = ['[rank1]:Thread 0x00007f03 (most recent call first):',
             '[rank1]:  File "/x/h.py", line 5 in stuck',
             '[rank1]:  File "/x/h.py[rank0]:Current thread 0x00007f01 (most recent call first):',  # rank 1 cut
             '[rank0]:  File "/x/train.py", line 10 in step',
             '[rank1]:", line 7 in outer',  # rank 1's rest
             '[rank0]:  File "/x/tr[rank0]:ain.py", line 20 in <module>',  # cut and continued at once
             '[rank1]:  File "/x/h.py", line 9 in <module>',
             '[rank0]:[rank0]: Traceback (most recent call last):']  # torch's excepthook prefixes its own
    assert stacks_from_output(lines) == {0: ["train.py:10 step", "train.py:20 <module>"],
                                         1: ["h.py:5 stuck", "h.py:7 outer", "h.py:9 <module>"]}
    thread_head_cut = ["[rank2]:Current thread 0x00007f", "[rank2]:05 (most recent call first):",
                       '[rank2]:  File "/x/w.py", line 3 in wait']
    assert stacks_from_output(thread_head_cut) == {2: ["w.py:3 wait"]}


def test_keyboard_interrupt_kills_every_process(tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    driver = textwrap.dedent(f"""
        import nanodist as nd
        try:
            nd.launch({str(SCRIPTS / 'hang.py')!r}, nproc=2, timeout=300, env={{"PID_DIR": {str(pid_dir)!r}}})
        except KeyboardInterrupt:
            print("interrupted cleanly", flush=True)
            raise SystemExit(130)
    """)
    proc = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "NANODIST_RESULTS_DIR": str(tmp_path)})
    try:
        pids = wait_for_pid_files(pid_dir, 2)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out
    assert "interrupted cleanly" in out
    time.sleep(0.5)
    assert [p for p in pids if alive(p)] == []


def test_concurrent_launches_get_different_ports(results_dir):
    runs, errors = [None, None], []

    def go(i):
        try:
            runs[i] = nd.launch(SCRIPTS / "ok.py", nproc=2, timeout=120, echo=False)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert runs[0].port != runs[1].port
    assert runs[0].run_id != runs[1].run_id
    assert [r.results["metrics"]["rank_sum"] for r in runs] == [1.0, 1.0]


def test_a_port_taken_before_torchrun_binds_it_is_retried(results_dir, monkeypatch):
    import importlib
    import socket
    launch_module = importlib.import_module("nanodist.launch")  # the module, not the function
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    ports = iter([taken])
    real = launch_module.free_port
    monkeypatch.setattr(launch_module, "free_port", lambda: next(ports, None) or real())
    try:
        run = nd.launch(SCRIPTS / "ok.py", nproc=2, timeout=120, echo=False)
    finally:
        squatter.close()
    assert run.port != taken and run.results["metrics"]["rank_sum"] == 1.0


def test_bad_arguments_fail_before_starting_anything():
    with pytest.raises(ValueError, match="nproc must be a positive integer"):
        nd.launch(SCRIPTS / "ok.py", nproc=0)
    with pytest.raises(ValueError, match="timeout must be a positive"):
        nd.launch(SCRIPTS / "ok.py", timeout=0)
    with pytest.raises(FileNotFoundError, match="lab01_ranks"):
        nd.launch("no_such_lab")
    assert resolve_script("lab01_ranks").name == "lab01_ranks.py"


def test_a_failure_on_one_node_stops_the_other_node_promptly(results_dir):
    start = time.monotonic()
    with pytest.raises(nd.LaunchError) as err:  # fail.py's other ranks would wait 60 s in a barrier
        nd.launch(SCRIPTS / "fail.py", nproc=1, nnodes=2, timeout=120, echo=False)
    assert err.value.rank == 1 and "ZeroDivisionError" in err.value.traceback
    assert time.monotonic() - start < 45


def test_multi_line_exception_messages_are_kept():
    output = "\n".join([
        "[rank1]:[rank1]: Traceback (most recent call last):",
        "[rank1]:[rank1]:   File \"x.py\", line 9, in <module>",
        "[rank1]:[rank1]: AssertionError: parameters differ across ranks: first is 'w'",
        "[rank1]:[rank1]: ranks with identical copies: [0], [1]",
        "[rank1]:[rank1]: max abs diff 0.5",
        "[rank1]:terminate called without an active exception",
        "Root Cause (first observed failure):",
        "  rank      : 1 (local_rank: 1)",
    ])
    rank, tb = _failing_rank(output)
    assert rank == 1 and tb.splitlines()[-2:] == ["ranks with identical copies: [0], [1]", "max abs diff 0.5"]
    assert _exception_line(tb) == "AssertionError: parameters differ across ranks: first is 'w'"


def test_output_parsing_finds_the_root_cause_rank():
    output = "\n".join([
        "[rank0]:[rank0]: Traceback (most recent call last):",
        "[rank0]:[rank0]:   File \"x.py\", line 3, in <module>",
        "[rank0]:[rank0]: RuntimeError: Connection closed by peer",
        "[rank1]:hello",
        "[rank1]:[rank1]: Traceback (most recent call last):",
        "[rank1]:[rank1]:   File \"x.py\", line 9, in <module>",
        "[rank1]:[rank1]: KeyError: 'lr'",
        "[rank1]:terminate called without an active exception",
        "Root Cause (first observed failure):",
        "[0]:",
        "  rank      : 1 (local_rank: 1)",
    ])
    assert rank_lines(output)[1][0] == "hello"
    rank, tb = _failing_rank(output)
    assert rank == 1
    assert tb.splitlines() == ["Traceback (most recent call last):", "  File \"x.py\", line 9, in <module>",
                               "KeyError: 'lr'"]



def test_a_rank_killed_by_a_signal_is_the_cause_even_when_torchrun_names_its_peer():
    """torchrun's clock has whole seconds: a rank that lost its peer and exits in the same instant as the peer
    that was killed can come first in its report. The killed one is the cause."""
    output = "\n".join([
        "[rank0]:[rank0]: Traceback (most recent call last):",
        "[rank0]:[rank0]: RuntimeError: Connection closed by peer",
        "[rank1]:about to die",
        "Failures:",
        "[1]:",
        "  rank      : 1 (local_rank: 1)",
        "  exitcode  : -9 (pid: 2048)  (SIGKILL)",
        "------------------------------------------------------------",
        "Root Cause (first observed failure):",
        "[0]:",
        "  rank      : 0 (local_rank: 0)",
        "  exitcode  : 1 (pid: 2047)",
        "============================================================",
    ])
    assert _failing_rank(output)[0] == 1
    message, rank, _, code = _failure_message("x.py", output, 1)
    assert (rank, code) == (1, -9) and "killed by SIGKILL" in message
    # and a rank stopped with SIGTERM (by torchrun, or another node's agent) is never the cause
    assert _failing_rank(output.replace("(SIGKILL)", "(SIGTERM)").replace("-9", "-15"))[0] == 0


def test_a_killed_rank_is_named_from_torch_2_11s_report_too():
    """torch 2.11 (seen on an H100 box) writes the signal only on the traceback line, not beside the exit code:
    the negative exit code says which signal it was. The report below is that box's, for Lab 7's dead peer."""
    output = "\n".join([
        "[rank1]:rank 1 is about to be killed by SIGKILL",
        "Failures:",
        "[1]:",
        "  time      : 2026-11-27_05:22:15",
        "  host      : localhost",
        "  rank      : 0 (local_rank: 0)",
        "  exitcode  : -15 (pid: 1894)",
        "  error_file: <N/A>",
        "  traceback : Signal 15 (SIGTERM) received by PID 1894",
        "------------------------------------------------------",
        "Root Cause (first observed failure):",
        "[0]:",
        "  time      : 2026-11-27_05:22:14",
        "  host      : localhost",
        "  rank      : 1 (local_rank: 1)",
        "  exitcode  : -9 (pid: 1895)",
        "  error_file: <N/A>",
        "  traceback : Signal 9 (SIGKILL) received by PID 1895",
        "======================================================",
    ])
    assert [(f["rank"], f["signal"]) for f in _failures(output)] == [(0, "SIGTERM"), (1, "SIGKILL")]
    message, rank, _, code = _failure_message("lab07_debug.py", output, 1)
    assert (rank, code) == (1, -9) and "failed on rank 1: killed by SIGKILL (exit code -9)" in message, message


def test_of_ranks_that_raised_together_the_one_whose_peer_vanished_is_not_the_cause():
    """Both ranks exit 1 in the same second; torchrun names the one that lost its peer. Its error says so; the
    other's is the cause. The same from two agents (nnodes = 2), whose lines carry their node."""
    output = "\n".join([
        "[rank1]:[rank1]: Traceback (most recent call last):",
        "[rank1]:[rank1]: ZeroDivisionError: rank one divides by zero on purpose",
        "[rank0]:[rank0]: Traceback (most recent call last):",
        "[rank0]:[rank0]: RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1",
        "Failures:",
        "[1]:",
        "  rank      : 1 (local_rank: 1)",
        "  exitcode  : 1 (pid: 2048)",
        "------------------------------------------------------------",
        "Root Cause (first observed failure):",
        "[0]:",
        "  rank      : 0 (local_rank: 0)",
        "  exitcode  : 1 (pid: 2047)",
        "============================================================",
    ])
    rank, tb = _failing_rank(output)
    assert rank == 1 and tb.endswith("ZeroDivisionError: rank one divides by zero on purpose")
    two_nodes = "\n".join(line if line.startswith("[rank") else f"[node{0 if 'rank      : 0' in line else 1}] {line}"
                          for line in output.splitlines())
    assert _failing_rank(two_nodes)[0] == 1

# ----------------------------------------------------------------------------- the truth about failures

def test_a_killed_rank_is_named_with_its_signal_not_the_rank_that_lost_its_peer(results_dir):
    with pytest.raises(nd.LaunchError) as err:
        nd.launch(SCRIPTS / "killself.py", nproc=2, timeout=120, echo=False)
    e = err.value
    assert e.rank == 1 and e.returncode == -9
    assert "failed on rank 1: killed by SIGKILL (exit code -9)" in str(e) and "out-of-memory" in str(e)
    assert "rank 1 is about to be killed by SIGKILL" in str(e)  # what the rank said last


def test_a_labs_own_error_line_is_the_message_and_string_args_are_split(results_dir):
    with pytest.raises(nd.LaunchError) as err:
        nd.launch("lab03_ddp", nproc=2, args="--impl nanodist --steps 2", timeout=120, echo=False)
    msg = str(err.value)
    assert err.value.returncode == 2
    assert msg.startswith("lab03_ddp.py failed on rank") and "(exit code 2)" in msg
    assert "lab03_ddp.py: error: --steps must be more than 3" in msg


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killing_the_launching_process_leaves_no_process_behind(tmp_path, sig):
    """What a Jupyter kernel restart, `kill` or `timeout` does to the process running launch."""
    if not nd.reaper.available():
        pytest.skip("needs Linux's prctl (documented limit)")
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    driver = (f"import nanodist as nd\nnd.launch({str(SCRIPTS / 'hang.py')!r}, nproc=2, timeout=300, "
              f"env={{'PID_DIR': {str(pid_dir)!r}}}, echo=False)\n")
    proc = subprocess.Popen([sys.executable, "-c", driver], env={**os.environ, "NANODIST_RESULTS_DIR": str(tmp_path)})
    try:
        pids = wait_for_pid_files(pid_dir, 2)
        # everything the launch started: the agent server, the agent (the workers' parent), and the workers
        agents = [p.pid for p in psutil.Process(proc.pid).children(recursive=True) if p.pid not in pids]
        assert {psutil.Process(p).ppid() for p in pids} & set(agents), "the agent was running"
        proc.send_signal(sig)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(alive(p) for p in pids + agents):
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert [p for p in pids + agents if alive(p)] == [], "workers, their children and the agent are all gone"


def test_the_warm_agent_server_outlives_the_thread_that_started_it_and_is_replaced_when_it_dies(results_dir):
    """Launches fork their torchrun agent from one server per process (nanodist/agent_server.py): started from a
    thread that ends, it stays (its death signal follows the thread that started it); killed, the next launch
    starts another."""
    from nanodist.launch import _AgentServer
    if not _AgentServer.enabled():
        pytest.skip("the warm agent needs Linux (and NANODIST_WARM_AGENT unset)")
    first = []
    t = threading.Thread(target=lambda: first.append(nd.launch(SCRIPTS / "ok.py", nproc=2, timeout=120,
                                                               echo=False)))
    t.start()
    t.join()
    server = _AgentServer._proc.pid
    time.sleep(0.5)
    assert alive(server), "the server survived the end of the thread that started it"
    again = nd.launch(SCRIPTS / "ok.py", nproc=2, timeout=120, echo=False)
    assert _AgentServer._proc.pid == server  # the same warm server
    os.kill(server, signal.SIGKILL)
    _AgentServer._proc.wait(timeout=10)
    third = nd.launch(SCRIPTS / "ok.py", nproc=2, timeout=120, echo=False)
    assert _AgentServer._proc.pid != server
    assert [r.results["metrics"]["rank_sum"] for r in first + [again, third]] == [1.0, 1.0, 1.0]


def test_with_the_warm_agent_off_each_launch_runs_torchrun_under_the_reaper(results_dir, monkeypatch):
    monkeypatch.setenv("NANODIST_WARM_AGENT", "0")
    run = nd.launch(SCRIPTS / "ok.py", nproc=2, timeout=120, echo=False)
    assert run.results["metrics"]["rank_sum"] == 1.0
    assert "torch.distributed.run" in run.command[0]
    assert (nd.reaper.__file__ in run.command[0]) == nd.reaper.available()


def test_every_line_arrives_while_the_ranks_run(results_dir, monkeypatch):
    """Streamed live, through a warm agent as through a cold one: a line a rank printed is shown before the rank
    has finished (a forked agent writes to its pipe line by line, as a cold one under PYTHONUNBUFFERED does)."""
    import importlib
    launch_module = importlib.import_module("nanodist.launch")
    # a notebook's kernel has no PYTHONUNBUFFERED; the warm server takes the environment it starts in
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    server = launch_module._AgentServer._proc
    if server is not None and server.poll() is None:
        server.kill()
        server.wait(timeout=10)
    arrived = {}
    monkeypatch.setattr(launch_module, "print", lambda line, **kw: arrived.setdefault(line, time.monotonic()),
                        raising=False)
    nd.launch(SCRIPTS / "slow_lines.py", nproc=2, timeout=120)
    assert arrived["[rank0]:second line"] - arrived["[rank0]:first line"] > 1.0, arrived  # 3 s apart; held: ~0


def test_a_launch_the_launcher_hangs_up_on_is_ended_by_the_server(tmp_path):
    """Ctrl-C while a launch waits for its agent: the launcher closes its end of the launch, and the server ends
    the agent it had started for it, with its workers."""
    from nanodist.launch import _AgentServer, _agent_commands, free_port
    if not _AgentServer.enabled():
        pytest.skip("the warm agent needs Linux (and NANODIST_WARM_AGENT unset)")
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    cmd = _agent_commands(SCRIPTS / "hang.py", 2, 1, free_port(), "hangup", [], reaped=False)[0]
    agent = _AgentServer.spawn([str(c) for c in cmd], {**os.environ, "PID_DIR": str(pid_dir)})
    pids = wait_for_pid_files(pid_dir, 2)
    assert alive(agent.pid) and all(alive(p) for p in pids)
    agent._reply.close()  # what spawn's clean-up and the end of a launch that was interrupted do
    agent.stdout.close()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(alive(p) for p in pids + [agent.pid]):
        time.sleep(0.2)
    assert [p for p in pids + [agent.pid] if alive(p)] == []
    server = psutil.Process(_AgentServer._proc.pid)  # and the server forgot that launch: it waits, it does not spin
    assert server.cpu_percent(interval=1.0) < 50
    assert nd.launch(SCRIPTS / "ok.py", nproc=2, timeout=120, echo=False).results["metrics"]["rank_sum"] == 1.0


# ----------------------------------------------------------------------------- warm ranks

def _seen(run_or_error) -> dict:
    import json
    out = {}
    for rank, lines in rank_lines(run_or_error.output).items():
        line = next(l for l in lines if l.startswith("SEEN "))
        seen, preloaded = line[5:].rsplit(" PRELOADED ", 1)
        out[rank] = {**json.loads(seen), "preloaded": preloaded == "True",
                     "after": [l for l in lines if l in ("thread finished", "atexit ran")]}
    return out


def _warm_and_cold(monkeypatch, **kw):
    """The same launch with warm ranks (forked from the agent server) and cold ones (NANODIST_WARM_AGENT=0)."""
    def run():
        try:
            return nd.launch(SCRIPTS / "fresh.py", nproc=2, timeout=120, echo=False, **kw)
        except nd.LaunchError as e:
            return e
    warm = run()
    monkeypatch.setenv("NANODIST_WARM_AGENT", "0")
    cold = run()
    monkeypatch.delenv("NANODIST_WARM_AGENT")
    return warm, cold


def test_a_warm_rank_sees_what_a_fresh_interpreter_sees(results_dir, monkeypatch):
    """Each rank of a launch is forked from the agent server, which has imported torch once (about 2 s a rank
    saved). It must be indistinguishable from torchrun's `python -u script args` but for torch being imported
    already: __main__, argv, sys.path, directory, environment, threads, unbuffered output, pickling of classes
    defined in the script, non-daemon threads and atexit handlers finished at exit, exit codes, tracebacks."""
    from nanodist.launch import _AgentServer
    if not _AgentServer.enabled():
        pytest.skip("warm ranks need Linux (and NANODIST_WARM_AGENT unset)")
    args = ["--flag", "two words"]
    warm, cold = _warm_and_cold(monkeypatch, args=args, env={"FROM_LAUNCH": "yes", "OMP_NUM_THREADS": "1"})
    w, c = _seen(warm), _seen(cold)
    assert [w[r].pop("preloaded") for r in (0, 1)] == [True, True]  # forked warm, both of them
    assert [c[r].pop("preloaded") for r in (0, 1)] == [False, False]
    assert w == c
    assert w[0]["name"] == "__main__" and w[0]["argv"] == [str(SCRIPTS / "fresh.py"), *args]
    assert w[0]["path0"] == str(SCRIPTS) and w[0]["threads"] == 1 and w[0]["env"] == "yes"
    assert w[0]["unbuffered"] and w[0]["pickled"] == 3 and w[0]["after"] == ["thread finished", "atexit ran"]

    for fail, code in (("exit3", 3), ("raise", 1)):
        warm, cold = _warm_and_cold(monkeypatch, env={"FAIL": fail})
        assert isinstance(warm, nd.LaunchError) and isinstance(cold, nd.LaunchError)
        assert (warm.rank, warm.returncode) == (cold.rank, cold.returncode) == (1, code)
        assert _seen(warm)[1]["after"] == _seen(cold)[1]["after"] == ["thread finished", "atexit ran"]
        frames = [[l for l in e.traceback.splitlines() if l.lstrip().startswith("File ")] for e in (warm, cold)]
        assert frames[0] == frames[1]  # the traceback starts in the script, not in the server that forked it
        # the same message (its first line: a rank's stdout and stderr reach torchrun through two files, so
        # how their lines interleave in the rest of it differs from run to run, warm or cold)
        assert str(warm).replace("PRELOADED True", "PRELOADED False").splitlines()[0] == str(cold).splitlines()[0]


def test_a_launch_that_changes_an_import_time_variable_gets_fresh_ranks(results_dir):
    """A variable read when torch is imported (here PYTHONHASHSEED; ATEN_CPU_CAPABILITY, OMP_*, MKL_*, TORCH_*
    alike) cannot take effect in a process that imported torch already: such a launch's ranks are fresh
    interpreters, and the variable takes effect."""
    run = nd.launch(SCRIPTS / "fresh.py", nproc=2, timeout=120, echo=False, env={"PYTHONHASHSEED": "7"})
    assert [s["preloaded"] for s in _seen(run).values()] == [False, False]


def test_a_warm_ranks_stand_in_killed_by_sigkill_kills_the_rank(results_dir, tmp_path):
    """torchrun knows a warm rank by its stand-in (nanodist/rank_client.py, which passes every signal on). A
    SIGKILL cannot be passed on: the server sees the stand-in's socket close and kills the rank, and what it
    started; torchrun reports the rank as killed by SIGKILL."""
    from nanodist.launch import _AgentServer
    if not _AgentServer.enabled():
        pytest.skip("warm ranks need Linux (and NANODIST_WARM_AGENT unset)")
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    errors = []

    def run():
        try:
            nd.launch(SCRIPTS / "hang.py", nproc=2, timeout=120, echo=False, env={"PID_DIR": str(pid_dir)})
        except nd.LaunchError as e:
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    pids = wait_for_pid_files(pid_dir, 2)
    rank1 = [int(p) for p in (pid_dir / "1.pids").read_text().split()]
    stand_ins = [p for p in psutil.process_iter(["cmdline"])
                 if any(a.endswith("rank_client.py") for a in p.info["cmdline"] or [])
                 and p.environ().get("RANK") == "1" and str(pid_dir) == p.environ().get("PID_DIR")]
    assert len(stand_ins) == 1 and stand_ins[0].pid not in pids
    stand_ins[0].kill()
    thread.join(timeout=60)
    assert not thread.is_alive() and errors and errors[0].rank == 1 and errors[0].returncode == -9
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    assert [p for p in pids + rank1 if alive(p)] == []
