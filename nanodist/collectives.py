"""Collectives from scratch: all-reduce, reduce-scatter and all-gather built from point-to-point messages.

torch.distributed gives us `all_reduce` in one call; this file opens it up. Every function here uses
only `isend`/`irecv` (batched with `batch_isend_irecv`) between pairs of ranks, plus local tensor
arithmetic, so you can read exactly who sends what to whom at every step:

    ring_all_reduce(t)                  # in place; the bandwidth-optimal ring (what NCCL does on rings)
    ring_reduce_scatter(out, inp)       # the first half of the ring: rank r ends with the sum of chunk r
    ring_all_gather(out, inp)           # the second half: every rank ends with every chunk
    naive_all_reduce(t)                 # everyone -> rank 0 -> everyone: simple, and rank 0 is the bottleneck
    recursive_doubling_all_reduce(t)    # log2(N) exchanges of the whole tensor: few steps, more bytes

They mirror torch's contracts (`dist.all_reduce`, `dist.reduce_scatter_tensor`,
`dist.all_gather_into_tensor`): same shapes, same results, any process group (`group=`), any world
size, any length. The ring's schedule (`ring_schedule`) is a pure function, and `simulate()` replays
it on a list of per-rank buffers in one process -- that is what the book draws, step by step;
`frames_from_traces()` turns what real processes recorded (`ring_all_reduce(t, trace=[])`) into the same frames.

Reductions: op="sum" or "avg" (torch's ReduceOp.SUM / AVG work too). "avg" sums, then divides by the
world size, like torch's gloo backend; on integer tensors it raises TypeError (torch raises too).

Checked by default: a rank that passes a different dtype, shape or op than its peers would make
point-to-point code exchange the wrong number of bytes -- it hangs or returns garbage. So before any
other work, the ranks exchange a short description of their call (a 256-byte all-gather, N-1 tiny
messages) and, if they disagree, all raise CollectiveMismatch naming what each rank passed. lab02
measures what this costs (metrics["check_cost"]: noticeable for kilobyte messages, nothing for
megabytes); check=False, or NANODIST_CHECK_COLLECTIVES=0 on every rank, turns it off where the
shapes hold by construction (ZeRO's buckets do).

Receive buffers are kept between calls (allocating 16 MiB per call costs page faults, i.e. bandwidth);
free_buffers() releases them.
"""
from __future__ import annotations

import os
from itertools import zip_longest

import torch
import torch.distributed as dist

from .group import Group
from .profile import annotated

OPS = ("sum", "avg")
PHASES = ("reduce-scatter", "all-gather")


class CollectiveMismatch(RuntimeError):
    """Ranks called a collective with different arguments (dtype, shape, op, or a different collective)."""


# ----------------------------------------------------------------------------- who is in the group

def _group_ranks(group) -> tuple[int, int, list[int], object]:
    """(my rank in the group, group size, the global rank of every group member, torch's process group handle).

    Point-to-point calls name peers by *global* rank even inside a subgroup, so we translate once.
    """
    if not dist.is_initialized():
        raise RuntimeError("no process group: call nanodist.init() (or torch.distributed.init_process_group) first")
    g = Group.resolve(group)
    return g.rank, g.size, list(g.ranks), g.pg


def _op_name(op) -> str:
    name = op if isinstance(op, str) else {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg"}.get(op)
    if name is None or name.lower() not in OPS:
        raise ValueError(f"unsupported reduction {op!r}: use op='sum' or op='avg'")
    return name.lower()


def _check_op_dtype(fn: str, op: str, dtype: torch.dtype) -> None:
    # torch's gloo computes avg as sum / world_size in place, which an integer tensor cannot hold.
    if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"{fn}: op='avg' needs a floating-point tensor, got {dtype} (torch.distributed "
                        f"rejects it too). Use op='sum' and divide yourself, e.g. t //= world_size.")


# ----------------------------------------------------------------------------- buffers and messages

_buffers: dict[tuple, torch.Tensor] = {}  # (device, dtype, slot) -> a flat buffer, grown on demand


def _scratch(numel: int, like: torch.Tensor, slot: int = 0) -> torch.Tensor:
    """A receive buffer of numel elements, reused across calls (slot: a second one, for double buffering)."""
    key = (like.device, like.dtype, slot)
    buf = _buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = _buffers[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel]


def free_buffers() -> None:
    """Release the receive buffers this module keeps between calls (they are as large as a chunk)."""
    _buffers.clear()


