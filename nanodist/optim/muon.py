"""Muon's update, on the whole matrices this rank owns (the math only; the sharding is in sharded.py).

    opt = make_muon_optimizer(model, lr=3e-3, muon_lr=0.02)    # Muon for hidden matrices, AdamW for the rest
    loss.backward(); opt.step(); opt.zero_grad()

Muon (Keller Jordan) replaces a matrix's momentum by its "orthogonalised" version -- the same singular
vectors, singular values pushed towards 1 -- computed by a few Newton-Schulz iterations in bf16. That
needs the *whole* matrix, so instead of cutting every parameter (DistAdamW), DistMuon deals whole
matrices out to the ranks (`deal`), largest first, each to the rank with the least work so far. The
deal depends only on the matrices' sizes, their order and the number of ranks, so every rank computes
it alone, and a checkpoint knows where each momentum lives. More ranks than matrices is fine: some
ranks just idle.

The update is torch.optim.Muon's (same arguments, defaults and math; we call torch's own
Newton-Schulz and learning-rate rule when this torch has them, torch >= 2.9).
"""
from __future__ import annotations

import math

import torch
from torch import nn


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


DEFAULTS = dict(lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True, ns_coefficients=DEFAULT_NS_COEFFICIENTS,
                eps=DEFAULT_EPS, ns_steps=DEFAULT_NS_STEPS, adjust_lr_fn=None,  # torch.optim.Muon's
                batched=None)  # ours: Newton-Schulz batched over same-shape matrices (None: on a GPU)


def check(group: dict) -> None:
    """torch.optim.Muon's argument checks and messages; the Newton-Schulz ones too, up front, so that no rank
    fails in the middle of a step while the others wait in a collective."""
    if not 0.0 <= group["lr"]:
        raise ValueError(f"Learning rate should be >= 0 but is: {group['lr']}")
    if not 0.0 <= group["momentum"]:
        raise ValueError(f"momentum should be >= 0 but is: {group['momentum']}")
    if not 0.0 <= group["weight_decay"]:
        raise ValueError(f"weight decay should be >= 0 but is: {group['weight_decay']}")
    if group["adjust_lr_fn"] is not None and group["adjust_lr_fn"] not in ("original", "match_rms_adamw"):
        raise ValueError(f"Adjust learning rate function {group['adjust_lr_fn']} is not supported")
    if not 0 <= group["ns_steps"] < 100:
        raise ValueError(f"ns_steps must be in 0..99 (Number of steps must be less than 100 for computational "
                         f"efficiency), got {group['ns_steps']}")
    if len(group["ns_coefficients"]) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")
    if group.get("batched") not in (None, True, False):
        raise ValueError(f"batched must be True, False or None (None: batched on a GPU), got {group['batched']!r}")
    group["ns_coefficients"] = tuple(group["ns_coefficients"])


def check_param(p: torch.Tensor, where: str) -> None:
    if p.ndim != 2:
        raise ValueError(f"Muon only supports 2D parameters whereas we found a parameter with size: {p.size()} "
                         f"({where}). Optimise it with DistAdamW (split_params_for_muon sorts a model's "
                         f"parameters into the two).")


def deal(numels: list[int], world_size: int, load: list[int] | None = None) -> list[int]:
    """The owner of each matrix (or whole parameter): largest first, each to the least-loaded rank (ties: the lower
    index, the lower rank), starting from `load` (elements each rank owns already; updated in place). Depends only
    on the sizes, their order, world_size and load."""
    load = [0] * world_size if load is None else load
    owner = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(world_size), key=lambda k: (load[k], k))
        owner[i] = r
        load[r] += numels[i]
    return owner


def init_state(matrix: torch.Tensor) -> dict:
    return {"momentum_buffer": torch.zeros_like(matrix)}


def newton_schulz_batched(grads: torch.Tensor, ns_coefficients=DEFAULT_NS_COEFFICIENTS,
                          ns_steps: int = DEFAULT_NS_STEPS, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """newton_schulz on a stack of same-shape matrices (B, rows, cols) at once: the same operations, as batched
    matrix multiplies -- ns_steps x 3 kernel launches for the whole stack instead of for every matrix. Each
    matrix is scaled by its own norm, so every slice of the result is the one newton_schulz gives it."""
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if grads.dim() != 3:
        raise ValueError(f"newton_schulz_batched needs a stack of matrices (B, rows, cols), got shape "
                         f"{tuple(grads.shape)}")
    a, b, c = ns_coefficients
    tall = grads.size(1) > grads.size(2)
    x = grads.bfloat16()
    if tall:  # the wide orientation: the Gram matrices X X^T are the small ones
        x = x.mT
    x = x / x.norm(dim=(1, 2), keepdim=True).clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A^2
        x = torch.baddbmm(x, poly, x, beta=a)  # a X + (b A + c A^2) X
    return x.mT if tall else x


def update(group: dict, items: list[tuple[dict, torch.Tensor, torch.Tensor]]) -> None:
    """torch.optim.Muon's update. The matrices of one shape go through momentum and the parameter update
    together (foreach kernels); Newton-Schulz runs batched over them (batched=True, the default on a GPU), or
    matrix by matrix as torch.optim.Muon does -- the default on the CPU, where launches are cheap and it keeps
    the result bitwise torch's (a batched bf16 matrix multiply may round differently from a single one, by a
    bf16 ulp). items: (state, averaged gradient, parameter), whole matrices."""
    lr, weight_decay, momentum = group["lr"], group["weight_decay"], group["momentum"]
    by_shape: dict[tuple, list] = {}
    for item in items:
        by_shape.setdefault((tuple(item[2].shape), item[2].dtype, item[2].device), []).append(item)
    for (shape, _, _), same in by_shape.items():
        states, grads, params = (list(x) for x in zip(*same))
        bufs = [st["momentum_buffer"] for st in states]
        torch._foreach_lerp_(bufs, grads, 1 - momentum)  # B = mu B + (1 - mu) g
        steps = torch._foreach_lerp(grads, bufs, momentum) if group["nesterov"] else bufs
        batched = group.get("batched")
        if batched is None:
            batched = params[0].is_cuda
        if len(steps) == 1 or not batched:
            ortho = [newton_schulz(step, group["ns_coefficients"], group["ns_steps"], group["eps"]) for step in steps]
        else:
            ortho = newton_schulz_batched(torch.stack(steps), group["ns_coefficients"], group["ns_steps"],
                                          group["eps"]).unbind(0)
        if weight_decay != 0:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        torch._foreach_add_(params, list(ortho), alpha=-adjust_lr(lr, group["adjust_lr_fn"], shape))


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
