"""nanodist.shm: the shared-memory all-reduce equals torch's, leaves no file behind, and refuses what it cannot do."""
import glob
import os
import socket

import pytest
import torch
import torch.distributed as dist

import nanodist as nd
from nanodist.shm import SharedMemoryAllReduce, _shm_dir
from nanodist.testing import spawn

pytestmark = pytest.mark.dist


def ours_files():
    return set(glob.glob(os.path.join(_shm_dir(), "nanodist-shm-*")))


def equal_worker(rank, world):
    out = {}
    for dtype, n in ((torch.float32, 1), (torch.float32, 1001), (torch.float64, 7), (torch.int64, 10)):
        g = torch.Generator().manual_seed(rank)
        t = (torch.randn(n, generator=g) * 100).to(dtype)
        reducer = SharedMemoryAllReduce(n, dtype)
        for step in range(3):  # reused: each call must see this call's values, not the last one's
            x = t + step
            ref = x.clone()
            dist.all_reduce(ref)
            got = reducer.all_reduce_(x.clone())
            # the ranks' values (O(100)) summed in another order than gloo's: fp32 roundings of O(100) sums
            # (1e-4 absolute is a few ulps of 100); integers are exact
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4 if dtype.is_floating_point else 0)
    # non-contiguous input, in place; and scale (1/N makes the average)
    m = torch.arange(12.0).view(3, 4).t() + rank
    reducer = SharedMemoryAllReduce(12)
    ref = m.clone()
    dist.all_reduce(ref)
    reducer.all_reduce_(m)
    torch.testing.assert_close(m, ref)
    avg = reducer.all_reduce_(torch.full((12,), float(rank)), scale=1 / world)
    torch.testing.assert_close(avg, torch.full((12,), (world - 1) / 2))
    try:
        reducer.all_reduce_(torch.zeros(5))
    except ValueError as e:
        out["error"] = str(e)
    # reduce-scatter and all-gather (ZeRO's two halves), with and without the closing barrier
    m = 5
    rs = SharedMemoryAllReduce(world * m)
    for step, fence in enumerate((True, False, True)):
        x = torch.arange(world * m, dtype=torch.float32) * (rank + 1) + step
        ref = torch.empty(m)
        dist.reduce_scatter_tensor(ref, x.clone())
        rs.mine.copy_(x)
        got = rs.reduce_scatter_(torch.empty(m), fence=fence)
        torch.testing.assert_close(got, ref)
        mine = torch.full((m,), float(rank * 10 + step))
        ref_all = torch.empty(world * m)
        dist.all_gather_into_tensor(ref_all, mine)
        seen = []
        rs.all_gather_(mine, lambda rows: seen.append(rows.reshape(-1).clone()), fence=fence)
        torch.testing.assert_close(seen[0], ref_all)
    try:
        rs.reduce_scatter_(torch.empty(m + 1))
    except ValueError as e:
        out["rs_error"] = str(e)
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_equals_torch_all_reduce_and_leaves_no_file(world):
    before = ours_files()
    out = spawn(equal_worker, world, timeout=120)
    assert all("sums 12 torch.float32 elements on the CPU, got 5" in o["error"] for o in out)
    assert all(f"{world} chunks of 5; got an output of 6" in o["rs_error"] for o in out)
    assert ours_files() <= before  # every file was unlinked once mapped


def other_host_worker(rank, world):
    socket.gethostname = lambda: f"host{rank}"  # pretend each rank runs on its own machine
    from torch import nn
    ddp = nd.DDP(nn.Linear(4, 4), shared_memory=True)
    try:
        SharedMemoryAllReduce(4)
    except ValueError as e:
        return ddp.shared_memory, str(e)


def test_ranks_on_different_machines_fall_back_to_the_process_group():
    for used, message in spawn(other_host_worker, 2, timeout=120):
        assert used is False
        assert "every rank on one machine" in message and "host0" in message and "host1" in message
