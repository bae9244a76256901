"""Is a distributed set-up the same training as one process? Models that look like users' models, and a runner.

    from nanodist import parity
    report = parity.compare(["ddp", "zero2", "fsdp"], steps=4)     # on every rank, after nanodist.init()
    parity.print_report(report)                                      # one line per set-up: worst deviation, where

Every wrapper in nanodist is proven against its reference here, on the same models (tests/test_parity.py at world
sizes 1, 2 and 3), and Chapter 7 hands the same runner to the reader as a parity harness.

The models (`UserModel`) have what the course's GPT does not, and what breaks wrappers on a user's first day:
a frozen block, a frozen parameter inside a trainable layer, layer norms, a bare nn.Parameter in every block and
a 0-dimensional one at the top, an output layer tied to the embedding, buffers (one that counts calls, one
constant), and a branch (`aux`) used only on every other call, so some steps give it no gradient at all.

The data (`batch`) is one global batch per step, cut into equal rows per rank: a mean over ranks of each rank's
mean loss is the one-process mean loss, so every data-parallel set-up computes the same averaged gradient as one
process, up to the order of floating-point sums.

A set-up (`SETUPS`, a registry: add your own with `register`; "zero1-any" is ZeroOptimizer over torch's AdamW) builds the wrapped model and its optimizer from a
fresh model on every rank; the runner trains it for k steps on `batch`, gathers every parameter whole, and
`compare` measures it against one process trained on the whole batch with the set-up's reference optimizer.
"""
from __future__ import annotations

from dataclasses import dataclass
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


# ----------------------------------------------------------------------------- set-ups

@dataclass(frozen=True)
class Setup:
    """How to train a model one way: build(model, group) -> (module to call, optimizer); full(module) -> every
    parameter whole by the bare model's names, on every rank; reference: which one-process optimizer it must
    equal ("adamw" or "muon")."""

    name: str
    build: Callable
    full: Callable
    reference: str = "adamw"
    needs_group: bool = False  # only with a process group (torch's wrappers)


SETUPS: dict[str, Setup] = {}


def register(setup: Setup) -> Setup:
    """Add a set-up to the registry (a name already there is replaced)."""
    SETUPS[setup.name] = setup
    return setup


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def _trainable(module: nn.Module):
    return [p for p in module.parameters() if p.requires_grad]


def _replicated(module: nn.Module) -> dict:
    bare = getattr(module, "module", module)
    return {n: p.detach().clone() for n, p in bare.named_parameters(remove_duplicate=False)}


def _muon_reference(model):
    from .optim import MuonAdamW
    return MuonAdamW(model, lr=LR, weight_decay=WEIGHT_DECAY)


def _muon_sharded(model, group, **kw):
    from .optim import make_muon_optimizer
    return make_muon_optimizer(model, lr=LR, weight_decay=WEIGHT_DECAY, group=group, **kw)


def _fsdp_full(module) -> dict:
    return module.full_state_dict(all_ranks=True)


def _fsdp2(model, group):
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
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model.aux, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, _adamw(_trainable(model))


def _fsdp2_full(module) -> dict:
    out = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        out[n] = full_tensor(p).detach().clone()
        if n in getattr(module, "parity_scalars", ()):
            out[n] = out[n].reshape(())
    return out


def _torch_ddp(model, group):
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(model, process_group=group.pg, find_unused_parameters=True), _adamw(_trainable(model))


def _register_builtins() -> None:
    from .ddp import DDP
    from .fsdp import FSDP
    from .optim import DistAdamW, ZeroOptimizer

    register(Setup("one-process", lambda m, g: (m, _adamw(_trainable(m))), _replicated))
    register(Setup("ddp", lambda m, g: (DDP(m, group=g, find_unused_parameters=True),
                                        _adamw(_trainable(m))), _replicated))
    register(Setup("torch-ddp", _torch_ddp, _replicated, needs_group=True))
    # The sharded optimizers get every parameter, frozen ones included, as torch.optim.AdamW does.
    register(Setup("zero1", lambda m, g: (m, DistAdamW(m.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, group=g,
                                                       zero_stage=1)), _replicated))
    register(Setup("zero2", lambda m, g: (m, DistAdamW(m.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, group=g)),
                   _replicated))
    register(Setup("zero1-any", lambda m, g: (m, ZeroOptimizer(m.parameters(), torch.optim.AdamW, group=g, module=m,
                                                               lr=LR, weight_decay=WEIGHT_DECAY)), _replicated))
    register(Setup("muon", lambda m, g: (m, _muon_sharded(m, g)), _replicated, reference="muon"))
    register(Setup("fsdp", lambda m, g: _fsdp_with_adamw(FSDP(m, units=[*m.blocks, m.aux], group=g)), _fsdp_full))
    register(Setup("fsdp2", _fsdp2, _fsdp2_full, needs_group=True))


def _fsdp_with_adamw(fsdp):
    return fsdp, _adamw([p for p in fsdp.parameters() if p.requires_grad])


# ----------------------------------------------------------------------------- the runner

def train(setup: str | Setup, steps: int = 4, group=None, model_fn: Callable = UserModel) -> dict:
    """Train `setup` for `steps` steps on `batch` (this rank's share), on every rank of `group` (a collective).
    Returns {"losses": the mean loss over ranks per step, "params": every parameter whole, by name}."""
    s = SETUPS[setup] if isinstance(setup, str) else setup
    g = Group.resolve(group)
    module, opt = s.build(model_fn(), g)
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


def print_report(report: dict, file=None) -> None:
    for name, r in report.items():
        print(f"{name:12s} parameters off one process by {r['param_dev']:.1e} of what training moved them "
              f"(worst: {r['worst'] or '-'}), losses within {r['loss_dev']:.1e}; frozen ones moved "
              f"{r['frozen_moved']:.1e}", file=file)


_register_builtins()
