"""Is a distributed set-up the same training as one process? Models that look like users' models, and a runner.

    from nanodist import parity
    report = parity.compare(["ddp", "zero2", "fsdp"], steps=4)     # on every rank, after nanodist.init()
    parity.print_report(report)                                      # one line per set-up: worst deviation, where

    report = parity.harness(model_fn=MyModel, batches=my_batches, optimizer=parity.OptimizerSpec(torch.optim.AdamW,
                            {"lr": 1e-3}))                           # your model: the first step and tensor where
    parity.print_harness(report)                                     # a set-up leaves one process, or none

Every wrapper in nanodist is proven against its reference here, on the same models (tests/test_parity.py at world
sizes 1, 2 and 3), and Chapter 7 hands the same runner to the reader as a parity harness.

The models (`UserModel`) have what the course's GPT does not, and what breaks wrappers on a user's first day:
a frozen block, a frozen parameter inside a trainable layer, layer norms, a bare nn.Parameter in every block and
a 0-dimensional one at the top, an output layer tied to the embedding, buffers (one that counts calls, one
constant), and a branch (`aux`) used only on every other call, so some steps give it no gradient at all.

A second family, `ConvNet` on `images`, is nothing like a language model (convolutions, a group norm, a
classifier head): the harness is shown and tested on both.

The data (`batch`) is one global batch per step, cut into equal rows per rank: a mean over ranks of each rank's
mean loss is the one-process mean loss, so every data-parallel set-up computes the same averaged gradient as one
process, up to the order of floating-point sums.

A set-up (`SETUPS`, a registry: add your own with `register`; "zero1-any" is ZeroOptimizer over torch's AdamW) builds the wrapped model and its optimizer from a
fresh model on every rank; the runner trains it for k steps on `batch`, gathers every parameter whole, and
`compare` measures it against one process trained on the whole batch with the set-up's reference optimizer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .group import Group
from .state import full_tensor

VOCAB, DIM, SEQ, GLOBAL_BATCH = 13, 8, 6, 12  # GLOBAL_BATCH divides by 1, 2, 3, 4, 6, 12 ranks
LR, WEIGHT_DECAY = 1e-2, 0.1


class Block(nn.Module):
    """A residual block: a layer norm, a linear layer and a bare nn.Parameter (a per-channel gain)."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)
        self.gain = nn.Parameter(torch.full((dim,), 0.5))

    def forward(self, h):
        return h + self.gain * torch.tanh(self.fc(self.norm(h)))


class UserModel(nn.Module):
    """A small language model with every awkward thing users' models have (see the module docstring).

    forward(x, y) -> (logits, loss), as the course's GPT (the Trainer's protocol). `blocks` are the natural FSDP
    units; `aux` is used on odd calls only (counted by the `calls` buffer, which is the same on every rank)."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, layers: int = 3, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.aux = nn.Linear(dim, dim, bias=False)
        self.temperature = nn.Parameter(torch.tensor(1.0))  # 0-D
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("offset", torch.linspace(-0.1, 0.1, dim))
        with torch.no_grad():  # the same weights from a seed, whatever the global RNG holds
            for p in self.parameters():
                if p.ndim:
                    p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.ndim > 1 else 0.1) + (p.ndim == 1) * 0.5)
        if layers > 1:
            self.blocks[1].requires_grad_(False)  # a frozen block
        self.blocks[0].fc.bias.requires_grad_(False)  # a frozen parameter beside trainable ones

    def forward(self, x, y=None):
        h = self.emb(x) + self.offset
        for block in self.blocks:
            h = block(h)
        if int(self.calls) % 2 == 1:
            h = h + torch.tanh(self.aux(h))
        self.calls += 1
        logits = self.head(h) * self.temperature
        loss = None if y is None else F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        return logits, loss


def batch(step: int, rank: int = 0, world_size: int = 1, global_batch: int = GLOBAL_BATCH, seq: int = SEQ,
          vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s global batch of token sequences (x, y) -- the same on every machine -- and this rank's equal
    share of its rows (world_size must divide global_batch)."""
    if global_batch % world_size:
        raise ValueError(f"parity.batch: {world_size} ranks cannot share {global_batch} rows equally; choose a "
                         f"global_batch that world_size divides")
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (global_batch, seq + 1), generator=g)
    rows = global_batch // world_size
    mine = tokens[rank * rows:(rank + 1) * rows]
    return mine[:, :-1], mine[:, 1:]