def _post(sends=(), recvs=(), pg=None) -> list:
    """Start sends [(tensor, global peer)] and receives [(tensor, global peer)] together; return the requests.

    Posting both sides of an exchange in one batch is what makes a ring deadlock-free: nobody waits
    for its send to finish before it has offered to receive. Empty tensors (and None) carry nothing
    and are skipped: both sides know the sizes, so they skip the same messages.
    """
    for t, _ in (*sends, *recvs):
        if t is not None and t.is_cuda and _backend(pg) == "gloo":
            raise ValueError(f"gloo's point-to-point send/recv cannot move GPU memory, and this is a {t.dtype} tensor "
                             f"on {t.device}: give the ring collectives CPU tensors on a gloo group (t.cpu(), then "
                             f"copy the result back), or use nccl (one GPU per rank)")
    ops = [dist.P2POp(dist.isend, t, peer, pg) for t, peer in sends if t is not None and t.numel() > 0]
    ops += [dist.P2POp(dist.irecv, t, peer, pg) for t, peer in recvs if t is not None and t.numel() > 0]
    return dist.batch_isend_irecv(ops) if ops else []


def _backend(pg) -> str:
    return dist.get_backend(pg)


def _wait(requests) -> None:
    for req in requests:
        req.wait()


SEGMENT_BYTES = 4 << 20  # pipelining granularity: big enough that per-message overhead stays small


