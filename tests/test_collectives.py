"""The from-scratch collectives equal torch.distributed's own, on real gloo processes.

One spawn per world size runs every case (a spawn costs seconds; a case costs milliseconds). Each
worker compares with torch on the spot and returns a list of failures, so the assertion message
says which case broke on which rank.
"""
import os

import pytest
import torch
import torch.distributed as dist

from nanodist import collectives as C
from nanodist.testing import spawn

pytestmark = pytest.mark.dist

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64)
ALL_REDUCES = (C.ring_all_reduce, C.naive_all_reduce, C.recursive_doubling_all_reduce)
# torch >= 2.13 renamed these two; use the new names where they exist, to stay free of warnings.
_torch_rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_torch_ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _data(shape, dtype, rank, seed, integer):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if integer or not dtype.is_floating_point:  # integer values: every summation order gives the same bits
        return torch.randint(-50, 50, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _compare(fails, name, got, want, exact):
    if got.shape != want.shape or got.dtype != want.dtype:
        fails.append(f"{name}: got {got.dtype}{list(got.shape)}, want {want.dtype}{list(want.shape)}")
    elif exact and not torch.equal(got, want):
        fails.append(f"{name}: not bitwise equal to torch (max diff {(got.double() - want.double()).abs().max()})")
    elif not exact:
        # bf16 keeps 8 bits of mantissa: a sum in another order than torch's differs by a few of its roundings
        # (2^-8 relative each); fp32 sums in another order, by a few fp32 roundings
        tol = dict(rtol=2e-2, atol=5e-2) if got.dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
        if not torch.allclose(got.double(), want.double(), **tol):
            fails.append(f"{name}: not close to torch (max diff {(got.double() - want.double()).abs().max()})")


def _lengths(ws):
    return (0, 1, ws - 1, 7, 1009)  # empty, one element, fewer than ranks, not divisible, prime


def _all_reduce_cases(rank, ws, group=None, tag=""):
    fails, fingerprints = [], []
    for dtype in DTYPES:
        ops = ("sum", "avg") if dtype.is_floating_point else ("sum",)
        shapes = [(L,) for L in _lengths(ws)] + [(), (3, 5)]
        for seed, shape in enumerate(shapes):
            for integer in (True, False):
                for op in ops:
                    x = _data(shape, dtype, rank, seed, integer)
                    want = x.clone()
                    dist.all_reduce(want, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.AVG, group=group)
                    for fn in ALL_REDUCES:
                        got = x.clone()
                        out = fn(got, op=op, group=group)
                        name = f"{tag}{fn.__name__}({dtype}, shape={shape}, op={op}, integer={integer})"
                        if out is not got:
                            fails.append(f"{name}: did not return its argument")
                        _compare(fails, name, got, want, exact=integer)
                        if not integer:  # all ranks must agree bit for bit, or replicas drift apart
                            fingerprints.append((name, got.view(-1).double().tolist()))
    # A non-contiguous tensor (a transposed view) is reduced in place all the same.
    x = _data((4, 6), torch.float32, rank, 99, True)
    want = x.clone()
    dist.all_reduce(want, group=group)
    for fn in ALL_REDUCES:
        base = x.t().clone().t()  # same values, column-major memory
        fn(base, group=group)
        _compare(fails, f"{tag}{fn.__name__}(non-contiguous)", base, want, exact=True)
    return fails, fingerprints


def _reduce_scatter_cases(rank, ws, group=None, tag=""):
    fails = []
    for dtype in DTYPES:
        ops = ("sum", "avg") if dtype.is_floating_point else ("sum",)
        for seed, (out_shape, in_shape) in enumerate([((m,), (ws * m,)) for m in (0, 1, 3, 101)]
                                                     + [((2, 3), (2 * ws, 3)), ((3,), (ws, 3))]):
            for integer in (True, False):
                for op in ops:
                    x = _data(in_shape, dtype, rank, seed, integer)
                    want = torch.empty(out_shape, dtype=dtype)
                    if want.numel():  # gloo cannot reduce-scatter empty tensors, nor take the stacked form
                        torch_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.AVG
                        _torch_rs(want, x.reshape(-1, *out_shape[1:]), op=torch_op, group=group)
                    got = torch.full(out_shape, 7, dtype=dtype)
                    before = x.clone()
                    C.ring_reduce_scatter(got, x, op=op, group=group)
                    name = f"{tag}ring_reduce_scatter({dtype}, out={out_shape}, in={in_shape}, op={op}, int={integer})"
                    _compare(fails, name, got, want, exact=integer)
                    if not torch.equal(x, before):
                        fails.append(f"{name}: modified its input")
    # 0-D output, stacked input: torch's gloo crashes on this one, so compare with the definition.
    got = torch.tensor(0.0)
    C.ring_reduce_scatter(got, torch.arange(ws, dtype=torch.float32) + rank, group=group)
    members = [dist.get_global_rank(group or dist.group.WORLD, r) for r in range(dist.get_world_size(group))]
    want = torch.tensor(float(dist.get_rank(group) * len(members) + sum(members)))
    _compare(fails, f"{tag}ring_reduce_scatter(0-D output)", got, want, exact=True)
    return fails


def _all_gather_cases(rank, ws, group=None, tag=""):
    fails = []
    for dtype in DTYPES:
        for seed, (in_shape, out_shape) in enumerate([((m,), (ws * m,)) for m in (0, 1, 3, 101)]
                                                     + [((2, 3), (2 * ws, 3)), ((3,), (ws, 3))]):
            x = _data(in_shape, dtype, rank, seed, False)
            want = torch.empty(out_shape, dtype=dtype)
            if want.numel():
                _torch_ag(want.view(-1, *in_shape[1:]), x, group=group)
            got = torch.full(out_shape, 7, dtype=dtype)
            C.ring_all_gather(got, x, group=group)
            _compare(fails, f"{tag}ring_all_gather({dtype}, in={in_shape}, out={out_shape})", got, want, exact=True)
    got = torch.zeros(ws)
    C.ring_all_gather(got, torch.tensor(float(rank)), group=group)  # 0-D inputs, stacked
    _compare(fails, f"{tag}ring_all_gather(0-D input)", got,
             torch.tensor([float(dist.get_global_rank(group or dist.group.WORLD, r)) for r in range(ws)]), exact=True)
    return fails


def _sum_of_ranks(shape, ws, dtype=torch.float32):
    """What a sum over ws ranks gives when group rank r holds _ranked(shape, r): (r + 1) * 100 + position."""
    return (100 * ws * (ws + 1) // 2 + ws * torch.arange(_numel(shape))).to(dtype).reshape(shape)


def _ranked(shape, r, dtype=torch.float32):
    return ((r + 1) * 100 + torch.arange(_numel(shape))).to(dtype).reshape(shape)


def _numel(shape):
    return torch.Size(shape).numel()


def _views_and_aliases(rank, ws, group=None, tag=""):
    """Non-contiguous outputs (torch.empty_like keeps their strides: flattening one makes a copy, and what is
    received there is lost) and in-place calls whose output and input share memory, as ZeRO and
    all_gather_into_tensor use them. Compared with sums computed by hand, so torch's quirks play no part."""
    fails = []
    me = dist.get_rank(group)  # data follow the group rank, so the expected values do too

    def same(name, got, want):
        if got.dtype != want.dtype or not torch.equal(got, want):
            fails.append(f"{tag}{name}: got {got.dtype} {got.tolist()}, want {want.dtype} {want.tolist()}")

    m = 3
    total = _sum_of_ranks((2 * ws, m), ws)  # the reduction of every rank's full input
    mine = total[2 * me:2 * me + 2]
    # reduce-scatter into a transposed view, and into every other element of a buffer
    out = torch.full((m, 2), 7.0).t()
    C.ring_reduce_scatter(out, _ranked((2 * ws, m), me), group=group)
    same("ring_reduce_scatter(output transposed)", out, mine)
    buf = torch.full((4 * m,), 7.0)
    C.ring_reduce_scatter(buf[::2], _ranked((ws * 2 * m,), me), group=group)
    same("ring_reduce_scatter(output strided)", buf[::2], mine.reshape(-1))
    same("ring_reduce_scatter(output strided) left the gaps alone", buf[1::2], torch.full((2 * m,), 7.0))
    # in place: output is this rank's chunk of input, flat or stacked; then another rank's chunk
    for op in ("sum", "avg"):
        div = ws if op == "avg" else 1
        inp = _ranked((ws * m,), me)
        before = inp.clone()
        C.ring_reduce_scatter(inp[me * m:(me + 1) * m], inp, op=op, group=group)
        want = before.clone()
        want[me * m:(me + 1) * m] = _sum_of_ranks((ws * m,), ws)[me * m:(me + 1) * m] / div
        same(f"ring_reduce_scatter(in place, op={op}): output and the rest of input", inp, want)
    stacked = _ranked((ws, m), me)
    C.ring_reduce_scatter(stacked[me], stacked, group=group)
    same("ring_reduce_scatter(in place, stacked)", stacked[me], _sum_of_ranks((ws, m), ws)[me])
    inp = _ranked((ws * m,), me)
    other = (me + 1) % ws
    C.ring_reduce_scatter(inp[other * m:(other + 1) * m], inp, group=group)
    same("ring_reduce_scatter(output = another rank's chunk of input)", inp[other * m:(other + 1) * m],
         _sum_of_ranks((ws * m,), ws)[me * m:(me + 1) * m])
    # complex numbers travel as pairs of reals: chunk r must still be r's complex numbers
    z = torch.complex(_ranked((ws * m,), me), -_ranked((ws * m,), me))
    zo = torch.zeros(m, dtype=torch.complex64)
    C.ring_reduce_scatter(zo, z, group=group)
    s = _sum_of_ranks((ws * m,), ws)[me * m:(me + 1) * m]
    same("ring_reduce_scatter(complex64)", zo, torch.complex(s, -s))

    # all-gather into a transposed view, into a strided slice, and in place
    everyone = torch.cat([_ranked((2, m), r) for r in range(ws)])
    out = torch.full((m, 2 * ws), 7.0).t()
    C.ring_all_gather(out, _ranked((2, m), me), group=group)
    same("ring_all_gather(output transposed)", out, everyone)
    buf = torch.full((4 * ws * m,), 7.0)
    C.ring_all_gather(buf[::2], _ranked((2 * m,), me), group=group)
    same("ring_all_gather(output strided)", buf[::2], everyone.reshape(-1))
    same("ring_all_gather(output strided) left the gaps alone", buf[1::2], torch.full((2 * ws * m,), 7.0))
    out = torch.full((2 * ws, m), 7.0)
    out[2 * me:2 * me + 2] = _ranked((2, m), me)
    C.ring_all_gather(out, out[2 * me:2 * me + 2], group=group)
    same("ring_all_gather(in place: input is this rank's chunk of output)", out, everyone)
    out = torch.full((2 * ws, m), 7.0)
    out[:2] = _ranked((2, m), me)
    C.ring_all_gather(out, out[:2], group=group)
    same("ring_all_gather(input = chunk 0 of output on every rank)", out, everyone)

    # all-reduce in place on every other element, and on one column of a matrix
    for fn in ALL_REDUCES:
        buf = torch.full((2 * 7,), 7.0)
        buf[::2] = _ranked((7,), me)
        fn(buf[::2], group=group)
        want = torch.full((2 * 7,), 7.0)
        want[::2] = _sum_of_ranks((7,), ws)
        same(f"{fn.__name__}(strided slice)", buf, want)
        mat = torch.full((5, 3), 7.0)
        mat[:, 1] = _ranked((5,), me)
        fn(mat[:, 1], group=group)
        want = torch.full((5, 3), 7.0)
        want[:, 1] = _sum_of_ranks((5,), ws)
        same(f"{fn.__name__}(one column)", mat, want)
    return fails


def _errors(rank, ws):
    """Error cases: raised before any message is sent, so every rank can run them and carry on."""
    msgs = {}
    for name, call in {
        "rs_shape": lambda: C.ring_reduce_scatter(torch.empty(3), torch.empty(3 * ws + 1)),
        "ag_shape": lambda: C.ring_all_gather(torch.empty(2 * ws, 2), torch.empty(3, 2)),
        "rs_dtype": lambda: C.ring_reduce_scatter(torch.empty(3), torch.empty(3 * ws, dtype=torch.float64)),
        "int_avg": lambda: C.ring_all_reduce(torch.ones(4, dtype=torch.int64), op="avg"),
        "bad_op": lambda: C.ring_all_reduce(torch.ones(4), op="max"),
    }.items():
        try:
            call()
            msgs[name] = None
        except (ValueError, TypeError) as e:
            msgs[name] = (type(e).__name__, str(e))
    return msgs


def _mismatch(rank, ws):
    """Metadata check: a rank with a different shape, op or collective makes every rank raise, not hang."""
    msgs = {}
    cases = {
        "shape": lambda: C.ring_all_reduce(torch.ones(10 + (rank == 1)), check=True),
        "op": lambda: C.ring_all_reduce(torch.ones(10), op="avg" if rank == 1 else "sum", check=True),
        "dtype": lambda: C.naive_all_reduce(torch.ones(4, dtype=torch.float64 if rank == 1 else torch.float32),
                                            check=True),
        "collective": lambda: (C.ring_all_gather(torch.empty(ws), torch.ones(1), check=True) if rank == 1
                               else C.ring_all_reduce(torch.ones(ws), check=True)),
        # rank 1 alone breaks the shape contract: the exchange comes first, so every rank raises, none hangs
        "one_bad": lambda: C.ring_reduce_scatter(torch.empty(3), torch.ones(3 * ws + (rank == 1)), check=True),
    }
    for name, call in cases.items():
        try:
            call()
            msgs[name] = None
        except C.CollectiveMismatch as e:
            msgs[name] = str(e)
    os.environ.pop("NANODIST_CHECK_COLLECTIVES", None)  # on by default: no check= and no environment
    try:
        C.ring_reduce_scatter(torch.empty(2 + (rank == 1)), torch.ones(ws * (2 + (rank == 1))))
        msgs["env"] = None
    except C.CollectiveMismatch as e:
        msgs["env"] = str(e)
    try:  # sum on one rank and avg on another: a wrong answer everywhere, were it not for the check
        C.ring_all_reduce(torch.ones(4), op="avg" if rank == 0 else "sum")
        msgs["default_op"] = None
    except C.CollectiveMismatch as e:
        msgs["default_op"] = str(e)
    t = torch.ones(5) * (rank + 1)  # and matching calls still work with it on
    C.ring_all_reduce(t)
    msgs["ok_after"] = t.tolist()
    os.environ["NANODIST_CHECK_COLLECTIVES"] = "0"  # the environment switch turns it off
    t = torch.ones(3)
    C.ring_all_reduce(t)
    msgs["off"] = t.tolist()
    del os.environ["NANODIST_CHECK_COLLECTIVES"]
    return msgs


def _subgroup(rank, ws):
    """group= on ranks [0, 2] of 3: p2p peers are global ranks 0 and 2, rank 1 is not involved."""
    sub = dist.new_group([0, 2])  # every rank must call new_group, members or not
    # A group torch made, spanning every rank: nothing here depends on nanodist.init() having made it.
    whole = dist.new_group([0, 1, 2])
    x, want = torch.arange(7.0) * (rank + 1), torch.arange(7.0) * 6
    fails = [] if torch.equal(C.ring_all_reduce(x, group=whole), want) else [f"group=new_group([0,1,2]): {x}"]
    if rank == 1:
        try:
            C.ring_all_reduce(torch.ones(3), group=sub)
            return fails + ["rank 1 was allowed to call a collective on a group it is not in"]
        except ValueError as e:
            return fails + ([] if "not a member" in str(e) else [f"unexpected message: {e}"])
    fails += _all_reduce_cases(rank, 2, group=sub, tag="[0,2] ")[0]
    fails += _reduce_scatter_cases(rank, 2, group=sub, tag="[0,2] ")
    fails += _all_gather_cases(rank, 2, group=sub, tag="[0,2] ")
    fails += _views_and_aliases(rank, 2, group=sub, tag="[0,2] ")
    return fails


def _segmented(rank, ws):
    """Large messages travel in pipelined segments; shrink the segment size so small tensors take that path."""
    fails, saved = [], C.SEGMENT_BYTES
    C.SEGMENT_BYTES = 20  # not a multiple of any element size: segments of uneven lengths
    try:
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            x = _data((1009,), dtype, rank, 7, True)
            want = x.clone()
            dist.all_reduce(want)
            got = C.ring_all_reduce(x.clone())
            _compare(fails, f"segmented ring_all_reduce({dtype})", got, want, exact=True)
            out, want_rs = torch.empty(101, dtype=dtype), torch.empty(101, dtype=dtype)
            _torch_rs(want_rs, x[:101 * ws].clone())
            C.ring_reduce_scatter(out, x[:101 * ws])
            _compare(fails, f"segmented ring_reduce_scatter({dtype})", out, want_rs, exact=True)
    finally:
        C.SEGMENT_BYTES = saved
    return fails


def _trace(rank, ws):
    x = _data((11,), torch.float32, rank, 5, False)
    steps = []
    C.ring_all_reduce(x.clone(), op="avg", trace=steps)
    # Plain lists, not tensors: a tensor returned from a worker travels as a shared-memory handle that
    # dies with the worker process.
    return x.tolist(), [s["buffer"].tolist() for s in steps]


def _worker(rank, ws):
    fails, fingerprints = _all_reduce_cases(rank, ws)
    fails += _reduce_scatter_cases(rank, ws)
    fails += _all_gather_cases(rank, ws)
    fails += _segmented(rank, ws)
    out = {"fails": fails, "fingerprints": fingerprints, "errors": _errors(rank, ws), "mismatch": _mismatch(rank, ws),
           "trace": _trace(rank, ws), "views": _views_and_aliases(rank, ws)}
    if ws == 3:
        out["subgroup"] = _subgroup(rank, ws)
    dist.barrier()
    return out


_outs: dict = {}  # world size -> every rank's results: one spawn per world size for the whole module


def _run(ws):
    if ws not in _outs:
        _outs[ws] = spawn(_worker, ws, timeout=120)
    return _outs[ws]


@pytest.fixture(params=[2, 3, 4], ids=lambda n: f"world{n}")
def runs(request):
    return request.param, _run(request.param)


def test_equal_to_torch(runs):
    ws, outs = runs
    fails = [f"rank {r}: {f}" for r, out in enumerate(outs) for f in out["fails"]]
    assert not fails, f"{len(fails)} cases differ from torch.distributed:\n" + "\n".join(fails[:20])


def test_non_contiguous_outputs_and_in_place_calls(runs):
    ws, outs = runs
    fails = [f"rank {r}: {f}" for r, out in enumerate(outs) for f in out["views"]]
    assert not fails, f"{len(fails)} cases differ from the sums computed by hand:\n" + "\n".join(fails[:20])


def test_every_rank_ends_with_the_same_bits(runs):
    ws, outs = runs
    for i, (name, values) in enumerate(outs[0]["fingerprints"]):
        for r in range(1, ws):
            assert outs[r]["fingerprints"][i] == (name, values), f"{name}: rank {r} differs from rank 0"


def test_errors_say_what_was_wrong(runs):
    ws, outs = runs
    e = outs[0]["errors"]
    assert e["rs_shape"][0] == "ValueError" and f"({3 * ws + 1},)" in e["rs_shape"][1] and "(3,)" in e["rs_shape"][1]
    assert f"({3 * ws}," in e["rs_shape"][1]  # says what shape would be right
    assert e["ag_shape"][0] == "ValueError" and f"({2 * ws}, 2)" in e["ag_shape"][1]
    assert f"({3 * ws}, 2)" in e["ag_shape"][1]  # the shape that would fit
    assert e["rs_dtype"][0] == "ValueError" and "torch.float64" in e["rs_dtype"][1]
    assert e["int_avg"][0] == "TypeError" and "torch.int64" in e["int_avg"][1] and "op='sum'" in e["int_avg"][1]
    assert e["bad_op"][0] == "ValueError" and "'max'" in e["bad_op"][1]


def test_metadata_check_names_both_ranks(runs):
    ws, outs = runs
    for r, out in enumerate(outs):
        m = out["mismatch"]
        assert m["shape"] and "rank 0: ring_all_reduce op=sum tensor=float32[10]" in m["shape"], (r, m["shape"])
        assert "rank 1: ring_all_reduce op=sum tensor=float32[11]" in m["shape"], (r, m["shape"])
        assert m["op"] and "op=avg" in m["op"] and "op=sum" in m["op"]
        assert m["dtype"] and "float64[4]" in m["dtype"] and "float32[4]" in m["dtype"]
        assert m["collective"] and "ring_all_gather" in m["collective"] and "ring_all_reduce" in m["collective"]
        assert m["one_bad"] and f"input=float32[{3 * ws + 1}]" in m["one_bad"]
        assert m["env"] and "output=float32[3]" in m["env"] and f"input=float32[{3 * ws}]" in m["env"]
        assert m["ok_after"] == [sum(range(1, ws + 1))] * 5
        assert m["default_op"] and "op=avg" in m["default_op"] and "op=sum" in m["default_op"]  # checked by default
        assert m["off"] == [float(ws)] * 3


def test_trace_replays_in_simulate(runs):
    """The single-process simulation the book draws is step for step what the real ranks did."""
    ws, outs = runs
    inputs = [torch.tensor(out["trace"][0], dtype=torch.float32) for out in outs]
    frames = C.simulate(inputs, op="avg")
    assert [f["phase"] for f in frames[1:]] == ["reduce-scatter"] * (ws - 1) + ["all-gather"] * (ws - 1)
    for r, out in enumerate(outs):
        real = out["trace"][1]
        assert len(real) == len(frames) - 1
        for step, (buf, frame) in enumerate(zip(real, frames[1:])):
            assert torch.equal(torch.tensor(buf, dtype=torch.float32), frame["buffers"][r]), f"rank {r} step {step}"
    want = torch.stack(inputs).double().mean(0).float()
    # the ring's sums run in another order than the float64 mean: an fp32 rounding or two of O(1) values
    assert all(torch.allclose(b, want, atol=1e-6) for b in frames[-1]["buffers"])


def test_subgroup():
    outs = _run(3)
    fails = [f"rank {r}: {f}" for r, out in enumerate(outs) for f in out["subgroup"]]
    assert not fails, "\n".join(fails[:20])


def test_simulate_and_schedule_without_processes():
    bufs = [torch.arange(5.0) * (r + 1) for r in range(4)]
    frames = C.simulate(bufs)
    assert len(frames) == 1 + 2 * 3
    assert all(torch.equal(b, torch.arange(5.0) * 10) for b in frames[-1]["buffers"])
    assert torch.equal(bufs[0], torch.arange(5.0))  # inputs untouched
    # after reduce-scatter, rank r holds the finished chunk r (what ring_reduce_scatter returns)
    after_rs = frames[3]["buffers"]
    for r, (a, b) in enumerate(C.chunk_bounds(5, 4)):
        assert torch.equal(after_rs[r][a:b], torch.arange(5.0)[a:b] * 10)
    assert C.chunk_bounds(5, 4) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert C.chunk_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    with pytest.raises(ValueError, match="one tensor per rank"):
        C.simulate([torch.ones(3), torch.ones(4)])
    # torch's ReduceOp works as well as the strings
    assert torch.equal(C.simulate(bufs, op=dist.ReduceOp.AVG)[-1]["buffers"][0], torch.arange(5.0) * 2.5)


def _traced_ring(rank, world_size, values, op):
    trace = []
    C.ring_all_reduce(torch.tensor(values[rank]), op=op, trace=trace)
    return [{**t, "buffer": t["buffer"].tolist()} for t in trace]


def test_traced_ring_all_reduce_shows_the_real_ranks():
    """What real processes record, turned into frames, is frame for frame what simulate() draws."""
    bufs = [torch.arange(7.0) * (r + 1) - 3 for r in range(3)]
    traces = spawn(_traced_ring, 3, args=([b.tolist() for b in bufs], "avg"), timeout=60)
    real, sim = C.frames_from_traces(bufs, traces), C.simulate(bufs, op="avg")
    assert [(f["phase"], f["step"], f["sends"], f["bounds"]) for f in real] == \
        [(f["phase"], f["step"], f["sends"], f["bounds"]) for f in sim]
    for a, b in zip(real, sim):
        assert all(torch.equal(x, y) for x, y in zip(a["buffers"], b["buffers"])), (a["phase"], a["step"])
    assert all(torch.equal(b, torch.arange(7.0) * 2 - 3) for b in real[-1]["buffers"])
    with pytest.raises(ValueError, match="one trace per rank"):
        C.frames_from_traces(bufs, traces[:2])
