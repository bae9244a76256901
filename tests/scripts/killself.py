"""Rank 1 is killed by SIGKILL (as the out-of-memory killer would); rank 0 waits in a barrier it never leaves."""
import torch.distributed as dist

import nanodist as nd
from nanodist import faults

nd.init(timeout=60)
faults.die(rank=1)
dist.barrier()
nd.shutdown()
