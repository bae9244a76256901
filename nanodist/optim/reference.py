"""The unsharded reference the sharded Muon is measured against: torch.optim.Muon on the hidden matrices and
torch.optim.AdamW on the rest, stepped as one optimizer (lab 4's DistMuon / MuonAdamW comparison)."""
from __future__ import annotations

import torch
from torch import nn

from . import muon as _muon


def muon_adamw_groups(model: nn.Module, weight_decay: float, exclude: tuple[str, ...]):
    """(muon, adamw groups): the hidden matrices for Muon; the rest as AdamW groups with weight decay on the
    matrices (embeddings, the output layer) and none on 1-D parameters."""
    muon, adamw = _muon.split_params_for_muon(model, exclude)
    decay = [(n, p) for n, p in adamw if p.ndim >= 2]
    no_decay = [(n, p) for n, p in adamw if p.ndim < 2]
    groups = [{"params": [p for _, p in ps], "param_names": [n for n, _ in ps], "weight_decay": wd}
              for ps, wd in ((decay, weight_decay), (no_decay, 0.0)) if ps]
    return muon, groups


class MuonAdamW(torch.optim.Optimizer):
    """torch.optim.Muon on the hidden matrices and torch.optim.AdamW on the rest, stepped as one optimizer: the
    unsharded reference DistMuon is measured against (lab 4). The same split and hyperparameters as
    make_muon_optimizer; AdamW is torch's fused kernel on a GPU. The two share their param-group dicts and one
    state mapping with this object, so an LR scheduler, zero_grad() and state_dict() see everything."""

    def __init__(self, model: nn.Module, *, lr: float = 3e-3, muon_lr: float = 0.02, weight_decay: float = 0.1,
                 muon_weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.95), momentum: float = 0.95,
                 exclude: tuple[str, ...] = ("lm_head",)):
        if not hasattr(torch.optim, "Muon"):
            raise RuntimeError(f"MuonAdamW is torch.optim.Muon beside AdamW, and torch.optim.Muon exists from torch 2.9 "
                               f"on; this is torch {torch.__version__}: upgrade torch (pip install 'torch>=2.9')")
        muon, groups = muon_adamw_groups(model, weight_decay, exclude)
        fused = any(p.is_cuda for g in groups for p in g["params"])
        # Each group says its rule ("kind"), as make_muon_optimizer's do: a checkpoint of one loads into the other.
        self.adamw = torch.optim.AdamW([{**g, "kind": "adamw"} for g in groups], lr=lr, betas=betas,
                                       fused=fused or None)
        self.muon = torch.optim.Muon([{"params": [p for _, p in muon], "param_names": [n for n, _ in muon],
                                       "kind": "muon"}],
                                     lr=muon_lr, weight_decay=muon_weight_decay, momentum=momentum) if muon else None
        inner = self.adamw.param_groups + (self.muon.param_groups if self.muon else [])
        super().__init__(inner, {})  # torch keeps the very dicts it is given: one set of groups for all three
        self._share()
        for part in (self.adamw, self.muon):
            if part is not None:
                part.nanodist_inner = True  # stepped by this one: nanodist.DDP counts this optimizer's steps only

    def _share(self) -> None:
        """Point the two halves at this optimizer's param-group dicts and state (again after a load, which
        replaces both)."""
        n = len(self.adamw.param_groups)
        self.adamw.param_groups, self.adamw.state = self.param_groups[:n], self.state
        if self.muon is not None:
            self.muon.param_groups, self.muon.state = self.param_groups[n:], self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._share()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.adamw.step()
        if self.muon is not None:
            self.muon.step()
        return loss