class ConvNet(nn.Module):
    """A second family, nothing like a language model: a small image classifier (convolutions, a group norm --
    per sample, so data parallelism is exact; a batch norm would need SyncBatchNorm -- and a linear head);
    forward(x, y) -> (logits, loss). Train it on `images`."""

    def __init__(self, seed: int = 3):
        super().__init__()
        torch.manual_seed(seed)
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.head = nn.Linear(16, 10)

    def forward(self, x, y):
        h = torch.relu(self.conv2(torch.relu(self.norm(self.conv1(x)))))
        logits = self.head(h.mean(dim=(2, 3)))
        return logits, F.cross_entropy(logits, y)


def images(step: int, rank: int = 0, world_size: int = 1, global_batch: int = GLOBAL_BATCH):
    """ConvNet's data: step `step`'s global batch of 8x8 RGB images and labels, this rank's equal share of it."""
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(global_batch, 3, 8, 8, generator=g), torch.randint(0, 10, (global_batch,), generator=g)
    rows = global_batch // world_size
    return x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]


# ----------------------------------------------------------------------------- set-ups

@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer a set-up trains with: a torch.optim class and its keyword arguments (the harness builds it
    for one process and for each set-up, over the parameters each one holds)."""

    cls: type = torch.optim.AdamW
    kwargs: dict = field(default_factory=lambda: {"lr": LR, "weight_decay": WEIGHT_DECAY})

    def make(self, params):
        return self.cls(params, **self.kwargs)


ADAMW = OptimizerSpec()


class SetupUnsupported(ValueError):
    """A set-up cannot train with the optimizer asked for (raised when it is built, before any collective)."""


@dataclass(frozen=True)
class Setup:
    """How to train a model one way: build(model, group[, optimizer]) -> (module to call, optimizer); full(module)
    -> every parameter whole by the bare model's names, on every rank; reference: which one-process optimizer it
    must equal ("adamw" or "muon"); takes_optimizer: build accepts an OptimizerSpec (the harness's optimizer=);
    grads(module) -> every averaged gradient whole by name, where the set-up holds them so after backward (None:
    it keeps them sharded or reduces them in its step)."""

    name: str
    build: Callable
    full: Callable
    reference: str = "adamw"
    needs_group: bool = False  # only with a process group (torch's wrappers)
    takes_optimizer: bool = False
    grads: Callable | None = None

    def make(self, model, group, optimizer: OptimizerSpec | None = None):
        if self.takes_optimizer:
            return self.build(model, group, optimizer or ADAMW)
        if optimizer is not None and optimizer != ADAMW:
            raise SetupUnsupported(f"parity: set-up {self.name!r} builds its own optimizer; it cannot train with "
                                   f"{optimizer.cls.__name__}")
        return self.build(model, group)


SETUPS: dict[str, Setup] = {}


def register(setup: Setup) -> Setup:
    """Add a set-up to the registry (a name already there is replaced)."""
    SETUPS[setup.name] = setup
    return setup


def _adamw(params):
    return ADAMW.make(params)


def _trainable(module: nn.Module):
    return [p for p in module.parameters() if p.requires_grad]


def _replicated(module: nn.Module) -> dict:
    bare = getattr(module, "module", module)
    return {n: p.detach().clone() for n, p in bare.named_parameters(remove_duplicate=False)}


def _replicated_grads(module: nn.Module) -> dict:
    bare = getattr(module, "module", module)
    return {n: p.grad.detach().clone() for n, p in bare.named_parameters() if p.grad is not None}


def _fsdp2_grads(module: nn.Module) -> dict:
    out = {}
    for n, p in module.named_parameters():
        if p.grad is not None:
            g = full_tensor(p.grad).detach().clone()
            out[n] = g.reshape(()) if n in getattr(module, "parity_scalars", ()) else g
    return out


def _units(model: nn.Module) -> list[nn.Module]:
    """The FSDP units of a model: its own `fsdp_units()` if it has one, the course-style `blocks` (and `aux`), else
    every direct child that holds parameters."""
    if hasattr(model, "fsdp_units"):
        return list(model.fsdp_units())
    if hasattr(model, "blocks"):
        return [*model.blocks] + ([model.aux] if hasattr(model, "aux") else [])
    return [c for c in model.children() if any(True for _ in c.parameters())]


def _muon_reference(model):
    from .optim import MuonAdamW
    return MuonAdamW(model, lr=LR, weight_decay=WEIGHT_DECAY)


def _muon_sharded(model, group, **kw):
    from .optim import make_muon_optimizer
    return make_muon_optimizer(model, lr=LR, weight_decay=WEIGHT_DECAY, group=group, **kw)


def _fsdp_full(module) -> dict:
    return module.full_state_dict(all_ranks=True)


def _fsdp2(model, group, optimizer: OptimizerSpec = ADAMW):
    from torch.distributed.fsdp import fully_shard
    mesh = group.device_mesh
    # FSDP2 refuses 0-D parameters ("change it to a 1-D tensor with numel 1", its own advice): so be it, and
    # full() gives them back their shape.
    model.parity_scalars = []
    for mname, m in model.named_modules():
        for attr, p in list(m._parameters.items()):
            if p is not None and p.ndim == 0:
                setattr(m, attr, nn.Parameter(p.detach().reshape(1), requires_grad=p.requires_grad))
                model.parity_scalars.append(f"{mname}.{attr}" if mname else attr)
    for unit in _units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, optimizer.make(_trainable(model))


def _fsdp2_full(module) -> dict:
    out = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        out[n] = full_tensor(p).detach().clone()
        if n in getattr(module, "parity_scalars", ()):
            out[n] = out[n].reshape(())
    return out


def _torch_ddp(model, group, optimizer: OptimizerSpec = ADAMW):
    from torch.nn.parallel import DistributedDataParallel
    return (DistributedDataParallel(model, process_group=group.pg, find_unused_parameters=True),
            optimizer.make(_trainable(model)))


def _torch_zero1(model, group, optimizer: OptimizerSpec = ADAMW):
    """torch's own ZeRO-1: torch DDP averages the gradients, ZeroRedundancyOptimizer keeps each rank's share of the
    optimizer state and broadcasts the updated parameters."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    module = _torch_ddp(model, group, optimizer)[0]
    return module, ZeroRedundancyOptimizer(_trainable(model), optimizer_class=optimizer.cls, process_group=group.pg,
                                           **optimizer.kwargs)


def _zero(model, group, optimizer: OptimizerSpec, stage: int):
    """ZeRO with the harness's optimizer: nanodist's DistAdamW for AdamW (stage 1 or 2), ZeroOptimizer (stage 1)
    over any other torch optimizer; stage 2 is DistAdamW's or DistMuon's only."""
    from .optim import DistAdamW, ZeroOptimizer
    if optimizer.cls is torch.optim.AdamW:
        extra = set(optimizer.kwargs) - {"lr", "betas", "eps", "weight_decay", "fused"}
        if extra:
            raise SetupUnsupported(f"parity: DistAdamW takes lr, betas, eps, weight_decay and fused, not "
                                   f"{', '.join(sorted(extra))}")
        return model, DistAdamW(model.parameters(), group=group, zero_stage=stage, **optimizer.kwargs)
    if stage == 1:
        return model, ZeroOptimizer(model.parameters(), optimizer.cls, group=group, module=model, **optimizer.kwargs)
    raise SetupUnsupported(f"parity: ZeRO-2 here is DistAdamW (or DistMuon): not {optimizer.cls.__name__}; use "
                           f"zero1-any")


def _register_builtins() -> None:
    from .ddp import DDP
    from .fsdp import FSDP
    from .optim import ZeroOptimizer

    register(Setup("one-process", lambda m, g, o: (m, o.make(_trainable(m))), _replicated, takes_optimizer=True,
                   grads=_replicated_grads))
    register(Setup("ddp", lambda m, g, o: (DDP(m, group=g, find_unused_parameters=True), o.make(_trainable(m))),
                   _replicated, takes_optimizer=True, grads=_replicated_grads))
    register(Setup("torch-ddp", _torch_ddp, _replicated, needs_group=True, takes_optimizer=True,
                   grads=_replicated_grads))
    # The sharded optimizers get every parameter, frozen ones included, as torch.optim.AdamW does.
    register(Setup("zero1", lambda m, g, o: _zero(m, g, o, 1), _replicated, takes_optimizer=True))
    register(Setup("torch-zero1", _torch_zero1, _replicated, needs_group=True, takes_optimizer=True,
                   grads=_replicated_grads))
    register(Setup("zero2", lambda m, g, o: _zero(m, g, o, 2), _replicated, takes_optimizer=True))
    register(Setup("zero1-any", lambda m, g, o: (m, ZeroOptimizer(m.parameters(), o.cls, group=g, module=m,
                                                                  **o.kwargs)), _replicated, takes_optimizer=True))
    register(Setup("muon", lambda m, g: (m, _muon_sharded(m, g)), _replicated, reference="muon"))
    register(Setup("fsdp", lambda m, g, o: _fsdp_with(FSDP(m, units=_units(m), group=g), o), _fsdp_full,
                   takes_optimizer=True))
    register(Setup("fsdp2", _fsdp2, _fsdp2_full, needs_group=True, takes_optimizer=True, grads=_fsdp2_grads))


def _fsdp_with(fsdp, optimizer: OptimizerSpec):
    return fsdp, optimizer.make([p for p in fsdp.parameters() if p.requires_grad])


# ----------------------------------------------------------------------------- the runner

def train(setup: str | Setup, steps: int = 4, group=None, model_fn: Callable = UserModel) -> dict:
    """Train `setup` for `steps` steps on `batch` (this rank's share), on every rank of `group` (a collective).
    Returns {"losses": the mean loss over ranks per step, "params": every parameter whole, by name}."""
    s = SETUPS[setup] if isinstance(setup, str) else setup
    g = Group.resolve(group)
    module, opt = s.make(model_fn(), g)
    losses = []
    for step in range(steps):
        x, y = batch(step, g.rank, g.size)
        loss = module(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        if g.size > 1:
            dist.all_reduce(mean, group=g.pg)
            mean /= g.size
        losses.append(float(mean))
    return {"losses": losses, "params": s.full(module)}


def reference(kind: str = "adamw", steps: int = 4, model_fn: Callable = UserModel) -> dict:
    """One process on the whole batch, with the reference optimizer: what every set-up must equal. No collective."""
    model = model_fn()
    opt = _muon_reference(model) if kind == "muon" else _adamw(_trainable(model))
    losses = []
    for step in range(steps):
        x, y = batch(step)
        loss = model(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "params": _replicated(model)}


def deviation(got: dict, want: dict, init: dict) -> tuple[float, str]:
    """How far a set-up's parameters are from one process's, relative to how far training moved them: the largest
    |got - want| over every element, divided by the largest |want - init| (so 1e-3 says: a thousandth of the
    training's own step). Returns it and the parameter where it is largest."""
    if set(got) != set(want):
        raise ValueError(f"parity: the set-up names {sorted(set(got) ^ set(want))} differently from one process")
    moved = max(float((want[n].float() - init[n].float()).abs().max()) for n in want)
    if moved == 0:
        raise ValueError("parity: one process did not change any parameter: nothing to compare (train longer, or "
                         "with a larger learning rate)")
    worst, where = 0.0, ""
    for n, w in want.items():
        d = float((got[n].float() - w.float()).abs().max()) / moved
        if d > worst:
            worst, where = d, n
    return worst, where


def compare(setups, steps: int = 4, group=None, model_fn: Callable = UserModel) -> dict:
    """Train each set-up and one process; per set-up: {"param_dev" (see deviation), "worst" (the parameter),
    "loss_dev" (the largest relative difference of a step's loss), "moved" (the largest change of any parameter
    in one process: "equal" is not "never trained"), "frozen_moved" (the largest change of a frozen parameter in
    the set-up: must be 0)}. A collective: call it on every rank of `group`."""
    model = model_fn()
    init = _replicated(model)
    frozen = [n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad]
    refs, out = {}, {}
    for name in setups:
        s = SETUPS[name]
        if s.needs_group and not dist.is_initialized():
            continue
        if s.reference not in refs:
            refs[s.reference] = reference(s.reference, steps, model_fn)
        ref, got = refs[s.reference], train(s, steps, group, model_fn)
        dev, where = deviation(got["params"], ref["params"], init)
        loss_dev = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
        moved = max(float((ref["params"][n] - init[n]).abs().max()) for n in init)
        out[name] = {"param_dev": dev, "worst": where, "loss_dev": loss_dev, "moved": moved,
                     "frozen_moved": max((float((got["params"][n] - init[n]).abs().max()) for n in frozen),
                                         default=0.0)}
    return out


# ----------------------------------------------------------------------------- the harness: where does it leave?

@dataclass(frozen=True)
class Tolerance:
    """How far a set-up may stray from one process before the harness calls it a divergence, per quantity. fp32
    sums taken in another order (per rank, then across ranks) stay far below: at most 1.3e-6 of the training's
    movement in the parameters here (tests/test_parity.py), ~1e-7 in losses and norms."""

    loss: float = 1e-5  # relative to one process's loss at that step
    grad_norm: float = 1e-5  # relative to one process's global gradient norm
    grad: float = 1e-4  # of the largest |element| of that gradient in one process
    param: float = 1e-4  # of the largest distance training has moved any parameter from its start (`deviation`)


def _steps(setup: Setup | None, steps: int, group, model_fn, batches, optimizer, reference: str = "adamw") -> list[dict]:
    """Train for `steps` steps; per step: the loss (mean over ranks), the global gradient norm, every averaged
    gradient whole (where the set-up holds them after backward; else None) and every parameter whole after the
    step. setup None: one process on the whole batch (no collective), with `optimizer`, or Muon for a "muon"
    reference."""
    from .parallel import gradient_sync
    g = Group.resolve(group) if setup is not None else None
    rank, world = (g.rank, g.size) if g is not None else (0, 1)
    model = model_fn()
    if setup is None:
        module = model
        opt = _muon_reference(model) if reference == "muon" else optimizer.make(_trainable(model))
        sync, grads_of, full = None, _replicated_grads, _replicated
    else:
        module, opt = setup.make(model, g, optimizer)
        sync, grads_of, full = gradient_sync(module, opt, g), setup.grads, setup.full
    rows = []
    for step in range(steps):
        x, y = batches(step, rank, world)
        loss = module(x, y)[1]
        loss.backward()
        grads = grads_of(module) if grads_of is not None else None
        if sync is None:
            norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], math.inf)
        else:
            norm = sync.clip_grad_norm_(math.inf)  # collective where the gradient is sharded; clips nothing
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean, group=g.pg)
            mean /= world
        rows.append({"loss": float(mean), "grad_norm": float(norm), "grads": grads, "params": full(module)})
    return rows


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def first_divergence(got: list[dict], want: list[dict], init: dict, tol: Tolerance = Tolerance()) -> dict:
    """Compare a set-up's steps with one process's, step by step and, within a step, in the order they happen
    (loss, gradients, gradient norm, parameters after the update). Returns {"diverged": None, or the first
    {"step", "quantity", "tensor", "deviation", "tolerance"} beyond its tolerance; "worst": per quantity, the
    largest deviation seen and where}."""
    worst: dict = {}
    first = None

    def see(step, quantity, tensor, dev, limit):
        nonlocal first
        if quantity not in worst or dev > worst[quantity]["deviation"]:
            worst[quantity] = {"deviation": dev, "step": step, "tensor": tensor}
        if first is None and dev > limit:
            first = {"step": step, "quantity": quantity, "tensor": tensor, "deviation": dev, "tolerance": limit}

    for step, (a, b) in enumerate(zip(got, want)):
        see(step, "loss", None, _relative(a["loss"], b["loss"]), tol.loss)
        if a["grads"] is not None:
            if set(a["grads"]) != set(b["grads"]):
                missing = sorted(set(a["grads"]) ^ set(b["grads"]))
                see(step, "gradient", missing[0], math.inf, tol.grad)  # a gradient one side has, the other not
            else:
                # each gradient against its own scale, floored at a thousandth of the step's largest (a gradient
                # that is zero in one process must be zero here too, within that floor)
                top = max((float(w.abs().max()) for w in b["grads"].values()), default=0.0)
                dev, where = max(((float((a["grads"][n] - w).abs().max()) / max(float(w.abs().max()), 1e-3 * top,
                                                                              1e-30), n)
                                  for n, w in b["grads"].items()), default=(0.0, None))
                see(step, "gradient", where, dev, tol.grad)
        see(step, "gradient norm", None, _relative(a["grad_norm"], b["grad_norm"]), tol.grad_norm)
        moved = max(float((b["params"][n].float() - init[n].float()).abs().max()) for n in b["params"])
        dev, where = max(((float((a["params"][n].float() - w.float()).abs().max()) / max(moved, 1e-30), n)
                          for n, w in b["params"].items()), default=(0.0, None))
        see(step, "parameters", where, dev, tol.param)
    return {"diverged": first, "worst": worst}


