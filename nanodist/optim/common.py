"""What DistAdamW and DistMuon share: ZeRO's step, written once.

    reduce-scatter the gradients  ->  each rank updates its shard  ->  all-gather the parameters

The model is *not* wrapped in DDP: the optimizer averages the gradients itself, inside step() (the
nanochat design). Each rank keeps optimizer state only for the pieces of the parameters it updates,
so with N ranks the state per rank is about 1/N of AdamW's -- ZeRO stage 1 -- and, at the default
zero_stage=2, the averaged gradient it keeps is a 1/N shard too.

How a step runs. Parameters are grouped into *buckets* (about bucket_cap_mb each). A bucket's
gradients are packed into one (world_size, row) buffer whose row r holds the *pieces* rank r will
update; a piece is a contiguous run of one parameter's elements. A reduce-scatter sums the buffer
over ranks and hands rank r its row (divided by N: the average). Rank r updates the parameters in
place, piece by piece, writes the new values into the same row, and an all-gather of the rows puts
every updated piece on every rank, which copies each piece back into its parameter. The two
optimizers differ only in how they cut parameters into pieces and in the update:

    DistAdamW: every parameter in N equal slices, one per rank (padded: any shape, 0-D included)
    DistMuon:  whole matrices, dealt out to the ranks (Newton-Schulz needs the whole matrix)

A parameter without a gradient. Ranks must issue the same collectives in the same order, so a
missing gradient travels as zeros. Before updating, the ranks agree, in one small all-reduce, on
which parameters had a gradient on *any* rank (and, when clipping, on the global gradient norm): a
parameter nobody had a gradient for is skipped everywhere -- no update, no weight decay, no state --
as torch's optimizers skip a parameter whose .grad is None.

Clipping. The Trainer sets `max_grad_norm`; the optimizer then clips by the norm of the *averaged*
gradient, which only it sees: each rank adds the squares of its shard, the all-reduce above sums
them. Same formula as torch.nn.utils.clip_grad_norm_.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..collectives import ring_all_gather, ring_reduce_scatter
from ..group import Group
from ..sync import Work as _Work
from ..sync import pack_buckets

# torch >= 2.13 renamed the single-tensor collectives; older versions only have the old names.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

COLLECTIVES = ("auto", "ring", "torch")
RESHARD_HINT = "resharding arrives with the checkpointing chapter"


@dataclass(frozen=True)
class Piece:
    """A contiguous run of one parameter's elements that one rank updates."""

    param: int  # index of the parameter in the optimizer (the numbering of state_dict()["state"])
    group: int  # index of its param group
    rank: int  # the rank that updates it
    start: int  # first element, counted in param.view(-1)
    numel: int
    offset: int  # where it sits in row `rank` of its bucket's buffer


@dataclass
class Bucket:
    """Parameters whose gradients travel in one (world_size, row_numel) buffer."""

    params: list[int]
    pieces: list[Piece]
    row_numel: int
    dtype: torch.dtype
    device: torch.device
    local: list[Piece] = field(default_factory=list)  # the pieces this rank updates
    shard: torch.Tensor | None = None  # zero_stage=2: the buffer of this rank's averaged gradient, reused


@dataclass
class _Pending:
    """One bucket's step: its buffers and the collective in flight."""

    bucket: Bucket
    send: torch.Tensor  # (world_size, row): packed local gradients, later the gathered parameters
    shard: torch.Tensor  # (row,): this rank's summed, then averaged, gradient; later its updated pieces
    work: _Work
    ready: bool = False
    gather: _Work | None = None


