"""Tensor parallelism, Megatron-style, on nanodist's collectives: one layer's matrices split across ranks.

    tp = nanodist.Group.world()                  # or mesh["tensor"], one dimension of a 2-D mesh
    model = GPT(cfg)                             # built from the same seed on every rank
    tensor_parallel(model, tp)                   # every block's MLP and attention, split over tp's ranks
    logits, loss = model(x, y)                   # x, y: the same batch on every rank of tp

A linear layer y = x W^T + b can be split two ways. **Column-parallel**: each rank keeps a slab of W's rows (output
features), computes its slice of y from the whole x, and keeps it: no communication forward. **Row-parallel**: each
rank keeps a slab of W's columns (input features), multiplies its slice of x, and the ranks' partial products are
summed: one all-reduce. Put a column-parallel layer before an element-wise function and a row-parallel one after
it (the MLP: fc, GELU, proj; attention: qkv, the heads, proj) and a block costs one all-reduce forward.

Backward mirrors it, through two conjugate operators (Megatron's f and g):

- f, at a column-parallel layer's input: identity forward; backward, the all-reduce of the input's gradient (each
  rank's slab contributes a part of dL/dx);
- g, at a row-parallel layer's output: the all-reduce forward; identity backward (every rank needs the whole
  dL/dy, and has it).

So one all-reduce forward and one backward per MLP and per attention: 2 + 2 per block.

The parameters are DTensors of their global shape, sharded on the group's mesh: a column-parallel weight
Shard(0), a row-parallel one Shard(1) with its bias Replicate. The fused qkv weight is sharded head by head, each
rank keeping its heads' rows of q, of k and of v (_StridedShard(0, split_factor=3): rank r's slab is
[q_r; k_r; v_r]), so the attention's `chunk(3)` finds this rank's q, k and v and the checkpoint keeps the
unsplit layout. The arithmetic runs on the local pieces (`to_local()`), with the collectives below: the
DTensors are there so that the state, the checkpoints and the global gradient norm see the whole tensors. The
layers outside the blocks (embedding, norms, the head) stay replicated: every rank computes them alike, and
their gradients come out equal on every rank (f's all-reduce made dL/dx whole before they see it).

`tensor_parallel(model, tp, vocab=True)` splits the vocabulary too, where a large one makes the embedding and
the logits the biggest tensors: each rank keeps V/n rows of the (tied) table, an embedding lookup is g over the
ranks' masked rows, the head is column-parallel, and the loss (VocabParallelCrossEntropy) is computed from the
split logits with three all-reduces of one number per position, never gathering B x T x V.

`tensor_parallel(model, tp, sequence=True)` adds **sequence parallelism** (Megatron's SP): between the blocks'
matmuls the activations are split along the sequence, each rank holding T/n positions, so the LayerNorms, the
dropouts and the residual stream run on 1/n of the tokens and take 1/n of their memory. g becomes a reduce-scatter
(the partial outputs summed and cut along the sequence), and f an all-gather of the sequence before a
column-parallel layer (which keeps only its shard for backward and gathers it again there, so that its saved input
is 1/n too). A replicated parameter used on a shard of the tokens (a LayerNorm's, a row-parallel bias) gets only
that shard's part of its gradient: it passes through f, whose backward all-reduces it.

Random numbers: a dropout on replicated activations must draw the same mask on every rank (or their copies
diverge), one on a rank's own slice (its heads; with SP, its positions) must draw its own. The model's generator
stays in step on every rank; where a rank's slice is dropped, `ShardedRandom` derives a stream for this rank from
one draw of it (activation checkpointing's recompute replays that draw, so it finds the same masks).

`record_traffic()` lists every collective issued here, with its size, for the formulas of Chapter 9.
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .group import Group
from .sync import all_gather, all_reduce, reduce_scatter_sum


class Sent(NamedTuple):
    """One collective nanodist.tp issued: its kind ("all-reduce", "all-gather", "reduce-scatter"), what it was
    for, and its size in bytes: the whole tensor's (an all-reduce's buffer, an all-gather's output, a
    reduce-scatter's input), the size the formulas speak of."""

    kind: str
    what: str
    nbytes: int

    def ring_bytes(self, n: int) -> float:
        """What each of n ranks sends for it on a ring: 2(n-1)/n of the size for an all-reduce (a reduce-scatter
        then an all-gather), (n-1)/n for the other two."""
        return (2 if self.kind == "all-reduce" else 1) * (n - 1) / n * self.nbytes