def _segments(t: torch.Tensor) -> tuple:
    # Sender and receiver cut a message identically, from its length alone, so the pieces match up;
    # no piece of a non-empty message is empty (there are never more pieces than elements).
    return t.tensor_split(max(1, t.numel() * t.element_size() // SEGMENT_BYTES))


def _send_recv_add(outgoing, right, incoming, left, addend, result, pg) -> None:
    """Send `outgoing` right while `incoming` arrives from the left; then result = incoming + addend.

    Pipelined: the messages travel as segments of about SEGMENT_BYTES, each segment's send and receive
    posted together (one batch, so NCCL too can run a ring of them without deadlock), all posted up
    front; each arriving segment is added while the next ones are still on the wire. `result` may be
    `incoming` or `addend`. The two messages can differ by one element, hence in segment count.
    """
    batches = [_post([(out, right)], [(inc, left)], pg)
               for out, inc in zip_longest(_segments(outgoing), _segments(incoming))]
    for requests, seg, add, out in zip_longest(batches, _segments(incoming), _segments(addend), _segments(result)):
        _wait(requests)
        if seg is not None:
            torch.add(seg, add, out=out)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of t's memory (complex numbers as pairs of reals). t must be contiguous: view, not reshape,
    so that a non-contiguous t raises instead of returning a copy that whatever we receive would miss."""
    return (torch.view_as_real(t) if t.is_complex() else t).view(-1)


def _contiguous_buffer(t: torch.Tensor) -> torch.Tensor:
    """t itself if contiguous, else a fresh row-major tensor of its shape to work in (copy it back at the end).

    Not torch.empty_like: for a dense non-contiguous t (a transposed view) that keeps t's strides, and
    flattening such a tensor makes a copy -- whatever we received into it would be lost.
    """
    return t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=t.device)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, last byte + 1) of the memory t's elements can touch."""
    if t.numel() == 0:
        return 0, 0
    start = t.data_ptr()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b may share memory (e.g. one is a slice of the other): then writing a can change b."""
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a.device == b.device and a0 < b1 and b0 < a1


def chunk_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """Split numel elements into world_size contiguous chunks [start, end), sizes differing by at most 1.

    The first numel % world_size chunks get one extra element; with fewer elements than ranks some
    chunks are empty. Every rank computes the same bounds, so no sizes are ever exchanged.
    """
    base, extra = divmod(numel, world_size)
    bounds, start = [], 0
    for i in range(world_size):
        end = start + base + (i < extra)
        bounds.append((start, end))
        start = end
    return bounds


# ----------------------------------------------------------------------------- the metadata check

def _check_enabled(check: bool | None) -> bool:
    if check is not None:
        return bool(check)
    return os.environ.get("NANODIST_CHECK_COLLECTIVES", "1") not in ("", "0", "false", "False")


def _describe(fn: str, op: str | None, **tensors: torch.Tensor) -> str:
    parts = [fn] + ([f"op={op}"] if op else [])
    parts += [f"{name}={str(t.dtype).replace('torch.', '')}{list(t.shape)}" for name, t in tensors.items()]
    return " ".join(parts)


_DESC_BYTES = 256


def _check_same_call(desc: str, device: torch.device, group) -> None:
    """All ranks exchange `desc` (a fixed-size byte tensor, so this exchange itself cannot mismatch)."""
    rank, size, _, _ = _group_ranks(group)
    raw = desc.encode()[:_DESC_BYTES]
    mine = torch.zeros(_DESC_BYTES, dtype=torch.uint8)
    mine[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    everyone = torch.empty(size * _DESC_BYTES, dtype=torch.uint8, device=device)
    ring_all_gather(everyone, mine.to(device), group=group, check=False)
    rows = everyone.view(size, _DESC_BYTES).cpu()
    descs = [bytes(row.tolist()).rstrip(b"\0").decode(errors="replace") for row in rows]
    if len(set(descs)) > 1:
        odd = next(r for r in range(size) if descs[r] != descs[0])
        listing = "; ".join(f"rank {r}: {d}" for r, d in enumerate(descs)) if size <= 8 else \
            f"rank 0: {descs[0]}; rank {odd}: {descs[odd]}"
        raise CollectiveMismatch(
            f"ranks called collectives that do not match (rank 0 and rank {odd} differ; ranks are numbered "
            f"within the group) -- {listing}. Every rank of the group must call the same collective with "
            f"the same op, dtype and shape; find where rank {odd}'s tensor was built differently.")


# ----------------------------------------------------------------------------- the ring

def ring_schedule(rank: int, world_size: int, phase: str, step: int) -> tuple[int, int]:
    """(chunk rank sends to rank+1, chunk it receives from rank-1) at `step` of `phase`.

    Reduce-scatter (steps 0..N-2): each rank forwards the partial sum it just made and adds its own
    piece to the one arriving, so after N-1 steps rank r holds the complete sum of chunk r.
    All-gather (steps 0..N-2): each rank forwards the finished chunk it got last, starting with its own.
    """
    if phase == "reduce-scatter":
        return (rank - step - 1) % world_size, (rank - step - 2) % world_size
    if phase == "all-gather":
        return (rank - step) % world_size, (rank - step - 1) % world_size
    raise ValueError(f"unknown phase {phase!r}: use one of {PHASES}")


@annotated("ring", "all_reduce", lambda a: a["tensor"].numel())
def ring_all_reduce(tensor: torch.Tensor, op="sum", group=None, check: bool | None = None,
                    trace: list | None = None) -> torch.Tensor:
    """Sum (or average) `tensor` over the group, in place, with a ring; returns `tensor`.

    Any shape, any length (also fewer elements than ranks), any dtype torch can add, contiguous or not
    (a non-contiguous tensor is reduced in a contiguous copy, written back at the end). Each rank sends
    and receives 2(N-1)/N of the tensor's bytes, in 2(N-1) steps. Every rank ends with bitwise the
    same values. `trace`, if a list, gets a snapshot of this rank's buffer after every step.
    """
    op = _op_name(op)
    rank, n, peers, pg = _group_ranks(group)
    if _check_enabled(check):
        _check_same_call(_describe("ring_all_reduce", op, tensor=tensor), tensor.device, group)
    _check_op_dtype("ring_all_reduce", op, tensor.dtype)
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    flat = _flat(work)
    chunks = [flat[a:b] for a, b in chunk_bounds(flat.numel(), n)]
    right, left = peers[(rank + 1) % n], peers[(rank - 1) % n]
    scratch = _scratch(chunks[0].numel(), flat)  # chunk 0 is never smaller than any other

    for step in range(n - 1):  # reduce-scatter: add what arrives to our own copy of that chunk
        send, recv = ring_schedule(rank, n, "reduce-scatter", step)
        incoming = scratch[:chunks[recv].numel()]
        _send_recv_add(chunks[send], right, incoming, left, addend=chunks[recv], result=chunks[recv], pg=pg)
        if op == "avg" and step == n - 2:  # chunk `rank` is complete: dividing only it is N times less work
            chunks[recv].div_(n)
        _record(trace, "reduce-scatter", step, send, recv, flat)
    for step in range(n - 1):  # all-gather: finished chunks travel round; receive straight into place
        send, recv = ring_schedule(rank, n, "all-gather", step)
        _wait(_post([(chunks[send], right)], [(chunks[recv], left)], pg))
        _record(trace, "all-gather", step, send, recv, flat)

    if work is not tensor:
        tensor.copy_(work)
    return tensor


def _record(trace, phase, step, send, recv, flat) -> None:
    if trace is not None:
        trace.append({"phase": phase, "step": step, "send": send, "recv": recv, "buffer": flat.clone().cpu()})


def _check_shapes(fn: str, small: torch.Tensor, big: torch.Tensor, n: int, small_name: str, big_name: str):
    """torch's contract: big is n small ones concatenated along dim 0, or stacked (shape (n, *small.shape))."""
    concat = small.dim() > 0 and big.shape == (small.shape[0] * n, *small.shape[1:])
    stacked = big.shape == (n, *small.shape)
    if not (concat or stacked):
        forms = ([f"{(small.shape[0] * n, *small.shape[1:])} (concatenated along dim 0) or"] if small.dim() else [])
        raise ValueError(
            f"{fn}: {big_name} has shape {tuple(big.shape)} and {small_name} {tuple(small.shape)}, but with "
            f"{n} ranks {big_name} must hold {n} {small_name}s: shape {' '.join(forms + [str((n, *small.shape))])} "
            f"(stacked). Resize one of them.")
    if small.dtype != big.dtype or small.device != big.device:
        raise ValueError(f"{fn}: {small_name} is {small.dtype} on {small.device} but {big_name} is {big.dtype} "
                         f"on {big.device}: both must have the same dtype and device")


@annotated("ring", "reduce_scatter", lambda a: a["input"].numel())
def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, op="sum", group=None,
                        check: bool | None = None) -> torch.Tensor:
    """Rank r's `output` = the sum (or average) over ranks of chunk r of `input`; returns `output`.

    Same contract as dist.reduce_scatter_tensor: input is N outputs concatenated along dim 0 (or
    stacked). `input` is not modified, except in place: `output` may be this rank's chunk of `input`
    (e.g. `input[r * m:(r + 1) * m]`), as NCCL allows and ZeRO does. `output` may be non-contiguous (a
    transposed view, a strided slice). Each rank sends (N-1)/N of input's bytes, in N-1 steps.
    """
    op = _op_name(op)
    rank, n, peers, pg = _group_ranks(group)
    if _check_enabled(check):
        _check_same_call(_describe("ring_reduce_scatter", op, output=output, input=input), input.device, group)
    _check_op_dtype("ring_reduce_scatter", op, input.dtype)
    _check_shapes("ring_reduce_scatter", output, input, n, "output", "input")
    inp = _flat(input.contiguous())
    out = _contiguous_buffer(output)
    m = _flat(out).numel()  # elements of the flat views (a complex number is two)
    mine = lambda c: inp[c * m:(c + 1) * m]  # noqa: E731  (chunk c of this rank's input)
    # In place, NCCL-style: `output` may be exactly this rank's chunk of `input` (ZeRO does this). Only
    # the last step writes output, adding the arrival to that very chunk element by element, so the
    # ring works unchanged. Any other overlap would overwrite input we still have to send or add: then
    # we reduce from a copy of the input.
    in_place = m > 0 and out.data_ptr() == mine(rank).data_ptr()
    if _overlap(out, inp) and not in_place:
        inp = inp.clone()
    right, left = peers[(rank + 1) % n], peers[(rank - 1) % n]

    if n == 1 and not in_place:
        _flat(out).copy_(inp)
    # The partial sum we forward starts as our own piece of the input, sent straight from it (no copy).
    # Each step's arrival lands in a scratch buffer and gets our piece added -- in the scratch buffer, to
    # be forwarded next step, or, at the last step, straight into `output`. Two scratch buffers alternate:
    # one is being sent while the next arrives.
    partial = None
    for step in range(n - 1):
        send, recv = ring_schedule(rank, n, "reduce-scatter", step)
        outgoing = mine(send) if step == 0 else partial
        incoming = _scratch(m, inp, slot=step % 2)
        result = _flat(out) if step == n - 2 else incoming
        _send_recv_add(outgoing, right, incoming, left, addend=mine(recv), result=result, pg=pg)
        partial = incoming
    if op == "avg":
        out.div_(n)
    if out is not output:
        output.copy_(out)
    return output


@annotated("ring", "all_gather", lambda a: a["output"].numel())
def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group=None,
                    check: bool | None = None) -> torch.Tensor:
    """Every rank's `output` = all ranks' `input`s, in rank order; returns `output`.

    Same contract as dist.all_gather_into_tensor: output is N inputs concatenated along dim 0 (or
    stacked). In place works too: `input` may be this rank's chunk of `output` (e.g. `output[r * m:(r + 1)
    * m]`). `output` may be non-contiguous. Each rank sends (N-1)/N of output's bytes, in N-1 steps.
    """
    rank, n, peers, pg = _group_ranks(group)
    if _check_enabled(check):
        _check_same_call(_describe("ring_all_gather", None, output=output, input=input), input.device, group)
    _check_shapes("ring_all_gather", input, output, n, "input", "output")
    inp = _flat(input.contiguous())
    out = _contiguous_buffer(output)
    flat = _flat(out)
    m = inp.numel()
    chunks = [flat[c * m:(c + 1) * m] for c in range(n)]
    # In place, like all_gather_into_tensor: `input` may be exactly this rank's chunk of `output`; that
    # chunk is only ever sent, never received into. Any other overlap would let arriving chunks overwrite
    # input before it is sent: then we send from a copy.
    in_place = m > 0 and inp.data_ptr() == chunks[rank].data_ptr()
    if _overlap(inp, flat) and not in_place:
        inp = inp.clone()
    right, left = peers[(rank + 1) % n], peers[(rank - 1) % n]

    for step in range(n - 1):
        send, recv = ring_schedule(rank, n, "all-gather", step)
        # Step 0 sends our input itself, so copying it into our slot of output overlaps the transfer.
        requests = _post([(inp if step == 0 else chunks[send], right)], [(chunks[recv], left)], pg)
        if step == 0 and not in_place:
            chunks[rank].copy_(inp)
        _wait(requests)
    if n == 1 and not in_place:
        chunks[0].copy_(inp)
    if out is not output:
        output.copy_(out)
    return output


