"""Who am I in this set of ranks? The one object every nanodist module asks.

    g = Group.world()                      # every rank of the run (a world of one without a process group)
    g.rank, g.size, g.backend, g.device    # this process's rank in the group, how many, gloo/nccl, where it computes
    dist.all_reduce(t.to(g.comm_device), group=g.pg)

    mesh = Group.world().mesh({"data": 2, "shard": 2})    # a 2-D mesh of 4 ranks (chapter 5)
    mesh["shard"].size, mesh["data"].rank                 # each dimension is a Group
    mesh.device_mesh                                      # torch's DeviceMesh, for fully_shard and DTensor

Every nanodist function that communicates takes `group=`: None means the world, and a `Group`, a
torch `ProcessGroup` or a 1-D `DeviceMesh` are accepted too (`Group.resolve`). A Group answers,
once, what used to be re-derived in every module: the rank and size within the group, the global
rank of each member (point-to-point calls name peers by global rank), the backend, the device this
process computes on (chosen by `nanodist.init`), and the device a collective's tensors must be on
(`comm_device`: the GPU for nccl, the CPU for gloo).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# The device this process computes on, as nanodist.init() chose it. Without init (another library created the
# process group, or a test), the backend decides: nccl computes on the current GPU, everything else on the CPU.
_world_device: torch.device | None = None
_world_cache: tuple | None = None  # (default process group, its Group): rebuilt when the default group changes


def set_world_device(device: torch.device | None) -> None:
    """Record the device nanodist.init() chose (None forgets it, as nanodist.shutdown() does)."""
    global _world_device, _world_cache
    _world_device = None if device is None else torch.device(device)
    _world_cache = None


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _backend_name(pg) -> str:
    name = str(dist.get_backend(pg)).lower()
    return "nccl" if "nccl" in name else "gloo" if "gloo" in name else name


def _default_device(backend: str) -> torch.device:
    if _world_device is not None:
        return _world_device
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True, eq=False)
class Group:
    """A set of ranks that run collectives together, seen from this process. Immutable.

    rank, size: this process's rank in the group, and the number of ranks in it.
    backend: "gloo" or "nccl"; "local" for a world of one with no process group at all.
    device: where this process computes (its model and batches live there).
    pg: the torch ProcessGroup to pass as `group=` to torch.distributed (None: the default group).
    ranks: the global rank of each member, in group order.
    """

    rank: int = 0
    size: int = 1
    backend: str = "local"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    pg: object = None
    ranks: tuple = (0,)

    # --- what the modules ask -----------------------------------------------------------------------

    @property
    def is_main(self) -> bool:
        """True on the group's rank 0: the rank that logs and writes."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def comm_device(self) -> torch.device:
        """Where a collective's tensors must be: the current GPU for nccl, the CPU otherwise (gloo's P2P and
        most of its collectives take CPU tensors only)."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def global_rank(self, group_rank: int) -> int:
        """The global rank (the number in the logs) of the group's member `group_rank`."""
        return self.ranks[group_rank]

    def all_gather_object(self, obj) -> list:
        """Every member's `obj`, in group order (a list of one in a world of one)."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def broadcast_object(self, obj, src: int = 0):
        """Member `src`'s `obj` on every member (the others' argument is ignored): one decision, shared."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.global_rank(src), group=self.pg)
        return box[0]

    def check_same(self, mine: list, who: str) -> None:
        """Raise the same ValueError on every member unless all pass equal lists (one entry per parameter: name,
        shape, dtype, requires_grad, ...); it names the first difference. Wrappers call it before any collective
        that the difference would hang or corrupt."""
        everyone = self.all_gather_object(mine)
        for r, theirs in enumerate(everyone):
            if theirs != everyone[0]:
                diff = next(((a, b) for a, b in zip(everyone[0], theirs) if a != b), None)
                what = (f"first difference: rank {self.global_rank(0)} has {diff[0]}, rank {self.global_rank(r)} "
                        f"has {diff[1]}" if diff else
                        f"rank {self.global_rank(0)} has {len(everyone[0])} parameters, rank {self.global_rank(r)} "
                        f"has {len(theirs)}")
                raise ValueError(f"{who}: ranks wrap different models ({what}). Build the same model, with the "
                                 f"same frozen parameters, on every rank.")

    @torch.no_grad()
    def broadcast_from_first(self, named: list[tuple[str, torch.Tensor]]) -> list[str]:
        """Give every rank the group's rank 0's values of these tensors (in place); return the names whose values
        differed anywhere before (a float64 sum and sum of squares per tensor, all-gathered, tells who)."""
        if self.size == 1 or not named:
            return []
        through = self.comm_device
        fp = torch.stack([torch.stack([t.double().sum(), t.double().pow(2).sum()]) for _, t in named]).flatten()
        fp = torch.nan_to_num(fp, nan=1.2345e300).to(through)
        every = [torch.empty_like(fp) for _ in range(self.size)]
        dist.all_gather(every, fp, group=self.pg)
        differ = [named[i][0] for i in range(len(named))
                  if any(not torch.equal(a[2 * i:2 * i + 2], every[0][2 * i:2 * i + 2]) for a in every[1:])]
        for _, t in named:
            if t.device == through or through.type != "cpu":
                dist.broadcast(t.data, src=self.global_rank(0), group=self.pg)
            else:  # gloo moves CPU tensors: a GPU tensor goes through a copy
                copy = t.data.to(through)
                dist.broadcast(copy, src=self.global_rank(0), group=self.pg)
                t.data.copy_(copy)
        return differ

    def barrier(self) -> None:
        """Wait until every member gets here (nothing to wait for in a world of one)."""
        if self.size > 1:
            dist.barrier(group=self.pg)

    @property
    def device_mesh(self):
        """torch's 1-D DeviceMesh over this group's ranks (for DTensor and FSDP2), built once per group."""
        pg = self.pg if self.pg is not None else dist.group.WORLD
        key = (id(pg), self.ranks, self.device.type)  # process groups live as long as the run: their ids are stable
        mesh = _meshes.get(key)
        if mesh is None:
            from torch.distributed.device_mesh import DeviceMesh
            mesh = _meshes[key] = DeviceMesh.from_group(pg, self.device.type)
        return mesh

    def mesh(self, dims: dict[str, int]) -> "Mesh":
        """Arrange the world's ranks in a mesh, e.g. {"data": 2, "shard": 2}; the last dimension varies fastest.

        Collective: every rank of the world calls it with the same dims. Only the world can be meshed.
        """
        if self.ranks != tuple(range(dist.get_world_size() if _initialized() else 1)):
            raise ValueError("Group.mesh arranges the whole world; call it on Group.world()")
        return Mesh(dims, self.device)

    # --- building -----------------------------------------------------------------------------------

    @staticmethod
    def world() -> "Group":
        """Every rank of the run: the default process group, or a world of one when there is none."""
        global _world_cache
        if not _initialized():
            return Group(device=_world_device or torch.device("cpu"))
        pg = dist.group.WORLD
        if _world_cache is not None and _world_cache[0] is pg:
            return _world_cache[1]
        backend = _backend_name(None)
        g = Group(rank=dist.get_rank(), size=dist.get_world_size(), backend=backend,
                  device=_default_device(backend), pg=None, ranks=tuple(range(dist.get_world_size())))
        _world_cache = (pg, g)
        return g

    @staticmethod
    def local(device: torch.device | str | None = None) -> "Group":
        """This process alone, a world of one even inside a larger run (lab03's 1-rank baseline on rank 0).
        No collective runs on it: every nanodist module skips communication at size 1."""
        rank = dist.get_rank() if _initialized() else 0
        return Group(rank=0, size=1, backend="local", device=torch.device(device) if device is not None
                     else (_world_device or torch.device("cpu")), pg=None, ranks=(rank,))

    @staticmethod
    def of(pg) -> "Group":
        """Wrap a torch ProcessGroup (from dist.new_group, or a DeviceMesh dimension's get_group())."""
        if pg is None or pg is dist.group.WORLD:
            return Group.world()
        rank = dist.get_rank(pg)
        if rank < 0:
            raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the process group "
                             f"it was given: only the group's members may use it (check the ranks given to "
                             f"dist.new_group, and build the object only on those ranks)")
        backend = _backend_name(pg)
        return Group(rank=rank, size=dist.get_world_size(pg), backend=backend, device=_default_device(backend),
                     pg=pg, ranks=tuple(dist.get_process_group_ranks(pg)))

    @staticmethod
    def resolve(group=None) -> "Group":
        """None -> the world; a Group -> itself; a ProcessGroup -> Group.of(it); a 1-D DeviceMesh -> its group."""
        if group is None:
            return Group.world()
        if _initialized() and group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group returns to non-members
            raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the process group "
                             f"it was given: only the group's members may use it (check the ranks given to "
                             f"dist.new_group, and call the collective only on those ranks)")
        if isinstance(group, Group):
            return group
        if hasattr(group, "get_group") and hasattr(group, "mesh"):  # a DeviceMesh
            if group.ndim != 1:
                raise ValueError(f"a {group.ndim}-D DeviceMesh is not one group: pass one of its dimensions, "
                                 f"e.g. mesh['shard']")
            return Group.of(group.get_group())
        if isinstance(group, dist.ProcessGroup):
            return Group.of(group)
        raise TypeError(f"group must be None (the world), a nanodist Group, a torch ProcessGroup or a 1-D "
                        f"DeviceMesh, got {type(group).__name__}")

    def __repr__(self) -> str:
        members = "" if self.ranks == tuple(range(self.size)) else f", global ranks {list(self.ranks)}"
        return f"Group(rank {self.rank} of {self.size}, {self.backend}, {self.device}{members})"