class ShardedOptimizer(torch.optim.Optimizer):
    """Base of DistAdamW and DistMuon: the sharded step. Subclasses define `_layout` and `_update`.

    - group: the ranks that share the work (default: the world; none at all = 1 rank),
      read when the optimizer is built: create it after nanodist.init().
    - zero_stage: 2 (default) keeps only this rank's shard of the averaged gradient; the full local
      gradients are consumed by step() (every p.grad is None afterwards). 1 all-reduces the gradients
      instead, so after step() every p.grad holds the full averaged gradient, as under DDP; the
      optimizer state is sharded in both. (Stage 3, sharded parameters, is the FSDP chapter.)
    - bucket_cap_mb: gradients travel in buckets of about this size (one collective each way per bucket).
    - collectives: "auto" (nanodist's ring reduce-scatter/all-gather on gloo, torch's async ones on
      nccl), "ring" or "torch".
    - max_grad_norm: set it (the Trainer does) to clip by the global norm of the averaged gradient;
      `last_grad_norm` then holds that norm after each step.
    """

    def __init__(self, params, defaults: dict, *, group=None, zero_stage: int = 2,
                 bucket_cap_mb: float = 25.0, collectives: str = "auto"):
        name = type(self).__name__
        if zero_stage not in (1, 2):
            raise ValueError(f"{name}: zero_stage must be 1 or 2, got {zero_stage!r} (stage 0 is DDP with a plain "
                             f"optimizer; stage 3 shards the parameters too: the FSDP chapter)")
        if not bucket_cap_mb > 0:
            raise ValueError(f"{name}: bucket_cap_mb must be positive, got {bucket_cap_mb!r}")
        if collectives not in COLLECTIVES:
            raise ValueError(f"{name}: collectives must be one of {', '.join(COLLECTIVES)}, got {collectives!r}")
        g = Group.resolve(group)
        self.group, self.pg = g, g.pg
        self.world_size, self.rank, self.backend = g.size, g.rank, g.backend
        self.zero_stage = zero_stage
        self.bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        # gloo's reduce_scatter_tensor is an all-reduce in disguise (each rank moves the whole buffer both
        # ways) and our ring (chapter 2) moves half as much, so on gloo the ring wins even though it is
        # synchronous. On nccl torch's collectives are native rings and asynchronous: we use them there.
        self.use_ring = collectives == "ring" or (collectives == "auto" and self.backend == "gloo")
        self.max_grad_norm: float | None = None
        self.last_grad_norm: float | None = None
        self.recorded: list[dict] | None = None
        self._record = False
        self._plan_key = None
        self._buckets: list[Bucket] = []
        self._params: list[torch.Tensor] = []
        super().__init__(params, defaults)

    # ----------------------------------------------------------------------------- validation

    def add_param_group(self, param_group: dict) -> None:
        """torch's add_param_group, then our checks: one device and dtype per group, real, contiguous."""
        super().add_param_group(param_group)
        try:
            self._check_group(len(self.param_groups) - 1)
        except Exception:
            self.param_groups.pop()
            raise

    def _check_group(self, g: int) -> None:
        name, params = type(self).__name__, self.param_groups[g]["params"]
        for i, p in enumerate(params):
            where = f"parameter {i} of param group {g} ({self._param_name(g, i)}, shape {tuple(p.shape)})"
            if p.is_complex():
                raise ValueError(f"{name} does not support complex parameters: {where} is {p.dtype}")
            if not p.is_contiguous():
                raise ValueError(f"{name} needs contiguous parameters (it updates them through flat views): {where} "
                                 f"is not. Make it contiguous before building the optimizer: "
                                 f"p.data = p.data.contiguous()")
            if (p.device, p.dtype) != (params[0].device, params[0].dtype):
                raise ValueError(
                    f"{name}: the parameters of one param group must share a device and a dtype, but {where} is "
                    f"{p.dtype} on {p.device} while parameter 0 is {params[0].dtype} on {params[0].device}. Move or "
                    f"convert the model first (model.to(device, dtype)), or put them in separate param groups.")
            self._check_param(p, where)

    def _check_param(self, p: torch.Tensor, where: str) -> None:
        """Subclasses reject parameters they cannot optimise (DistMuon: anything but a matrix)."""

    def _param_name(self, g: int, i: int) -> str:
        names = self.param_groups[g].get("param_names")
        return names[i] if names and i < len(names) else f"param_groups[{g}].params[{i}]"

    # ----------------------------------------------------------------------------- the layout

    def _layout(self, items: list[tuple[int, int, int]]) -> tuple[list[Piece], int]:
        """Cut a bucket's parameters, given as (index, group, numel), into pieces; return them and the row length."""
        raise NotImplementedError

    def _update(self, group: dict, items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """Update this rank's pieces in place: items are (parameter, averaged gradient piece, parameter piece),
        the pieces flat views of the shard and of the parameter."""
        raise NotImplementedError

    def _plan(self) -> list[Bucket]:
        """The buckets and pieces; rebuilt only when the parameters change (add_param_group)."""
        self._params = [p for g in self.param_groups for p in g["params"]]
        key = tuple((id(p), tuple(p.shape), p.dtype, p.device) for p in self._params)
        if key == self._plan_key:
            return self._buckets
        group_of = [g for g, group in enumerate(self.param_groups) for _ in group["params"]]
        nonempty = [i for i, p in enumerate(self._params) if p.numel() > 0]  # empty: nothing to update or send
        runs = [[nonempty[j] for j in run]
                for run in pack_buckets([self._params[i] for i in nonempty], self.bucket_cap_bytes)]
        self._buckets = []
        for run in runs:
            pieces, row = self._layout([(i, group_of[i], self._params[i].numel()) for i in run])
            p0 = self._params[run[0]]
            local = [pc for pc in pieces if pc.rank == self.rank]
            self._buckets.append(Bucket(run, pieces, row, p0.dtype, p0.device, local))
        self._plan_key = key
        return self._buckets

    def local_pieces(self) -> list[Piece]:
        """The pieces this rank updates (and keeps optimizer state for)."""
        return [pc for b in self._plan() for pc in b.local]

    def _comm_device(self, bucket: Bucket) -> torch.device:
        if self.world_size == 1:
            return bucket.device
        if self.backend == "nccl":
            if bucket.device.type != "cuda":
                raise ValueError(f"{type(self).__name__}: the nccl backend moves CUDA tensors only, but some "
                                 f"parameters are on {bucket.device}: move the model to the GPU (model.to('cuda')) "
                                 f"or use gloo")
            return bucket.device
        # gloo's point-to-point messages (our ring) want CPU tensors: CUDA parameters are staged through the CPU.
        return torch.device("cpu") if self.backend == "gloo" else bucket.device

    def _small_device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # ----------------------------------------------------------------------------- collectives

    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> _Work:
        if self.use_ring:
            ring_reduce_scatter(out, inp, group=self.group)  # synchronous: done when it returns
            return _Work()
        # The flat (concatenated) form: gloo's version rejects the stacked (world_size, row) one.
        return _Work(_reduce_scatter_single(out, inp.view(-1), group=self.pg, async_op=True), out, inp)

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> _Work:
        if self.use_ring:
            ring_all_gather(out, inp, group=self.group)
            return _Work()
        return _Work(_all_gather_single(out.view(-1), inp, group=self.pg, async_op=True), out, inp)

    def _all_reduce(self, t: torch.Tensor) -> _Work:
        return _Work(dist.all_reduce(t, group=self.pg, async_op=True), t)

    # ----------------------------------------------------------------------------- the step, in phases

    def _local_flags(self) -> list[float]:
        """1.0 for each parameter that has a gradient on this rank (summed over ranks by the agreement)."""
        self._plan()
        flags = []
        for g, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if p.grad is not None and p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients, and "
                                       f"{self._param_name(g, i)} has one: use a dense nn.Embedding (sparse=False)")
                flags.append(float(p.grad is not None))
        return flags

    def _launch(self) -> list[_Pending]:
        """Pack every bucket's gradients and start its reduce-scatter (all-reduce at stage 1)."""
        W, pending = self.world_size, []
        self._plan()
        if self._record:
            self.recorded = [self._record_entry(i) for i in range(len(self._params))]
        for b in self._buckets:
            send = torch.zeros(W, b.row_numel, dtype=b.dtype, device=self._comm_device(b))
            flat = send.view(-1)
            for pc in b.pieces:
                grad = self._params[pc.param].grad
                if grad is not None:  # a missing gradient stays zeros
                    at = pc.rank * b.row_numel + pc.offset
                    flat[at:at + pc.numel].copy_(grad.reshape(-1)[pc.start:pc.start + pc.numel])
            if self.zero_stage == 2:
                for i in b.params:  # ZeRO-2: the full gradient is not kept; the shard below is
                    self._params[i].grad = None
                if b.shard is None or b.shard.device != send.device:
                    b.shard = torch.empty(b.row_numel, dtype=b.dtype, device=send.device)
                shard = b.shard
                if W == 1:
                    shard.copy_(send[0])
                    work = _Work()
                else:
                    work = self._reduce_scatter(shard, send)
            else:  # stage 1: everyone gets the whole averaged gradient; we update only our row of it
                work = self._all_reduce(send) if W > 1 else _Work()
                shard = send[self.rank]
            pending.append(_Pending(b, send, shard, work))
        return pending

    def _ready(self, pd: _Pending) -> None:
        """Wait for a bucket's reduction and turn the sum into the average."""
        if not pd.ready:
            pd.work.wait()
            if self.world_size > 1:
                (pd.send if self.zero_stage == 1 else pd.shard).div_(self.world_size)
            pd.ready = True

    def _local_sq_norm(self, pending: list[_Pending]) -> torch.Tensor:
        """Sum of squares of this rank's averaged gradient shards (padding is zero), in float64."""
        total = torch.zeros((), dtype=torch.float64, device=self._small_device())
        for pd in pending:
            self._ready(pd)
            total += torch.linalg.vector_norm(pd.shard, dtype=torch.float64).to(total.device) ** 2
        return total

    @torch.no_grad()
    def _finish(self, pending: list[_Pending], has_grad: list[bool], clip_coef: float | None) -> None:
        """Update this rank's pieces bucket by bucket as their reductions complete, then all-gather."""
        W = self.world_size
        for pd in pending:
            self._ready(pd)
            b = pd.bucket
            if clip_coef is not None:
                (pd.send if self.zero_stage == 1 else pd.shard).mul_(clip_coef)
            if self.zero_stage == 1:
                self._write_back_grads(pd, has_grad)
            shard = pd.shard if pd.shard.device == b.device else pd.shard.to(b.device)
            by_group: dict[int, list] = {}
            for pc in b.local:
                if has_grad[pc.param]:
                    p = self._params[pc.param]
                    grad, param = shard[pc.offset:pc.offset + pc.numel], p.view(-1)[pc.start:pc.start + pc.numel]
                    by_group.setdefault(pc.group, []).append((p, grad, param))
                    if self._record:
                        self.recorded[pc.param]["grad_shard"] = grad.clone()
            for g, items in by_group.items():
                self._update(self.param_groups[g], items)
            if W == 1:
                continue
            # The updated pieces travel back in the row their gradients came in.
            out = shard if self.zero_stage == 2 else torch.empty_like(shard)
            for pc in b.local:
                out[pc.offset:pc.offset + pc.numel].copy_(self._params[pc.param].view(-1)[pc.start:pc.start + pc.numel])
            if out.device != pd.send.device:
                out = out.to(pd.send.device)
            pd.gather = self._all_gather(pd.send, out)
        for pd in pending:
            if pd.gather is not None:
                pd.gather.wait()
                flat = pd.send.view(-1)
                for pc in pd.bucket.pieces:
                    if pc.rank != self.rank and has_grad[pc.param]:
                        at = pc.rank * pd.bucket.row_numel + pc.offset
                        self._params[pc.param].view(-1)[pc.start:pc.start + pc.numel].copy_(flat[at:at + pc.numel])
        if self._record:
            local = {pc.param: pc for pc in self.local_pieces()}
            for entry in self.recorded:
                p, pc = self._params[entry["index"]], local.get(entry["index"])
                if pc is not None:
                    entry["piece"] = (pc.start, pc.numel)
                    entry["updated_shard"] = p.detach().view(-1)[pc.start:pc.start + pc.numel].clone()
                entry["param"] = p.detach().clone()
            self._record = False

    def _write_back_grads(self, pd: _Pending, has_grad: list[bool]) -> None:
        """Stage 1: every p.grad becomes the full averaged gradient (None where no rank had one)."""
        flat = pd.send.view(-1)
        for pc in pd.bucket.pieces:
            p = self._params[pc.param]
            if not has_grad[pc.param]:
                continue
            if p.grad is None or not p.grad.is_contiguous():
                p.grad = torch.zeros_like(p)
            at = pc.rank * pd.bucket.row_numel + pc.offset
            p.grad.view(-1)[pc.start:pc.start + pc.numel].copy_(flat[at:at + pc.numel])

    def _record_entry(self, i: int) -> dict:
        g = next(g for g, group in enumerate(self.param_groups) if any(q is self._params[i] for q in group["params"]))
        j = next(j for j, q in enumerate(self.param_groups[g]["params"]) if q is self._params[i])
        grad = self._params[i].grad
        return {"index": i, "name": self._param_name(g, j), "shape": tuple(self._params[i].shape),
                "rank": self.rank, "world_size": self.world_size,
                "grad": None if grad is None else grad.detach().clone(),
                "piece": None, "grad_shard": None, "updated_shard": None, "param": None}

    # ----------------------------------------------------------------------------- public

    @torch.no_grad()
    def step(self, closure=None):
        """One sharded step: reduce-scatter, update this rank's shard, all-gather. Collective: every rank calls it."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        sharded_step([self], self.max_grad_norm)
        return loss

    def record_next_step(self) -> None:
        """Keep, for the next step only, what the pipeline did to every parameter on this rank.

        Afterwards `recorded` is a list (one dict per parameter): name, shape, `grad` (this rank's local
        gradient before the reduce-scatter), `piece` ((start, numel) of the slice this rank updates, or
        None), `grad_shard` (that slice of the averaged gradient), `updated_shard` (the slice after the
        update) and `param` (the whole parameter after the all-gather). For drawing the pipeline.
        """
        self._record = True

    def gradient_buffers(self) -> list[torch.Tensor]:
        """The gradient memory this optimizer keeps between steps: at stage 2, this rank's averaged shards."""
        return [b.shard for b in self._buckets if b.shard is not None]

    def state_dict(self) -> dict:
        """torch's state dict of this rank's shard, plus `zero`: who saved it and how parameters were cut.

        state_dict()["state"] holds exactly the tensors this rank keeps. Save one file per rank; load it
        on the same rank of a run with the same world size (another world size: resharding arrives with
        the checkpointing chapter).
        """
        sd = super().state_dict()
        sd["zero"] = {"optimizer": type(self).__name__, "world_size": self.world_size, "rank": self.rank,
                      "zero_stage": self.zero_stage,
                      "pieces": [[pc.param, pc.start, pc.numel] for pc in self.local_pieces()]}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what state_dict() saved on this rank; a clear error for another rank, world size or layout."""
        name = type(self).__name__
        meta = state_dict.get("zero")
        if meta is None:
            raise ValueError(f"{name}.load_state_dict: this state dict has no 'zero' entry, so a sharded optimizer did "
                             f"not save it (a torch.optim state dict holds full, unsharded state). Load what "
                             f"{name}.state_dict() saved on this rank; converting full state to shards: "
                             f"{RESHARD_HINT}.")
        if meta["optimizer"] != name:
            raise ValueError(f"{name}.load_state_dict: this state was saved by {meta['optimizer']}, not {name}")
        if meta["world_size"] != self.world_size:
            raise ValueError(
                f"{name}.load_state_dict: this state is rank {meta['rank']}'s shard of a run with {meta['world_size']} "
                f"ranks, but this run has {self.world_size}. A sharded state only fits the world size it was saved "
                f"at -- {RESHARD_HINT}. Resume with {meta['world_size']} ranks.")
        if meta["rank"] != self.rank:
            raise ValueError(f"{name}.load_state_dict: this state is rank {meta['rank']}'s shard, but this is rank "
                             f"{self.rank}: every rank must load the state it saved itself (name files by rank)")
        mine = [[pc.param, pc.start, pc.numel] for pc in self.local_pieces()]
        if [list(x) for x in meta["pieces"]] != mine:
            raise ValueError(f"{name}.load_state_dict: the parameters were cut into other pieces when this state was "
                             f"saved (another model, parameter order or bucket_cap_mb): build the optimizer as in the "
                             f"saved run")
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "zero"})


def sharded_step(optimizers: list[ShardedOptimizer], max_grad_norm: float | None) -> float | None:
    """Step several sharded optimizers (same process group) as one: one agreement, one clipping norm.

    Returns the global norm of the averaged gradient when clipping (max_grad_norm > 0), else None.
    """
    lead = optimizers[0]
    clip = max_grad_norm is not None and max_grad_norm > 0
    flags = [o._local_flags() for o in optimizers]
    agree = torch.tensor([f for fl in flags for f in fl] + ([0.0] if clip else []), dtype=torch.float64,
                         device=lead._small_device())
    agreement = None
    if lead.world_size > 1 and not clip:
        # Started before the reduce-scatters: nccl runs collectives in the order issued, so this small one
        # finishes first and the updates can begin as soon as the first bucket's reduce-scatter is in.
        agreement = lead._all_reduce(agree)
    pending = [o._launch() for o in optimizers]
    if clip:  # the norm needs every shard first, so no update can start before this all-reduce
        agree[-1] = sum(o._local_sq_norm(p) for o, p in zip(optimizers, pending))
        if lead.world_size > 1:
            agreement = lead._all_reduce(agree)
    if agreement is not None:
        agreement.wait()
    values = agree.tolist()
    norm = coef = None
    if clip:
        norm = math.sqrt(values[-1])
        coef = min(1.0, max_grad_norm / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s formula
        coef = None if coef == 1.0 else coef
    start = 0
    for o, fl, p in zip(optimizers, flags, pending):
        has_grad = [v > 0 for v in values[start:start + len(fl)]]
        start += len(fl)
        o._finish(p, has_grad, coef)
        o.last_grad_norm = norm
    return norm


class CombinedOptimizer:
    """Several sharded optimizers stepped as one (e.g. DistAdamW for embeddings + DistMuon for matrices).

    Works with the Trainer: `param_groups` lists every child's groups (the same dicts, so setting a
    group's lr sets the child's), `zero_grad`, `step`, and `max_grad_norm`, which clips by the global
    norm over all children's parameters (one all-reduce, shared with the agreement on missing gradients).
    """

    def __init__(self, optimizers):
        self.optimizers = list(optimizers)
        if not self.optimizers:
            raise ValueError("CombinedOptimizer needs at least one optimizer")
        for o in self.optimizers:
            if not isinstance(o, ShardedOptimizer):
                raise TypeError(f"CombinedOptimizer combines sharded optimizers (DistAdamW, DistMuon), got "
                                f"{type(o).__name__}: step a torch optimizer yourself, next to it")
        lead = self.optimizers[0]
        for o in self.optimizers[1:]:
            if (o.world_size, o.rank, o.group.ranks) != (lead.world_size, lead.rank, lead.group.ranks):
                raise ValueError("CombinedOptimizer: all optimizers must use the same process group")
        seen = set()
        for o in self.optimizers:
            for group in o.param_groups:
                for p in group["params"]:
                    if id(p) in seen:
                        raise ValueError("CombinedOptimizer: a parameter appears in two optimizers; give each "
                                         "parameter to exactly one (split_params_for_muon does)")
                    seen.add(id(p))
        self.max_grad_norm: float | None = None
        self.last_grad_norm: float | None = None

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for o in self.optimizers for p, s in o.state.items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.last_grad_norm = sharded_step(self.optimizers, self.max_grad_norm)
        return loss

    def record_next_step(self) -> None:
        for o in self.optimizers:
            o.record_next_step()

    def gradient_buffers(self) -> list[torch.Tensor]:
        return [t for o in self.optimizers for t in o.gradient_buffers()]

    def state_dict(self) -> dict:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict.get("optimizers")
        if saved is None or len(saved) != len(self.optimizers):
            raise ValueError(f"CombinedOptimizer.load_state_dict: expected the state of {len(self.optimizers)} "
                             f"optimizers (from CombinedOptimizer.state_dict()), got "
                             f"{'none' if saved is None else len(saved)}")
        for o, s in zip(self.optimizers, saved):
            o.load_state_dict(s)

    def __repr__(self) -> str:
        return "CombinedOptimizer(" + ", ".join(type(o).__name__ for o in self.optimizers) + ")"
