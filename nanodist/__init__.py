"""nanodist: the small library behind the course "distributed training with PyTorch, hands-on".

    import nanodist as nd
    info = nd.init()                  # torchrun environment -> process group, device, seeds
    nd.print0(info)
    run = nd.launch("lab01_ranks", nproc=2)   # from a notebook: torchrun, results back
"""
__version__ = "0.1.0"  # before the imports: nanodist.checkpoint records it

from . import check, data, faults, model
from .checkpoint import CheckpointError, CheckpointManager
from .checkpoint import load as load_checkpoint
from .ddp import DDP, NaiveDDP
from .fsdp import FSDP
from .group import Group, Mesh
from .optim import DistAdamW, DistMuon, ZeroOptimizer
from .launch import LaunchError, LaunchResult, LaunchTimeout, launch
from .results import Recorder
from .train import TrainConfig, Trainer
from .tp import ColumnParallelLinear, RowParallelLinear, record_traffic, tensor_parallel
from .runtime import (DistConfigError, DistInfo, dist_info, get_logger, get_rank, get_world_size, init,
                      print0, seed_everything, shutdown)

__all__ = [
    "check", "data", "faults", "model",
    "init", "shutdown", "dist_info", "DistInfo", "DistConfigError", "get_rank", "get_world_size",
    "print0", "get_logger", "seed_everything", "launch", "LaunchResult", "LaunchError", "LaunchTimeout",
    "Recorder", "DDP", "NaiveDDP", "FSDP", "DistAdamW", "DistMuon", "ZeroOptimizer", "Group", "Mesh",
    "Trainer", "TrainConfig", "CheckpointManager", "CheckpointError", "load_checkpoint",
    "tensor_parallel", "ColumnParallelLinear", "RowParallelLinear", "record_traffic",
]
