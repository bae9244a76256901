"""ZeRO-1 over any torch optimizer: whole parameters dealt to the ranks, each rank steps only its own.

    opt = ZeroOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)   # no DDP wrapper
    loss.backward()          # each gradient is reduce-scattered to the rank that owns its parameter
    opt.step()               # every rank steps its own parameters, then all-gathers the updated ones
    opt.zero_grad()

The simplest ZeRO, and the one torch ships (torch.distributed.optim.ZeroRedundancyOptimizer): the optimizer's
state is what takes memory (AdamW: two tensors per parameter), so keep it for 1/N of the parameters on each rank.
The parameters are dealt out whole, largest first, each to the rank with the fewest elements so far; every rank
builds `optimizer_class` over its own parameters only, so any optimizer works -- SGD, Adagrad, Adafactor, yours --
without nanodist knowing its update. The price of whole parameters is balance: one embedding larger than the rest
of the model lands on one rank. DistAdamW (optim/sharded.py) cuts every tensor instead, which balances exactly
but needs an element-wise update.

How a step travels, through the gradient-sync engine (nanodist.sync) like DDP's and DistAdamW's: parameters are
grouped into buckets of about bucket_cap_mb in backward order; a bucket's buffer has one row per rank, row r holding
rank r's parameters of that bucket end to end. When the last gradient of a bucket arrives, its reduce-scatter
starts: rank r receives row r summed over the ranks -- the gradients of its own parameters -- and divides by N.
step() then agrees with the other ranks (which parameters had a gradient anywhere; the global norm when clipping;
the divergence detector's digest), points each owned parameter's .grad at its averaged gradient, runs the wrapped
optimizer, and all-gathers the rows, so every rank holds every updated parameter. Reduce-scatter plus all-gather
move what DDP's all-reduce moves, 2 (N-1)/N of the model per rank (`bytes_per_step` counts it, padding included),
where torch's ZeroRedundancyOptimizer behind DDP adds a broadcast of every parameter to DDP's all-reduce.

After a reduction a parameter this rank does not own has .grad None: its gradient lives on its owner. Gradient
accumulation: set_requires_gradient_sync(False) for the micro-steps (the Trainer does); without it each backward
is reduced and added to the last, which is also correct. `module=` keeps that module's buffers equal to rank 0's
at every step. The state (`state_dict()`) is torch's layout over all the parameters, with an entry only where
this rank owns the parameter; nanodist.checkpoint saves it by parameter name and loads it at any world size.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import diverge
from ..group import Group
from .agreement import agree
from ..sync import (Bucket, GradSync, LocalFinite, ReportsLocalFinite, Slot, all_gather, optimizer_params, pack_buckets,
                    reduce_scatter_sum, refuse_dtensors)
from .muon import deal  # Muon deals whole matrices the same way

HYPER_SKIP = ("params", "param_names")


class ZeroOptimizer(torch.optim.Optimizer, ReportsLocalFinite):
    """ZeRO-1 over `optimizer_class` (see the module docstring).

    - params: parameters or param groups, as for any torch optimizer; `**defaults` go to optimizer_class.
    - group: the ranks that share the work (default: the world). Build it after nanodist.init().
    - bucket_cap_mb: gradients travel in buckets of about this size.
    - module: a module whose buffers are made rank 0's at every step (as DDP's broadcast_buffers).

    `param_groups` are the global groups, so LR schedulers work as usual; their hyperparameters are handed to the
    wrapped optimizer at every step. `inner` is this rank's optimizer over the parameters it owns.
    Implements the Trainer's protocol: set_requires_gradient_sync and clip_grad_norm_ (the global norm).
    """

    def __init__(self, params, optimizer_class, *, group=None, bucket_cap_mb: float = 25.0, module=None, **defaults):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"ZeroOptimizer wraps a torch.optim.Optimizer class (e.g. torch.optim.SGD), got "
                            f"{optimizer_class!r}")
        if not bucket_cap_mb > 0:
            raise ValueError(f"ZeroOptimizer: bucket_cap_mb must be positive, got {bucket_cap_mb!r}")
        g = Group.resolve(group)
        self.group, self.world_size, self.rank = g, g.size, g.rank
        self.optimizer_class, self.bucket_cap_bytes, self.module = optimizer_class, int(bucket_cap_mb * 2**20), module
        self.inner: torch.optim.Optimizer | None = None
        self._owner: dict[int, int] = {}  # id(parameter) -> the rank that steps it
        self._load = [0] * g.size
        self._engine: GradSync | None = None
        self._plan_key = None
        self._reduced = False
        self._agreement = None
        self._last_norm = None
        self.bytes_per_step = 0  # what each rank sends in one step's reduce-scatter and all-gather
        self._digest_check = diverge.PendingCheck("ZeroOptimizer")
        self._local_finite = LocalFinite()
        super().__init__(params, defaults)
        refuse_dtensors(optimizer_params(self), "ZeroOptimizer")
        local = [{**{k: v for k, v in grp.items() if k not in HYPER_SKIP}, "params": self._mine(grp["params"])}
                 for grp in self.param_groups]
        self.inner = optimizer_class(local, **defaults)
        self.state = self.inner.state  # one state, the wrapped optimizer's: memory accounting and tools see it
        for grp, inner in zip(self.param_groups, self.inner.param_groups):  # the wrapped optimizer's own defaults
            for k, v in inner.items():
                if k not in HYPER_SKIP:
                    grp.setdefault(k, v)
        self._plan()

    # ----------------------------------------------------------------------------- ownership

    def add_param_group(self, param_group: dict) -> None:
        """torch's add_param_group; during training (unfreezing a layer) the new parameters are dealt to the
        least-loaded ranks and the wrapped optimizer gets their group; the buckets are re-planned."""
        super().add_param_group(param_group)
        new = self.param_groups[-1]["params"]
        fresh = [p for p in new if id(p) not in self._owner]
        for p, r in zip(fresh, deal([p.numel() for p in fresh], self.world_size, self._load)):  # updates _load
            self._owner[id(p)] = r
        if self.inner is not None:
            grp = self.param_groups[-1]
            self.inner.add_param_group({**{k: v for k, v in grp.items() if k not in HYPER_SKIP},
                                        "params": self._mine(new)})
            for k, v in self.inner.param_groups[-1].items():
                if k not in HYPER_SKIP:
                    grp.setdefault(k, v)

    def _mine(self, params) -> list:
        return [p for p in params if self._owner.get(id(p)) == self.rank]

    def owner(self, p: torch.Tensor) -> int:
        """The rank that steps parameter p (and keeps its optimizer state)."""
        return self._owner[id(p)]

    # ----------------------------------------------------------------------------- the layout

    def _layout_key(self) -> tuple:
        return tuple((id(p), tuple(p.shape), p.dtype, p.device, p.requires_grad)
                     for grp in self.param_groups for p in grp["params"])

    def _stale(self) -> bool:
        return self._layout_key() != self._plan_key

    def _plan(self) -> GradSync | None:
        """Buckets (one row per rank: its parameters end to end) and the engine's hooks; again when a parameter is
        frozen, unfrozen or added -- never while reduced gradients wait for their step."""
        key = self._layout_key()
        if key == self._plan_key or (self._reduced and self._engine is not None):
            return self._engine
        if self._engine is not None:
            self._engine.remove()
            self._engine = None
        W = self.world_size
        params = [p for grp in self.param_groups for p in grp["params"]]
        self._params = params
        order = [i for i in reversed(range(len(params))) if params[i].numel() > 0 and params[i].requires_grad]
        self._stepped = [False] * len(params)
        for i in order:
            self._stepped[i] = True
        buckets = []
        for run in pack_buckets([params[i] for i in order], self.bucket_cap_bytes):
            idx = [order[j] for j in run]
            ends = [0] * W
            place = {}
            for i in idx:
                r = self._owner[id(params[i])]
                place[i] = (r, ends[r])
                ends[r] += params[i].numel()
            row = max(max(ends), 1)
            slots = [Slot(i, 0, params[i].numel(), place[i][0] * row + place[i][1]) for i in idx]
            p0 = params[idx[0]]
            b = Bucket(len(buckets), idx, slots, W * row, p0.dtype, p0.device)
            b.extra.update(row=row, mine=[(i, place[i][1]) for i in idx if place[i][0] == self.rank],
                           what=f"ZeRO-1 reduce-scatter of bucket {len(buckets)}",
                           gather_what=f"ZeRO-1 all-gather of bucket {len(buckets)}")
            buckets.append(b)
        self._buckets = buckets
        self.bytes_per_step = sum(2 * (W - 1) * b.extra["row"] * torch.empty((), dtype=b.dtype).element_size()
                                  for b in buckets)
        self._had_grad = [False] * len(params)
        self._reduced, self._agreement = False, None
        if W > 1 and buckets:
            names = [f"parameter {i}" for i in range(len(params))]
            self._engine = GradSync(params, buckets, self._launch, self._finish, names=names, stale=self._stale)
        self._plan_key = key
        return self._engine

    # ----------------------------------------------------------------------------- the engine's side

    def _launch(self, b: Bucket):
        W, row = self.world_size, b.extra["row"]
        grads = [p.grad for p in self._params]
        for i in b.params:
            if grads[i] is not None:
                self._had_grad[i] = True
        if b.extra.get("pending"):
            diverge.note(self.group, f"it reduced bucket {b.index} again before a step (a backward without a step)")
        device = self.group.comm_device if self.group.backend == "nccl" else b.device
        send = torch.zeros(W * row, dtype=b.dtype, device=device)
        b.pack(send, grads)
        self._local_finite.add(send)
        for i in b.params:  # the gradient now travels to its owner; the owner's .grad is set again at step()
            self._params[i].grad = None
        shard = b.extra.get("shard")
        if shard is None or shard.device != send.device:
            shard = b.extra["shard"] = torch.zeros(row, dtype=b.dtype, device=send.device)
        out = torch.empty_like(shard) if b.extra.get("pending") else shard
        b.extra["out"] = out
        return reduce_scatter_sum(out, send.view(W, row), self.group, ring=self.group.backend == "gloo",
                                  what=b.extra["what"])

    def _finish(self, missing) -> None:
        self._local_finite.close()
        for b in self._buckets:
            out = b.extra.pop("out")
            out.div_(self.world_size)
            if out is not b.extra["shard"]:
                b.extra["shard"].add_(out)
            b.extra["pending"] = True
        self._reduced = True

    # ----------------------------------------------------------------------------- the protocol

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """False: backward only accumulates p.grad (micro-steps); True: the next backward reduces."""
        engine = self._plan()
        if engine is not None:
            engine.enabled = bool(requires_gradient_sync)

    def _reduce_now(self) -> None:
        engine = self._plan()
        if engine is None:
            return
        if engine.pending:
            engine.reset()
        if not self._reduced:
            engine.sync()

    def _owned_grads(self) -> list[tuple[int, torch.Tensor]]:
        """(index, this rank's averaged gradient of it) for the parameters it owns."""
        out = []
        for b in self._buckets:
            shard = b.extra["shard"]
            for i, at in b.extra["mine"]:
                out.append((i, shard[at:at + self._params[i].numel()]))
        return out

    def _agree(self, clip_norm: float | None):
        """Which parameters had a gradient on any rank, the global norm and clip coefficient (clip_norm given),
        and the divergence detector's digest: one small all-reduce (optim/agreement.py)."""
        if self.world_size == 1:
            return agree(self.group, [p.grad is not None for p in self._params], self._stepped,
                         [p.grad for p in self._params if p.grad is not None], clip_norm, self._digest_check, "")
        parts = [g for _, g in self._owned_grads()] if clip_norm is not None else []
        return agree(self.group, self._had_grad, self._stepped, parts, clip_norm, self._digest_check,
                     "ZeRO-1 agreement (gradient flags and norm)")

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the averaged gradient by its global norm (every owner's part) and return the norm. Collective."""
        self._reduce_now()
        has_grad, norm, coef = self._agree(float(max_norm))
        self._agreement = (has_grad, coef)
        self._last_norm = norm
        return norm

    @property
    def last_grad_norm(self) -> float | None:
        return None if self._last_norm is None else float(self._last_norm)

    # ----------------------------------------------------------------------------- the step

    @torch.no_grad()
    def step(self, closure=None):
        """Reduce (if backward did not), agree, step the wrapped optimizer on this rank's parameters, all-gather."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._reduce_now()
        if self._agreement is None:
            self._agreement = self._agree(None)[0], None  # no clipping asked: only which parameters had a gradient
        has_grad, coef = self._agreement
        if self.world_size == 1:
            if coef is not None:
                for p in self._params:
                    if p.grad is not None:
                        p.grad.mul_(coef)
        else:
            for i, g in self._owned_grads():
                p = self._params[i]
                if has_grad[i]:
                    if coef is not None:
                        g.mul_(coef)
                    p.grad = g.view_as(p)
                else:
                    p.grad = None
        for grp, inner in zip(self.param_groups, self.inner.param_groups):  # an LR scheduler changed ours
            for k, v in grp.items():
                if k not in HYPER_SKIP:
                    inner[k] = v
        self.inner.step()
        if self.world_size > 1:
            self._gather(has_grad)
        if self.module is not None and self.world_size > 1:
            with diverge.waiting(diverge.issue(self.group, "ZeRO-1 buffer broadcast")):
                for buf in self.module.buffers():
                    dist.broadcast(buf.data, src=self.group.global_rank(0), group=self.group.pg)
        self._consumed()
        return loss

    def _gather(self, has_grad: list[bool]) -> None:
        """Every rank's updated parameters, row by row (the gradients' buckets, in reverse)."""
        W = self.world_size
        for b in self._buckets:
            row = b.extra["row"]
            # One buffer per bucket, gathered in place (this rank's row is its input): no other allocation. The
            # padding at a row's end is sent but never read.
            rows = torch.empty(W, row, dtype=b.dtype, device=b.extra["shard"].device)
            out = rows[self.rank]
            for i, at in b.extra["mine"]:
                out[at:at + self._params[i].numel()].copy_(self._params[i].detach().reshape(-1))
            all_gather(rows, out, self.group, ring=self.group.backend == "gloo", what=b.extra["gather_what"]).wait()
            flat = rows.reshape(-1)
            dst, src = [], []
            for s in b.slots:
                if s.offset // row != self.rank and has_grad[s.param]:
                    dst.append(self._params[s.param].detach().view(-1))
                    src.append(flat[s.offset:s.offset + s.numel])
            if dst:
                torch._foreach_copy_(dst, src)

    def _consumed(self) -> None:
        self._reduced, self._agreement = False, None
        self._had_grad = [False] * len(self._params)
        for b in self._buckets:
            b.extra["pending"] = False  # the next reduction overwrites the shard
        if self.world_size > 1:
            for i, _ in self._owned_grads():
                self._params[i].grad = None  # views of the shard: a backward must not add into them

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's zero_grad on every parameter, and reduced gradients not yet stepped are dropped."""
        for p in self._params:
            p.grad = None
        if self._reduced:
            self._consumed()

    # ----------------------------------------------------------------------------- state

    def state_dict(self) -> dict:
        """torch's layout over all the parameters (the global groups' order): the wrapped optimizer's state under
        each owned parameter's index, an empty entry for the others; `zero1` says who saved it."""
        self._plan()
        index = {id(p): i for i, p in enumerate(self._params)}
        inner = self.inner.state_dict()
        local = [p for grp in self.inner.param_groups for p in grp["params"]]
        state = {i: {} for i in range(len(self._params))}
        for k, st in inner["state"].items():
            state[index[id(local[k])]] = st
        groups, at = [], 0
        for grp in self.param_groups:
            groups.append({**{k: v for k, v in grp.items() if k != "params"},
                           "params": list(range(at, at + len(grp["params"])))})
            at += len(grp["params"])
        return {"state": state, "param_groups": groups,
                "zero1": {"optimizer": self.optimizer_class.__name__, "world_size": self.world_size,
                          "layout": "whole parameters; each rank holds the state of the ones it owns"}}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what state_dict() saved, at this or any world size (each rank keeps the entries of the parameters
        it owns now), or a torch optimizer's state dict of the same parameters."""
        self._plan()
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(len(g["params"]) != len(h["params"])
                                                         for g, h in zip(groups, self.param_groups)):
            raise ValueError(f"ZeroOptimizer.load_state_dict: the saved state has param groups of sizes "
                             f"{[len(g['params']) for g in groups]}, this optimizer "
                             f"{[len(h['params']) for h in self.param_groups]}: build it as in the saved run")
        saved_ids = [k for g in groups for k in g["params"]]
        local = [p for grp in self.inner.param_groups for p in grp["params"]]
        where = {id(p): j for j, p in enumerate(local)}
        state = {}
        for i, key in enumerate(saved_ids):
            st = state_dict["state"].get(key)
            p = self._params[i]
            if st and id(p) in where:
                state[where[id(p)]] = {k: v.to(p.device) if torch.is_tensor(v) and k != "step" else v
                                       for k, v in st.items()}
        for mine, saved in zip(self.param_groups, groups):
            for k, v in saved.items():
                if k not in HYPER_SKIP:
                    mine[k] = v
        inner_groups, at = [], 0
        for grp, saved in zip(self.inner.param_groups, groups):
            inner_groups.append({**{k: v for k, v in saved.items() if k not in HYPER_SKIP},
                                 "params": list(range(at, at + len(grp["params"])))})
            at += len(grp["params"])
        self.inner.load_state_dict({"state": state, "param_groups": inner_groups})
        self.state = self.inner.state  # torch's load replaced it

    def gradient_buffers(self) -> list[torch.Tensor]:
        """The gradient memory kept between steps: this rank's averaged rows (its parameters' gradients)."""
        return [b.extra["shard"] for b in self._buckets if "shard" in b.extra]

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (tensors only)."""
        return sum(t.numel() * t.element_size() for st in self.state.values() for t in st.values()
                   if torch.is_tensor(t))
