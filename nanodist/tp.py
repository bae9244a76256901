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
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import diverge
from .group import Group
from .sync import all_reduce_sum


def _all_reduce(t: torch.Tensor, group: Group, what: str) -> torch.Tensor:
    out = t.contiguous().clone()  # autograd's tensors are not summed in place
    all_reduce_sum(out, group, what).wait()
    return out


def _all_reduce_max(t: torch.Tensor, group: Group, what: str) -> torch.Tensor:
    if group.size == 1:
        return t
    import torch.distributed as dist
    out = t.detach().contiguous().to(group.comm_device, copy=True)
    with diverge.waiting(diverge.issue(group, what)):
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group.pg)
    return out.to(t.device)


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

    def __init__(self, linear: nn.Linear, group: Group, split: int = 1, name: str = "linear"):
        super().__init__()
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.placement_types import _StridedShard
        _check_divides(name, linear.out_features // split, "output features" + (f" per part (of {split})"
                                                                               if split > 1 else ""), group)
        self.group, self.split = group, split
        self.in_features, self.out_features = linear.in_features, linear.out_features
        placement = Shard(0) if split == 1 else _StridedShard(0, split_factor=split)
        self.weight = _shard(linear.weight, group, placement)
        self.bias = None if linear.bias is None else _shard(linear.bias, group, placement)
        if hasattr(linear, "residual"):  # the GPT's mark for its scaled initialisation, kept with the layer
            self.residual = linear.residual  # (the values are initialised already: a built model is split)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = CopyToTensorParallel.apply(x, self.group)
        return F.linear(x, self.weight.to_local(), None if self.bias is None else self.bias.to_local())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (this rank: "
                f"{self.out_features // self.group.size}), split={self.split}, ranks={self.group.size}")


class RowParallelLinear(nn.Module):
    """A linear layer whose input features are split: rank r keeps columns r of W and multiplies its slice of x (a
    column-parallel layer's output); the partial products are all-reduced, then the (replicated) bias added."""

    def __init__(self, linear: nn.Linear, group: Group, name: str = "linear"):
        super().__init__()
        from torch.distributed.tensor import Replicate, Shard
        _check_divides(name, linear.in_features, "input features", group)
        self.group = group
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = _shard(linear.weight, group, Shard(1))
        self.bias = None if linear.bias is None else _shard(linear.bias, group, Replicate())
        if hasattr(linear, "residual"):
            self.residual = linear.residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ReduceFromTensorParallel.apply(F.linear(x, self.weight.to_local()), self.group)
        return y if self.bias is None else y + self.bias.to_local()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (this rank: {self.in_features // self.group.size}), "
                f"out_features={self.out_features}, ranks={self.group.size}")


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

    def __init__(self, linear: nn.Linear, group: Group, name: str = "lm_head"):
        super().__init__(linear, group, name=name)
        self.start = group.rank * (linear.out_features // group.size)

    def cross_entropy(self, logits, targets, ignore_index: int = -1):
        return VocabParallelCrossEntropy.apply(logits, targets, self.start, self.group, ignore_index)


def tensor_parallel(model: nn.Module, group=None, vocab: bool = False) -> nn.Module:
    """Split every block of the course's GPT over `group` (default: the world), in place: the MLP's fc
    column-parallel and proj row-parallel, the attention's qkv column-parallel head by head and proj
    row-parallel. vocab=True splits the token embedding and the output layer by vocabulary too (tied, they stay
    one parameter), and the loss is then computed from the split logits (VocabParallelCrossEntropy): the logits
    the model returns are this rank's slice. Every rank must hold the same model (rank 0's is broadcast first, as
    DDP does) and feed it the same batches. Returns the model."""
    group = Group.resolve(group)
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise TypeError(f"tensor_parallel splits the course's GPT (its blocks); {type(model).__name__} has none: "
                        f"build the layers with ColumnParallelLinear and RowParallelLinear instead")
    differ = group.broadcast_from_first(list(model.named_parameters()) + list(model.named_buffers()))
    if differ:
        from .runtime import get_logger
        get_logger().warning(f"tensor_parallel: ranks started with different values for {len(differ)} tensor(s) "
                             f"({', '.join(differ[:5])}); rank 0's were broadcast to all")
    for i, block in enumerate(blocks):
        heads = block.attn.qkv.out_features // 3 // block.attn.head_dim
        _check_divides(f"blocks.{i}.attn", heads, "heads", group)
        block.attn.qkv = ColumnParallelLinear(block.attn.qkv, group, split=3, name=f"blocks.{i}.attn.qkv")
        block.attn.proj = RowParallelLinear(block.attn.proj, group, name=f"blocks.{i}.attn.proj")
        block.mlp.fc = ColumnParallelLinear(block.mlp.fc, group, name=f"blocks.{i}.mlp.fc")
        block.mlp.proj = RowParallelLinear(block.mlp.proj, group, name=f"blocks.{i}.mlp.proj")
    if vocab:
        tied = model.lm_head.weight is model.wte.weight
        model.wte = VocabParallelEmbedding(model.wte, group, name="wte")
        head = VocabParallelHead(model.lm_head, group, name="lm_head")
        if tied:
            head.weight = model.wte.weight
        model.lm_head = head
    return model
