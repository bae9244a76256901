"""Two or more ranks all-reduce their rank and rank 0 writes a results file."""
import torch
import torch.distributed as dist

import nanodist as nd

info = nd.init()
t = torch.tensor([float(info.rank)])
dist.all_reduce(t)
print(f"sum of ranks is {t.item():.0f}")
rec = nd.Recorder("test_ok", config={"purpose": "launcher test"})
rec.step(step=0, time_s=0.0)
rec.metrics.update(rank_sum=t.item(), node_rank_by_rank=None)
reports = [None] * info.world_size
dist.all_gather_object(reports, (info.rank, info.node_rank, info.local_rank))
rec.metrics["ranks"] = sorted(reports)
rec.save()
nd.shutdown()