def harness(setups=("ddp", "torch-ddp", "zero1", "torch-zero1", "zero2", "fsdp", "fsdp2"), *, model_fn: Callable = UserModel,
            batches: Callable = batch, optimizer: OptimizerSpec = ADAMW, steps: int = 4, tol: Tolerance = Tolerance(),
            group=None) -> dict:
    """The parity harness for your model: train it one process on the whole batch and under each set-up for
    `steps` steps, and report, per set-up, the first step and quantity (loss, gradient, gradient norm, parameters)
    and tensor where it leaves one process beyond `tol` -- or that it never did.

    model_fn() -> a fresh model (the same weights on every call: seed inside it), whose forward(x, y) returns
    (output, loss) with the loss a mean over the batch; batches(step, rank, world_size) -> (x, y), the rank's
    equal share of the step's global batch (world_size 1: all of it); optimizer: the class and arguments every
    set-up trains with. A collective: call it on every rank (after nanodist.init(); torch's set-ups need a
    process group). Set-ups that cannot train with the optimizer are reported as skipped, with why (decided when
    the set-up is built, alike on every rank); any other error is raised."""
    one = {}
    out = {}
    for name in setups:
        s = SETUPS[name]
        if s.needs_group and not dist.is_initialized():
            out[name] = {"skipped": "needs a process group"}
            continue
        try:
            got = _steps(s, steps, group, model_fn, batches, optimizer)
        except SetupUnsupported as e:
            out[name] = {"skipped": str(e)}
            continue
        if s.reference not in one:
            one[s.reference] = _steps(None, steps, None, model_fn, batches, optimizer, reference=s.reference)
        init = _replicated(model_fn())
        out[name] = {**first_divergence(got, one[s.reference], init, tol), "steps": steps,
                     "grads_compared": s.grads is not None}
    return out


