"""DistMuon: Muon with whole matrices dealt out to the ranks, and the helpers that pair it with DistAdamW.

    opt = make_muon_optimizer(model, lr=3e-3, muon_lr=0.02)    # DistMuon for hidden matrices, DistAdamW for the rest
    loss.backward(); opt.step(); opt.zero_grad()

Muon (Keller Jordan) replaces a matrix's momentum by its "orthogonalised" version -- the same singular
vectors, singular values pushed towards 1 -- computed by a few Newton-Schulz iterations in bf16. That
needs the *whole* matrix, so instead of slicing every parameter (DistAdamW), DistMuon deals whole
matrices out to the ranks, largest first, each to the rank with the least work so far. Rank r's
matrices lie end to end in row r of the bucket's buffer: the reduce-scatter hands each rank the
averaged gradients of exactly its matrices, it orthogonalises and updates those, and the all-gather
brings every updated matrix to every rank. More ranks than matrices is fine: some ranks just idle.

The update is torch.optim.Muon's (same arguments, defaults and math; we call torch's own
Newton-Schulz and learning-rate rule when this torch has them, torch >= 2.9).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .adamw import DistAdamW
from .common import CombinedOptimizer, Piece, ShardedOptimizer

# Keller Jordan's constants, as in torch.optim.Muon.
DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
DEFAULT_EPS = 1e-7
DEFAULT_NS_STEPS = 5


def _newton_schulz(grad: torch.Tensor, ns_coefficients=DEFAULT_NS_COEFFICIENTS, ns_steps: int = DEFAULT_NS_STEPS,
                   eps: float = DEFAULT_EPS) -> torch.Tensor:
    """Orthogonalise a matrix: U S V^T -> about U S' V^T with S' in roughly [0.5, 1.5] (a copy of torch's).

    Scale so the spectral norm is at most 1 (the Frobenius norm bounds it), then iterate the quintic
    X <- a X + (b A + c A^2) X with A = X X^T, which pushes every singular value towards 1. In bf16.
    """
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if len(grad.shape) != 2:
        raise ValueError("Input tensor gradient must be a 2D matrix")
    if len(ns_coefficients) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")
    a, b, c = ns_coefficients
    x = grad.bfloat16()
    if grad.size(0) > grad.size(1):  # work on the wide orientation: the Gram matrix X X^T is the small one
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A^2
        x = torch.addmm(x, poly, x, beta=a)  # a X + (b A + c A^2) X
    if grad.size(0) > grad.size(1):
        x = x.T
    return x


def _adjust_lr_rule(lr: float, adjust_lr_fn: str | None, param_shape) -> float:
    """torch.optim.Muon's learning-rate scaling by the matrix's shape (A rows, B columns)."""
    A, B = param_shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, A / B))  # Keller Jordan: the update's RMS independent of the aspect ratio
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(A, B))  # Moonshot: the update's RMS matches AdamW's, reuse AdamW's lr
    else:
        ratio = 1.0
    return lr * ratio


try:  # torch >= 2.9 ships Muon: use its own functions, so DistMuon follows torch.optim.Muon exactly
    from torch.optim._muon import _adjust_lr as adjust_lr
    from torch.optim._muon import _zeropower_via_newtonschulz as newton_schulz
except ImportError:  # pragma: no cover - older torch: the copies above (tests check they match torch's)
    newton_schulz, adjust_lr = _newton_schulz, _adjust_lr_rule


def newton_schulz_singular_values(matrix: torch.Tensor, ns_steps: int = DEFAULT_NS_STEPS,
                                  ns_coefficients=DEFAULT_NS_COEFFICIENTS, eps: float = DEFAULT_EPS) -> dict:
    """Singular values of a matrix before and after Newton-Schulz, for plotting what Muon does to an update.

    Returns {"before": singular values of matrix / ||matrix||_F (the scaled input), "after": those of
    the orthogonalised matrix, "per_step": one tensor after each of 0..ns_steps iterations}; float32,
    descending. "after" == per_step[-1].
    """
    if matrix.dim() != 2:
        raise ValueError(f"newton_schulz_singular_values needs a matrix, got shape {tuple(matrix.shape)}")
    m = matrix.detach().float()
    per_step = [torch.linalg.svdvals(newton_schulz(m, ns_coefficients, k, eps).float()) for k in range(ns_steps + 1)]
    before = torch.linalg.svdvals(m / m.norm().clamp(min=eps))
    return {"before": before, "after": per_step[-1], "per_step": per_step}


class DistMuon(ShardedOptimizer):
    """torch.optim.Muon, with whole matrices distributed over the ranks and gradients averaged inside step().

    Same arguments and defaults as torch.optim.Muon, plus group and zero_stage / bucket_cap_mb /
    collectives (see ShardedOptimizer). Only 2-D parameters: give the others to DistAdamW
    (split_params_for_muon sorts a model's parameters, make_muon_optimizer builds both).
    """

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
                 eps: float = DEFAULT_EPS, ns_steps: int = DEFAULT_NS_STEPS, adjust_lr_fn: str | None = None,
                 group=None, *, zero_stage: int = 2, bucket_cap_mb: float = 25.0,
                 collectives: str = "auto"):
        # torch.optim.Muon's checks and messages; the Newton-Schulz ones too, up front, so that no rank
        # fails in the middle of a step while the others wait in a collective.
        if not 0.0 <= lr:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not 0.0 <= momentum:
            raise ValueError(f"momentum should be >= 0 but is: {momentum}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
        if adjust_lr_fn is not None and adjust_lr_fn not in ("original", "match_rms_adamw"):
            raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")
        if not 0 <= ns_steps < 100:
            raise ValueError(f"ns_steps must be in 0..99 (Number of steps must be less than 100 for computational "
                             f"efficiency), got {ns_steps}")
        if len(ns_coefficients) != 3:
            raise ValueError("Coefficients must be a tuple of exactly 3 values")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        super().__init__(params, defaults, group=group, zero_stage=zero_stage,
                         bucket_cap_mb=bucket_cap_mb, collectives=collectives)

    def _check_param(self, p, where):
        if p.ndim != 2:
            raise ValueError(f"Muon only supports 2D parameters whereas we found a parameter with size: {p.size()} "
                             f"({where}). Optimise it with DistAdamW (split_params_for_muon sorts a model's "
                             f"parameters into the two).")

    def _layout(self, items):
        """Whole matrices to ranks: largest first, each to the least-loaded rank (ties: the lowest rank).

        Every rank computes the same deal from the shapes alone, so no one has to be told.
        """
        W = self.world_size
        load, owned = [0] * W, [[] for _ in range(W)]
        for index, group, numel in sorted(items, key=lambda t: (-t[2], t[0])):
            r = min(range(W), key=lambda k: (load[k], k))
            owned[r].append((index, group, numel))
            load[r] += numel
        pieces = []
        for r in range(W):
            offset = 0
            for index, group, numel in sorted(owned[r]):
                pieces.append(Piece(index, group, r, 0, numel, offset))
                offset += numel
        return pieces, max(load)  # shorter rows are padded with zeros

    def _update(self, group, items):
        """torch.optim.Muon's update, on the matrices this rank owns."""
        lr, weight_decay, momentum = group["lr"], group["weight_decay"], group["momentum"]
        for p, grad, param in items:  # flat views of whole matrices
            grad, param = grad.view(p.shape), param.view(p.shape)
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad)
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1 - momentum)  # B = mu B + (1 - mu) g
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            update = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
            param.mul_(1 - lr * weight_decay)
            param.add_(update, alpha=-adjust_lr(lr, group["adjust_lr_fn"], param.shape))


