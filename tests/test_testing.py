"""nanodist.testing.spawn: values back by rank, a failing rank's traceback, a hang turned into a timeout."""
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from nanodist.testing import WorkerError, spawn

pytestmark = pytest.mark.dist


def sum_of_ranks(rank, world, n):
    t = torch.full((n,), float(rank))
    dist.all_reduce(t)
    return {"sum": t, "big": torch.arange(100_000) * rank}  # tensors come back by value


def one_rank_raises(rank, world):
    if rank == 1:
        raise KeyError("rank one has no such key")
    dist.barrier()


def one_rank_hangs(rank, world):
    if rank == 0:
        dist.barrier()  # rank 1 never joins
    else:
        time.sleep(60)


def test_values_come_back_by_rank():
    out = spawn(sum_of_ranks, 3, args=(2,), timeout=60)
    assert [o["sum"].tolist() for o in out] == [[3.0, 3.0]] * 3
    assert int(out[2]["big"][-1]) == 2 * 99_999


def test_a_failing_rank_is_named_with_its_traceback():
    with pytest.raises(WorkerError) as e:
        spawn(one_rank_raises, 2, timeout=60)
    assert e.value.rank == 1 and "KeyError: 'rank one has no such key'" in e.value.traceback


def test_a_hang_times_out_and_leaves_no_process():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(TimeoutError, match="ranks that never returned"):
        spawn(one_rank_hangs, 2, timeout=8)
    time.sleep(0.5)
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE]
    assert left == []


def test_run_script_is_python_running_the_file(tmp_path):
    """What a command-line test reads from `python script.py args`: exit code, stdout and stderr, the environment
    it was given, sys.argv -- and a script that raises, exits with a message or runs too long."""
    import subprocess
    from nanodist.testing import run_script
    script = tmp_path / "script.py"
    script.write_text("import os, sys\nprint('out', sys.argv[1:], os.environ.get('GREETING'))\n"
                      "print('err', file=sys.stderr)\n"
                      "if sys.argv[1] == 'raise': raise ValueError('bad value')\n"
                      "if sys.argv[1] == 'message': sys.exit('a message')\n"
                      "if sys.argv[1] == 'sleep': import time; time.sleep(60)\n"
                      "sys.exit(int(sys.argv[1]))\n")
    ok = run_script(script, ["3"], env={"GREETING": "hi", "PATH": "/usr/bin"})
    assert (ok.returncode, ok.stdout, ok.stderr) == (3, "out ['3'] hi\n", "err\n")
    raised = run_script(script, ["raise"])
    assert raised.returncode == 1 and "ValueError: bad value" in raised.stderr and "Traceback" in raised.stderr
    said = run_script(script, ["message"])
    assert said.returncode == 1 and said.stderr.endswith("a message\n")
    with pytest.raises(subprocess.TimeoutExpired):
        run_script(script, ["sleep"], timeout=2)
