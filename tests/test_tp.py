"""nanodist's tensor parallelism (nanodist.tp) proven equal to one process and to torch's parallelize_module.

The course's GPT split over TP = 1, 2 and 4 ranks gives the one-process loss, gradients (gathered whole from their
DTensors) and global gradient norm; three SGD steps leave the same parameters; a block costs exactly two
all-reduces forward and two backward, of the activations' size; TP = 3 (4 heads) stops with a message naming the
shape; with the vocabulary split too (embedding, head and a loss that never gathers the logits) the same holds;
an MLP split by nanodist equals the same MLP split by torch's ColwiseParallel / RowwiseParallel; a planted
1.001 on one rank's slab is caught."""
import pytest
import torch
from torch import nn

from nanodist.testing import spawn

pytestmark = [pytest.mark.dist, pytest.mark.numerical]  # fp32 sums in another order: the second kernel path too
# fp32: the same sums split differently (row-parallel partial products added by the all-reduce, attention heads
# computed apart): a few roundings of O(1) values, ~1e-7; 1e-5 leaves a margin of 100. The planted error (one rank's
# slab x 1.001) moves gradients by ~1e-3 of their size.
TOL = 1e-5
VOCAB, T, B = 64, 16, 4


def gpt():
    from nanodist.model import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", vocab_size=VOCAB, block_size=T))


def batch(step=0):
    g = torch.Generator().manual_seed(10 + step)
    x = torch.randint(0, VOCAB, (B, T + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def close(got, want, what):
    # relative to the tensor's largest value; the floor only keeps a gradient that is rounding noise in both runs
    # (the key bias's: its true value is zero) from being compared to itself
    scale = max(float(want.abs().max()), 1e-3)
    diff = float((got - want).abs().max())
    assert diff <= TOL * scale, f"{what}: differs by {diff:.2e} (tolerance {TOL * scale:.1e})"
    return diff


def gpt_worker(rank, W, planted=False, vocab=False):
    import nanodist as nd
    from nanodist import tp as tp_module
    from nanodist.parallel import clip_grad_norm_
    from nanodist.state import full_tensor
    group = nd.Group.world()
    plain, model = gpt(), gpt()
    tp_module.tensor_parallel(model, group, vocab=vocab)
    if planted and rank == W - 1:
        with torch.no_grad():
            model.blocks[0].mlp.fc.weight.to_local().mul_(1.001)
    sent = []  # every all-reduce TP runs: (what, bytes)
    real = tp_module.all_reduce_sum

    def counting(t, g, what="all-reduce"):
        if g.size > 1:  # a world of one sends nothing
            sent.append((what, t.numel() * t.element_size()))
        return real(t, g, what)

    tp_module.all_reduce_sum = counting
    x, y = batch()
    if vocab:  # some positions ignored (target -1), as F.cross_entropy's ignore_index: the mean is over the rest
        y = y.clone()
        y[:, :3] = -1
    _, loss = model(x, y)
    forward = list(sent)
    loss.backward()
    backward = sent[len(forward):]
    tp_module.all_reduce_sum = real
    _, want = plain(x, y)
    want.backward()
    out = {"loss": (float(loss.detach()), float(want.detach())), "forward": forward, "backward": backward, "grads": {}}
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        out["grads"][name] = (full_tensor(p.grad), q.grad)
    out["norm"] = (float(clip_grad_norm_(list(model.parameters()), float("inf"))),
                   float(torch.nn.utils.clip_grad_norm_(plain.parameters(), float("inf"))))
    out["local"] = {n: tuple(p.to_local().shape) for n, p in model.named_parameters() if hasattr(p, "to_local")}
    if vocab:  # a rank holds a slice of the logits: sampling alone would pick from it
        try:
            model.generate(x[:, :2], 1, temperature=0)
            out["generate"] = "sampled"
        except ValueError as e:
            out["generate"] = str(e)
    if planted:
        return out
    # three steps (the first above): the same parameters. SGD with momentum, not AdamW: the key bias's true gradient
    # is zero (a constant added to every key moves no softmax), so both runs hold rounding noise of ~1e-9 there, which
    # AdamW divides by its own square root -- an update of +-lr whatever the noise's sign. SGD keeps noise noise.
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, plain)]
    for step in range(3):
        if step:
            for m in (model, plain):
                m.zero_grad()
                m(*batch(step))[1].backward()
        for o in opts:
            o.step()
    out["params"] = {n: (full_tensor(p.detach()), q.detach()) for (n, p), q in
                     zip(model.named_parameters(), plain.parameters())}
    return out


@pytest.mark.parametrize("W,vocab", [(1, False), (2, False), (4, False), (2, True), (4, True)],
                         ids=["tp1", "tp2", "tp4", "tp2-vocab", "tp4-vocab"])