# ----------------------------------------------------------------------------- two other all-reduces

def naive_all_reduce(tensor: torch.Tensor, op="sum", group=None, check: bool | None = None) -> torch.Tensor:
    """All-reduce in place by sending everything to the group's rank 0, which sums and sends the result back.

    2(N-1) messages of the whole tensor pass through rank 0's link: the baseline the ring beats.
    """
    op = _op_name(op)
    rank, n, peers, pg = _group_ranks(group)
    if _check_enabled(check):
        _check_same_call(_describe("naive_all_reduce", op, tensor=tensor), tensor.device, group)
    _check_op_dtype("naive_all_reduce", op, tensor.dtype)
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    flat = _flat(work)
    if rank == 0:
        incoming = _scratch(flat.numel(), flat)
        for r in range(1, n):  # one at a time, in rank order: rank 0 has one link and one buffer
            _wait(_post(recvs=[(incoming, peers[r])], pg=pg))
            flat.add_(incoming)
        if op == "avg":
            flat.div_(n)
        _wait(_post(sends=[(flat, peers[r]) for r in range(1, n)], pg=pg))
    else:
        _wait(_post(sends=[(flat, peers[0])], pg=pg))
        _wait(_post(recvs=[(flat, peers[0])], pg=pg))
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def recursive_doubling_all_reduce(tensor: torch.Tensor, op="sum", group=None,
                                  check: bool | None = None) -> torch.Tensor:
    """All-reduce in place in about log2(N) steps: at step k, swap the whole tensor with rank XOR 2^k and add.

    Latency-optimal (few steps) but every step moves the whole tensor. A world size that is not a power
    of two first folds the extra ranks in: rank 2i hands its tensor to rank 2i+1 (for the first N - 2^m
    pairs), the 2^m survivors double recursively, and the folded ranks get the result back at the end.
    Every rank ends with bitwise the same values (addition is commutative, and partners add the same pair).
    """
    op = _op_name(op)
    rank, n, peers, pg = _group_ranks(group)
    if _check_enabled(check):
        _check_same_call(_describe("recursive_doubling_all_reduce", op, tensor=tensor), tensor.device, group)
    _check_op_dtype("recursive_doubling_all_reduce", op, tensor.dtype)
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    flat = _flat(work)
    incoming = _scratch(flat.numel(), flat)
    pow2 = 1 << (n.bit_length() - 1)  # the largest power of two <= n
    extra = n - pow2

    # Fold: among ranks 0..2*extra-1, even ranks give their tensor to the odd rank next to them and wait.
    if rank < 2 * extra and rank % 2 == 0:
        _wait(_post(sends=[(flat, peers[rank + 1])], pg=pg))
        _wait(_post(recvs=[(flat, peers[rank + 1])], pg=pg))
    else:
        if rank < 2 * extra:
            _wait(_post(recvs=[(incoming, peers[rank - 1])], pg=pg))
            flat.add_(incoming)
        # The survivors renumber 0..pow2-1 and double: partners differ in one bit of the new number.
        new = rank // 2 if rank < 2 * extra else rank - extra
        old = lambda v: 2 * v + 1 if v < extra else v + extra  # noqa: E731  (new number -> group rank)
        distance = 1
        while distance < pow2:
            partner = peers[old(new ^ distance)]
            _wait(_post([(flat, partner)], [(incoming, partner)], pg))
            flat.add_(incoming)
            distance *= 2
        if op == "avg":
            flat.div_(n)
        if rank < 2 * extra:  # unfold: hand the result back
            _wait(_post(sends=[(flat, peers[rank - 1])], pg=pg))
    if work is not tensor:
        tensor.copy_(work)
    return tensor


