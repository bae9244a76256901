"""The Trainer on a 2-D mesh: the data dimension averages gradients and splits the batches, the tensor dimension
(torch's parallelize_module: column- then row-parallel linears) shares each batch, the world keeps the run's
identity. Trained on a 2 x 2 mesh (FSDP2 on the data dimension x TP on the tensor one) and on 1 x 2 (TP alone,
where the gradients are DTensors beside plain ones and the norm must be the placement-aware one), the run equals
one process training on the whole batch: losses, global gradient norms and parameters. A model like users' own: a
tied embedding and head, a frozen parameter, a buffer, a bare nn.Parameter."""
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nanodist.testing import spawn

pytestmark = pytest.mark.dist
numerical = pytest.mark.numerical  # fp32 sums in another order: the second kernel path too (not the refusals)
V, D, T, MICRO, STEPS = 32, 16, 8, 2, 3
# fp32, the same arithmetic split differently (row-parallel partial sums, sharded squares of the norm): a few
# roundings of values of O(1), ~1e-7 relative; 1e-5 leaves a margin of 100. A rank's loss scaled by 1.001 moves the
# global gradient norm by ~1e-4 relative or more: ten times the tolerance (the planted case below).
TOL = 1e-5


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 4 * D)
        self.fc2 = nn.Linear(4 * D, D)

    def forward(self, h):
        return h + self.fc2(F.gelu(self.fc1(self.norm(h))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.register_buffer("pos", 0.1 * torch.randn(T, D))
        self.gain = nn.Parameter(torch.ones(D))  # a bare parameter
        self.shift = nn.Parameter(0.1 * torch.randn(D), requires_grad=False)  # frozen
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, x, y):
        h = self.emb(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        logits = self.head(h * self.gain + self.shift)
        return logits, F.cross_entropy(logits.flatten(0, 1), y.flatten())


class Batches:
    """Step k's global batch (`rows` sequences) is the same for every layout; a data rank takes its `micro` rows."""

    def __init__(self, rank, micro, rows):
        self.rank, self.micro, self.rows, self.k = rank, micro, rows, 0

    def __iter__(self):
        return self

    def __next__(self):
        g = torch.Generator().manual_seed(100 + self.k)
        self.k += 1
        full = torch.randint(0, V, (self.rows, T + 1), generator=g)
        mine = full[self.rank * self.micro:(self.rank + 1) * self.micro]
        return mine[:, :-1], mine[:, 1:]

    def state_dict(self):  # the cursor, part of the Trainer's state: a resumed run reads the steps after it
        return {"k": self.k}

    def load_state_dict(self, saved):
        self.k = saved["k"]


def config(micro, data_size):
    from nanodist.train import TrainConfig
    return TrainConfig(steps=STEPS, total_batch_tokens=micro * T * data_size, micro_batch=micro, seq_len=T,
                       lr=1e-2, warmup_steps=1, log_every=0, progress=False)


def run(model, trainer_kwargs, data, micro, data_size):
    from nanodist.train import Trainer
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    trainer = Trainer(model, opt, data, config(micro, data_size), **trainer_kwargs)
    trainer.fit()
    return trainer


def parallel_net(mesh):
    """Net, seeded as the reference is, with TP on the mesh's tensor dimension and FSDP2 on its data dimension."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    torch.manual_seed(0)
    model = Net()
    for block in model.blocks:
        parallelize_module(block, mesh.device_mesh["tensor"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    if mesh["data"].size > 1:
        for block in model.blocks:
            fully_shard(block, mesh=mesh.device_mesh["data"])
        fully_shard(model, mesh=mesh.device_mesh["data"])
    return model


def mesh_worker(rank, W, shape, planted=False):
    import nanodist as nd
    from nanodist.state import full_tensor
    mesh = nd.Group.world().mesh({"data": shape[0], "tensor": shape[1]})
    model = parallel_net(mesh)
    data_rank = mesh["data"].rank
    if planted and rank == W - 1:  # the last rank's loss 0.1 % too large at step 0 (or NaN at step 1)
        forward, calls = model.forward, []
        factor, at = (float("nan"), 2) if planted == "nan" else (1.001, 1)

        def loud(x, y):
            logits, loss = forward(x, y)
            calls.append(1)
            return logits, loss * factor if len(calls) == at else loss

        model.forward = loud
    if planted == "nan":
        from nanodist.train import NonFiniteError
        try:
            run(model, {"mesh": mesh}, Batches(data_rank, MICRO, MICRO * shape[0]), MICRO, shape[0])
            return "no stop"
        except NonFiniteError as e:
            return str(e)
    trainer = run(model, {"mesh": mesh}, Batches(data_rank, MICRO, MICRO * shape[0]), MICRO, shape[0])
    out = {"coordinate": mesh.coordinate, "rows": [(h["loss"], h["grad_norm"]) for h in trainer.history],
           "tokens_per_step": trainer.tokens_per_step, "grad_accum": trainer.grad_accum}
    sd = trainer.state_dict(weights=False)
    out.update(world_size=sd["world_size"], rng=sorted(sd["rng"]), run_id=sd["run_id"])
    out["params"] = {n: full_tensor(p.detach(), to_host=True) for n, p in model.named_parameters()}
    if rank == 0:  # the reference: one process, the whole batch, the same initial weights
        torch.manual_seed(0)
        whole = MICRO * shape[0]
        ref = run(Net(), {"group": nd.Group.local()}, Batches(0, whole, whole), whole, 1)
        out["ref_rows"] = [(h["loss"], h["grad_norm"]) for h in ref.history]
        out["ref_params"] = {n: p.detach().clone() for n, p in ref.model.named_parameters()}
    return out


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


@numerical
@pytest.mark.parametrize("W,shape", [(4, (2, 2)), (2, (1, 2))], ids=["2x2-fsdp2-tp", "1x2-tp"])
def test_a_mesh_trains_as_one_process(W, shape):
    outs = spawn(mesh_worker, W, args=(shape,), timeout=300)
    ref = outs[0]
    for r, out in enumerate(outs):
        assert out["world_size"] == W and out["rng"] == [f"rank{r}"] and out["run_id"] == ref["run_id"], (r, out)
        assert out["tokens_per_step"] == MICRO * T * shape[0] and out["grad_accum"] == 1
        for step, ((_, norm), (_, want)) in enumerate(zip(out["rows"], ref["ref_rows"])):
            assert rel(norm, want) <= TOL, (r, step, norm, want)  # the global norm, on every rank
        for name, want in ref["ref_params"].items():
            diff = float((out["params"][name] - want).abs().max())
            assert diff <= TOL, (r, name, diff)
    for step, (_, want) in enumerate(ref["ref_rows"]):  # the loss: each data rank's mean, averaged over them
        by_data = {}
        for out in outs:
            by_data.setdefault(out["coordinate"]["data"], set()).add(out["rows"][step][0])
        assert all(len(v) == 1 for v in by_data.values()), by_data  # tensor-parallel peers: the same loss
        mean = sum(v.pop() for v in by_data.values()) / len(by_data)
        assert rel(mean, ref["ref_rows"][step][0]) <= TOL, (step, mean, ref["ref_rows"][step][0])


@numerical
def test_a_planted_error_on_one_rank_is_caught():
    outs = spawn(mesh_worker, 4, args=((2, 2),), kwargs={"planted": True}, timeout=300)
    norm, want = outs[0]["rows"][0][1], outs[0]["ref_rows"][0][1]
    assert rel(norm, want) > 10 * TOL, (norm, want)


def test_a_nan_on_one_rank_stops_every_rank_naming_its_global_rank():
    """Rank 3 (data rank 1, tensor rank 1) computes a NaN loss: every rank stops at the same step, and the report,
    gathered over the world, names global rank 3 -- not its rank in a dimension."""
    for said in spawn(mesh_worker, 4, args=((2, 2),), kwargs={"planted": "nan"}, timeout=300):
        assert "non-finite values at step 1" in said and "nan on rank 3" in said, said


def checkpoint_worker(rank, W, directory, fmt, kind="net", shape=(2, 2)):
    """4 steps straight; then 2 steps, a checkpoint, and a fresh run resuming from it for the last 2. Rank 0 then
    loads the same checkpoint into one process (the plain model, AdamW) and takes the same last 2 steps. kind
    "net": Net under FSDP2 x torch's TP; "gpt": the course's GPT under nanodist.tp (and FSDP2 where data > 1);
    "gpt-ddp": the same under nanodist DDP on the data dimension."""
    import nanodist as nd
    parallel, plain = {"net": (parallel_net, Net), "gpt": (parallel_gpt, gpt),
                       "gpt-ddp": (lambda m: parallel_gpt(m, data="ddp"), gpt)}[kind]
    from nanodist.checkpoint import CheckpointError, CheckpointManager
    from nanodist.train import Trainer
    mesh = nd.Group.world().mesh({"data": shape[0], "tensor": shape[1]})
    n = shape[0]

    def trainer(model, steps, data_rank, micro, data_size, **kw):
        cfg = config(micro, data_size)
        cfg.steps, cfg.checkpoint_every = steps, 2
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        return Trainer(model, opt, Batches(data_rank, micro, MICRO * n), cfg, **kw)

    straight = trainer(parallel(mesh), 4, mesh["data"].rank, MICRO, n, mesh=mesh)
    straight.fit()
    manager = CheckpointManager(directory, format=fmt)
    first = trainer(parallel(mesh), 4, mesh["data"].rank, MICRO, n, mesh=mesh, checkpoints=manager)
    try:
        first.fit(max_steps=2)
    except (CheckpointError, ValueError) as e:
        return {"refused": str(e)}
    manager.wait()
    second = trainer(parallel(mesh), 4, mesh["data"].rank, MICRO, n, mesh=mesh)
    resumed_from = manager.resume(second)
    second.fit()
    out = {"straight": [h["grad_norm"] for h in straight.history], "resumed": [h["grad_norm"] for h in second.history],
           "from": resumed_from is not None and resumed_from.name}
    if rank == 0:  # one process: the whole batch, the checkpoint's state loaded into a plain model
        torch.manual_seed(0)
        alone = trainer(plain(), 4, 0, MICRO * n, 1, group=nd.Group.local())
        CheckpointManager(directory, format=fmt, group=nd.Group.local()).resume(alone)
        alone.fit()
        out["alone"] = [h["grad_norm"] for h in alone.history]
    return out


@pytest.mark.parametrize("fmt,kind,shape", [  # the one-process comparison on the second kernel path: once per kind
    pytest.param("sharded", "net", (2, 2), marks=numerical), ("full", "net", (2, 2)),
    pytest.param("sharded", "gpt", (1, 2), marks=numerical), ("full", "gpt", (1, 2)), ("sharded", "gpt-ddp", (2, 2))],
                         ids=["2x2-torch-tp-sharded", "2x2-torch-tp-full", "tp2-nanodist-sharded", "tp2-nanodist-full",
                              "2x2-nanodist-ddp-nanodist-tp-sharded"])
def test_a_checkpoint_on_a_mesh_resumes_exactly_and_loads_in_one_process(fmt, kind, shape, tmp_path):
    """A TP = 2 checkpoint of the course's GPT resumes bit for bit at TP = 2 and loads at TP = 1; so do a 2 x 2 one
    of FSDP2 x torch's TP and one of nanodist DDP x nanodist TP."""
    outs = spawn(checkpoint_worker, shape[0] * shape[1], args=(str(tmp_path), fmt, kind, shape), timeout=300)
    for out in outs:
        assert out["straight"][2:] == out["resumed"], out  # bit for bit: the same steps, the same arithmetic
    alone, want = outs[0]["alone"], outs[0]["straight"][2:]
    assert len(alone) == 2 and all(rel(a, b) <= TOL for a, b in zip(alone, want)), (alone, want)


def reverse_worker(rank, W, directory):
    """The reverse of the test above: a one-process run of the course's GPT saves a checkpoint after 2 steps; a TP = 2
    run resumes from it and takes the last 2 steps; so does the one-process run, straight on."""
    import nanodist as nd
    from nanodist.checkpoint import CheckpointManager
    from nanodist.train import Trainer
    mesh = nd.Group.world().mesh({"data": 1, "tensor": W})

    def trainer(model, steps, **kw):
        cfg = config(MICRO, 1)
        cfg.steps, cfg.checkpoint_every = steps, 2
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return Trainer(model, opt, Batches(0, MICRO, MICRO), cfg, **kw)

    out = {}
    if rank == 0:
        alone = trainer(gpt(), 4, group=nd.Group.local(),
                        checkpoints=CheckpointManager(directory, format="sharded", group=nd.Group.local()))
        alone.fit()
        out["alone"] = [h["grad_norm"] for h in alone.history[2:]]
    nd.Group.world().barrier()
    split = trainer(parallel_gpt(mesh), 4, mesh=mesh)
    resumed = CheckpointManager(directory, format="sharded").resume(split, Path(directory) / "step_00000002")
    split.fit()
    out["split"] = [h["grad_norm"] for h in split.history]
    out["from"] = resumed is not None and resumed.name
    return out


@numerical
def test_a_one_process_checkpoint_resumes_at_tp_2(tmp_path):
    outs = spawn(reverse_worker, 2, args=(str(tmp_path),), timeout=300)
    want = outs[0]["alone"]
    for out in outs:
        assert out["from"] == "step_00000002" and len(out["split"]) == 2, out
        assert all(rel(a, b) <= TOL for a, b in zip(out["split"], want)), (out["split"], want)


def test_fsdp2_over_nanodist_tp_refuses_to_checkpoint_with_the_reason(tmp_path):
    """FSDP2 re-cuts nanodist.tp's head-by-head qkv: a layout torch 2.13's DTensor cannot describe (its gather puts
    rows in the wrong places). Training is right (above); a checkpoint says why it cannot be written."""
    for out in spawn(checkpoint_worker, 4, args=(str(tmp_path), "sharded", "gpt", (2, 2)), timeout=300):
        assert "cannot describe that layout" in out.get("refused", ""), out


def test_a_mesh_and_a_group_together_are_refused():
    from nanodist.train import Trainer

    class FakeMesh:
        names = ("data", "tensor")
    with pytest.raises(ValueError, match="not both"):
        Trainer(Net(), torch.optim.SGD(Net().parameters(), lr=0.1), Batches(0, MICRO, MICRO), config(MICRO, 1),
                group=object(), mesh=FakeMesh())
    with pytest.raises(ValueError, match="none named 'batch'"):
        Trainer(Net(), torch.optim.SGD(Net().parameters(), lr=0.1), Batches(0, MICRO, MICRO), config(MICRO, 1),
                mesh=FakeMesh(), data_dim="batch")


def refusal_worker(rank, W):
    """nanodist's own wrappers and sharded optimizers pack plain tensors: given tensor-parallel DTensors they stop at
    once, naming them and saying what to use instead."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import nanodist as nd
    from nanodist.optim import DistAdamW, ZeroOptimizer
    mesh = nd.Group.world().mesh({"tensor": W})
    model = Net()
    for block in model.blocks:
        parallelize_module(block, mesh.device_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    said = {}
    for name, make in (("DDP", lambda: nd.DDP(model)), ("FSDP", lambda: nd.FSDP(model)),
                       ("DistAdamW", lambda: DistAdamW(model.parameters())),
                       ("ZeroOptimizer", lambda: ZeroOptimizer(model.parameters(), torch.optim.SGD, lr=0.1))):
        try:
            make()
            said[name] = "accepted"
        except ValueError as e:
            said[name] = str(e)
    return said


def test_nanodist_wrappers_refuse_tensor_parallel_parameters_with_a_message():
    for said in spawn(refusal_worker, 2, timeout=120):
        for name, message in said.items():
            assert "takes plain tensors" in message and "fully_shard on the data dimension" in message, (name, message)
        assert "blocks.0.fc1.weight, blocks.0.fc1.bias, blocks.0.fc2.weight" in said["DDP"], said["DDP"]
        assert "param_groups[0][" in said["DistAdamW"], said["DistAdamW"]


def gpt():
    from nanodist.model import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", vocab_size=V))


def parallel_gpt(mesh, sequence=False, data="fsdp2"):
    """The course's GPT with nanodist's own tensor parallelism (nanodist.tp; sequence parallelism too with
    sequence=True) on the tensor dimension, and on the data one, where it has more than one rank, torch's FSDP2
    (data="fsdp2") or nanodist's DDP (data="ddp": it averages the DTensors' local pieces over the data group)."""
    from torch.distributed.fsdp import fully_shard

    import nanodist as nd
    from nanodist.tp import tensor_parallel
    model = tensor_parallel(gpt(), mesh["tensor"], sequence=sequence)
    if mesh["data"].size > 1 and data == "ddp":
        return nd.DDP(model, group=mesh["data"], bucket_cap_mb=0.05)  # several buckets: DTensors and plain mixed
    if mesh["data"].size > 1:
        for block in model.blocks:
            fully_shard(block, mesh=mesh.device_mesh["data"])
        fully_shard(model, mesh=mesh.device_mesh["data"])
    return model


def gpt_mesh_worker(rank, W, shape, sequence=False, data="fsdp2"):
    """parallel_gpt trained by the Trainer: the one-process losses and norms."""
    import nanodist as nd
    mesh = nd.Group.world().mesh({"data": shape[0], "tensor": shape[1]})
    model = parallel_gpt(mesh, sequence, data)
    trainer = run(model, {"mesh": mesh}, Batches(mesh["data"].rank, MICRO, MICRO * shape[0]), MICRO, shape[0])
    out = {"rows": [(h["loss"], h["grad_norm"]) for h in trainer.history], "data": mesh["data"].rank}
    if rank == 0:
        whole = MICRO * shape[0]
        ref = run(gpt(), {"group": nd.Group.local()}, Batches(0, whole, whole), whole, 1)
        out["ref_rows"] = [(h["loss"], h["grad_norm"]) for h in ref.history]
    return out


@numerical
@pytest.mark.parametrize("W,shape,sequence,data", [(2, (1, 2), False, "-"), (4, (2, 2), False, "fsdp2"),
                                                   (4, (2, 2), True, "fsdp2"), (4, (2, 2), False, "ddp"),
                                                   (4, (2, 2), True, "ddp")],
                         ids=["1x2-nanodist-tp", "2x2-fsdp2-nanodist-tp", "2x2-fsdp2-nanodist-tp-sp",
                              "2x2-nanodist-ddp-nanodist-tp", "2x2-nanodist-ddp-nanodist-tp-sp"])
def test_the_gpt_with_nanodist_tp_on_a_mesh_trains_as_one_process(W, shape, sequence, data):
    """Losses and norms, not parameters: AdamW turns the key bias's zero gradient (rounding noise in both runs)
    into +-lr updates that differ, but a key bias moves no softmax, so the losses do not see them."""
    outs = spawn(gpt_mesh_worker, W, args=(shape, sequence, data), timeout=300)
    want = outs[0]["ref_rows"]
    for out in outs:
        for step, (_, norm) in enumerate(out["rows"]):
            assert rel(norm, want[step][1]) <= TOL, (step, norm, want[step][1])
    for step in range(STEPS):
        losses = {out["data"]: out["rows"][step][0] for out in outs}
        assert rel(sum(losses.values()) / len(losses), want[step][0]) <= TOL, (step, losses, want[step][0])
