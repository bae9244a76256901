"""The training state's one protocol (nanodist.state): model and optimizer keyed by the bare model's parameter
names. Any torch optimizer -- built in or the user's own -- round-trips through a checkpoint without nanodist
knowing its class; optimizer state is matched to parameters and saved groups to live groups by name, never by
position; nanodist.FSDP's state loads into another packing of units; models with frozen, tied and bare
parameters and buffers round-trip; torch.compile's prefix is not part of the names."""
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nanodist as nd
from nanodist import state
from nanodist.checkpoint import CheckpointManager, fingerprint, load
from nanodist.data import TokenStream
from nanodist.testing import spawn
from nanodist.train import TrainConfig, Trainer

V, D = 13, 8


class Odd(nn.Module):
    """What users' models have and the course's GPT does not: a frozen layer, a bare nn.Parameter, an output
    layer tied to the embedding, a buffer that changes as it trains."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.frozen = nn.Linear(D, D)
        self.frozen.requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(D))
        self.mix = nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x, y):
        self.seen += x.numel()
        h = torch.tanh(self.mix(self.frozen(self.emb(x)) * self.scale))
        logits = self.head(h)
        return logits, F.cross_entropy(logits.view(-1, V), y.reshape(-1))


class SignMomentum(torch.optim.Optimizer):
    """A user's own optimizer, which nanodist has never heard of: state keys of its own, a scalar and a tensor."""

    def __init__(self, params, lr=0.01, beta=0.9):
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            with torch.enable_grad():
                closure()
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["velocity"], st["updates"] = torch.zeros_like(p), 0
                st["velocity"].mul_(g["beta"]).add_(p.grad)
                st["updates"] += 1
                p.add_(st["velocity"].sign(), alpha=-g["lr"])


OPTIMIZERS = {
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.9),
    "sign-momentum": lambda ps: SignMomentum(ps, lr=0.01),
}


def odd_trainer(optimizer: str, group=None, wrap=lambda m: m):
    torch.manual_seed(0)
    model = wrap(Odd())
    params = [p for p in model.parameters() if p.requires_grad]
    opt = OPTIMIZERS[optimizer]([{"params": params[:2]}, {"params": params[2:], "lr": 0.02}])
    tokens = torch.randint(0, V, (4000,), generator=torch.Generator().manual_seed(1))
    cfg = TrainConfig(steps=6, micro_batch=2, seq_len=8, progress=False, log_every=0, warmup_steps=1, lr=0.05)
    return Trainer(model, opt, TokenStream(tokens, batch_size=2, block_size=8, shuffle=False), cfg, group=group)


def any_optimizer_worker(rank, world, directory):
    """Each optimizer nanodist has no code for, each format: train 3 steps, save, resume into a fresh run that has
    taken no step (its optimizer has no state yet), and go on: the state and the next steps are the saved run's."""
    wrap = (lambda m: nd.DDP(m)) if world > 1 else (lambda m: m)
    out = {}
    for name in OPTIMIZERS:
        for fmt in ("full", "sharded"):
            mgr = CheckpointManager(Path(directory) / f"{name}-{fmt}", format=fmt)
            a = odd_trainer(name, wrap=wrap)
            a.fit(max_steps=3)
            mgr.save(a)
            before = fingerprint(a)
            b = odd_trainer(name, wrap=wrap)
            mgr.resume(b, "auto")
            after = fingerprint(b)
            la = [h["loss"] for h in a.fit(max_steps=2)[-2:]]
            lb = [h["loss"] for h in b.fit(max_steps=2)[-2:]]
            buffers = torch.equal(state.model_state_dict(a.model)["seen"], state.model_state_dict(b.model)["seen"])
            out[name, fmt] = (before == after, la == lb, buffers, b.step)
    return out


@pytest.mark.dist
@pytest.mark.parametrize("world", [1, 3])
def test_any_optimizer_and_a_users_model_round_trip_through_a_checkpoint(tmp_path, world):
    for rank_out in spawn(any_optimizer_worker, world, args=(str(tmp_path),), timeout=120):
        assert len(rank_out) == 2 * len(OPTIMIZERS)
        for setup, (same_state, same_losses, same_buffers, step) in rank_out.items():
            assert same_state and same_losses and same_buffers and step == 5, (world, setup)


