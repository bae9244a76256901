"""The slice layout of ZeRO's element-wise sharding, and a recorder of what one step did to it.

DistAdamW (and the AdamW groups of any ShardedOptimizer) cut every parameter, flattened, into world_size slices by
torch.chunk's rule -- also DTensor Shard(0)'s, so a saved slice is a DTensor of the parameter's global, flattened
shape and torch.distributed.checkpoint reshards it. A Piece is one such run of elements and the place it sits in
its bucket's buffer; Muon's whole matrices are Pieces too (start 0, every element).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..state import is_dtensor  # noqa: F401 -- the sharded optimizers' import of it


@dataclass(frozen=True)
class Piece:
    """A contiguous run of one parameter's elements that one rank updates (possibly empty)."""

    param: int  # index of the parameter in the optimizer (the numbering of state_dict()["state"])
    group: int  # index of its param group
    rank: int  # the rank that updates it
    start: int  # first element, counted in param.view(-1)
    numel: int
    offset: int  # where it sits in row `rank` of its bucket's buffer


def slice_bounds(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """Elements [start, stop) of slice `rank` when `numel` elements are cut into world_size slices as torch.chunk
    does (ceil(numel / N) each; the last slices shorter, or empty) -- also DTensor Shard(0)'s rule."""
    size = math.ceil(numel / world_size)
    start = min(rank * size, numel)
    return start, min(start + size, numel)






class PipelineRecorder:
    """What one ZeRO step did to every parameter on this rank: an observer the optimizer calls at three points
    only while one is attached (record_next_step), so an unrecorded step pays one `is None` test per piece.

    finished() returns one dict per parameter: name, shape, `grad` (this rank's local gradient before the
    reduction), `piece` ((start, numel) of the slice this rank updates, or None), `grad_shard` (that slice of the
    averaged gradient), `updated_shard` (the slice after the update) and `param` (the whole parameter after the
    all-gather).
    """

    def __init__(self, names: list[str], params: list[torch.Tensor], rank: int, world_size: int):
        self.entries = [{"index": i, "name": names[i], "shape": tuple(p.shape), "rank": rank, "world_size": world_size,
                         "grad": None if p.grad is None else p.grad.detach().clone(), "piece": None,
                         "grad_shard": None, "updated_shard": None, "param": None} for i, p in enumerate(params)]

    def packed(self, indices: list[int], grads: list[torch.Tensor | None]) -> None:
        for i in indices:
            self.entries[i]["grad"] = None if grads[i] is None else grads[i].detach().clone()

    def reduced(self, piece: Piece, grad: torch.Tensor) -> None:
        self.entries[piece.param].update(piece=(piece.start, piece.numel), grad_shard=grad.reshape(-1).clone())

    def finished(self, params: list[torch.Tensor]) -> list[dict]:
        for e in self.entries:
            p = params[e["index"]]
            if e["piece"] is not None:
                a, n = e["piece"]
                e["updated_shard"] = p.detach().view(-1)[a:a + n].clone()
            e["param"] = p.detach().clone()
        return self.entries
