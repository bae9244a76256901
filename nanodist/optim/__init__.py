"""Chapter 4: ZeRO -- optimizers that average gradients themselves and shard their state over the ranks.

    from nanodist.optim import DistAdamW, DistMuon, make_muon_optimizer
    opt = DistAdamW(model.configure_param_groups(0.1), lr=3e-3)      # the model needs no DDP wrapper
    opt = make_muon_optimizer(model)                                  # DistMuon for matrices + DistAdamW

    common.py   the sharded step both share: reduce-scatter -> update this rank's shard -> all-gather
    adamw.py    DistAdamW: every parameter sliced over the ranks
    muon.py     DistMuon: whole matrices dealt out to the ranks; split_params_for_muon, make_muon_optimizer
"""
from .adamw import DistAdamW
from .common import CombinedOptimizer, Piece, ShardedOptimizer, sharded_step
from .muon import (DistMuon, make_muon_optimizer, newton_schulz, newton_schulz_singular_values,
                   split_params_for_muon)

__all__ = ["DistAdamW", "DistMuon", "CombinedOptimizer", "ShardedOptimizer", "Piece", "sharded_step",
           "split_params_for_muon", "make_muon_optimizer", "newton_schulz", "newton_schulz_singular_values"]
