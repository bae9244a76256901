"""Rank 1 raises a distinctive error; the others wait in a barrier it never reaches."""
import torch.distributed as dist

import nanodist as nd

info = nd.init(timeout=60)
if info.rank == 1:
    raise ZeroDivisionError("rank one divides by zero on purpose")
dist.barrier()
nd.shutdown()
