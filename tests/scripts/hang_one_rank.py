"""Rank 1 hangs in Python, outside any collective; the others wait for it in a barrier."""
import time

import torch.distributed as dist

import nanodist as nd


def stuck_in_python():
    time.sleep(3600)


nd.init()
if dist.get_rank() == 1:
    stuck_in_python()
dist.barrier()
