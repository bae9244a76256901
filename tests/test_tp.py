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

pytestmark = pytest.mark.dist
numerical = pytest.mark.numerical  # fp32 sums in another order: the second kernel path too (not the byte counts)
# fp32: the same sums split differently (row-parallel partial products added by the all-reduce, attention heads
# computed apart): a few roundings of O(1) values, ~1e-7; 1e-5 leaves a margin of 100. The planted error (one rank's
# slab x 1.001) moves gradients by ~1e-3 of their size.
TOL = 1e-5
VOCAB, T, B = 64, 16, 2  # B x T = 32 positions: the loss's per-position all-reduces (128 bytes) differ in size
# from a LayerNorm's gradient (C = 64: 256 bytes), so the traffic's sizes tell them apart


def gpt(**changes):
    from nanodist.model import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", vocab_size=VOCAB, block_size=T, **changes))


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


def gpt_worker(rank, W, planted=False, vocab=False, sequence=False):
    import nanodist as nd
    from nanodist import tp as tp_module
    from nanodist.parallel import clip_grad_norm_
    from nanodist.state import full_tensor
    group = nd.Group.world()
    plain, model = gpt(), gpt()
    tp_module.tensor_parallel(model, group, vocab=vocab, sequence=sequence)
    if planted and rank == W - 1:
        with torch.no_grad():
            model.blocks[0].mlp.fc.weight.to_local().mul_(1.001)
    x, y = batch()
    if vocab:  # some positions ignored (target -1), as F.cross_entropy's ignore_index: the mean is over the rest
        y = y.clone()
        y[:, :3] = -1
    with tp_module.record_traffic() as sent:  # every collective TP runs, with its size
        _, loss = model(x, y)
        forward = len(sent)
        loss.backward()
    _, want = plain(x, y)
    want.backward()
    out = {"loss": (float(loss.detach()), float(want.detach())), "grads": {},
           "traffic": [("forward" if i < forward else "backward", s.kind, s.nbytes) for i, s in enumerate(sent)]}
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


def outside_the_blocks(W, vocab, sequence):
    """The collectives outside the blocks, itemised: {(phase, kind, bytes): count}."""
    from collections import Counter
    C = 64
    S = B * T * C * 4  # the activations, fp32
    out = Counter()
    if W == 1:
        return out
    if vocab:  # the embedding's g; the loss's MAX, denominators and targets' logits (one number per position)
        out[("forward", "all-reduce", S)] += 1
        out[("forward", "all-reduce", B * T * 4)] += 3
    if vocab and not sequence:
        out[("backward", "all-reduce", S)] += 1  # the head's f
    if sequence:
        out[("backward", "all-gather", S)] += 1  # the split after the embeddings: its gradient gathered
        out[("backward", "all-reduce", C * 4)] += 2  # the final LayerNorm's weight and bias
        out[("forward", "all-gather", S)] += 1  # the final norm's output (or the vocab head's input) gathered
        if vocab:  # the head is column-parallel under SP: its input's gradient reduce-scattered, its shard regathered
            out[("backward", "reduce-scatter", S)] += 1
            out[("backward", "all-gather", S)] += 1
    return out


@numerical
@pytest.mark.parametrize("W,vocab,sequence", [(1, False, False), (2, False, False), (4, False, False),
                                              (2, True, False), (4, True, False), (2, False, True), (4, False, True),
                                              (2, True, True), (4, True, True)],
                         ids=["tp1", "tp2", "tp4", "tp2-vocab", "tp4-vocab", "tp2-sp", "tp4-sp", "tp2-vocab-sp",
                              "tp4-vocab-sp"])