def print_harness(report: dict, file=None) -> None:
    """One line per set-up: where it first left one process, or that it never did (with its largest deviations)."""
    for name, r in report.items():
        if "skipped" in r:
            print(f"{name:12s} skipped: {r['skipped']}", file=file)
            continue
        d = r["diverged"]
        if d is None:
            worst = ", ".join(f"{q} {w['deviation']:.1e}" for q, w in r["worst"].items())
            print(f"{name:12s} no divergence in {r['steps']} steps (largest: {worst})"
                  + ("" if r["grads_compared"] else "; its gradients are not held whole after backward: not "
                                                    "compared"), file=file)
        else:
            what = {"loss": "the loss is off by {d} of itself",
                    "gradient": "the gradient of {t} is off by {d} of its largest element",
                    "gradient norm": "the gradient norm is off by {d} of itself",
                    "parameters": "parameter {t} is off by {d} of what training moved the parameters"}[d["quantity"]]
            print(f"{name:12s} DIVERGES at step {d['step']}: " + what.format(t=d["tensor"], d=f"{d['deviation']:.1e}")
                  + f" (tolerance {d['tolerance']:.0e})", file=file)


def print_report(report: dict, file=None) -> None:
    for name, r in report.items():
        print(f"{name:12s} parameters off one process by {r['param_dev']:.1e} of what training moved them "
              f"(worst: {r['worst'] or '-'}), losses within {r['loss_dev']:.1e}; frozen ones moved "
              f"{r['frozen_moved']:.1e}", file=file)


_register_builtins()