_traffic: list[Sent] | None = None


@contextlib.contextmanager
def record_traffic():
    """A context that lists every collective nanodist.tp issues inside it (Sent tuples, in order). A group of one
    sends nothing and records nothing.

        with record_traffic() as sent:
            model(x, y)[1].backward()
        sum(s.nbytes for s in sent if s.kind == "all-reduce")
    """
    global _traffic
    outer, _traffic = _traffic, []
    try:
        yield _traffic
    finally:
        _traffic = outer


def _log(kind: str, what: str, t: torch.Tensor, group: Group) -> None:
    if _traffic is not None and group.size > 1:
        _traffic.append(Sent(kind, what, t.numel() * t.element_size()))


def _all_reduce(t: torch.Tensor, group: Group, what: str, op=None) -> torch.Tensor:
    """A sum over the group (or `op`, a dist.ReduceOp), into a new tensor: autograd's are not reduced in place."""
    out = t.contiguous().clone()
    _log("all-reduce", what, out, group)
    all_reduce(out, group, what, op or dist.ReduceOp.SUM).wait()
    return out


def _all_reduce_max(t: torch.Tensor, group: Group, what: str) -> torch.Tensor:
    return _all_reduce(t.detach(), group, what, dist.ReduceOp.MAX)


# The sequence dimension of the course's activations (B, T, C) is 1.
def _check_sequence(T: int, group: Group) -> None:
    if T % group.size:
        raise ValueError(f"sequence parallelism over {group.size} ranks gives each rank T/{group.size} positions, "
                         f"and this batch's sequences have T = {T}, not a multiple of {group.size}: choose a "
                         f"sequence length (seq_len) that {group.size} divides, or sequence=False")