# ----------------------------------------------------------------------------- pairing Muon with AdamW

def split_params_for_muon(model: nn.Module, exclude: tuple[str, ...] = ("lm_head",)):
    """Sort a model's trainable parameters nanochat-style: returns (muon, adamw), lists of (name, parameter).

    Muon gets the hidden matrices: 2-D weights of nn.Linear layers. AdamW gets everything else: embeddings
    (also when tied to the output layer), the output layer itself (modules named in `exclude`), biases,
    norms and scalars. A tied weight is listed once.
    """
    linear, embedding, excluded = set(), set(), set()
    for mname, module in model.named_modules():
        leaf = mname.rsplit(".", 1)[-1]
        for p in module.parameters(recurse=False):
            if isinstance(module, nn.Embedding):
                embedding.add(id(p))
            elif isinstance(module, nn.Linear) and p.ndim == 2:
                linear.add(id(p))
            if leaf in exclude:
                excluded.add(id(p))
    muon, adamw = [], []
    for name, p in model.named_parameters():  # yields a shared parameter once
        if not p.requires_grad:
            continue
        is_hidden_matrix = id(p) in linear and id(p) not in embedding and id(p) not in excluded
        (muon if is_hidden_matrix else adamw).append((name, p))
    return muon, adamw


def make_muon_optimizer(model: nn.Module, *, lr: float = 3e-3, muon_lr: float = 0.02, weight_decay: float = 0.1,
                        muon_weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.95),
                        momentum: float = 0.95, exclude: tuple[str, ...] = ("lm_head",), group=None,
                        **kwargs) -> CombinedOptimizer:
    """DistMuon for the hidden matrices, DistAdamW for the rest (weight decay on embeddings, none on 1-D),
    stepped together. kwargs (zero_stage, bucket_cap_mb, collectives) go to both."""
    muon, adamw = split_params_for_muon(model, exclude)
    decay = [(n, p) for n, p in adamw if p.ndim >= 2]
    no_decay = [(n, p) for n, p in adamw if p.ndim < 2]
    groups = [{"params": [p for _, p in ps], "param_names": [n for n, _ in ps], "weight_decay": wd}
              for ps, wd in ((decay, weight_decay), (no_decay, 0.0)) if ps]
    optimizers = [DistAdamW(groups, lr=lr, betas=betas, group=group, **kwargs)]
    if muon:
        optimizers.append(DistMuon([{"params": [p for _, p in muon], "param_names": [n for n, _ in muon]}],
                                   lr=muon_lr, weight_decay=muon_weight_decay, momentum=momentum,
                                   group=group, **kwargs))
    return CombinedOptimizer(optimizers)