ALL_REDUCES = {"ring": ring_all_reduce, "naive": naive_all_reduce, "recursive_doubling": recursive_doubling_all_reduce}


# ----------------------------------------------------------------------------- a picture of the ring

def _check_buffers(fn: str, buffers) -> int:
    if len(buffers) == 0 or any(b.shape != buffers[0].shape or b.dtype != buffers[0].dtype for b in buffers):
        raise ValueError(f"{fn}: give one tensor per rank, all of one shape and dtype; got "
                         f"{[(tuple(b.shape), str(b.dtype)) for b in buffers]}")
    return len(buffers)


def simulate(buffers: list[torch.Tensor], op="sum") -> list[dict]:
    """Replay ring_all_reduce on `buffers` (one tensor per rank) in this process, for drawing.

    Returns frames: the start, then one per step -- {"phase", "step", "sends": [(src, dst, chunk)],
    "bounds": each chunk's [start, end), "buffers": [each rank's buffer after the step]} -- ending with every buffer equal to the reduction.
    Uses the same ring_schedule and chunk_bounds as ring_all_reduce; the inputs are not modified.
    frames[N-1] is the state after the reduce-scatter phase: rank r holds the finished chunk r, which is
    what ring_reduce_scatter returns; the all-gather frames after it picture ring_all_gather.
    """
    op = _op_name(op)
    n = _check_buffers("simulate", buffers)
    _check_op_dtype("simulate", op, buffers[0].dtype)
    flats = [_flat(b.contiguous()).clone() for b in buffers]
    bounds = chunk_bounds(flats[0].numel(), n)
    frames = [{"phase": "start", "step": -1, "sends": [], "bounds": bounds, "buffers": [f.clone() for f in flats]}]
    for phase in PHASES:
        for step in range(n - 1):
            sends = [(r, (r + 1) % n, ring_schedule(r, n, phase, step)[0]) for r in range(n)]
            # Everyone sends at once: read all outgoing chunks before anyone writes.
            payload = [flats[src][slice(*bounds[c])].clone() for src, _, c in sends]
            for (src, dst, c), data in zip(sends, payload):
                target = flats[dst][slice(*bounds[c])]
                target.add_(data) if phase == "reduce-scatter" else target.copy_(data)
            if phase == "reduce-scatter" and step == n - 2 and op == "avg":
                for r in range(n):
                    flats[r][slice(*bounds[r])].div_(n)
            frames.append({"phase": phase, "step": step, "sends": sends, "bounds": bounds,
                           "buffers": [f.clone() for f in flats]})
    return frames


