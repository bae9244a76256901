"""nanodist.Group answers rank, size, backend, device and members once; Mesh arranges the world in 2-D."""
import pytest
import torch
import torch.distributed as dist

import nanodist as nd
from nanodist.group import Group
from nanodist.testing import spawn


def describe(g: Group) -> dict:
    return {"rank": g.rank, "size": g.size, "backend": g.backend, "device": str(g.device),
            "comm_device": str(g.comm_device), "ranks": list(g.ranks), "is_main": g.is_main}


def check_world_and_subgroups(rank, W):
    out = {"world": describe(Group.world()), "same_object": Group.world() is Group.resolve(None)}
    out["info_group"] = nd.dist_info().group is Group.world()
    odd = dist.new_group([r for r in range(W) if r % 2 == 1])  # every rank calls new_group
    if rank % 2 == 1:
        g = Group.resolve(odd)
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=g.pg)
        out["odd"] = {**describe(g), "sum": t.item(), "gathered": g.all_gather_object(rank)}
    else:
        try:
            Group.of(odd)
            out["odd"] = "no error"
        except ValueError as e:
            out["odd"] = str(e)
    out["local"] = describe(Group.local())
    return out


def check_mesh(rank, W):
    mesh = Group.world().mesh({"data": 2, "shard": 2})
    out = {"coordinate": mesh.coordinate, "repr": repr(mesh)}
    for name in ("data", "shard"):
        g = mesh[name]
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=g.pg)
        out[name] = {**describe(g), "sum": t.item()}
    out["device_mesh"] = (tuple(mesh.device_mesh.shape), mesh.device_mesh.mesh_dim_names)
    for bad in ({"data": 3, "shard": 2}, {"data": 0, "shard": 4}):
        try:
            Group.world().mesh(bad)
        except ValueError as e:
            out.setdefault("errors", []).append(str(e))
    try:
        mesh["tensor"]
    except KeyError as e:
        out["key_error"] = str(e)
    one_d = Group.resolve(Group.world().device_mesh)
    out["from_device_mesh"] = describe(one_d)
    return out


@pytest.mark.dist
@pytest.mark.parametrize("W", [2, 3])
def test_world_and_subgroups(W):
    outs = spawn(check_world_and_subgroups, W, timeout=120)
    for r, out in enumerate(outs):
        assert out["world"] == {"rank": r, "size": W, "backend": "gloo", "device": "cpu", "comm_device": "cpu",
                                "ranks": list(range(W)), "is_main": r == 0}
        assert out["same_object"] and out["info_group"]
        assert out["local"]["size"] == 1 and out["local"]["ranks"] == [r] and out["local"]["backend"] == "local"
        odd = [q for q in range(W) if q % 2 == 1]
        if r % 2 == 1:
            assert out["odd"]["ranks"] == odd and out["odd"]["rank"] == odd.index(r)
            assert out["odd"]["size"] == len(odd) and out["odd"]["sum"] == sum(odd)
            assert out["odd"]["gathered"] == odd
        else:
            assert f"global rank {r}) is not a member" in out["odd"]


@pytest.mark.dist
def test_a_two_by_two_mesh():
    outs = spawn(check_mesh, 4, timeout=120)
    for r, out in enumerate(outs):
        data_rank, shard_rank = divmod(r, 2)  # row-major: the last dimension varies fastest
        assert out["coordinate"] == {"data": data_rank, "shard": shard_rank}
        assert out["shard"]["ranks"] == [2 * data_rank, 2 * data_rank + 1]
        assert out["data"]["ranks"] == [shard_rank, shard_rank + 2]
        assert out["shard"]["sum"] == sum(out["shard"]["ranks"]) and out["data"]["sum"] == sum(out["data"]["ranks"])
        assert out["device_mesh"] == ((2, 2), ("data", "shard"))
        assert any("2 x 2" not in e and "3 x 2 = 6 ranks does not fit a world of 4" in e for e in out["errors"])
        assert any("positive integers" in e for e in out["errors"])
        assert "not 'tensor'" in out["key_error"]
        assert out["from_device_mesh"]["ranks"] == [0, 1, 2, 3]


def test_without_a_process_group_it_is_a_world_of_one():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is active in this test process")
    g = Group.world()
    assert (g.rank, g.size, g.backend, g.ranks, str(g.device)) == (0, 1, "local", (0,), "cpu")
    assert Group.resolve(None).size == 1 and Group.resolve(g) is g
    with pytest.raises(TypeError, match="group must be None"):
        Group.resolve("world")
