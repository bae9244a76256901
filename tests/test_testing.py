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
