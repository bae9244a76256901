"""ZeRO in one torch.optim.Optimizer: it averages the gradients itself and keeps state only for its shard.

    opt = DistAdamW(model.configure_param_groups(0.1), lr=3e-3)   # the model needs no DDP wrapper
    opt = make_muon_optimizer(model)       # one optimizer: Muon groups for matrices, AdamW groups for the rest
    loss.backward()                        # the gradients are reduce-scattered while backward runs
    opt.step()                             # update this rank's shard, all-gather the parameters
    opt.zero_grad()

One optimizer object drives param groups of two *kinds* (nanochat's design), each group saying which:

    kind="adamw"  every parameter's elements cut into world_size equal slices (torch.chunk's rule on the
                  flattened parameter); rank r updates slice r and keeps AdamW's state for it (optim/adamw.py)
    kind="muon"   whole matrices dealt out to the ranks; each is updated, and has momentum, on its
                  owner only (optim/muon.py)

How a step travels. Parameters are grouped into buckets (about bucket_cap_mb, in reverse order: the
order in which backward produces their gradients). A bucket's buffer has one row per rank; row r holds
the pieces rank r owns (an AdamW slice of every parameter, at the same offset in every row; then rank
r's Muon matrices end to end). The gradient-sync engine (nanodist.sync) launches a bucket's collective
from the autograd hooks as soon as its last gradient has arrived:

    zero_stage=2 (default)  reduce-scatter: rank r receives row r summed over ranks, divides it by N, and
                            keeps only that (the full gradient is freed as backward goes: p.grad is None)
    zero_stage=1            all-reduce: every rank gets the whole averaged gradient, written back to p.grad

step() then agrees with the other ranks in one small all-reduce on which parameters had a gradient
anywhere (and, when clipping, on the global norm), updates its pieces, and all-gathers the rows so that
every rank holds every updated parameter. A step with no backward since the last one (gradients set by
hand) packs p.grad at step() instead. Gradient accumulation: set_requires_gradient_sync(False) makes the
hooks wait until the last micro-step (the Trainer does this); without it every backward is reduced and
its shard added to the previous one, which is also correct.

The state (`state_dict()`) is torch's layout (integer keys, groups with `param_names` and `kind`), so
torch's LR schedulers and torch.distributed.checkpoint's get_state_dict accept it. With several ranks an
AdamW state tensor is a DTensor Shard(0) of the flattened parameter, shape (numel,) -- this rank's slice,
no copy -- whose global shape does not depend on the world size, so a sharded checkpoint can be loaded
at another one; a Muon momentum exists only on the matrix's owner.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .. import diverge
from ..group import Group
from ..sync import (DONE, Bucket, GradSync, LocalFinite, ReportsLocalFinite, Slot, Work, all_gather, all_reduce_sum,
                    optimizer_params, pack_buckets, reduce_scatter_sum, refuse_dtensors)
from . import adamw as _adamw
from .agreement import agree
from .layout import Piece, PipelineRecorder, is_dtensor, slice_bounds
from .reference import muon_adamw_groups
from . import muon as _muon

KINDS = {"adamw": _adamw, "muon": _muon}
COLLECTIVES = ("auto", "ring", "torch", "shm")
RESHARD_HINT = ("to resume at another world size, save and load through nanodist.checkpoint, which keeps the state by "
                "parameter name at its global shape (Chapter 6)")


class ShardedOptimizer(torch.optim.Optimizer, ReportsLocalFinite):
    """ZeRO stage 1 or 2 over param groups of kind "adamw" and "muon" (see the module docstring).

    - params: parameters or param groups; a group's "kind" defaults to `kind`. A group may carry
      "param_names" (GPT.configure_param_groups does): state dicts and error messages use them.
    - adamw, muon: the defaults of each kind's hyperparameters (torch.optim.AdamW's and torch.optim.Muon's
      arguments); a group overrides any of them.
    - group: the ranks that share the work (default: the world; no process group at all is a world of one).
      Read when the optimizer is built: create it after nanodist.init().
    - zero_stage: 2 (default) or 1 (see above). Stage 3, sharded parameters, is the FSDP chapter.
    - bucket_cap_mb: gradients travel in buckets of about this size.
    - collectives: "auto" (nanodist's ring reduce-scatter/all-gather on gloo, which moves half the bytes of
      gloo's own reduce-scatter; torch's async ones on nccl), "ring", "torch", or "shm": through shared
      memory, for CPU ranks on one machine (nanodist.shm; where it cannot be used, the ring, with a warning).

    Implements the Trainer's protocol (nanodist.parallel): set_requires_gradient_sync and clip_grad_norm_.
    `max_grad_norm`, when set, makes step() clip by the global norm of the averaged gradient itself.
    """

    def __init__(self, params, *, kind: str = "adamw", adamw: dict | None = None, muon: dict | None = None,
                 group=None, zero_stage: int = 2, bucket_cap_mb: float = 25.0, collectives: str = "auto"):
        name = type(self).__name__
        if kind not in KINDS:
            raise ValueError(f"{name}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if zero_stage not in (1, 2):
            raise ValueError(f"{name}: zero_stage must be 1 or 2, got {zero_stage!r} (stage 0 is DDP with a plain "
                             f"optimizer; stage 3 shards the parameters too: the FSDP chapter)")
        if not bucket_cap_mb > 0:
            raise ValueError(f"{name}: bucket_cap_mb must be positive, got {bucket_cap_mb!r}")
        if collectives not in COLLECTIVES:
            raise ValueError(f"{name}: collectives must be one of {', '.join(COLLECTIVES)}, got {collectives!r}")
        self.kind = kind
        self.kind_defaults = {"adamw": {**_adamw.DEFAULTS, **(adamw or {})}, "muon": {**_muon.DEFAULTS, **(muon or {})}}
        for k, d in self.kind_defaults.items():
            KINDS[k].check(dict(d))  # bad defaults fail here, before any group uses them
        g = Group.resolve(group)
        self.group, self.world_size, self.rank, self.backend = g, g.size, g.rank, g.backend
        self.zero_stage = zero_stage
        self.bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        # gloo's reduce_scatter_tensor is an all-reduce in disguise (each rank moves the whole buffer both
        # ways) and our ring (chapter 2) moves half as much, so on gloo the ring wins even though it is
        # synchronous. On nccl torch's collectives are native rings and asynchronous: we use them there.
        self.use_ring = collectives in ("ring", "shm") or (collectives == "auto" and self.backend == "gloo")
        self.collectives = collectives
        self.max_grad_norm: float | None = None
        self._last_norm: torch.Tensor | None = None  # the global norm of the last clipped step, on the device
        self.recorded: list[dict] | None = None  # what record_next_step() kept of the last recorded step
        self._pipeline: PipelineRecorder | None = None
        self._engine: GradSync | None = None
        self._plan_key = None
        self._reduced = False
        self._digest_check = diverge.PendingCheck(name)
        self._local_finite = LocalFinite()
        super().__init__(params, {})
        refuse_dtensors(optimizer_params(self), name)
        self._plan()  # the hooks are in place before the first backward

    # ----------------------------------------------------------------------------- groups

    def add_param_group(self, param_group: dict) -> None:
        """torch's add_param_group after filling in the group's kind and its kind's defaults; then our checks:
        one device and dtype per group, real, contiguous (Muon: matrices only)."""
        param_group = dict(param_group)
        kind = param_group.setdefault("kind", self.kind)
        if kind not in KINDS:
            raise ValueError(f"{type(self).__name__}: a param group's kind must be one of {', '.join(KINDS)}, "
                             f"got {kind!r}")
        for key, value in self.kind_defaults[kind].items():
            param_group.setdefault(key, value)
        KINDS[kind].check(param_group)
        super().add_param_group(param_group)
        try:
            self._check_group(len(self.param_groups) - 1)
        except Exception:
            self.param_groups.pop()
            raise
        self._plan_key = None  # the layout changes with the parameters

    def _check_group(self, g: int) -> None:
        name, group = type(self).__name__, self.param_groups[g]
        params = group["params"]
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
            if group["kind"] == "muon":
                _muon.check_param(p, where)

    def _param_name(self, g: int, i: int) -> str:
        names = self.param_groups[g].get("param_names")
        return names[i] if names and i < len(names) else f"param_groups[{g}].params[{i}]"

    # ----------------------------------------------------------------------------- the layout

    def _layout_key(self) -> tuple:
        return tuple((id(p), tuple(p.shape), p.dtype, p.device, p.requires_grad)
                     for g in self.param_groups for p in g["params"])

    def _stale(self) -> bool:
        """At the first gradient of a backward: has a parameter been frozen or unfrozen (or the groups changed)
        since the layout was built? Then the engine sits this backward out, and step() re-plans and reduces."""
        return self._layout_key() != self._plan_key

    def _plan(self) -> GradSync:
        """Pieces, buckets and the engine's hooks; built once, again only when the parameters change (a group added,
        a parameter frozen or unfrozen) -- and never while reduced gradients wait for their step: they belong to the
        layout they were reduced in."""
        key = self._layout_key()
        if key == self._plan_key or (self._reduced and self._engine is not None):
            return self._engine
        params = [p for g in self.param_groups for p in g["params"]]
        if self._engine is not None:
            self._engine.remove()
            self._engine = None
        W = self.world_size
        self._params = params
        self._flat = [p.detach().view(-1) for p in params]  # flat views: the pieces are runs of these
        self._group_of = [g for g, group in enumerate(self.param_groups) for _ in group["params"]]
        self._names = [self._param_name(g, j) for g, group in enumerate(self.param_groups)
                       for j in range(len(group["params"]))]
        kinds = [self.param_groups[g]["kind"] for g in self._group_of]
        # Frozen matrices are dealt too, so that unfreezing one later moves no other matrix (nor its momentum).
        muon = [i for i, k in enumerate(kinds) if k == "muon" and params[i].numel() > 0]
        owner = dict(zip(muon, _muon.deal([params[i].numel() for i in muon], W)))
        self._owner = owner
        # Backward produces the last layers' gradients first: buckets in reverse parameter order. A frozen parameter
        # (requires_grad False) gets no gradient, no hook, no place in a bucket and no state -- as torch.optim skips
        # a parameter whose grad is None. An AdamW slice depends on the parameter alone, so freezing or unfreezing
        # one leaves every other parameter's piece (and state) where it was.
        order = [i for i in reversed(range(len(params))) if params[i].numel() > 0 and params[i].requires_grad]
        buckets, pieces = [], []
        for run in pack_buckets([params[i] for i in order], self.bucket_cap_bytes):
            idx = [order[j] for j in run]
            row, mine = 0, []
            for i in idx:  # AdamW slices: parameter i's slice r sits at the same offset in every row r
                if kinds[i] != "adamw":
                    continue
                n = params[i].numel()
                for r in range(W):
                    a, b = slice_bounds(n, W, r)
                    if b > a:  # a 3-element parameter on 4 ranks: rank 3 gets nothing (and keeps no state)
                        mine.append(Piece(i, self._group_of[i], r, a, b - a, row))
                row += math.ceil(n / W)
            ends = [row] * W
            for i in idx:  # Muon matrices: each one whole, in its owner's row
                if kinds[i] == "muon":
                    r = owner[i]
                    mine.append(Piece(i, self._group_of[i], r, 0, params[i].numel(), ends[r]))
                    ends[r] += params[i].numel()
            row = max(ends)
            slots = [Slot(pc.param, pc.start, pc.numel, pc.rank * row + pc.offset) for pc in mine if pc.numel]
            p0 = params[idx[0]]
            b = Bucket(len(buckets), idx, slots, W * row, p0.dtype, p0.device)
            b.extra.update(row=row, pieces=mine, local=[pc for pc in mine if pc.rank == self.rank],
                           what=f"ZeRO-{self.zero_stage} {'all-reduce' if self.zero_stage == 1 else 'reduce-scatter'}"
                                f" of bucket {len(buckets)}", gather_what=f"ZeRO all-gather of bucket {len(buckets)}")
            buckets.append(b)
            pieces += mine
        self._buckets = buckets
        self._bucketed = [False] * len(params)
        for i in order:
            self._bucketed[i] = True
        if self.collectives == "shm" and W > 1 and buckets:
            self._attach_shared_memory()
        self._local_by_param = {}
        for pc in pieces:
            if pc.rank == self.rank:
                self._local_by_param.setdefault(pc.param, []).append(pc)
        self._had_grad = [False] * len(params)
        self._reduced = False  # gradients reduced since the last step (by the hooks, or by hand)
        self._agreement = None  # (has_grad flags, clip coefficient) once clip_grad_norm_ has agreed
        if W > 1 and buckets:  # a world of one has nothing to reduce: step() updates from p.grad (_step_alone)
            self._engine = GradSync(params, buckets, self._launch, self._finish, names=self._names,
                                    observer=getattr(self, "_observer", None), stale=self._stale)
        self._plan_key = key
        return self._engine

    def _attach_shared_memory(self) -> None:
        """A shared-memory region per bucket (collective); where that cannot be, every rank falls back together."""
        from ..runtime import get_logger
        from ..shm import SharedMemoryAllReduce
        if {b.device.type for b in self._buckets} != {"cpu"} or self.group.comm_device.type != "cpu":
            raise ValueError(f"{type(self).__name__}(collectives='shm') reduces CPU tensors: the parameters must be "
                             f"on the CPU and the backend gloo")
        try:
            for b in self._buckets:
                b.extra["shm"] = SharedMemoryAllReduce(b.numel, b.dtype, self.group)
            # The agreement (one flag per parameter, and the squared norm): each rank writes its row, one barrier,
            # everyone adds up the rows. No closing barriers anywhere: a step runs reduce-scatter -> agreement ->
            # all-gather -> (next backward) reduce-scatter, and each of them has a barrier after its writes, so
            # between one operation's reads and the next write to the same memory there is always a barrier.
            self._shm_agree = SharedMemoryAllReduce(len(self._params) + 3, torch.float64, self.group)
        except (ValueError, OSError) as e:  # raised on every rank alike
            for b in self._buckets:
                b.extra.pop("shm", None)
            self._shm_agree = None
            get_logger().warning(f"{type(self).__name__}: shared memory unavailable, using the ring ({e})")

    @property
    def transport(self) -> str:
        """How the gradients travel: "shared memory", "the process group", or "none" (a world of one)."""
        if self.world_size == 1:
            return "none"
        return "shared memory" if any("shm" in b.extra for b in self._buckets) else "the process group"

    def local_pieces(self) -> list[Piece]:
        """The pieces this rank updates (and keeps optimizer state for)."""
        self._plan()
        return [pc for b in self._buckets for pc in b.extra["local"]]

    def _comm_device(self, bucket: Bucket) -> torch.device:
        if self.world_size == 1:
            return bucket.device
        if self.backend == "nccl" and bucket.device.type != "cuda":
            raise ValueError(f"{type(self).__name__}: the nccl backend moves CUDA tensors only, but some parameters "
                             f"are on {bucket.device}: move the model to the GPU (model.to('cuda')) or use gloo")
        return self.group.comm_device

    # ----------------------------------------------------------------------------- the engine's side

    def _launch(self, b: Bucket) -> Work:
        """Pack this bucket's gradients into its (world_size, row) buffer and start its reduction."""
        W, row = self.world_size, b.extra["row"]
        grads = [p.grad for p in self._params]
        for i in b.params:
            if grads[i] is not None:
                if grads[i].is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients, and "
                                       f"{self._names[i]} has one (nn.Embedding(sparse=True)): use sparse=False")
                self._had_grad[i] = True
        if self._pipeline is not None:
            self._pipeline.packed(b.params, grads)
        shm = b.extra.get("shm")
        # With shared memory the gradients go straight into this rank's row (padding stays zero from the start).
        send = shm.mine.view(W, row) if shm is not None else torch.zeros(W, row, dtype=b.dtype,
                                                                          device=self._comm_device(b))
        self._pack(b, send, grads)
        self._local_finite.add(send)
        if self.zero_stage == 1:
            if b.extra.get("pending"):
                diverge.note(self.group, f"it reduced bucket {b.index} again before a step (a backward without a step)")
            if shm is not None:
                b.extra["send"] = shm.all_reduce_().view(W, row).clone()
                return DONE
            b.extra["send"] = send
            return all_reduce_sum(send, self.group, b.extra["what"])
        b.extra["send"] = send
        for i in b.params:  # ZeRO-2: the full gradient is not kept; only this rank's reduced row will be
            self._params[i].grad = None
        shard = b.extra.get("shard")
        if shard is None or shard.device != send.device or shard.numel() != row:
            shard = b.extra["shard"] = torch.zeros(row, dtype=b.dtype, device=send.device)
        # A shard not yet consumed by step() (another backward without a step in between) is added to.
        out = torch.empty_like(shard) if b.extra.get("pending") else shard
        if b.extra.get("pending"):
            diverge.note(self.group, f"it reduced bucket {b.index} again before a step (a backward without a step)")
        b.extra["out"] = out
        if shm is not None:
            shm.reduce_scatter_(out, fence=False)  # see _attach_shared_memory: the next barrier fences it
            return DONE
        return reduce_scatter_sum(out, send, self.group, self.use_ring, b.extra["what"])

    def _blocks(self, b: Bucket) -> list[tuple]:
        """How each of this bucket's parameters travels: ("rows", i, offset, size) when its slices fill a
        (world_size, size) block of the buffer -- one strided view moves all of them -- else ("slots", i, slots)."""
        if "blocks" not in b.extra:
            W, blocks = self.world_size, []
            by_param: dict[int, list[Slot]] = {}
            for slot in b.slots:
                by_param.setdefault(slot.param, []).append(slot)
            kinds = {pc.param: self.param_groups[pc.group]["kind"] for pc in b.extra["pieces"]}
            for i in b.params:
                n, slots = self._params[i].numel(), by_param.get(i, [])
                if kinds.get(i) == "adamw" and n % W == 0 and len(slots) == W:
                    blocks.append(("rows", i, slots[0].offset, n // W))
                else:
                    blocks.append(("slots", i, slots))
            b.extra["blocks"] = blocks
        return b.extra["blocks"]

    def _pack(self, b: Bucket, send: torch.Tensor, grads: list) -> None:
        """Copy the bucket's gradients into their places in the (world_size, row) buffer, in one foreach call."""
        flat, dst, src = send.view(-1), [], []
        for block in self._blocks(b):
            g = grads[block[1]]
            if block[0] == "rows":
                _, i, offset, size = block
                view = send[:, offset:offset + size]
                if g is None:
                    view.zero_()
                else:
                    dst.append(view)
                    src.append(g.reshape(self.world_size, size))
            else:
                for slot in block[2]:
                    view = flat[slot.offset:slot.offset + slot.numel]
                    if g is None:
                        view.zero_()
                    else:
                        dst.append(view)
                        src.append(g.reshape(-1)[slot.start:slot.start + slot.numel])
        if dst:
            torch._foreach_copy_(dst, src)

    def _finish(self, missing: list[int]) -> None:
        """Every bucket's reduction is in: turn sums into averages (stage 2: into the shard kept; stage 1: into
        p.grad, the whole averaged gradient)."""
        self._local_finite.close()
        W = self.world_size
        for b in self._buckets:
            if self.zero_stage == 2:
                out = b.extra.pop("out")
                if W > 1:
                    out.div_(W)
                if out is not b.extra["shard"]:
                    b.extra["shard"].add_(out)
                b.extra.pop("send", None)  # only this rank's row is kept
            elif W > 1:  # stage 1: the whole buffer; step() writes it back to p.grad once the ranks agree
                b.extra["send"].div_(W)
            b.extra["pending"] = True
        self._reduced = True

    # ----------------------------------------------------------------------------- the protocol

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """False: backward only accumulates p.grad (micro-steps of gradient accumulation); True: the next
        backward reduces (the Trainer turns it on for the last micro-step). A world of one always just accumulates."""
        engine = self._plan()
        if engine is not None:
            engine.enabled = bool(requires_gradient_sync)

    def _reduce_now(self) -> None:
        engine = self._plan()
        if engine is None:  # a world of one (the gradients in p.grad are the averaged ones), or nothing trainable
            return
        if engine.pending:  # a backward was interrupted (an exception) before it finished: start over
            engine.reset()
        if not self._reduced:
            engine.sync()

    def _agree(self, clip_norm: float | None) -> tuple[list[bool], torch.Tensor | None, torch.Tensor | None]:
        """Which parameters had a gradient on any rank, and (when clipping) the global norm and the clip
        coefficient: one small all-reduce (optim/agreement.py). clip_norm=inf: the norm only, no coefficient."""
        if self.world_size == 1:
            return agree(self.group, [p.grad is not None for p in self._params], self._bucketed,
                         [p.grad for p in self._params if p.grad is not None], clip_norm, self._digest_check, "")
        parts = ([b.extra["shard"] if self.zero_stage == 2 else b.extra["send"][self.rank] for b in self._buckets]
                 if clip_norm is not None else [])
        return agree(self.group, self._had_grad, self._bucketed, parts, clip_norm, self._digest_check,
                     "ZeRO agreement (gradient flags and norm)", shm=getattr(self, "_shm_agree", None))

    @property
    def last_grad_norm(self) -> float | None:
        """The global norm of the averaged gradient at the last clip_grad_norm_ (or clipped step), as a float:
        reading it waits for the device, so read it when logging."""
        return None if self._last_norm is None else float(self._last_norm)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the averaged gradient by its global norm (over every rank's shard) and return that norm.
        Collective. The clipping is applied in the next step()."""
        self._reduce_now()
        has_grad, norm, coef = self._agree(float(max_norm))
        self._agreement = (has_grad, coef)
        self._last_norm = norm
        return norm

    # ----------------------------------------------------------------------------- the step

    @torch.no_grad()
    def step(self, closure=None):
        """Reduce (if backward did not), agree, update this rank's pieces, all-gather. Collective."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._reduce_now()
        if self._agreement is None:
            clip = self.max_grad_norm if self.max_grad_norm is not None and self.max_grad_norm > 0 else None
            has_grad, norm, coef = self._agree(clip)
            if clip is not None:
                self._last_norm = norm
        else:
            has_grad, coef = self._agreement
        if self.world_size == 1:
            self._step_alone(has_grad, coef)
            return loss
        gathers = []
        for b in self._buckets:
            gathers.append(self._update_bucket(b, has_grad, coef))
        for b, work in zip(self._buckets, gathers):
            if work is not None:
                work.wait()
                self._copy_gathered(b, has_grad)
        if self._pipeline is not None:
            self.recorded, self._pipeline = self._pipeline.finished(self._params), None
        self._consumed()
        return loss

    def _step_alone(self, has_grad: list[bool], coef: torch.Tensor | None) -> None:
        """A world of one: the plain optimizer. Each kind's update runs on p.grad and p themselves -- no buffer, no
        copy -- and p.grad stays (it is the whole averaged gradient; zero_grad() frees it, as with torch's)."""
        grads = [p.grad if h else None for p, h in zip(self._params, has_grad)]
        for i, g in enumerate(grads):
            if g is not None and g.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients, and {self._names[i]} "
                                   f"has one (nn.Embedding(sparse=True)): use sparse=False")
        if self._pipeline is not None:
            self._pipeline.packed(range(len(grads)), grads)
        present = [g for g in grads if g is not None]
        if coef is not None and present:
            torch._foreach_mul_(present, coef.to(present[0].device))
        by_group: dict[int, list] = {}
        for j, g in enumerate(grads):
            if g is None or j not in self._local_by_param:
                continue  # no gradient, or an empty parameter (no piece: nothing to update)
            p, group = self._params[j], self._group_of[j]
            state = self.state[p]
            if not state:
                state.update(self._init_state(p, self.param_groups[group]["kind"]))
            if self.param_groups[group]["kind"] == "muon":
                by_group.setdefault(group, []).append((state, g, p.detach()))
            else:
                by_group.setdefault(group, []).append((state, g.reshape(-1), self._flat[j]))
            if self._pipeline is not None:
                self._pipeline.reduced(self._local_by_param[j][0], g)
        for group, items in by_group.items():
            KINDS[self.param_groups[group]["kind"]].update(self.param_groups[group], items)
        if self._pipeline is not None:
            self.recorded, self._pipeline = self._pipeline.finished(self._params), None
        self._consumed()

    def _update_bucket(self, b: Bucket, has_grad: list[bool], coef: float | None) -> Work | None:
        if self.zero_stage == 1:
            if coef is not None:
                b.extra["send"].mul_(coef)
            self._write_back_grads(b, has_grad)
        mine = b.extra["shard"] if self.zero_stage == 2 else b.extra["send"][self.rank]
        if coef is not None and self.zero_stage == 2:
            mine.mul_(coef)
        shard = mine if mine.device == b.device else mine.to(b.device)
        # The (state, gradient, parameter) views of this rank's pieces, by param group: the same every step while
        # the shard buffer and the set of stepped parameters stay the same, so they are built once and reused.
        key = (shard.data_ptr(), tuple(has_grad[pc.param] for pc in b.extra["local"]))
        cached = b.extra.get("items")
        if cached is not None and cached[0] == key and self._pipeline is None:
            by_group = cached[1]
        else:
            by_group = self._update_items(b, shard, has_grad)
            b.extra["items"] = (key, by_group)
        for g, items in by_group.items():
            KINDS[self.param_groups[g]["kind"]].update(self.param_groups[g], items)
        if self.world_size == 1:
            return None
        # The updated pieces travel back in the row their gradients came in (one foreach copy for all of them).
        out = shard if self.zero_stage == 2 else torch.empty_like(shard)
        copies = b.extra.get("copy_out")
        if copies is None or copies[0] != out.data_ptr():
            pieces = [pc for pc in b.extra["local"] if pc.numel]
            copies = (out.data_ptr(), [out[pc.offset:pc.offset + pc.numel] for pc in pieces],
                      [self._flat[pc.param][pc.start:pc.start + pc.numel] for pc in pieces])
            b.extra["copy_out"] = copies
        if copies[1]:
            torch._foreach_copy_(copies[1], copies[2])
        if out.device != mine.device:
            out = out.to(mine.device)
        shm = b.extra.get("shm")
        if shm is not None:  # synchronous: the other ranks' pieces are copied out of the shared row right here
            shm.all_gather_(out, lambda rows: self._copy_gathered(b, has_grad, rows), fence=False)
            return None
        gathered = torch.empty(self.world_size, b.extra["row"], dtype=b.dtype, device=mine.device)
        b.extra["gathered"] = gathered
        return all_gather(gathered, out, self.group, self.use_ring, b.extra["gather_what"])

    def _update_items(self, b: Bucket, shard: torch.Tensor, has_grad: list[bool]) -> dict[int, list]:
        by_group: dict[int, list] = {}
        for pc in b.extra["local"]:
            if not has_grad[pc.param]:
                continue
            p = self._params[pc.param]
            kind = self.param_groups[pc.group]["kind"]
            grad, param = shard[pc.offset:pc.offset + pc.numel], self._flat[pc.param][pc.start:pc.start + pc.numel]
            state = self.state[p]
            if not state:  # lazily, like torch: state exists only for parameters that were stepped
                state.update(self._init_state(p, kind))
            if kind == "muon":
                grad, param = grad.view(p.shape), param.view(p.shape)
            by_group.setdefault(pc.group, []).append((state, grad, param))
            if self._pipeline is not None:
                self._pipeline.reduced(pc, grad)
        return by_group

    def _write_back_grads(self, b: Bucket, has_grad: list[bool]) -> None:
        """Stage 1: every p.grad becomes the whole averaged gradient (None where no rank had one)."""
        flat = b.extra["send"].view(-1)
        for s in b.slots:
            p = self._params[s.param]
            if not has_grad[s.param]:
                continue
            if p.grad is None or not p.grad.is_contiguous():
                p.grad = torch.zeros_like(p)
            p.grad.view(-1)[s.start:s.start + s.numel].copy_(flat[s.offset:s.offset + s.numel])

    def _copy_gathered(self, b: Bucket, has_grad: list[bool], rows: torch.Tensor | None = None) -> None:
        rows = b.extra.pop("gathered") if rows is None else rows
        flat, row = rows.reshape(-1), b.extra["row"]
        dst, src = [], []
        for block in self._blocks(b):
            i = block[1]
            if not has_grad[i]:
                continue
            if block[0] == "rows":  # every rank's slice at once (this rank's own comes back unchanged)
                _, i, offset, size = block
                dst.append(self._flat[i].view(self.world_size, size))
                src.append(rows[:, offset:offset + size])
            else:
                for slot in block[2]:
                    if slot.offset // row != self.rank:
                        at = slot.offset
                        dst.append(self._flat[i][slot.start:slot.start + slot.numel])
                        src.append(flat[at:at + slot.numel])
        if dst:
            torch._foreach_copy_(dst, src)

    def _init_state(self, p: torch.Tensor, kind: str) -> dict:
        if kind == "muon":
            return _muon.init_state(p)
        a, b = slice_bounds(p.numel(), self.world_size, self.rank)
        return _adamw.init_state((b - a,), p)

    def init_state(self) -> None:
        """Create (zero) state for every piece this rank updates that has none yet -- what the first step would
        create -- so that a checkpoint can be loaded into it before any step. No collective, no update."""
        self._plan()
        for j, pieces in self._local_by_param.items():
            p = self._params[j]
            if not self.state[p]:
                self.state[p].update(self._init_state(p, self.param_groups[pieces[0].group]["kind"]))
        for b in self._buckets:
            b.extra.pop("items", None)  # cached update views point at the old state

    def _consumed(self) -> None:
        """The reduced gradients were used: the next backward starts afresh."""
        self._reduced = False
        self._agreement = None
        self._had_grad = [False] * len(self._params)
        for b in self._buckets:
            b.extra["pending"] = False
            b.extra.pop("send", None)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's zero_grad, and the reduced gradients not yet stepped are dropped too."""
        super().zero_grad(set_to_none=set_to_none)
        if self._plan_key is not None:
            if self._reduced:
                for b in self._buckets:
                    if "shard" in b.extra:
                        b.extra["shard"].zero_()
            self._consumed()

    # ----------------------------------------------------------------------------- recording, memory

    def record_next_step(self) -> None:
        """Keep, for the next step only, what the pipeline does to every parameter on this rank (a
        PipelineRecorder, for drawing chapter 4's figure); afterwards `recorded` holds it. Call it before the
        backward whose gradients are to be recorded (or before step() when gradients are set by hand)."""
        self._plan()
        self._pipeline = PipelineRecorder(self._names, self._params, self.rank, self.world_size)

    def observe(self, observer) -> None:
        """Attach a nanodist.sync.Observer (e.g. BucketTimeline) to the gradient hooks; None detaches it. (A world of
        one has no hooks: nothing travels.)"""
        engine = self._plan()
        if engine is not None:
            engine.observer = observer
        self._observer = observer

    def gradient_buffers(self) -> list[torch.Tensor]:
        """The gradient memory this optimizer keeps between steps: at stage 2, this rank's averaged shards."""
        if self._engine is None or self.zero_stage != 2:
            return []
        return [b.extra["shard"] for b in self._buckets if "shard" in b.extra]

    # ----------------------------------------------------------------------------- state

    def _slice_dtensor(self, t: torch.Tensor, p: torch.Tensor):
        from torch.distributed.tensor import DTensor, Shard
        return DTensor.from_local(t, self.group.device_mesh, [Shard(0)], run_check=False, shape=(p.numel(),),
                                  stride=(1,))

    def state_dict(self) -> dict:
        """torch's layout, plus `zero`: who saved it. With several ranks each AdamW state tensor is a DTensor
        Shard(0) of the flattened parameter, shape (numel,) (this rank's slice, the same storage); Muon momenta
        are whole matrices, on their owner only; step counters are plain tensors, equal on every rank."""
        self._plan()
        sd = super().state_dict()
        for i in range(len(self._params)):
            # Every parameter has an entry, empty where this rank keeps nothing (another rank's Muon matrix): a
            # loader such as torch.distributed.checkpoint's set_state_dict then finds every name on every rank.
            sd["state"].setdefault(i, {})
        if self.world_size > 1:
            for i, st in sd["state"].items():
                p = self._params[i]
                if self.param_groups[self._group_of[i]]["kind"] == "adamw":
                    # torch hands out the live per-parameter dicts: wrap in a copy, never in the optimizer's own
                    sd["state"][i] = {k: self._slice_dtensor(v, p) if k in ("exp_avg", "exp_avg_sq") else v
                                      for k, v in st.items()}
        sd["zero"] = {"optimizer": type(self).__name__, "world_size": self.world_size, "rank": self.rank,
                      "zero_stage": self.zero_stage,
                      "layout": "adamw: slice r of the flattened parameter (torch.chunk) on rank r; "
                                "muon: whole matrices on their owner"}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what state_dict() saved: on the same rank of a run with the same world size, or as DTensors or
        whole tensors (what torch.distributed.checkpoint hands back), which are cut to this rank's pieces."""
        name = type(self).__name__
        meta = state_dict.get("zero")
        groups = state_dict.get("param_groups", [])
        if meta is None and not all("kind" in g for g in groups):
            raise ValueError(f"{name}.load_state_dict: this state dict has no 'zero' entry, so a sharded optimizer did "
                             f"not save it (a torch.optim state dict holds full, unsharded state). Load what "
                             f"{name}.state_dict() saved on this rank; converting full state to shards: "
                             f"{RESHARD_HINT}.")
        if meta is not None:
            if meta["optimizer"] != name:
                raise ValueError(f"{name}.load_state_dict: this state was saved by {meta['optimizer']}, not {name}")
            if meta["world_size"] > 1 and meta["world_size"] != self.world_size:  # a world of one saved it whole
                raise ValueError(
                    f"{name}.load_state_dict: this state is rank {meta['rank']}'s shard of a run with "
                    f"{meta['world_size']} ranks, but this run has {self.world_size}. A sharded state only fits the "
                    f"world size it was saved at -- {RESHARD_HINT}. Resume with {meta['world_size']} ranks.")
            if meta["world_size"] > 1 and meta["rank"] != self.rank:
                raise ValueError(f"{name}.load_state_dict: this state is rank {meta['rank']}'s shard, but this is "
                                 f"rank {self.rank}: every rank must load the state it saved itself (name files by "
                                 f"rank)")
        self._plan()
        if len(groups) != len(self.param_groups) or any(len(g["params"]) != len(h["params"])
                                                         for g, h in zip(groups, self.param_groups)):
            raise ValueError(f"{name}.load_state_dict: the saved state has param groups of sizes "
                             f"{[len(g['params']) for g in groups]}, this optimizer {[len(h['params']) for h in self.param_groups]}: "
                             f"build the optimizer as in the saved run")
        for g, h in zip(groups, self.param_groups):
            # torch's AdamW options that change the arithmetic and that DistAdamW does not have: loading would
            # drop max_exp_avg_sq (amsgrad), or minimize what the saved run maximized (maximize), silently
            options = [k for k in ("amsgrad", "maximize") if h["kind"] == "adamw" and g.get(k)]
            if options:
                raise ValueError(f"{name}.load_state_dict: the saved optimizer ran AdamW with "
                                 f"{' and '.join(f'{k}=True' for k in options)}, which {name} does not implement: "
                                 f"resume into torch.optim.AdamW with the same option (under DDP or FSDP), or "
                                 f"start {name} from fresh optimizer state")
        saved_ids = [i for g in groups for i in g["params"]]  # ints, or names (from get_state_dict)
        new_state = {}
        for j, key in enumerate(saved_ids):
            if not state_dict["state"].get(key):
                continue
            p, g = self._params[j], self._group_of[j]
            kind = self.param_groups[g]["kind"]
            if self.world_size > 1 and not any(pc.param == j for pc in self._local_by_param.get(j, ())):
                continue  # another rank's matrix (or 0-D parameter)
            new_state[p] = {k: self._local(v, p, kind, k) for k, v in state_dict["state"][key].items()}
        self.state.clear()
        self.state.update(new_state)
        for b in self._buckets:
            b.extra.pop("items", None)  # the cached update views point at the old state
        for mine, saved in zip(self.param_groups, groups):
            for k, v in saved.items():
                if k not in ("params", "param_names"):
                    mine[k] = v

    def _local(self, t, p: torch.Tensor, kind: str, key: str):
        """This rank's part of a saved state tensor: a DTensor's local slice, or a whole tensor cut to the slice."""
        if not torch.is_tensor(t):
            return t
        if is_dtensor(t):
            mesh_size = t.device_mesh.size()
            if mesh_size != self.world_size:
                raise ValueError(f"{type(self).__name__}.load_state_dict: {key} of a parameter is sharded over "
                                 f"{mesh_size} ranks but this run has {self.world_size}: load it through "
                                 f"torch.distributed.checkpoint, which reshards")
            t = t.to_local()
        elif key != "step" and kind == "adamw" and t.numel() == p.numel():
            # a whole tensor (a world of one saved it, or torch's AdamW, in the parameter's shape): this rank's slice
            a, b = slice_bounds(p.numel(), self.world_size, self.rank)
            t = t.reshape(-1)[a:b]
        return t.detach().clone().to(p.device if key != "step" else t.device)


class DistAdamW(ShardedOptimizer):
    """AdamW with optimizer state (and, at zero_stage=2, the averaged gradient) sharded over the ranks.

    Arguments as torch.optim.AdamW (lr, betas, eps, weight_decay, fused; param groups may override them), plus
    group, and zero_stage / bucket_cap_mb / collectives (see ShardedOptimizer). fused=None (the default) uses
    torch's fused AdamW kernel for parameters on a GPU and the foreach kernels on the CPU.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, group=None, *, fused: bool | None = None, zero_stage: int = 2,
                 bucket_cap_mb: float = 25.0, collectives: str = "auto"):
        super().__init__(params, kind="adamw",
                         adamw=dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused),
                         group=group, zero_stage=zero_stage, bucket_cap_mb=bucket_cap_mb, collectives=collectives)


class DistMuon(ShardedOptimizer):
    """torch.optim.Muon, with whole matrices distributed over the ranks and gradients averaged in backward.

    Same arguments and defaults as torch.optim.Muon, plus group and zero_stage / bucket_cap_mb / collectives
    (see ShardedOptimizer), and batched: Newton-Schulz over all same-shape matrices at once (None, the default:
    on a GPU; see optim/muon.py's update). Only 2-D parameters: give the others to an "adamw" group (make_muon_optimizer).
    """

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = _muon.DEFAULT_NS_COEFFICIENTS,
                 eps: float = _muon.DEFAULT_EPS, ns_steps: int = _muon.DEFAULT_NS_STEPS,
                 adjust_lr_fn: str | None = None, group=None, *, batched: bool | None = None, zero_stage: int = 2,
                 bucket_cap_mb: float = 25.0, collectives: str = "auto"):
        super().__init__(params, kind="muon",
                         muon=dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                   ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
                                   adjust_lr_fn=adjust_lr_fn, batched=batched),
                         group=group, zero_stage=zero_stage, bucket_cap_mb=bucket_cap_mb, collectives=collectives)


def make_muon_optimizer(model: nn.Module, *, lr: float = 3e-3, muon_lr: float = 0.02, weight_decay: float = 0.1,
                        muon_weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.95),
                        momentum: float = 0.95, exclude: tuple[str, ...] = ("lm_head",), group=None,
                        **kwargs) -> ShardedOptimizer:
    """One ShardedOptimizer: a "muon" group for the hidden matrices, "adamw" groups for the rest (weight decay
    on embeddings, none on 1-D parameters). kwargs (zero_stage, bucket_cap_mb, collectives) go to it."""
    if type(model).__name__ == "FSDP":
        raise ValueError("make_muon_optimizer: Muon orthogonalises whole matrices, and nanodist.FSDP keeps only a flat "
                         "slice of each on every rank. Use AdamW (or DistAdamW's element-wise update) with FSDP, or "
                         "DistMuon with a replicated model (DDP, ZeRO-1/2): chapter 5 explains why.")
    muon, groups = muon_adamw_groups(model, weight_decay, exclude)
    for g in groups:
        g["kind"] = "adamw"
    if muon:
        groups.append({"params": [p for _, p in muon], "param_names": [n for n, _ in muon], "kind": "muon"})
    return ShardedOptimizer(groups, kind="adamw", adamw=dict(lr=lr, betas=betas),
                            muon=dict(lr=muon_lr, weight_decay=muon_weight_decay, momentum=momentum),
                            group=group, **kwargs)
