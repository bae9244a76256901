"""The training state's one protocol: what a checkpoint saves, keyed by the bare model's parameter names.

    state = trainer.state_dict()        # every rank; model and optimizer by parameter name, global shapes
    trainer.load_state_dict(state)      # any world size, any packing, any order of a param group

nanodist.checkpoint talks to the Trainer only through `state_dict()` / `load_state_dict()` (torch's `Stateful`),
and the Trainer builds its model and optimizer entries with the functions here. The layout does not depend on the
world size, on how a wrapper packs its parameters or on the order of a param group:

- model: the bare module's `state_dict()` -- torch DDP's `module.` and torch.compile's `_orig_mod.` prefixes
  removed (nanodist's DDP gives the bare names itself). A sharded parameter is a DTensor `Shard(0)` of its global
  shape (torch FSDP2 does this; nanodist.FSDP converts its flat shards to it).
- optimizer: `{"state": {name: {key: value}}, "param_groups": [{..., "params": [names]}]}` -- torch's layout with
  each parameter's index replaced by its name. A per-element state tensor has its parameter's layout (a DTensor
  where the parameter is one); a sharded optimizer may hold another sharded layout of its own (nanodist's ZeRO:
  a DTensor `Shard(0)` of the flattened parameter). Loading matches saved state to parameters, and saved groups
  to live groups, by name: never by position.

What a wrapper or an optimizer provides to take part (duck-typed; nothing here knows their classes):
- a wrapper that only wraps (replicates, averages gradients) names the module it wraps as `state_module`:
  its names, not the wrapper's `module.`-prefixed ones, are the state's (nanodist's DDP does);
- a model whose parameters, as the optimizer sees them, are not in the layout above (nanodist.FSDP's flat
  shards) provides `optimizer_state_dict(optimizer)` and `load_optimizer_state_dict(optimizer, state)` in the
  layout above, and may provide `state_snapshot(optimizer)` (copy now, lay out later: asynchronous saves);
- a sharded optimizer (each rank keeps a part of the state: nanodist's ZeRO) provides `init_state()`, which
  creates its empty state without a step, so that a load reads only this rank's part, and its
  `load_state_dict` takes its own DTensors, DTensors of another world size resharded by DCP, or whole tensors.
Any other torch.optim.Optimizer works as it is: its state is whatever its `state_dict()` holds.
"""
from __future__ import annotations

import torch
import torch.nn as nn


def is_dtensor(t) -> bool:
    """A torch DTensor (tensor parallelism, FSDP2), told by its type's name: no import of torch's DTensor here."""
    return type(t).__name__ == "DTensor"


def bare_module(model: nn.Module) -> nn.Module:
    """The module whose parameter names are the bare model's: through torch DDP (`.module`), torch.compile
    (`._orig_mod`) and any wrapper that names it as its `state_module` (nanodist's DDP), in any nesting."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "state_module", None), nn.Module):  # a wrapper that says whose names count
            model = model.state_module
        elif hasattr(torch, "_dynamo") and isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            model = model._orig_mod
        else:
            return model


def model_state_dict(model: nn.Module) -> dict:
    """The bare model's state dict, its DTensors in layouts a checkpoint can write (`savable`). A collective where
    one needs converting: every rank calls it."""
    return {k: savable(v) for k, v in bare_module(model).state_dict().items()}


def load_model_state_dict(model: nn.Module, state: dict) -> None:
    live = bare_module(model).state_dict()
    bare_module(model).load_state_dict({k: _relaid(v, live.get(k)) for k, v in state.items()})


def savable(t):
    """A DTensor in a layout torch.distributed.checkpoint can write. DCP stores each rank's piece as one block (an
    offset and a size) of the global tensor; a piece that is no such block -- nanodist.tp's fused qkv, whose rank r
    holds its rows of q, of k and of v (_StridedShard on the mesh's last dimension) -- is gathered along that
    dimension first (Replicate there). Sharded again on an outer dimension (FSDP2 over it) it is refused, with the
    reason. Anything else as it is. Loading puts it back in the live layout (`load_model_state_dict`,
    `like_param`)."""
    if not is_dtensor(t):
        return t
    placements = t.placements
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.placement_types import _StridedShard
    last = len(placements) - 1
    if not isinstance(placements[last], _StridedShard):
        return t
    if any(not pl.is_replicate() for pl in placements[:last]):
        # FSDP2 over nanodist.tp's qkv: FSDP2 cuts each rank's [q_r; k_r; v_r] again, a stride within a stride that
        # torch 2.13's DTensor placements cannot describe (its gather puts the rows in the wrong places; full_tensor
        # gathers it by hand, but DCP's save and load go through DTensor's own)
        raise ValueError("this model's fused qkv is split head by head by nanodist.tp and sharded again by FSDP2 on "
                         "a 2-D mesh: torch's DTensor cannot describe that layout, so torch.distributed.checkpoint "
                         "cannot write or read it. Training so is right; to checkpoint, average over the data dimension "
                         "with nanodist.DDP(model, group=mesh['data']) instead of FSDP2, or use torch's "
                         "parallelize_module under FSDP2 (its layouts gather)")
    whole = full_tensor(t)  # gathered here (and through the host where gloo holds GPU memory): then re-cut
    return dtensor_like(whole, t, placements=[*placements[:last], Replicate()])


def _relaid(t, live):
    """t in live's layout where live is a DTensor: a whole tensor cut, a DTensor laid out otherwise (a savable
    layout coming back) gathered and cut. Anything else as it is."""
    if not is_dtensor(live) or not torch.is_tensor(t):
        return t
    if not is_dtensor(t):
        return dtensor_like(t, live)
    return t if tuple(t.placements) == tuple(live.placements) else dtensor_like(full_tensor(t), live)


def _names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its name in the bare model (a tied parameter: its first name)."""
    return {id(p): n for n, p in bare_module(model).named_parameters()}


