"""The divergence detector (nanodist.diverge): ranks that stop doing the same thing get an error naming the rank
and what differed within seconds -- for DDP, ZeRO and FSDP alike, the faulty rank chosen at random -- and ranks
that are merely slow are never stopped."""
import os
import random
import re
import time

import pytest
import torch

import nanodist as nd
from nanodist import diverge, parity
from nanodist.ddp import DDP
from nanodist.fsdp import FSDP
from nanodist.optim import DistAdamW
from nanodist.sync import all_reduce_sum
from nanodist.testing import WorkerError, spawn

pytestmark = pytest.mark.dist
WITHIN_S = 10  # the promise: an error within 10 s of the divergence


def _build(model, wrapper):
    if wrapper == "ddp":
        return DDP(model, find_unused_parameters=True), torch.optim.AdamW(model.parameters(), lr=1e-2)
    if wrapper == "zero2":
        return model, DistAdamW(model.parameters(), lr=1e-2, bucket_cap_mb=0.0001)
    for block in model.blocks:
        block.requires_grad_(True)
    fsdp = FSDP(model, units=list(model.blocks))
    return fsdp, torch.optim.AdamW(fsdp.parameters(), lr=1e-2)


def fault_worker(rank, W, bad, fault):
    if fault != "skip-unit":  # the default stall (3 s) is what skip-unit checks; the others wait 1 s, to be quick
        os.environ["NANODIST_STALL_S"] = "1"
    model = parity.UserModel(layers=3)
    m, opt = _build(model, "zero2" if fault == "extra-backward" else "fsdp")
    if rank == bad and fault == "skip-unit":
        model.blocks[1].forward = lambda h: h  # called, but its parameters take no part on this rank
    if rank == bad and fault == "unit-order":
        model.blocks[1], model.blocks[2] = model.blocks[2], model.blocks[1]
    for step in range(3):
        x, y = parity.batch(step, rank, W)
        m(x, y)[1].backward()
        if rank == bad and fault == "extra-backward":
            m(x, y)[1].backward()  # a backward without a step
        opt.step()
        opt.zero_grad()
    return "finished"


EXPECT = {"skip-unit": "unit blocks.1 got no gradient in its backward",
          "unit-order": "its forward ran units blocks.0, blocks.2, blocks.1",
          "extra-backward": "again before a step (a backward without a step)"}


@pytest.mark.parametrize("fault,W", [("skip-unit", 2), ("skip-unit", 3), ("unit-order", 3), ("extra-backward", 3)])
def test_a_rank_that_hangs_the_others_is_named_within_seconds(fault, W):
    """The collectives part and the ranks wait in different ones: before, FSDP waited the whole collective timeout
    (300 s) in silence. Now the watchdog reports each rank's collective, what it noted and where it is."""
    bad = random.randrange(W)
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as e:
        spawn(fault_worker, W, args=(bad, fault), timeout=60)
    took = time.monotonic() - t0
    msg = str(e.value)
    assert "the ranks diverged" in msg, msg
    assert re.search(rf"rank {bad}: waits in collective #\d+ [^\n]* for \d+ s; [^\n]*{re.escape(EXPECT[fault])}",
                     msg), msg
    waited = [int(s) for s in re.findall(r"for (\d+) s;", msg)]
    # the promise is `waited`; `took` adds starting W ranks on 2 cores (a few seconds, more on a loaded machine)
    assert waited and max(waited) <= WITHIN_S and took < WITHIN_S + 30, (waited, took)


def silent_worker(rank, W, bad, wrapper):
    """One rank runs another collective of the same size: the pair completes (gloo cannot tell), and nothing
    would hang. The step's agreement sees the digests differ."""
    model = parity.UserModel(layers=3)
    m, opt = _build(model, wrapper)
    group = nd.Group.world()
    for step in range(2):
        x, y = parity.batch(step, rank, W)
        if step == 1:
            what = "an all-reduce only this rank runs" if rank == bad else "the all-reduce the others run"
            all_reduce_sum(torch.ones(3), group, what).wait()
        try:
            m(x, y)[1].backward()
            opt.step()
        except diverge.DivergenceError as err:
            return step, str(err)
        opt.zero_grad()
    return None


@pytest.mark.parametrize("wrapper", ["ddp", "zero2", "fsdp"])
def test_a_silent_divergence_is_named_at_the_steps_agreement(wrapper):
    W, bad = 3, random.randrange(3)
    for step, msg in spawn(silent_worker, W, args=(bad, wrapper), timeout=60):
        assert step == 1  # at the step of the divergence, on every rank
        assert f"rank {bad} ran 'an all-reduce only this rank runs', while ranks" in msg, msg
        assert "did not issue the same collectives" in msg


def slow_worker(rank, W):
    import io
    import sys
    os.environ["NANODIST_STALL_S"] = "1"
    sys.stderr = said = io.StringIO()  # what the watchdog prints
    model = parity.UserModel(layers=2)
    m, opt = _build(model, "ddp")
    for step in range(2):
        if rank == 0 and step == 1:
            time.sleep(3.5)  # a long save on rank 0: the others wait in the next collective, three stalls long
        x, y = parity.batch(step, rank, W)
        m(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
    return said.getvalue()


def test_a_slow_rank_is_not_a_divergence():
    said = spawn(slow_worker, 2, timeout=60)[1]  # it finished: no rank was stopped
    assert "[rank 1] nanodist: waited" in said and "rank 0 is not in a collective" in said, said  # but it said so


def test_tracking_keeps_a_bounded_record():
    """What every collective leaves behind: a count, a digest and the last HISTORY descriptions (lab03 prints what
    the bookkeeping costs as a share of its step)."""
    t = diverge.Tracker(nd.Group(rank=0, size=2, backend="gloo", ranks=(0, 1)))
    for i in range(200):
        t.issue(f"collective {i % 3}")
    assert t.seq == 200 and len(t.history) == diverge.HISTORY and t.entries()[-1] == (200, "collective 1")
    assert 0 < t.digest < diverge.MOD and diverge.tracking_cost_s(100) > 0
