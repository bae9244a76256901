"""nanodist.parallel.clip_grad_norm_: the global norm of gradients that are DTensors of any placement (Shard(0),
Shard(1), Replicate, on a 1-D and a 2-D mesh) mixed with plain ones -- what tensor parallelism beside replicated
layers needs, and torch's clip_grad_norm_ refuses -- equal to the norm of the whole gradients, at world sizes 1, 2
and 4 (a 2 x 2 mesh); clipping scales every shard alike; a planted 1.001 on one rank's shard is caught."""
import math

import pytest
import torch

from nanodist.testing import spawn

pytestmark = [pytest.mark.dist, pytest.mark.numerical]  # fp32 sums in another order: the second kernel path too
# fp32 sums of squares taken in another order (per shard, then across ranks): ~1e-7 relative here; 1e-5 leaves a
# margin of 100, and one rank's shard scaled by 1.001 moves the norm by 1e-4 or more (the planted case below)
TOL = 1e-5
SHAPES = [(8, 6), (6, 4), (12,), (5, 3)]


def _whole(device="cpu"):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(s, generator=g).to(device) for s in SHAPES]


def norm_worker(rank, W, planted=False, device="cpu"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from nanodist.parallel import clip_grad_norm_
    from nanodist.state import full_tensor
    whole = _whole(device)
    want = float(torch.linalg.vector_norm(torch.cat([w.reshape(-1) for w in whole])))
    if W == 4:
        mesh = init_device_mesh(device, (2, 2), mesh_dim_names=("data", "tensor"))
        layouts = [(mesh, [Replicate(), Shard(0)]), (mesh, [Shard(0), Shard(1)]), (None, None),
                   (mesh["tensor"], [Shard(1)])]
    else:
        mesh = init_device_mesh(device, (W,), mesh_dim_names=("tensor",))
        layouts = [(mesh, [Shard(0)]), (mesh, [Shard(1)]), (None, None), (mesh, [Replicate()])]

    def dt(t, m, placements):  # every rank holds the whole value: each keeps its own shard, nothing is scattered
        return distribute_tensor(t, m, placements, src_data_rank=None)

    def params():
        out = []
        for w, (m, placements) in zip(whole, layouts):
            p = torch.nn.Parameter(torch.zeros_like(w) if m is None else dt(torch.zeros_like(w), m, placements))
            p.grad = w.clone() if m is None else dt(w.clone(), m, placements)
            out.append(p)
        return out

    ps = params()
    if planted and rank == 1:
        ps[0].grad.to_local().mul_(1.001)  # one rank's shard of a sharded gradient, 0.1 % too large
    got = float(clip_grad_norm_(ps, math.inf))
    out = {"want": want, "got": got}
    if planted:
        return out
    ps = params()  # clipping to half the norm scales every shard and every plain gradient by one half
    clip_grad_norm_(ps, want / 2)
    full = [full_tensor(p.grad) for p in ps]
    out["clipped"] = max(float((f - w * (want / 2) / (want + 1e-6)).abs().max()) for f, w in zip(full, whole))
    try:
        flat = mesh if W != 4 else mesh["tensor"]
        bad = torch.nn.Parameter(dt(torch.zeros(4, device=device), flat, [Replicate()]))
        bad.grad = DTensor.from_local(torch.ones(4, device=device), flat, [Partial()])  # each rank's addend of a pending sum
        clip_grad_norm_([bad], 1.0)
        out["partial"] = "accepted"
    except ValueError as e:
        out["partial"] = str(e)
    return out


@pytest.mark.parametrize("W", [1, 2, 4])
def test_the_norm_of_sharded_replicated_and_plain_gradients_is_the_whole_gradients_norm(W):
    for r, out in enumerate(spawn(norm_worker, W, timeout=120)):
        assert abs(out["got"] - out["want"]) <= TOL * out["want"], (W, r, out)
        assert out["clipped"] <= 1e-6, (W, r, out)  # every piece scaled alike, to the half norm
        assert "pending sum (Partial): redistribute" in out["partial"], out


def test_a_planted_error_on_one_ranks_shard_is_caught():
    outs = spawn(norm_worker, 2, kwargs={"planted": True}, timeout=120)
    assert all(abs(o["got"] - o["want"]) > 10 * TOL * o["want"] for o in outs), outs


def missing_worker(rank, W):
    """Rank 1 has no gradients at all (a user's bug, or a step where its copy of a layer went unused): the norm's
    collectives follow the parameters, so it still joins them and nobody hangs; its missing pieces count as zeros."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from nanodist.parallel import clip_grad_norm_
    mesh = init_device_mesh("cpu", (W,), mesh_dim_names=("tensor",))
    whole = _whole()[0]
    p = torch.nn.Parameter(distribute_tensor(torch.zeros_like(whole), mesh, [Shard(0)], src_data_rank=None))
    if rank == 0:
        p.grad = distribute_tensor(whole.clone(), mesh, [Shard(0)], src_data_rank=None)
    return float(clip_grad_norm_([p], math.inf)), float(whole.chunk(W)[0].norm())


def test_a_rank_without_gradients_still_joins_the_norms_collectives():
    outs = spawn(missing_worker, 2, timeout=60)
    for got, rank0_piece in outs:
        assert abs(got - rank0_piece) <= TOL * rank0_piece, outs  # the same on both ranks: rank 0's piece alone


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("W", [1, 2])
def test_the_norm_of_gradients_on_the_gpu(W, monkeypatch):
    """CUDA DTensors: a world of one on nccl, and two ranks sharing the GPU through gloo (the shards' squares go
    through the host)."""
    monkeypatch.setenv("NANODIST_DEVICE", "cuda")
    for r, out in enumerate(spawn(norm_worker, W, kwargs={"device": "cuda"}, backend="nccl" if W == 1 else "gloo",
                                  timeout=300)):
        assert abs(out["got"] - out["want"]) <= TOL * out["want"], (W, r, out)
        assert out["clipped"] <= 1e-6, (W, r, out)
        assert "pending sum (Partial): redistribute" in out["partial"], out