def test_the_gpt_split_over_w_ranks_equals_one_process(W, vocab, sequence):
    from collections import Counter

    from nanodist.costmodel import tensor_parallel_traffic
    outs = spawn(gpt_worker, W, kwargs={"vocab": vocab, "sequence": sequence}, timeout=180)
    for rank, out in enumerate(outs):
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
        # the collectives counted in the run are the formula's, per block, exactly: TP 2 all-reduces of the
        # activations forward and 2 backward; SP all-gathers and reduce-scatters (costmodel.tensor_parallel_traffic)
        n_layer = 2
        want = Counter({k: n * n_layer for k, n in tensor_parallel_traffic(B, T, C, W, sequence).items()})
        want += outside_the_blocks(W, vocab, sequence)
        assert Counter(map(tuple, out["traffic"])) == want, (sorted(Counter(map(tuple, out["traffic"])).items()),
                                                             sorted(want.items()))
        if vocab:
            assert out["local"]["wte.weight"] == (VOCAB // W, C)
            assert "split by vocabulary" in out["generate"], out["generate"]


@numerical
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


def seeds_worker(rank, W):
    import nanodist as nd
    from nanodist.model import GPT, GPTConfig
    from nanodist.testing import LogLines
    from nanodist.tp import tensor_parallel
    torch.manual_seed(rank)  # a user who seeded each rank differently
    model = GPT(GPTConfig.preset("tiny", vocab_size=VOCAB, block_size=T))
    with LogLines() as log:
        tensor_parallel(model, nd.Group.world())
    embedding = model.wte.weight.detach()  # replicated: every rank must hold rank 0's
    return {"warned": log.lines, "embeddings": nd.Group.world().all_gather_object(embedding)}


def test_ranks_built_with_different_seeds_start_from_rank_0s_and_are_told():
    for out in spawn(seeds_worker, 2, timeout=120):
        assert torch.equal(*out["embeddings"])
        assert [line for line in out["warned"] if line.startswith("tensor_parallel: ranks started with different")
                and "wte.weight" in line and "Seed model init identically" in line], out["warned"]


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


@numerical
@pytest.mark.parametrize("W", [2, 4])
def test_an_mlp_split_by_nanodist_equals_torchs_parallelize_module(W):
    for out in spawn(mlp_worker, W, timeout=120):
        assert out["out"] <= TOL and out["dx"] <= TOL, out  # the same matmuls; sums may meet in another order
        assert all(d <= TOL for d in out["grads"].values()), out


def activation_worker(rank, W, sequence):
    """What block 0 saves for backward on this rank, counted by autograd's saved-tensor hooks."""
    import nanodist as nd
    from nanodist.memory import LiveBytes
    from nanodist.tp import tensor_parallel
    model = gpt()
    if W > 1:
        tensor_parallel(model, nd.Group.world(), sequence=sequence)
    live = LiveBytes(parameters=model.parameters())  # a DTensor's local piece is a parameter, not an activation
    with live.track_module(model.blocks[0]):
        model(*batch())
    return live.saved_bytes()


@pytest.mark.parametrize("W,sequence", [(1, False), (2, False), (4, False), (2, True), (4, True)],
                         ids=["tp1", "tp2", "tp4", "tp2-sp", "tp4-sp"])
def test_a_blocks_saved_activations_are_the_formulas(W, sequence):
    """Exactly, in bytes: fp32 on a CPU, whose fused attention kernel keeps no T x T scores (one logsumexp per
    row) and writes its output in the order the projection reads it (costmodel.activation_bytes says which
    tensor is which). TP leaves 4 of the 16 b s h replicated; SP splits them too."""
    from nanodist.costmodel import activation_bytes
    want = activation_bytes(B, T, 64, 4, W, sequence)["total"]
    for got in spawn(activation_worker, W, args=(sequence,), timeout=120):
        assert got == want, (got, want)


def dropout_worker(rank, W, sequence):
    import nanodist as nd
    from nanodist.tp import tensor_parallel
    group = nd.Group.world()
    out = {}
    torch.manual_seed(5)  # the same generator on every rank, as nanodist.init and the labs seed it
    model = tensor_parallel(gpt(dropout=0.2), group, sequence=sequence)
    with model.blocks[0].attn.heads_random():  # a rank's own stream, for its own heads (and, with SP, positions)
        out["own"] = torch.rand(4)
    with model.blocks[0].attn.heads_random():
        out["own again"] = torch.rand(4)
    x, y = batch()
    logits, loss = model(x, y)
    loss.backward()
    out["logits"] = logits.detach()  # replicated: the residual stream's dropouts drew the same masks on every rank
    out["after"] = torch.rand(4)  # the shared generator is still in step
    grads = {n: p.grad.to_local().clone() if hasattr(p.grad, "to_local") else p.grad.clone()
             for n, p in model.named_parameters()}
    # activation checkpointing recomputes each block in backward: it must find the same masks
    torch.manual_seed(6)
    model.zero_grad()
    model(x, y)[1].backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.manual_seed(6)
    model.zero_grad()
    model.activation_checkpointing = True
    model(x, y)[1].backward()
    out["recompute"] = max(float((p.grad - plain[n]).abs().max()) for n, p in model.named_parameters())
    out["differs from seed 5"] = any(not torch.equal(plain[n], g) for n, g in grads.items())
    return out


@pytest.mark.parametrize("sequence", [False, True], ids=["tp2", "tp2-sp"])
def test_dropout_draws_the_same_masks_where_replicated_and_its_own_where_split(sequence):
    a, b = spawn(dropout_worker, 2, args=(sequence,), timeout=120)
    assert not torch.equal(a["own"], b["own"]), "the ranks' own streams drew the same numbers"
    assert not torch.equal(a["own"], a["own again"]), "entering the stream twice drew the same numbers"
    assert torch.equal(a["logits"], b["logits"]), "the replicated logits differ: a replicated dropout diverged"
    assert torch.equal(a["after"], b["after"]), "the shared generator fell out of step"
    for out in (a, b):
        assert out["recompute"] == 0.0, out["recompute"]  # the recompute drew the very same masks
        assert out["differs from seed 5"]  # (the masks do depend on the seed: the check above could fail)


def short_sequence_worker(rank, W):
    import nanodist as nd
    from nanodist.tp import tensor_parallel
    model = tensor_parallel(gpt(), nd.Group.world(), sequence=True)
    x, y = batch()
    said = []
    for attempt in (lambda: model(x[:, :15], y[:, :15]), lambda: model.generate(x[:, :4], 2, temperature=0)):
        try:
            attempt()
            said.append("accepted")
        except ValueError as e:
            said.append(str(e))
    return said


def test_sequence_parallelism_names_a_length_that_does_not_divide_and_refuses_to_generate():
    for short, generate in spawn(short_sequence_worker, 2, timeout=120):
        assert "T = 15, not a multiple of 2" in short and "seq_len" in short, short
        assert "splits each sequence" in generate and "one process" in generate, generate


def autocast_worker(rank, W):
    """SP under CPU bf16 autocast: the fused gather casts the shard before it travels and stays (half the bytes of
    fp32 activations), the gradients come back in the parameters' dtype, and the loss is one process's to bf16's
    precision."""
    import nanodist as nd
    from nanodist.state import full_tensor
    from nanodist.tp import record_traffic, tensor_parallel
    plain, model = gpt(), tensor_parallel(gpt(), nd.Group.world(), sequence=True)
    x, y = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with record_traffic() as sent:
            _, loss = model(x, y)
        _, want = plain(x, y)
    loss.backward()
    want.backward()
    gathers = sorted({s.nbytes for s in sent if s.what == "SP f: all-gather of the sequence"})
    grads = [(full_tensor(p.grad), q.grad) for p, q in zip(model.parameters(), plain.parameters())]
    return {"loss": (float(loss.detach()), float(want.detach())), "gathers": gathers,
            "dtypes": sorted({str(g.dtype) for g, _ in grads}),
            "worst": max(float((g - w).abs().max()) / max(float(w.abs().max()), 1e-3) for g, w in grads)}


def test_sequence_parallelism_under_bf16_autocast():
    for out in spawn(autocast_worker, 2, timeout=120):
        got, want = out["loss"]
        assert abs(got - want) <= 2e-2 * want, out  # bf16's 8 bits of mantissa, summed in other orders
        assert out["gathers"] == [B * T * 64 * 2], out  # the whole (B, T, C) gathered in bf16: 2 bytes a value
        assert out["dtypes"] == ["torch.float32"] and out["worst"] <= 5e-2, out