def test_the_gpt_split_over_w_ranks_equals_one_process(W, vocab):
    for rank, out in enumerate(spawn(gpt_worker, W, kwargs={"vocab": vocab}, timeout=180)):
        got, want = out["loss"]
        assert abs(got - want) <= TOL * abs(want), out["loss"]
        for name, (g, w) in out["grads"].items():
            close(g, w, f"rank {rank}: gradient of {name}")
        got, want = out["norm"]
        assert abs(got - want) <= TOL * want, out["norm"]
        for name, (p, q) in out["params"].items():
            close(p, q, f"rank {rank}: {name} after 3 SGD steps")
        # this rank holds 1/W of each split matrix: qkv's rows head by head, fc's rows, the projections' columns
        C = 64
        assert out["local"]["blocks.0.attn.qkv.weight"] == (3 * C // W, C)
        assert out["local"]["blocks.0.mlp.fc.weight"] == (4 * C // W, C)
        assert out["local"]["blocks.0.mlp.proj.weight"] == (C, 4 * C // W)
        assert out["local"]["blocks.0.attn.proj.bias"] == (C,)  # replicated
        # two all-reduces a block forward (g after each row-parallel layer) and two backward (f before each
        # column-parallel one), each of the activations' size: B x T x C fp32 values
        n_layer, act = 2, B * T * C * 4
        want_count = 0 if W == 1 else 2 * n_layer
        if not vocab:
            assert [b for _, b in out["forward"]] == [act] * want_count, out["forward"]
            assert [b for _, b in out["backward"]] == [act] * want_count, out["backward"]
        else:  # + the embedding's g forward and the head's f backward (activations), and the loss's denominators
            # and target logits (one fp32 number per position; the MAX all-reduce before them is not counted here)
            assert out["local"]["wte.weight"] == (VOCAB // W, C)
            assert "split by vocabulary" in out["generate"], out["generate"]
            assert [b for _, b in out["forward"]] == [act] * (1 + want_count) + [B * T * 4] * 2, out["forward"]
            assert [b for _, b in out["backward"]] == [act] * (want_count + 1), out["backward"]


def test_a_planted_error_on_one_ranks_slab_is_caught():
    out = spawn(gpt_worker, 2, kwargs={"planted": True}, timeout=180)[0]
    g, w = out["grads"]["blocks.0.mlp.fc.weight"]
    with pytest.raises(AssertionError, match="differs by"):  # the very check the equivalence test makes
        close(g, w, "planted")


def heads_worker(rank, W):
    import nanodist as nd
    from nanodist.tp import tensor_parallel
    try:
        tensor_parallel(gpt(), nd.Group.world())
    except ValueError as e:
        return str(e)
    return "accepted"


def test_a_size_that_does_not_divide_the_heads_stops_with_the_shape():
    for said in spawn(heads_worker, 3, timeout=120):
        assert "blocks.0.attn's heads (4)" in said and "not a multiple of 3" in said, said


def mlp_worker(rank, W):
    """The same MLP split by nanodist and by torch's parallelize_module: the same outputs and gradients."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import nanodist as nd
    from nanodist.model import MLP, GPTConfig
    from nanodist.state import full_tensor
    from nanodist.tp import ColumnParallelLinear, RowParallelLinear
    group = nd.Group.world()
    cfg = GPTConfig.preset("tiny", vocab_size=VOCAB, block_size=T)
    torch.manual_seed(0)
    ours, theirs = MLP(cfg), MLP(cfg)
    theirs.load_state_dict(ours.state_dict())
    ours.fc, ours.proj = ColumnParallelLinear(ours.fc, group), RowParallelLinear(ours.proj, group)
    parallelize_module(theirs, group.device_mesh, {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
    x = torch.randn(B, T, cfg.n_embd, generator=torch.Generator().manual_seed(3), requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    a, b = ours(x), theirs(x2)
    a.square().sum().backward()
    b.square().sum().backward()
    def rel(got, want):  # largest difference, relative to the largest value (at least 1)
        return float((got - want).abs().max()) / max(float(want.abs().max()), 1.0)

    out = {"out": rel(a.detach(), b.detach()), "dx": rel(x.grad, x2.grad)}
    out["grads"] = {n: rel(full_tensor(p.grad), full_tensor(q.grad))
                    for (n, p), q in zip(ours.named_parameters(), theirs.parameters())}
    return out


def test_an_mlp_split_by_nanodist_equals_torchs_parallelize_module():
    for out in spawn(mlp_worker, 2, timeout=120):
        assert out["out"] <= TOL and out["dx"] <= TOL, out  # the same matmuls; sums may meet in another order
        assert all(d <= TOL for d in out["grads"].values()), out
