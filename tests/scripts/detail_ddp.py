"""torch's own DDP built under TORCH_DISTRIBUTED_DEBUG=DETAIL on gloo (torch 2.13: the ranks crash, SIGSEGV)."""
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
ddp(torch.randn(2, 4)).sum().backward()
print(f"rank {dist.get_rank()}: torch DDP ran under DETAIL", flush=True)
dist.destroy_process_group()