def test_optimizer_state_is_matched_by_name_whatever_the_order_of_groups_and_parameters():
    """Saved with groups (decay, no decay), loaded into an optimizer whose groups come the other way round with
    their parameters reversed: every parameter gets its own moments and its own group's hyperparameters."""
    torch.manual_seed(0)
    a = Odd()
    named = [(n, p) for n, p in a.named_parameters() if p.requires_grad]
    decay, rest = [p for n, p in named if p.ndim >= 2], [p for n, p in named if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=0.01)
    x = torch.randint(0, V, (2, 8))
    for _ in range(2):
        a(x, x)[1].backward()
        opt.step()
        opt.zero_grad()
    saved = state.optimizer_state_dict(a, opt)
    assert set(saved["state"]) == {n for n, _ in named}  # keyed by name; the tied head is the embedding
    b = Odd()
    b.load_state_dict(a.state_dict())
    theirs = dict(b.named_parameters())
    by_name = {n: theirs[n] for n, _ in named}
    decay_b = [by_name[n] for n, p in named if p.ndim >= 2][::-1]
    rest_b = [by_name[n] for n, p in named if p.ndim < 2][::-1]
    opt_b = torch.optim.AdamW([{"params": rest_b, "weight_decay": 0.0}, {"params": decay_b, "weight_decay": 0.1}],
                              lr=0.01)
    state.load_optimizer_state_dict(b, opt_b, saved)
    for n, p in named:
        mine, theirs_st = opt.state[p], opt_b.state[by_name[n]]
        assert torch.equal(mine["exp_avg"], theirs_st["exp_avg"]) and torch.equal(mine["exp_avg_sq"],
                                                                                 theirs_st["exp_avg_sq"]), n
    assert [g["weight_decay"] for g in opt_b.param_groups] == [0.0, 0.1]
    # a group holding other parameters than any saved group is refused, naming it
    opt_c = torch.optim.AdamW([{"params": decay_b[:1] + rest_b}, {"params": decay_b[1:]}], lr=0.01)
    with pytest.raises(ValueError, match="no saved group with the same parameters"):
        state.load_optimizer_state_dict(b, opt_c, saved)


def test_names_are_the_bare_models_through_torch_compile():
    torch.manual_seed(0)
    model = Odd()
    compiled = torch.compile(model)  # compiles at its first call: never called here
    assert list(state.model_state_dict(compiled)) == list(model.state_dict())
    opt = torch.optim.SGD(compiled.parameters(), lr=0.1, momentum=0.9)
    assert set(state.optimizer_state_dict(compiled, opt)["param_groups"][0]["params"]) == \
        {n for n, _ in model.named_parameters()}


def fsdp_packing_worker(rank, world, directory):
    """nanodist.FSDP with one unit per block saves; the same model wrapped as one unit, and with the blocks'
    units in reverse, loads: every parameter and every moment is the saved one (the fingerprint is by name)."""
    from nanodist import experiment
    from tests.test_checkpoint import make_args
    args = make_args()
    data = experiment.load_data(args)
    run = experiment.build(args, data, nd.Group.world(), wrapper="fsdp", optimizer="adamw", name="t")
    run.trainer.fit(max_steps=2)
    mgr = CheckpointManager(Path(directory), format="sharded")
    mgr.save(run.trainer)
    saved = fingerprint(run.trainer)
    out = {}
    group = nd.Group.world()
    for packing in ("one unit", "reversed"):
        model = experiment.build_model(args, data.vocab_size, group.device)
        units = [] if packing == "one unit" else list(model.blocks)[::-1]
        fsdp = nd.FSDP(model, units, group=group)
        opt = torch.optim.AdamW(fsdp.configure_param_groups(0.1)[::-1], lr=1e-3)
        stream = TokenStream(data.train, batch_size=2, block_size=16, rank=group.rank, world_size=group.size)
        trainer = Trainer(fsdp, opt, stream, run.trainer.cfg)
        load(mgr.latest(), trainer)
        out[packing] = fingerprint(trainer) == saved
    return out


@pytest.mark.dist
def test_fsdp_state_loads_into_another_packing_of_units(tmp_path):
    for rank_out in spawn(fsdp_packing_worker, 2, args=(str(tmp_path),), timeout=120):
        assert rank_out == {"one unit": True, "reversed": True}


def full_tensor_worker(rank, world):
    """state.full_tensor through the host route (the one a GPU DTensor on gloo takes) against DTensor's own
    gather, on a 1-D mesh and a 2-D one, for uneven shards, a replicated tensor and a partial sum."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor, DTensor
    out = []
    for shape in ((world,), (1, world)):
        mesh = init_device_mesh("cpu", shape)
        torch.manual_seed(0)
        whole = torch.randn(2 * world + 1, 3)  # shards of unequal length
        last = [Shard(0)] if len(shape) == 1 else [Replicate(), Shard(0)]
        cases = [distribute_tensor(whole, mesh, last), distribute_tensor(whole, mesh, [Replicate()] * len(shape)),
                 DTensor.from_local(torch.full((2,), float(rank)), mesh, [Replicate()] * (len(shape) - 1) +
                                    [Partial()], run_check=False)]
        for t in cases:
            host, direct = state.full_tensor(t, via_host=True), state.full_tensor(t, via_host=False)
            out.append((tuple(host.shape), torch.equal(host, direct), type(host).__name__, host.flatten()[0].item()))
    return out


@pytest.mark.dist
def test_full_tensor_through_host_copies_equals_dtensors_own_gather():
    W = 3
    torch.manual_seed(0)
    first = torch.randn(2 * W + 1, 3)[0, 0].item()
    for rank_out in spawn(full_tensor_worker, W, timeout=120):
        assert [s for s, *_ in rank_out] == [(2 * W + 1, 3), (2 * W + 1, 3), (2,)] * 2
        assert all(same and kind == "Tensor" for _, same, kind, _ in rank_out), rank_out
        assert [v for *_, v in rank_out] == [first, first, float(sum(range(W)))] * 2  # a partial is summed