_meshes: dict[tuple, object] = {}  # (process group, ranks, device type) -> its DeviceMesh (a Group is frozen)


class Mesh:
    """Ranks arranged in named dimensions, e.g. 2 x 2 as {"data": 2, "shard": 2}. mesh[name] is a Group.

    Rank r sits at the row-major coordinates of r (the last dimension varies fastest), as torch's
    init_device_mesh places them: with {"data": 2, "shard": 2}, ranks 0 and 1 share a "shard" group
    and ranks 0 and 2 a "data" group. mesh.device_mesh is torch's DeviceMesh for FSDP2 and DTensor.
    """

    def __init__(self, dims: dict[str, int], device: torch.device):
        dims = dict(dims)
        world = dist.get_world_size() if _initialized() else 1
        sizes = list(dims.values())
        if not dims or any(not isinstance(s, int) or s < 1 for s in sizes):
            raise ValueError(f"mesh dimensions must be positive integers, got {dims}")
        product = 1
        for s in sizes:
            product *= s
        if product != world:
            raise ValueError(f"a mesh of {' x '.join(map(str, sizes))} = {product} ranks does not fit a world of "
                             f"{world}: choose sizes whose product is {world}")
        if not _initialized():
            raise RuntimeError("a mesh needs a process group: call nanodist.init() first")
        from torch.distributed.device_mesh import init_device_mesh
        self.names = tuple(dims)
        self.shape = tuple(sizes)
        self.device_mesh = init_device_mesh(device.type, self.shape, mesh_dim_names=self.names)
        self._groups = {name: Group.of(self.device_mesh.get_group(name)) for name in self.names}
        # mesh[name].device_mesh is this mesh's own dimension, not a DeviceMesh of its own: DTensors made on it
        # (nanodist.tp's parameters) and on the mesh (FSDP2 on another dimension) then share one root mesh.
        for name, g in self._groups.items():
            pg = g.pg if g.pg is not None else dist.group.WORLD
            _meshes[(id(pg), g.ranks, g.device.type)] = self.device_mesh[name]

    def __getitem__(self, name: str) -> Group:
        if name not in self._groups:
            raise KeyError(f"this mesh has dimensions {list(self.names)}, not {name!r}")
        return self._groups[name]

    @property
    def coordinate(self) -> dict[str, int]:
        """This rank's position along each dimension."""
        return {name: self._groups[name].rank for name in self.names}

    def __repr__(self) -> str:
        return f"Mesh({dict(zip(self.names, self.shape))}, this rank at {self.coordinate})"
