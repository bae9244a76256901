"""Chapter 4: ZeRO -- one optimizer that averages gradients itself and shards its state over the ranks.

    from nanodist.optim import DistAdamW, DistMuon, make_muon_optimizer
    opt = DistAdamW(model.configure_param_groups(0.1), lr=3e-3)      # the model needs no DDP wrapper
    opt = make_muon_optimizer(model)                                  # Muon for matrices + AdamW for the rest

    sharded.py    ShardedOptimizer: param groups of kind "adamw" or "muon", reduce-scatter in backward ->
                  update this rank's pieces -> all-gather; DistAdamW, DistMuon, make_muon_optimizer
    layout.py     the slice layout (torch.chunk's rule on the flattened parameter) and its Pieces
    adamw.py      AdamW's update on a dim-0 chunk
    muon.py       Muon's update on whole matrices, Newton-Schulz, the deal of matrices to ranks
    zero1.py      ZeroOptimizer: ZeRO-1 over any torch optimizer, whole parameters dealt to the ranks
    agreement.py  what both sharded optimizers agree on before a step (flags, global norm, divergence digest)
    reference.py  MuonAdamW: torch's Muon + AdamW, unsharded -- the reference DistMuon is measured against
"""
from .muon import newton_schulz, newton_schulz_singular_values, split_params_for_muon
from .layout import Piece
from .reference import MuonAdamW
from .sharded import DistAdamW, DistMuon, ShardedOptimizer, make_muon_optimizer
from .zero1 import ZeroOptimizer

__all__ = ["DistAdamW", "DistMuon", "MuonAdamW", "ShardedOptimizer", "ZeroOptimizer", "Piece", "split_params_for_muon", "make_muon_optimizer",
           "newton_schulz", "newton_schulz_singular_values"]
