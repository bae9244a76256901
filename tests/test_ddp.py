"""nanodist.DDP proven equal to torch's DistributedDataParallel and to one process training on the whole batch."""
import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import nanodist as nd
from nanodist.ddp import NaiveDDP
from nanodist import faults
from nanodist.testing import LogLines, spawn, within

pytestmark = pytest.mark.dist


class Net(nn.Module):
    """Has a frozen layer and a layer forward never uses: the two awkward cases for DDP."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.frozen = nn.Linear(32, 32)
        self.frozen.requires_grad_(False)
        self.hidden = nn.Linear(32, 32)
        self.out = nn.Linear(32, 3)
        self.unused = nn.Linear(3, 3)

    def forward(self, x, use_unused=False):
        h = torch.relu(self.inp(x))
        h = torch.relu(self.hidden(torch.relu(self.frozen(h))))
        return self.unused(self.out(h)) if use_unused else self.out(h)


def batch(rank, n=6, step=0):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def grads(model):
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}


def same_grads(a, b, label="gradients"):
    """Gradients equal up to rounding. Where both sides sum the same gradients over ranks (ours and torch DDP), the
    difference is at most the scaling's rounding; where one process sums the whole batch (N x b vs 1 x Nb), the batch
    sum is split in N parts: a few fp32 roundings of values of O(1), far below 1e-6, while the planted error (one
    rank's gradient x 1.001) moves values of O(0.1) by 1e-4 / N."""
    assert a.keys() == b.keys()
    for n in a:
        assert (a[n] is None) == (b[n] is None), f"{n}: one gradient is None"
    got = torch.cat([a[n].flatten() for n in a if a[n] is not None])
    want = torch.cat([b[n].flatten() for n in a if b[n] is not None])  # a's order for both
    within(f"DDP {label}", got, want, 1e-6, "a few fp32 roundings of O(1) values (absolute below 1)", abs_floor=1.0)


def loss_of(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def parity_worker(rank, world, shared_memory=False):
    results = {}
    torch.manual_seed(0)
    base = Net()
    ours = nd.DDP(_copy(base), bucket_cap_mb=0.004, find_unused_parameters=True,  # ~1 KB buckets: several
                  shared_memory=shared_memory)
    results["shared_memory"] = ours.shared_memory
    theirs = TorchDDP(_copy(base), bucket_cap_mb=0.004, find_unused_parameters=True)
    naive = NaiveDDP(_copy(base))
    results["buckets"] = len(ours.buckets)

    for step in range(3):  # several steps: after the first, grads live in the bucket buffers
        x, y = batch(rank, step=step)
        for m in (ours, theirs, naive):
            m.zero_grad(set_to_none=step % 2 == 0)
            loss_of(m, x, y).backward()
        same_grads(grads(ours.module), grads(theirs.module), "gradients, ours vs torch DDP")
        g_naive = grads(naive.module)
        same_grads({k: v for k, v in g_naive.items() if k.startswith(("inp", "hidden", "out"))},
                   {k: v for k, v in grads(ours.module).items() if k.startswith(("inp", "hidden", "out"))})
    assert ours.module.unused.weight.grad is None and ours.module.frozen.weight.grad is None

    # N ranks x b samples == 1 process x N*b samples
    xs, ys = zip(*(batch(r, step=2) for r in range(world)))
    single = _copy(base)
    loss_of(single, torch.cat(xs), torch.cat(ys)).backward()
    same_grads({k: v for k, v in grads(single).items()}, grads(ours.module), "gradients, N x b vs 1 x Nb")
    # the same comparison fails the planted error: rank 0's gradient 1.001 x too large
    planted = nd.DDP(_copy(base), bucket_cap_mb=0.004, find_unused_parameters=True, shared_memory=shared_memory)
    faults.scale_grad(loss_of(planted, *batch(rank, step=2)), rank=0).backward()
    try:
        same_grads(grads(single), grads(planted.module), "planted error (must fail), N x b vs 1 x Nb")
        results["planted_caught"] = False
    except AssertionError as e:
        results["planted_caught"] = "beyond the tolerance" in str(e)

    # gradient accumulation: two micro-batches, the first under no_sync, equal torch DDP's
    for m in (ours, theirs):
        m.zero_grad()
        with m.no_sync():
            loss_of(m, *batch(rank, step=5)).backward()
        loss_of(m, *batch(rank, step=6)).backward()
    same_grads(grads(ours.module), grads(theirs.module))
    results["ok"] = True
    return results


def _copy(model):
    import copy
    return copy.deepcopy(model)


@pytest.mark.numerical
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("shared_memory", [False, True], ids=["process-group", "shared-memory"])
def test_gradients_equal_torch_ddp_and_the_big_batch(world, shared_memory):
    out = spawn(parity_worker, world, kwargs={"shared_memory": shared_memory}, timeout=120)
    assert all(o["ok"] for o in out)
    assert all(o["planted_caught"] for o in out)
    assert all(o["shared_memory"] == (shared_memory and world > 1) for o in out)
    assert out[0]["buckets"] >= 3


def errors_worker(rank, world):
    found = {}
    torch.manual_seed(rank)  # deliberately different init on each rank
    model = Net()
    with LogLines() as log:
        ddp = nd.DDP(model)  # must broadcast rank 0's weights and say which differed
    found["mismatched"], found["warned"] = ddp.mismatched_at_wrap, log.lines
    try:
        nd.check.assert_params_in_sync(ddp.module)
        found["in_sync_after_wrap"] = True
    except AssertionError:
        found["in_sync_after_wrap"] = False
    try:
        loss_of(ddp, *batch(rank)).backward()
    except RuntimeError as e:
        found["unused_error"] = str(e)
    # a parameter unused on one rank only, with find_unused_parameters: averaged with that rank's zeros
    torch.manual_seed(0)
    ref = Net()
    a = nd.DDP(_copy(ref), find_unused_parameters=True)
    b = TorchDDP(_copy(ref), find_unused_parameters=True)
    for m in (a, b):
        x, y = batch(rank)
        nn.functional.cross_entropy(m(x, use_unused=rank == 0), y).backward()  # only rank 0 uses `unused`
    same_grads(grads(a.module), grads(b.module))
    # different architectures on different ranks: a clear error, not a hang
    other = nn.Linear(4, 4) if rank == 0 else nn.Linear(4, 5)
    try:
        nd.DDP(other)
    except ValueError as e:
        found["structure_error"] = str(e)
    try:
        nd.DDP(nn.Sequential(nn.Embedding(10, 4, sparse=True)))
    except ValueError as e:
        found["sparse_error"] = str(e)
    return found


def test_errors_are_clear_and_disagreeing_ranks_are_reported():
    out = spawn(errors_worker, 2, timeout=120)
    for found in out:
        assert "inp.weight" in found["mismatched"] and found["in_sync_after_wrap"]
        assert [line for line in found["warned"] if line.startswith("DDP: ranks started with different values")
                and "inp.weight" in line and "Seed model init identically" in line], found["warned"]
        assert "got no gradient this step, on this rank: unused.weight, unused.bias" in found["unused_error"]
        assert "find_unused_parameters=True" in found["unused_error"]
        assert "ranks wrap different models" in found["structure_error"]
        assert "rank 0 has ('weight', (4, 4)" in found["structure_error"]
        assert "sparse gradients, and 0 produce them" in found["sparse_error"]


def timeline_worker(rank, world):
    torch.manual_seed(0)
    net = Net()
    net.unused.requires_grad_(False)
    model = nd.DDP(net, bucket_cap_mb=0.004, first_bucket_cap_mb=0.004, record_timeline=True)
    for step in range(2):
        model.zero_grad()
        loss_of(model, *batch(rank, step=step)).backward()
    return model.timeline, len(model.buckets)


def test_buckets_are_launched_while_backward_is_still_running():
    timeline, n = spawn(timeline_worker, 2, timeout=60)[0]
    assert n >= 3 and len(timeline) == 2 * n
    assert [t["bucket"] for t in timeline] == list(range(n)) * 2
    for t in timeline:
        assert 0 <= t["launch_s"] <= t["done_s"] <= t["synced_s"] + 1e-3
        assert t["autograd_end_s"] <= t["synced_s"]
    for step in (timeline[:n], timeline[n:]):
        # overlap: each bucket goes out as soon as its gradients are ready, before autograd has finished,
        # one after another (a DDP that launched everything at the end of backward would fail both)
        assert all(t["launch_s"] < t["autograd_end_s"] for t in step)
        assert [t["launch_s"] for t in step] == sorted(t["launch_s"] for t in step)
        assert step[0]["launch_s"] < step[-1]["launch_s"]


def default_path_worker(rank, world):
    """The default DDP (no find_unused_parameters) against torch's default DDP, and every rank raising together."""
    torch.manual_seed(0)
    net = Net()
    net.unused.requires_grad_(False)
    ours, theirs = nd.DDP(_copy(net), bucket_cap_mb=0.004), TorchDDP(_copy(net), bucket_cap_mb=0.004)
    for step in range(2):
        for m in (ours, theirs):
            m.zero_grad()
            loss_of(m, *batch(rank, step=step)).backward()
        same_grads(grads(ours.module), grads(theirs.module))
    # a parameter unused on rank 1 only: both ranks must raise (rank 0 alone would walk into a hang)
    torch.manual_seed(0)
    ddp = nd.DDP(Net())
    try:
        loss_of_unused = nn.functional.cross_entropy(ddp(batch(rank)[0], use_unused=rank == 0), batch(rank)[1])
        loss_of_unused.backward()
        return "no error"
    except RuntimeError as e:
        message = str(e)
    # after the error the wrapper is usable again
    ddp2 = nd.DDP(net)
    loss_of(ddp2, *batch(rank)).backward()
    return message


@pytest.mark.parametrize("world", [2, 3])
def test_default_ddp_equals_torch_and_missing_gradients_raise_on_every_rank(world):
    messages = spawn(default_path_worker, world, timeout=120)
    assert "on this rank: unused.weight, unused.bias" in messages[1]
    assert "on another rank (this rank had every gradient)" in messages[0]
    assert all("find_unused_parameters=True" in m for m in messages)


def alone_worker(rank, world):
    """A world of one: DDP's gradients are the plain model's, bit for bit, left in p.grad (no bucket buffer, no copy),
    through no_sync accumulation too; the hooks still run bucket by bucket; a parameter without a gradient still
    raises, at once."""
    torch.manual_seed(0)
    net = Net()
    net.unused.requires_grad_(False)
    ours, plain = nd.DDP(_copy(net), bucket_cap_mb=0.004, record_timeline=True), _copy(net)
    out = {"buffers": [sorted(b.extra) for b in ours.buckets], "buckets": len(ours.buckets)}
    for step in range(3):
        for m in (ours, plain):
            m.zero_grad(set_to_none=True)
            with ours.no_sync() if m is ours else contextlib.nullcontext():
                loss_of(m, *batch(rank, step=step)).backward()  # accumulated, then the synchronising backward
            loss_of(m, *batch(rank, step=step + 10)).backward()
        out.setdefault("unequal", []).extend(
            n for (n, a), b in zip(ours.module.named_parameters(), plain.parameters())
            if (a.grad is None) != (b.grad is None) or (a.grad is not None and not torch.equal(a.grad, b.grad)))
        out.setdefault("views", []).extend(n for n, q in ours.module.named_parameters()
                                           if q.grad is not None and q.grad._base is not None)
    out["launched"] = len(ours.timeline)
    ddp = nd.DDP(Net())
    try:
        loss_of(ddp, *batch(rank)).backward()
        out["error"] = "no error"
    except RuntimeError as e:
        out["error"] = str(e)
    return out


def test_a_world_of_one_leaves_the_gradients_where_backward_put_them():
    out = spawn(alone_worker, 1, timeout=60)[0]
    assert out["buckets"] > 1 and all(keys == ["what"] for keys in out["buffers"]), out  # no buffer allocated
    assert out["unequal"] == [] and out["views"] == [], out
    assert out["launched"] == 3 * out["buckets"], out  # once per synchronising backward, never under no_sync
    assert "no gradient this step, on this rank: unused.weight, unused.bias" in out["error"], out


def test_pack_buckets_respects_caps_dtype_and_device():
    from nanodist.ddp import pack_buckets
    ts = [torch.zeros(4), torch.zeros(4), torch.zeros(4, dtype=torch.float64), torch.zeros(100), torch.zeros(1)]
    assert pack_buckets(ts, cap_bytes=32) == [[0, 1], [2], [3], [4]]  # dtype change splits; 400 B alone
    assert pack_buckets(ts, cap_bytes=32, first_cap_bytes=16) == [[0], [1], [2], [3], [4]]
    assert pack_buckets(ts, cap_bytes=10_000) == [[0, 1], [2], [3, 4]]
    assert pack_buckets([], cap_bytes=32) == []


def bitwise_worker(rank, world):
    from nanodist.model import GPT, GPTConfig
    torch.manual_seed(0)
    cfg = GPTConfig.preset("tiny", vocab_size=50, block_size=16)
    a, b = GPT(cfg), GPT(cfg)
    b.load_state_dict(a.state_dict())
    ours, theirs = nd.DDP(a), TorchDDP(b)
    g = torch.Generator().manual_seed(rank)
    unequal = []
    for step in range(3):
        x, y = torch.randint(0, 50, (4, 16), generator=g), torch.randint(0, 50, (4, 16), generator=g)
        ours(x, y)[1].backward()
        theirs(x, y)[1].backward()
        unequal.append([n for (n, p), q in zip(a.named_parameters(), b.parameters()) if not torch.equal(p.grad, q.grad)])
        a.zero_grad(), b.zero_grad()
    return unequal


def test_gradients_are_bit_identical_to_torch_ddp_once_its_buckets_are_rebuilt():
    # torch DDP starts with a 1 MiB first bucket and, after its first backward, rebuilds its buckets at the full
    # cap: from then on both reduce the same flat buffer with the same arithmetic (x 1/N, then SUM), so even at
    # W = 3, where rounding depends on the order of the sum, every gradient is equal bit for bit.
    for unequal in spawn(bitwise_worker, 3, timeout=120):
        assert unequal[1] == [] and unequal[2] == [], unequal


def drift_worker(rank, world, fault="extra"):
    torch.manual_seed(0)
    model = nd.DDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    try:
        for step in range(4):
            loss = model(x).sum()
            if not (fault == "skip" and step == 1 and rank == 1):  # rank 1 skips one backward, steps anyway
                loss.backward(retain_graph=True)
            if step == 1 and fault == "extra":
                nd.faults.extra_backward(loss, rank=1)  # one backward too many on rank 1 only
            opt.step()
            opt.zero_grad()
        return {"error": None, "step": step}
    except RuntimeError as e:
        return {"error": str(e), "step": step}


@pytest.mark.dist
@pytest.mark.parametrize("fault", ["extra", "skip"])
def test_ranks_whose_step_counts_drift_apart_fail_at_once_and_are_named(fault):
    """A backward without a step, or a step without a backward, on one rank: the next sync pairs gradients of
    different steps, and both ranks raise there, naming where each was (before: gloo's "Connection reset")."""
    outs = spawn(drift_worker, 2, args=(fault,), timeout=60)
    for out in outs:  # both ranks, at the very sync that paired different steps (not at the end of the run)
        assert out["error"] and "averaged gradients from different steps" in out["error"]
        behind, ahead = ("rank 1 after 1", "rank 0 after 2") if fault == "extra" else ("rank 0 after 1", "rank 1 after 2")
        assert behind + " optimizer step(s)" in out["error"] and ahead + " optimizer step(s)" in out["error"], out
    assert [o["step"] for o in outs] == ([2, 1] if fault == "extra" else [1, 2])


def deferred_worker(rank, world, case):
    """DDP(deferred_checks=True), the mode a GPU gets by default: the same gradients, and a fault reported on every
    rank one sync later (or at check_pending())."""
    torch.manual_seed(0)
    net = Net()
    net.unused.requires_grad_(False)
    ours = nd.DDP(_copy(net), bucket_cap_mb=0.004, deferred_checks=True)
    plain = nd.DDP(_copy(net), bucket_cap_mb=0.004, deferred_checks=False)
    for step in range(2):
        for m in (ours, plain):
            m.zero_grad()
            loss_of(m, *batch(rank, step=step)).backward()
        same_grads(grads(ours.module), grads(plain.module))
    ours.check_pending()  # nothing wrong so far
    torch.manual_seed(0)
    ddp = nd.DDP(Net(), deferred_checks=True)
    x, y = batch(rank)
    nn.functional.cross_entropy(ddp(x, use_unused=rank == 0), y).backward()  # rank 1 misses `unused`
    if case == "check_pending":
        try:
            ddp.check_pending()
        except RuntimeError as e:
            return {"at": "check_pending", "error": str(e)}
        return {"at": None, "error": None}
    try:
        nn.functional.cross_entropy(ddp(x), y).backward()  # the next sync reads the previous one's check
    except RuntimeError as e:
        return {"at": "next sync", "error": str(e)}
    return {"at": None, "error": None}


@pytest.mark.dist
@pytest.mark.parametrize("world,case", [(2, "next sync"), (3, "check_pending")])
def test_deferred_checks_equal_the_immediate_ones_and_report_a_step_late(world, case):
    outs = spawn(deferred_worker, world, args=(case,), timeout=120)
    for rank, out in enumerate(outs):  # every rank raises, at the same point
        assert out["at"] == case, out
        assert "got no gradient the previous step" in out["error"]
        assert ("on this rank: unused.weight, unused.bias" if rank != 0 else "on another rank") in out["error"]


def _sync_free_step_worker(rank, world):
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    model = nd.DDP(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).cuda())
    assert model.deferred_checks, "on a GPU the per-step check is read a step late"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x = torch.randn(32, 64, device="cuda")
    for step in range(3):
        if step == 1:
            torch.cuda.set_sync_debug_mode("error")  # from here, any hidden host-device sync raises
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.set_sync_debug_mode("default")
    model.check_pending()
    return True


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_ddp_step_on_a_gpu_never_waits_for_the_device():
    assert spawn(_sync_free_step_worker, 1, backend="nccl", timeout=120) == [True]