def _live(model: nn.Module, optimizer) -> list[tuple[torch.Tensor, str]]:
    """(parameter, name) of every parameter the optimizer steps, in its groups' order."""
    names = _names(model)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    unknown = sum(id(p) not in names for p in params)
    if unknown:
        raise ValueError(f"the optimizer steps {unknown} parameter(s) that the model does not have: build it from "
                         f"the model's parameters (model.parameters(), or param groups of them)")
    return [(p, names[id(p)]) for p in params]


def optimizer_state_dict(model: nn.Module, optimizer) -> dict:
    """The optimizer's state keyed by parameter name (see the module docstring). A collective where the model's
    hook or a DTensor conversion is one: every rank calls it."""
    hook = getattr(bare_module(model), "optimizer_state_dict", None)
    if callable(hook):
        return hook(optimizer)
    init = getattr(optimizer, "init_state", None)
    if callable(init):  # a sharded optimizer: every piece has its (possibly zero) state, so a load reads only it
        init()
    order = [n for _, n in _live(model, optimizer)]
    sd = optimizer.state_dict()
    return {"state": {order[i]: {k: savable(v) for k, v in st.items()} for i, st in sd["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in sd["param_groups"]]}


KERNEL_KEYS = ("fused", "foreach", "capturable", "differentiable")  # how an optimizer computes, not what


def torch_layout(optimizer, order: list[str], state: dict, saved_groups: list[dict]) -> dict:
    """An index-keyed state dict for `optimizer.load_state_dict` built from a name-keyed one: `order` names the
    optimizer's parameters in its groups' order. Each live group takes the hyperparameters of the saved group with
    the same parameters (in any order); each parameter its own saved state. torch maps indices by position, so
    the indices handed to it are the live positions."""
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(f"the saved optimizer has {len(saved_groups)} param group(s), this one "
                         f"{len(optimizer.param_groups)}: build the param groups as the saved run did")
    groups, at = [], 0
    for k, g in enumerate(optimizer.param_groups):
        mine = order[at:at + len(g["params"])]
        match = [s for s in saved_groups if sorted(s["params"]) == sorted(mine)]
        if not match:
            raise ValueError(f"param group {k} of this optimizer ({len(mine)} parameter(s): "
                             f"{', '.join(mine[:3])}{', ...' if len(mine) > 3 else ''}) has no saved group with the "
                             f"same parameters: build the param groups as the saved run did")
        # The saved hyperparameters over this group's own: a key the saving optimizer did not have (torch's
        # AdamW's amsgrad in a DistAdamW checkpoint, DistAdamW's kind in torch's) keeps this optimizer's value,
        # and so do the keys that choose a kernel, not the arithmetic (a GPU run keeps its fused AdamW).
        live = {k: v for k, v in g.items() if k not in ("params", "param_names")}
        group = {**live, **match[0], **{k: live[k] for k in KERNEL_KEYS if k in live},
                 "params": list(range(at, at + len(mine)))}
        if "param_names" in group:
            group["param_names"] = list(mine)
        groups.append(group)
        at += len(mine)
    index = {n: i for i, n in enumerate(order)}
    extra = [n for n, st in state.items() if st and n not in index]
    if extra:
        raise ValueError(f"the saved optimizer state holds {', '.join(extra[:3])}, which this optimizer does not step")
    return {"state": {index[n]: st for n, st in state.items() if st}, "param_groups": groups}


def load_optimizer_state_dict(model: nn.Module, optimizer, state: dict) -> None:
    """Load what optimizer_state_dict() returned -- saved at any world size and packing, by name -- or the same
    with whole tensors (a full checkpoint)."""
    hook = getattr(bare_module(model), "load_optimizer_state_dict", None)
    if callable(hook):
        hook(optimizer, state)
        return
    live = _live(model, optimizer)
    sharded = callable(getattr(optimizer, "init_state", None))  # takes its own layouts and whole tensors
    params = dict((n, p) for p, n in live)
    converted = {}
    for n, st in state["state"].items():
        p = params.get(n)
        if p is None or sharded:
            converted[n] = st
            continue
        converted[n] = {k: like_param(param_shaped(v, p), p) if torch.is_tensor(v) and k != "step" and
                        v.numel() == p.numel() else v for k, v in st.items()}
    optimizer.load_state_dict(torch_layout(optimizer, [n for _, n in live], converted, state["param_groups"]))


def param_shaped(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A state tensor of p's size in p's shape: DistAdamW keeps AdamW's moments flat, (numel,), where torch's
    AdamW keeps them shaped like the parameter; the elements are in the same order."""
    if tuple(t.shape) == tuple(p.shape):
        return t
    return full_tensor(t).reshape(p.shape)


def like_param(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A state tensor in the layout of parameter p: a DTensor of p's mesh and placements when p is one (cut
    from a whole tensor if need be); whole, on p's device, otherwise."""
    if hasattr(p, "device_mesh"):
        return _relaid(t, p) if hasattr(t, "to_local") else dtensor_like(t, p)
    return full_tensor(t).to(p.device)


def _stride_within_a_shard(t) -> bool:
    """FSDP2 (an outer mesh dimension) over nanodist.tp's fused qkv (_StridedShard on the last): a layout torch
    2.13's DTensor gathers wrongly (see savable)."""
    from torch.distributed.tensor.placement_types import _StridedShard
    placements = t.placements
    return (len(placements) == 2 and isinstance(placements[1], _StridedShard)
            and not placements[0].is_replicate())


def _gather_stride_within_a_shard(t) -> torch.Tensor:
    """The whole tensor of FSDP2 over nanodist.tp's qkv, gathered by hand from every rank's piece: FSDP2 cut each
    tensor-parallel rank's [q_r; k_r; v_r] in dim-0 chunks over the data ranks, so the data ranks' chunks, in
    order, are that rank's piece; the tensor ranks' pieces, each cut in split_factor parts and interleaved, are
    the whole. (Objects, not tensors, move: FSDP2's last chunk may be shorter.)"""
    import torch.distributed as dist
    mesh, local = t.device_mesh, t.to_local().detach()

    def gather(x, dim):
        out = [None] * mesh.size(dim)
        dist.all_gather_object(out, x.cpu(), group=mesh.get_group(dim))
        return out

    tensor_piece = torch.cat(gather(local, 0))
    pieces = gather(tensor_piece, 1)
    split = t.placements[1].split_factor
    return torch.cat([p.chunk(split)[j] for j in range(split) for p in pieces]).to(t.device)


def full_tensor(t: torch.Tensor, via_host: bool | None = None, to_host: bool = False) -> torch.Tensor:
    """A DTensor's whole value, on its device, or in host memory with to_host (a collective: every rank of its mesh
    calls it, in the same order); any other tensor as it is (to_host: copied to the host).

    gloo cannot take a DTensor's GPU memory through DTensor's own collectives (two ranks sharing a GPU through
    gloo crash in the gather, torch 2.11), so a DTensor in GPU memory on a mesh whose groups are gloo is gathered
    through host copies over the same groups, and the whole value goes back to the GPU. via_host forces one way
    or the other (the tests check the host route on CPU tensors)."""
    if not hasattr(t, "full_tensor"):
        return t.cpu() if to_host else t
    if _stride_within_a_shard(t):
        whole = _gather_stride_within_a_shard(t)
        return whole.cpu() if to_host else whole
    mesh = t.device_mesh
    if via_host is None:
        via_host = t.device.type != "cpu" and any(
            torch.distributed.get_backend(mesh.get_group(d)) == "gloo" for d in range(mesh.ndim))
    if not via_host:
        return t.full_tensor().cpu() if to_host else t.full_tensor()
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    groups = [mesh.get_group(d) for d in range(mesh.ndim)]
    host = DeviceMesh.from_group(groups[0] if mesh.ndim == 1 else groups, "cpu", mesh=mesh.mesh,
                                 mesh_dim_names=mesh.mesh_dim_names or tuple(f"dim{d}" for d in range(mesh.ndim)))
    on_host = DTensor.from_local(t.to_local().cpu(), host, t.placements, run_check=False, shape=t.shape,
                                 stride=t.stride())
    whole = on_host.full_tensor()
    return whole if to_host else whole.to(t.device)


def dtensor_like(whole: torch.Tensor, like, placements=None) -> torch.Tensor:
    """`like`'s layout (any placements on any mesh: FSDP2's Shard(0), TP's Shard and Replicate, FSDP2 x TP's
    _StridedShard on a 2-D mesh), or `placements` on its mesh, filled from a whole tensor every rank has: each rank
    keeps its own piece, nothing is sent."""
    from torch.distributed.tensor import distribute_tensor
    if tuple(whole.shape) != tuple(like.shape):
        raise ValueError(f"a saved tensor has shape {tuple(whole.shape)}, the model's {tuple(like.shape)}")
    return distribute_tensor(whole.to(like.to_local().device), like.device_mesh,
                             like.placements if placements is None else placements, src_data_rank=None)


def clone(value):
    """A copy of a state tree that training cannot change any more (DTensors stay DTensors: a local copy)."""
    if isinstance(value, dict):
        return {k: clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(clone(v) for v in value)
    if torch.is_tensor(value):
        return value.detach().clone()
    return value