def _sequence_shard(x: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's T/n positions of x (B, T, C)."""
    _check_sequence(x.shape[1], group)
    return x.chunk(group.size, dim=1)[group.rank].contiguous()


def _gather_sequence(x: torch.Tensor, group: Group, what: str) -> torch.Tensor:
    """(B, T/n, C) on every rank -> the whole (B, T, C), the ranks' shards in rank order."""
    if group.size == 1:
        return x
    out = torch.empty((group.size, x.numel()), dtype=x.dtype, device=x.device)  # flat rows, as the backends want
    _log("all-gather", what, out, group)
    all_gather(out, x.reshape(-1), group, ring=False, what=what).wait()
    return out.view(group.size, *x.shape).movedim(0, 1).flatten(1, 2)  # (n, B, T/n, C) -> (B, n * T/n, C)


def _reduce_scatter_sequence(x: torch.Tensor, group: Group, what: str) -> torch.Tensor:
    """(B, T, C) partial sums on every rank -> this rank's (B, T/n, C) of their sum."""
    if group.size == 1:
        return x
    _check_sequence(x.shape[1], group)
    B, T, C = x.shape
    stacked = x.reshape(B, group.size, T // group.size, C).movedim(1, 0).contiguous()  # row r: rank r's positions
    out = torch.empty(stacked[0].numel(), dtype=x.dtype, device=x.device)
    _log("reduce-scatter", what, stacked, group)
    reduce_scatter_sum(out, stacked.view(group.size, -1), group, ring=False, what=what).wait()
    return out.view(B, T // group.size, C)


class CopyToTensorParallel(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward (at a column-parallel layer's input)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, "TP f: all-reduce of the input's gradient"), None


class ReduceFromTensorParallel(torch.autograd.Function):
    """g: all-reduce forward (the row-parallel partial products), identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group, "TP g: all-reduce of the partial outputs")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ScatterToSequence(torch.autograd.Function):
    """Into the sequence-parallel region: keep this rank's T/n positions (no communication); backward, all-gather
    the shards' gradients into the whole (every rank's positions had their own)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _sequence_shard(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_sequence(grad, ctx.group, "SP: all-gather of the sequence's gradient (leaving the region)"), None


class GatherFromSequence(torch.autograd.Function):
    """Out of the sequence-parallel region into layers every rank computes alike (the unsplit output layer):
    all-gather forward; backward, keep this rank's positions of the (replicated, hence whole) gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_sequence(x, group, "SP: all-gather of the sequence for the replicated head")

    @staticmethod
    def backward(ctx, grad):
        return _sequence_shard(grad, ctx.group), None


class ReduceScatterToSequence(torch.autograd.Function):
    """SP's g, after a row-parallel layer: the partial outputs summed *and* cut along the sequence
    (reduce-scatter) forward; backward, all-gather the gradient (each rank's partial product needs all of it)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_sequence(x, group, "SP g: reduce-scatter of the partial outputs")

    @staticmethod
    def backward(ctx, grad):
        return _gather_sequence(grad, ctx.group, "SP g: all-gather of the output's gradient"), None


class SequenceGatheredLinear(torch.autograd.Function):
    """SP's f fused with a column-parallel layer: all-gather the sequence, multiply, and keep only the *shard* for
    backward (1/n of the input, the point of SP), gathering it again there for the weight's gradient. Backward:
    the input's gradient is a partial sum over the ranks' slabs, so it is reduce-scattered to this rank's
    positions. Under autocast the shard is cast to the autocast dtype before it is gathered and kept (as F.linear
    would cast it), so half the bytes travel and stay; the gradients return in the inputs' dtypes."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias, ctx.x_dtype = group, bias is not None, x.dtype
        kind = x.device.type
        if torch.is_autocast_enabled(kind):  # the matmul's dtype before the gather: half the bytes, sent and kept
            x = x.to(torch.get_autocast_dtype(kind))
        ctx.save_for_backward(x, weight)
        full = _gather_sequence(x, group, "SP f: all-gather of the sequence")
        return F.linear(full, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        group = ctx.group
        full = _gather_sequence(x, group, "SP f: all-gather again, for the weight's gradient").to(grad.dtype)
        grad_full = grad @ weight.to(grad.dtype)  # (B, T, in): this rank's slab's part of dL/dx
        grad_x = _reduce_scatter_sequence(grad_full, group, "SP f: reduce-scatter of the input's gradient")
        grad_w = grad.flatten(0, -2).t() @ full.flatten(0, -2)
        grad_b = grad.flatten(0, -2).sum(0) if ctx.has_bias else None
        return (grad_x.to(ctx.x_dtype), grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(weight.dtype), None)


def _whole_gradient(p: torch.Tensor, group: Group) -> torch.Tensor:
    """A replicated parameter used on this rank's positions only: through f, so that backward sums the ranks'
    parts of its gradient (the whole gradient, on every rank)."""
    return CopyToTensorParallel.apply(p, group)


def _shard(t: torch.Tensor, group: Group, placement) -> nn.Parameter:
    from torch.distributed.tensor import distribute_tensor
    return nn.Parameter(distribute_tensor(t.detach(), group.device_mesh, [placement], src_data_rank=None),
                        requires_grad=t.requires_grad)


def _check_divides(name: str, size: int, what: str, group: Group) -> None:
    if size % group.size:
        raise ValueError(f"tensor parallelism over {group.size} ranks splits {name}'s {what} ({size}) into "
                         f"{group.size} equal parts, and {size} is not a multiple of {group.size}: choose a "
                         f"tensor-parallel size that divides it")


class ColumnParallelLinear(nn.Module):
    """A linear layer whose output features are split: rank r keeps rows r of W (and of b) and returns its slice of
    y. `split`: the weight is `split` matrices stacked (a fused qkv: 3), each split alike, so that rank r's slab
    is its rows of each."""

    def __init__(self, linear: nn.Linear, group: Group, split: int = 1, name: str = "linear", sequence: bool = False):
        super().__init__()
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.placement_types import _StridedShard
        _check_divides(name, linear.out_features // split, "output features" + (f" per part (of {split})"
                                                                               if split > 1 else ""), group)
        self.group, self.split, self.sequence = group, split, sequence
        self.in_features, self.out_features = linear.in_features, linear.out_features
        placement = Shard(0) if split == 1 else _StridedShard(0, split_factor=split)
        self.weight = _shard(linear.weight, group, placement)
        self.bias = None if linear.bias is None else _shard(linear.bias, group, placement)
        if hasattr(linear, "residual"):  # the GPT's mark for its scaled initialisation, kept with the layer
            self.residual = linear.residual  # (the values are initialised already: a built model is split)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to_local()
        if self.sequence:  # x: this rank's positions (B, T/n, C)
            return SequenceGatheredLinear.apply(x, self.weight.to_local(), bias, self.group)
        x = CopyToTensorParallel.apply(x, self.group)
        return F.linear(x, self.weight.to_local(), bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (this rank: "
                f"{self.out_features // self.group.size}), split={self.split}, ranks={self.group.size}"
                + (", sequence-parallel input" if self.sequence else ""))


class RowParallelLinear(nn.Module):
    """A linear layer whose input features are split: rank r keeps columns r of W and multiplies its slice of x (a
    column-parallel layer's output); the partial products are all-reduced, then the (replicated) bias added."""

    def __init__(self, linear: nn.Linear, group: Group, name: str = "linear", sequence: bool = False):
        super().__init__()
        from torch.distributed.tensor import Replicate, Shard
        _check_divides(name, linear.in_features, "input features", group)
        self.group, self.sequence = group, sequence
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = _shard(linear.weight, group, Shard(1))
        self.bias = None if linear.bias is None else _shard(linear.bias, group, Replicate())
        if hasattr(linear, "residual"):
            self.residual = linear.residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight.to_local())
        if not self.sequence:
            y = ReduceFromTensorParallel.apply(partial, self.group)
            return y if self.bias is None else y + self.bias.to_local()
        y = ReduceScatterToSequence.apply(partial, self.group)  # this rank's positions of the sum
        return y if self.bias is None else y + _whole_gradient(self.bias.to_local(), self.group)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (this rank: {self.in_features // self.group.size}), "
                f"out_features={self.out_features}, ranks={self.group.size}"
                + (", sequence-parallel output" if self.sequence else ""))


class VocabParallelEmbedding(nn.Module):
    """An embedding whose vocabulary is split: rank r keeps rows r of the table (its tokens' vectors), looks up the
    ids that fall in its range, writes zeros for the others, and the all-reduce (g) adds the ranks' rows into the
    whole lookup: every id is in exactly one rank's range."""

    def __init__(self, embedding: nn.Embedding, group: Group, name: str = "embedding"):
        super().__init__()
        from torch.distributed.tensor import Shard
        _check_divides(name, embedding.num_embeddings, "vocabulary", group)
        self.group = group
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.per_rank = embedding.num_embeddings // group.size
        self.start = group.rank * self.per_rank
        self.weight = _shard(embedding.weight, group, Shard(0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight.to_local())
        return ReduceFromTensorParallel.apply(rows.masked_fill(outside.unsqueeze(-1), 0.0), self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (this rank: ids {self.start} to "
                f"{self.start + self.per_rank - 1}), ranks={self.group.size}")


class VocabParallelCrossEntropy(torch.autograd.Function):
    """The mean cross-entropy of logits split by vocabulary (rank r holds columns start..start + V/n), without
    gathering them: three all-reduces of one number per position -- the largest logit (MAX, for a stable softmax),
    the softmax's denominator (SUM), the target's logit (SUM, from the one rank that holds it). Backward needs no
    communication: each rank's slice of the gradient is its slice of softmax - one-hot. Unlike F.cross_entropy,
    a target outside the vocabulary is not detected (checking would wait for the device)."""

    @staticmethod
    def forward(ctx, logits, targets, start, group, ignore_index=-1):
        n_local = logits.shape[-1]
        top = _all_reduce_max(logits.max(dim=-1).values, group, "TP loss: the largest logit")
        shifted = logits - top.unsqueeze(-1)
        exp = shifted.exp()
        denominator = _all_reduce(exp.sum(dim=-1), group, "TP loss: the softmax's denominators")
        local = targets - start
        valid = targets != ignore_index
        here = (local >= 0) & (local < n_local) & valid
        index = local.clamp(0, n_local - 1)
        picked = shifted.gather(1, index.unsqueeze(1)).squeeze(1).masked_fill(~here, 0.0)
        picked = _all_reduce(picked, group, "TP loss: the targets' logits")
        count = valid.sum()
        loss = ((denominator.log() - picked) * valid).sum() / count  # every target ignored: NaN, as torch's
        ctx.save_for_backward(exp / denominator.unsqueeze(-1), index, here, valid, count.clamp(min=1))
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, index, here, valid, count = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(1, index.unsqueeze(1), -here.to(g.dtype).unsqueeze(1))
        g.mul_((valid.to(g.dtype) / count).unsqueeze(1) * grad)
        return g, None, None, None, None


class VocabParallelHead(ColumnParallelLinear):
    """The output layer split by vocabulary (column-parallel: each rank computes its slice of the logits) with its
    own cross_entropy, which the course's GPT calls instead of F.cross_entropy: the logits stay split."""

    def __init__(self, linear: nn.Linear, group: Group, name: str = "lm_head", sequence: bool = False):
        super().__init__(linear, group, name=name, sequence=sequence)
        self.start = group.rank * (linear.out_features // group.size)

    def cross_entropy(self, logits, targets, ignore_index: int = -1):
        return VocabParallelCrossEntropy.apply(logits, targets, self.start, self.group, ignore_index)


class SequenceParallelLayerNorm(nn.LayerNorm):
    """A LayerNorm on this rank's positions (B, T/n, C): the same arithmetic, on 1/n of the tokens. Its weight and
    bias are replicated, and each rank's positions give only a part of their gradient: they enter through f, whose
    backward all-reduces it (Megatron sums these after backward, in one go; here each is its own small all-reduce,
    counted in the traffic). Same parameter names as the LayerNorm it replaces, so checkpoints do not change.
    gather=True: the end of the region (the final norm before a replicated head): the output is gathered whole
    (GatherFromSequence)."""

    def __init__(self, norm: nn.LayerNorm, group: Group, gather: bool = False):
        super().__init__(norm.normalized_shape, eps=norm.eps, elementwise_affine=norm.elementwise_affine,
                         bias=norm.bias is not None, device="meta")
        self.weight, self.bias = norm.weight, norm.bias  # the same Parameters, not copies
        self.group, self.gather = group, gather

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = None if self.weight is None else _whole_gradient(self.weight, self.group)
        b = None if self.bias is None else _whole_gradient(self.bias, self.group)
        y = F.layer_norm(x, self.normalized_shape, w, b, self.eps)
        return GatherFromSequence.apply(y, self.group) if self.gather else y


class ShardedRandom:
    """A context in which torch's generators draw this rank's own numbers, for dropout on this rank's slice.

    Entering it takes one number from torch's CPU generator -- the same on every rank of the group, which keeps
    them in step -- and seeds, inside a fork of the generators (restored on leaving), a stream from that number
    and the rank: different on each rank, different at each entry. Activation checkpointing restores the
    generators before its recompute, so the recompute draws the same number and the same masks."""

    def __init__(self, group: Group):
        self.group = group

    @contextlib.contextmanager
    def __call__(self):
        seed = int(torch.randint(0, 2**62, (1,)))
        cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=cuda):
            own = (seed + 0x9E3779B97F4A7C15 * (self.group.rank + 1)) % 2**63
            torch.default_generator.manual_seed(own)
            for d in cuda:
                torch.cuda.default_generators[d].manual_seed(own)
            yield


class ShardedDropout(nn.Dropout):
    """nn.Dropout on a rank's own slice of the activations (with SP, its positions): a mask of its own
    (ShardedRandom). Inactive (p = 0 or eval), it draws nothing."""

    def __init__(self, dropout: nn.Dropout, group: Group):
        super().__init__(dropout.p, dropout.inplace)
        self.random = ShardedRandom(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        with self.random():
            return super().forward(x)


class SplitSequence(nn.Module):
    """Into the sequence-parallel region: this rank's positions (ScatterToSequence)."""

    def __init__(self, group: Group):
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ScatterToSequence.apply(x, self.group)


def tensor_parallel(model: nn.Module, group=None, vocab: bool = False, sequence: bool = False) -> nn.Module:
    """Split every block of the course's GPT over `group` (default: the world), in place: the MLP's fc
    column-parallel and proj row-parallel, the attention's qkv column-parallel head by head and proj
    row-parallel; the attention's dropout draws each rank's own masks (its heads are its own).

    vocab=True splits the token embedding and the output layer by vocabulary too (tied, they stay one parameter),
    and the loss is then computed from the split logits (VocabParallelCrossEntropy): the logits the model returns
    are this rank's slice. sequence=True adds sequence parallelism: after the embeddings each rank keeps T/n
    positions (T must divide), the LayerNorms and the residual dropouts run on them, g is a reduce-scatter and f
    an all-gather, and the final norm's output is gathered again for the head (the logits are whole, or this
    rank's vocabulary slice with vocab=True).

    Every rank must hold the same model (rank 0's is broadcast first, as DDP does) and feed it the same batches.
    The parameters keep their names, so a checkpoint loads into the unsplit model. Returns the model."""
    group = Group.resolve(group)
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise TypeError(f"tensor_parallel splits the course's GPT (its blocks); {type(model).__name__} has none: "
                        f"build the layers with ColumnParallelLinear and RowParallelLinear instead")
    from .runtime import warn_if_differed
    warn_if_differed("tensor_parallel", group.broadcast_from_first(list(model.named_parameters()) +
                                                                   list(model.named_buffers())))
    sp = dict(sequence=sequence)
    for i, block in enumerate(blocks):
        heads = block.attn.qkv.out_features // 3 // block.attn.head_dim
        _check_divides(f"blocks.{i}.attn", heads, "heads", group)
        block.attn.qkv = ColumnParallelLinear(block.attn.qkv, group, split=3, name=f"blocks.{i}.attn.qkv", **sp)
        block.attn.proj = RowParallelLinear(block.attn.proj, group, name=f"blocks.{i}.attn.proj", **sp)
        block.attn.heads_random = ShardedRandom(group)
        block.mlp.fc = ColumnParallelLinear(block.mlp.fc, group, name=f"blocks.{i}.mlp.fc", **sp)
        block.mlp.proj = RowParallelLinear(block.mlp.proj, group, name=f"blocks.{i}.mlp.proj", **sp)
        if sequence:
            block.ln1, block.ln2 = SequenceParallelLayerNorm(block.ln1, group), SequenceParallelLayerNorm(block.ln2, group)
            block.attn.resid_drop = ShardedDropout(block.attn.resid_drop, group)
            block.mlp.drop = ShardedDropout(block.mlp.drop, group)
    if sequence:  # the region runs from the embeddings' dropout to the final norm (parameterless modules: same names)
        # (with the vocabulary split, the embedding's g all-reduces and the split keeps 1/n of it: Megatron
        # reduce-scatters there, half the bytes of that one collective; the embedding stays one layer for both)
        model.drop = nn.Sequential(SplitSequence(group), ShardedDropout(model.drop, group))
        model.sequence_split = group.size  # GPT.generate refuses: its context grows one token at a time
        # the head: split by vocabulary, it gathers the sequence itself (column-parallel); else it is replicated
        model.ln_f = SequenceParallelLayerNorm(model.ln_f, group, gather=not vocab)
    if vocab:
        tied = model.lm_head.weight is model.wte.weight
        model.wte = VocabParallelEmbedding(model.wte, group, name="wte")
        head = VocabParallelHead(model.lm_head, group, name="lm_head", sequence=sequence)
        if tied:
            head.weight = model.wte.weight
        model.lm_head = head
    return model