def frames_from_traces(buffers: list[torch.Tensor], traces: list[list[dict]]) -> list[dict]:
    """Frames shaped like simulate()'s, from what every rank recorded with ring_all_reduce(..., trace=[...]).

    `buffers` are the ranks' starting tensors; traces[r] is rank r's trace list. lab02 --demo runs the ring on
    real processes and stores its traces, so the book can draw the real thing and check simulate() against it.
    """
    n = _check_buffers("frames_from_traces", buffers)
    if len(traces) != n or len({len(t) for t in traces}) != 1:
        raise ValueError(f"frames_from_traces: give one trace per rank, all of one length; got {len(traces)} traces "
                         f"for {n} buffers")
    start = [_flat(b.contiguous()).clone() for b in buffers]
    bounds = chunk_bounds(start[0].numel(), n)
    frames = [{"phase": "start", "step": -1, "sends": [], "bounds": bounds, "buffers": start}]
    for i, entry in enumerate(traces[0]):
        frames.append({"phase": entry["phase"], "step": entry["step"], "bounds": bounds,
                       "sends": [(r, (r + 1) % n, traces[r][i]["send"]) for r in range(n)],
                       "buffers": [_flat(torch.as_tensor(traces[r][i]["buffer"], dtype=buffers[0].dtype))
                                   for r in range(n)]})
    return frames
