"""Prove that replicas agree: parameters, gradients and optimizer state in sync, every sample read once.

    assert_params_in_sync(model)            # after init/broadcast, and every N steps while debugging
    loss.backward(); assert_grads_in_sync(model)
    opt.step(); assert_optimizer_state_in_sync(opt)
    check_sampler_exactly_once(sampler)     # every sample of the epoch read by exactly one rank
    assert_same_across_ranks(loss, "loss")  # a value every rank should hold alike (a logged metric)

The sync checkers are collectives: every rank must call them, in the same order. They work with any
initialised default process group (or `group=`), whoever created it; without one, or at world size 1,
they pass at once. Each check costs one all_gather of a few int64 numbers per rank: a checksum of the
tensors' exact bits. Only when checksums differ does a second, detailed pass run, which names the first
tensor whose *values* differ, the ranks that disagree and by how much, and raises AssertionError with the
same message on every rank, so no rank is left waiting in a collective the others skipped.

Bitwise equality is the fast path; equality of values decides. So identical tensors always pass, whatever
their dtype (bf16 included) and whatever they hold: NaN equals NaN at the same place, and -0.0 equals 0.0.
"""
from __future__ import annotations

import hashlib
from collections import Counter, defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .group import Group

_HINT = ("Usual causes: ranks initialised with different seeds and no broadcast, a rank that skipped an "
         "all-reduce or an optimizer step, gradient clipping or a learning-rate schedule applied on one rank "
         "only, or in-place edits of a parameter on one rank.")
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MASK64 = 2**64 - 1


# ----------------------------------------------------------------------------- collectives, small helpers

def _all_gather(t: torch.Tensor, group: Group) -> list[torch.Tensor]:
    t = t.to(group.comm_device).contiguous()
    out = [torch.empty_like(t) for _ in range(group.size)]
    dist.all_gather(out, t, group=group.pg)
    return [o.cpu() for o in out]


def _all_gather_exact(t: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's copy of t, moved as raw bytes so that any dtype travels unchanged (gloo has no bf16 or
    int16 collectives). bool comes back as uint8 and complex as (..., 2) real pairs: the same values."""
    real = torch.view_as_real(t) if t.is_complex() else t
    dtype = torch.uint8 if real.dtype == torch.bool else real.dtype
    bits = _as_bits(t)
    return [raw.view(bits.dtype).view(dtype).reshape(real.shape)
            for raw in _all_gather(bits.view(torch.uint8), group)]


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width (complex as pairs of reals), flattened."""
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.contiguous().view(_INT_OF_SIZE[flat.element_size()])


def _ranks(group: Group | None, rs) -> str:
    """Messages name global ranks, the numbers people see in their logs, even for a subgroup (None: rs are
    already the numbers to print)."""
    rs = list(rs) if group is None else [group.global_rank(r) for r in rs]
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {', '.join(map(str, rs))}"


def _signed64(x: int) -> int:
    x &= _MASK64
    return x - 2**64 if x >= 2**63 else x


# ----------------------------------------------------------------------------- fingerprints

def _local(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor to compare across ranks: a replicated DTensor's local copy; None for a sharded DTensor,
    whose shards differ by design (FSDP, tensor parallelism) and are not this module's business."""
    placements = getattr(t, "placements", None)
    if placements is not None and hasattr(t, "to_local"):
        if not all(p.is_replicate() for p in placements):
            return None
        t = t.to_local()
    return t.detach()


_CHUNK = 1 << 22  # elements per step of the checksum: bounds its int64 temporaries to 32 MiB each


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of the tensor's bit patterns, the second weighted by position so that swapped elements
    show; on t's device, so a GPU model is summed on the GPU. Integer sums are exact and order-independent:
    threads, devices and reduction order cannot change them, so equal bits always give equal checksums."""
    bits = _as_bits(t)
    out = torch.zeros(2, dtype=torch.int64, device=bits.device)
    for start in range(0, bits.numel(), _CHUNK):
        chunk = bits[start:start + _CHUNK].to(torch.int64)
        weights = torch.arange(start, start + chunk.numel(), device=bits.device, dtype=torch.int64) % 65521 + 1
        out += torch.stack([chunk.sum(), (chunk * weights).sum()])
    return out


def _structure_key(item) -> tuple:
    name, t = item
    return (name, None) if t is None else (name, tuple(t.shape), str(t.dtype))


def _stable_hash(obj) -> int:
    return _signed64(int.from_bytes(hashlib.blake2b(repr(obj).encode(), digest_size=8).digest(), "little"))


# ----------------------------------------------------------------------------- the engine

def _assert_in_sync(kind: str, items: list[tuple[str, torch.Tensor | None]], atol: float, group) -> None:
    """items: (name, tensor or None) in the same order on every rank. Raises AssertionError on every rank
    when names, presence, shapes, dtypes or values (beyond atol) differ."""
    if group.size == 1:
        return
    structure = [_structure_key(it) for it in items]
    sums = [_checksum(t).cpu() if t is not None else torch.zeros(2, dtype=torch.int64) for _, t in items]
    per_tensor = torch.stack(sums) if sums else torch.zeros(0, 2, dtype=torch.int64)
    total = 0
    for i, (a, b) in enumerate(per_tensor.tolist()):  # order-dependent: a value moved to another tensor shows
        total = (total * 1_000_003 + a * (2 * i + 1) + b) & _MASK64
    header = torch.tensor([_stable_hash(structure), _signed64(total), len(items)], dtype=torch.int64)
    headers = [h.tolist() for h in _all_gather(header, group)]
    if all(h == headers[0] for h in headers):
        return
    if any(h[0] != headers[0][0] for h in headers):
        _raise_structure_mismatch(kind, group.all_gather_object(structure), group)

    # Same structure, different bits somewhere: find which tensors, then compare their values.
    gathered = _all_gather(per_tensor, group)
    suspects = [i for i in range(len(items)) if any(not torch.equal(g[i], gathered[0][i]) for g in gathered)]
    for i in suspects:  # the same list on every rank, so every rank joins the same gathers
        name, t = items[i]
        values = _all_gather_exact(t, group)
        diffs = [_max_abs_diff(values[0], v) for v in values]
        if any(d[0] > atol for d in diffs):
            _raise_value_mismatch(kind, name, t, values, diffs, gathered, i, len(suspects), atol, group)
    # Every suspect was equal in value (e.g. -0.0 against 0.0, or NaNs with other payload bits): in sync.


def _max_abs_diff(ref: torch.Tensor, other: torch.Tensor) -> tuple[float, tuple, float, float]:
    """(max |ref - other|, where, ref value there, other value there). NaN matches NaN; NaN against a number,
    or +inf against -inf, counts as an infinite difference."""
    a, b = ref.double(), other.double()
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    diff = torch.where(same, torch.zeros_like(a), (a - b).abs()).nan_to_num(nan=float("inf"))
    if diff.numel() == 0:
        return 0.0, (), 0.0, 0.0
    flat = int(diff.reshape(-1).argmax())
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape)) if diff.dim() else ()
    return float(diff.reshape(-1)[flat]), where, float(a.reshape(-1)[flat]), float(b.reshape(-1)[flat])


_HINTS = {"values": "A value every rank should hold the same differs: a metric logged without averaging it over the "
                   "ranks (all_reduce with AVG before logging), or one computed from a rank's own data or random "
                   "stream."}


def _raise_value_mismatch(kind, name, t, values, diffs, checksums, i, n_suspects, atol, group):
    # Group ranks holding bit-identical copies, so "ranks 0, 2 agree; rank 1 differs" reads at a glance.
    versions: dict[tuple, list[int]] = defaultdict(list)
    for r, g in enumerate(checksums):
        versions[tuple(g[i].tolist())].append(r)
    lines = [f"{kind} out of sync across {len(values)} ranks: {name!r} (shape {tuple(t.shape)}, {t.dtype}) differs."]
    lines.append("  ranks with identical copies: " + "; ".join(_ranks(group, rs) for rs in versions.values()))
    for r, (d, where, ref, other) in enumerate(diffs):
        if d > atol:
            lines.append(f"  {_ranks(group, [r])} vs {_ranks(group, [0])}: max abs diff {d:.6g} at index "
                         f"{list(where)} ({other!r} vs {ref!r})")
    if n_suspects > 1:
        lines.append(f"  {n_suspects} {kind} tensors differ in bits in all; this is the first by order.")
    if atol:
        lines.append(f"  Tolerance: atol={atol:g}.")
    lines.append("  " + _HINTS.get(kind, _HINT))
    raise AssertionError("\n".join(lines))


def _raise_structure_mismatch(kind: str, structures: list[list[tuple]], group) -> None:
    lines = [f"{kind} out of sync across {len(structures)} ranks: the ranks do not even hold the same tensors."]
    lengths = [len(s) for s in structures]
    for pos in range(max(lengths)):
        at = [s[pos] if pos < len(s) else None for s in structures]
        if all(a == at[0] for a in at):
            continue
        names = {a[0] for a in at if a is not None}
        if len(names) == 1 and all(a is not None for a in at):  # same name: presence, shape or dtype differ
            (name,) = names
            groups: dict[tuple, list[int]] = defaultdict(list)
            for r, a in enumerate(at):
                groups[a[1:]].append(r)
            lines.append(f"  first difference: {name!r}")
            for desc, rs in groups.items():
                what = "is None" if desc == (None,) else f"has shape {desc[0]}, {desc[1]}"
                lines.append(f"    {_ranks(group, rs)}: {what}")
        else:
            lines.append(f"  first difference at position {pos}:")
            for r, a in enumerate(at):
                lines.append(f"    {_ranks(group, [r])}: {a[0]!r}" if a else f"    {_ranks(group, [r])}: (no tensor)")
        break
    if len(set(lengths)) > 1:
        lines.append(f"  number of tensors per rank: {dict(enumerate(lengths))}")
    lines.append("  Every rank must build the same model (and optimizer) and pass it to the checker.")
    if kind == "gradients":
        lines.append("  A grad that is None on some ranks means the parameter took no part in their loss: an unused "
                     "branch, or a forward pass that depends on the rank or the data.")
    elif kind == "optimizer state":
        lines.append("  State missing on some ranks means their optimizer has not stepped that parameter yet.")
    raise AssertionError("\n".join(lines))


# ----------------------------------------------------------------------------- public checkers

def assert_params_in_sync(module: torch.nn.Module, *, atol: float = 0.0, group=None,
                          buffers: bool = True) -> None:
    """Raise AssertionError on every rank unless all ranks hold the same parameters (and buffers) in `module`.

    Collective: call it on every rank. Identical tensors always pass; otherwise the message names the first
    differing tensor, which ranks disagree and the max abs difference (|diff| <= atol passes; tensors that
    differ in bits are then gathered whole to compare their values, so atol > 0 costs more on drifted runs).
    Sharded DTensor parameters (FSDP) are skipped; replicated DTensors compare their local copies.
    """
    items = [(n, _local(p)) for n, p in module.named_parameters()]
    if buffers:
        items += [(f"buffer {n}", _local(b)) for n, b in module.named_buffers()]
    items = [(n, t) for n, t in items if t is not None]
    _assert_in_sync("parameters", items, atol, Group.resolve(group))


def assert_same_across_ranks(value, name: str, *, atol: float = 0.0, group=None) -> None:
    """Raise AssertionError on every rank unless every rank holds the same `value` (a tensor or a number): a
    logged metric that should be global (a loss, a gradient norm), a decision every rank must take alike.

    Collective: call it on every rank, with the same `name`. The message names the value and groups the ranks
    that agree, as assert_params_in_sync does."""
    if torch.is_tensor(value):
        t = value.detach()
    elif isinstance(value, (bool, int, float)):
        t = torch.as_tensor(value, dtype=torch.float64 if isinstance(value, float) else torch.int64)
    else:
        raise TypeError(f"assert_same_across_ranks: {name!r} must be a tensor or a number, not "
                        f"{type(value).__name__}")
    _assert_in_sync("values", [(name, t)], atol, Group.resolve(group))


def assert_grads_in_sync(module: torch.nn.Module, *, atol: float = 0.0, group=None) -> None:
    """Raise AssertionError on every rank unless all ranks hold the same .grad for every parameter.

    Call it after backward and the gradient all-reduce, before the optimizer step. A grad that is None on
    one rank and a tensor on another is reported by parameter name; None everywhere is fine.
    """
    items = []
    for name, p in module.named_parameters():
        if _local(p) is None:
            continue  # sharded parameter: its gradient is sharded too
        items.append((name, None if p.grad is None else _local(p.grad)))
    _assert_in_sync("gradients", items, atol, Group.resolve(group))


def _optimizer_param_names(optimizer: torch.optim.Optimizer, names) -> dict[int, str]:
    by_id = {}
    if names is not None:  # a module, or a mapping name -> parameter
        pairs = names.named_parameters() if isinstance(names, torch.nn.Module) else names.items()
        by_id = {id(p): n for n, p in pairs}
    out = {}
    for g, group in enumerate(optimizer.param_groups):
        group_names = group.get("param_names")  # torch >= 2.6 keeps names given with the parameters
        for i, p in enumerate(group["params"]):
            out[id(p)] = (by_id.get(id(p)) or (group_names[i] if group_names else None)
                          or f"param_groups[{g}].params[{i}]")
    return out


def assert_optimizer_state_in_sync(optimizer: torch.optim.Optimizer, *, atol: float = 0.0, group=None,
                                   names=None) -> None:
    """Raise AssertionError on every rank unless a replicated optimizer (torch.optim.AdamW, SGD, ...) holds the
    same state on all ranks: every state tensor (exp_avg, exp_avg_sq, step, ...) and the numeric settings of
    each param group (lr, betas, weight_decay...), so a schedule stepped on one rank only is caught too.

    Tensors are named "<param name>.<state key>". Names come from `names` (the module, or a dict name ->
    parameter), else from the groups' `param_names` (GPT.configure_param_groups sets them), else positions.
    Not for sharded optimizers (ZeRO), whose ranks hold different state by design.
    """
    pnames = _optimizer_param_names(optimizer, names)
    items = []
    for g, pg in enumerate(optimizer.param_groups):
        for key in sorted(k for k in pg if k not in ("params", "param_names")):
            value = pg[key]
            if isinstance(value, torch.Tensor):  # a tensor lr (capturable optimizers)
                items.append((f"param_groups[{g}].{key}", _local(value)))
                continue
            numbers = value if isinstance(value, (tuple, list)) else (value,)
            if numbers and all(isinstance(v, (int, float)) for v in numbers):  # bools are ints too
                items.append((f"param_groups[{g}].{key}", torch.tensor([float(v) for v in numbers],
                                                                       dtype=torch.float64)))
        for p in pg["params"]:
            state = optimizer.state.get(p, {})
            for key in sorted(state):
                value = state[key]
                if isinstance(value, torch.Tensor):
                    t = _local(value)
                    if t is not None:
                        items.append((f"{pnames[id(p)]}.{key}", t))
                elif isinstance(value, (int, float)):
                    items.append((f"{pnames[id(p)]}.{key}", torch.tensor([float(value)], dtype=torch.float64)))
    _assert_in_sync("optimizer state", items, atol, Group.resolve(group))


# ----------------------------------------------------------------------------- samplers

@dataclass(frozen=True)
class SamplerCoverage:
    """What check_sampler_exactly_once found: per-rank counts, and how many samples were dropped or repeated."""

    world_size: int
    dataset_len: int
    per_rank: tuple[int, ...]
    distinct: int  # samples seen at least once
    dropped: int  # samples nobody saw (drop_last)
    padded: int  # extra reads beyond one per sample (padding)


def _fmt(xs, limit: int = 10) -> str:
    xs = sorted(xs)
    return str(xs[:limit])[:-1] + (f", ... ({len(xs)} in all)]" if len(xs) > limit else "]")


def check_sampler_exactly_once(sampler_or_indices, dataset_len: int | None = None, *, drop_last: bool | None = None,
                               equal_counts: bool = True, group=None) -> SamplerCoverage:
    """Prove that one epoch reads every sample of a dataset exactly once across ranks; return what was seen.

    sampler_or_indices is either every rank's list of indices (a list of lists, rank order; no communication)
    or this rank's sampler (anything iterable; then it is a collective and every rank must call it). A
    ShardedSampler is read with .indices(), which leaves its position alone, and supplies dataset_len and
    drop_last itself. With n samples on W ranks, a distributed sampler (ShardedSampler, torch's
    DistributedSampler) gives every rank its own share and allows, besides reading each sample once:
      - padding (drop_last=False): every rank reads ceil(n / W) samples, so W * ceil(n / W) - n < W samples
        are read twice to even out the shares, and every sample is seen;
      - drop_last=True: every rank reads n // W samples, none twice, and the n - W * (n // W) < W left over
        are never seen.
    drop_last=None infers the mode from the total read. equal_counts=False is for a split that is uneven on
    purpose, without padding (e.g. indices[rank::W] for evaluation, where no collective runs per batch): each
    rank may then read n // W or ceil(n / W) samples, and every sample is still read exactly once (or dropped
    or padded as above). With equal_counts=True (the default) unequal counts are an error: in training, the
    ranks with more batches would wait forever in their last step's all-reduce.

    Raises AssertionError naming the ranks that read the wrong number of samples, the duplicated indices
    (with their ranks), the missing ones and out-of-range ones; ValueError for an empty list of ranks or a
    missing or empty dataset_len.
    """
    if isinstance(sampler_or_indices, (list, tuple)) and all(isinstance(x, (list, tuple, range))
                                                             for x in sampler_or_indices):
        per_rank = [list(x) for x in sampler_or_indices]
        if not per_rank:
            raise ValueError("check_sampler_exactly_once got an empty list: no ranks, so nothing to check. Pass one "
                             "list of indices per rank, in rank order (e.g. [list(s) for s in samplers]), or this "
                             "rank's sampler on every rank.")
    else:
        sampler = sampler_or_indices
        mine = sampler.indices() if hasattr(sampler, "indices") else list(sampler)
        dataset_len = getattr(sampler, "dataset_len", None) if dataset_len is None else dataset_len
        drop_last = getattr(sampler, "drop_last", None) if drop_last is None else drop_last
        per_rank = Group.resolve(group).all_gather_object([int(i) for i in mine])
    if dataset_len is None:
        raise ValueError("dataset_len is needed: pass the dataset's length (a ShardedSampler supplies its own)")
    if dataset_len < 1:
        raise ValueError(f"dataset_len={dataset_len}: an empty dataset has no epoch to check. Pass the number of "
                         f"samples in the dataset the sampler draws from.")
    n, world = dataset_len, len(per_rank)
    counts_per_rank = tuple(len(x) for x in per_rank)
    total = sum(counts_per_rank)
    seen = Counter(i for idx in per_rank for i in idx)
    where = defaultdict(list)
    for r, idx in enumerate(per_rank):
        for i in idx:
            where[i].append(r)
    if drop_last is None:  # infer from the totals
        drop_last = total < n
    # What each rank may read: its share, n // W or ceil(n / W), or either one for an uneven split.
    floor, ceil = n // world, -(-n // world)
    lo = hi = floor if drop_last else ceil
    if not equal_counts:
        lo, hi = floor, ceil
    expected_total = min(max(total, world * lo), world * hi)  # the total closest to this one that is allowed
    problems = []
    if equal_counts and len(set(counts_per_rank)) > 1:
        problems.append(f"ranks get different numbers of samples {list(counts_per_rank)}: the ranks with more "
                        f"would wait forever in the last step's all-reduce")
    wrong = defaultdict(list)
    for r, c in enumerate(counts_per_rank):
        if not lo <= c <= hi:
            wrong[c].append(r)
    if wrong:
        who = "; ".join(f"rank {rs[0]} reads {_count(c, 'sample')}" if len(rs) == 1 else
                        f"{_ranks(None, rs)} read {_count(c, 'sample')} each"
                        for c, rs in sorted(wrong.items(), key=lambda kv: kv[1]))
        if lo != hi:
            rule = f"{n} // {world} = {lo} or ceil({n} / {world}) = {hi} (equal_counts=False: shares may differ by one)"
        elif floor == ceil:
            rule = f"{n} / {world} = {lo}"
        elif drop_last:
            rule = (f"{n} // {world} = {lo} (drop_last: the last {_count(n - world * lo, 'sample')} dropped so "
                    f"that the {world} shares are equal)")
        else:
            rule = (f"ceil({n} / {world}) = {hi} (padding: {_count(world * hi - n, 'sample')} read twice so that "
                    f"the {world} shares are equal)")
        problems.append(f"{who}, but a rank's share of {n} samples is {rule}")
    out_of_range = [i for i in seen if not 0 <= i < n]
    if out_of_range:
        problems.append(f"indices outside 0..{n - 1}: {_fmt(out_of_range)}")
    missing = [i for i in range(n) if i not in seen]
    duplicates = {i: c for i, c in seen.items() if c > 1}
    extra = sum(c - 1 for c in duplicates.values())
    if drop_last:
        expected_missing = max(n - expected_total, 0)
        if duplicates:
            problems.append(_describe_duplicates(duplicates, where, "with drop_last no sample may repeat"))
        if len(missing) != expected_missing:
            problems.append(f"{_count(len(missing), 'sample')} never seen where drop_last leaves out {n} - "
                            f"{expected_total} = {expected_missing}: missing {_fmt(missing)}")
    else:
        expected_extra = max(expected_total - n, 0)
        if missing:
            problems.append(f"{_count(len(missing), 'sample')} never seen by any rank: {_fmt(missing)}")
        # Too few repeats on ranks that read too few is already said; more repeats than padding never are.
        if extra > expected_extra or (extra != expected_extra and not wrong):
            problems.append(_describe_duplicates(duplicates, where, f"{extra} repeated reads where padding "
                                                 f"{expected_total} read - {n} samples = {expected_extra} are "
                                                 f"expected"))
    if problems:
        raise AssertionError(f"sampler does not read each of {n} samples once across {world} ranks "
                             f"(per-rank counts {list(counts_per_rank)}):\n  " + "\n  ".join(problems))
    return SamplerCoverage(world_size=world, dataset_len=n, per_rank=counts_per_rank, distinct=len(seen),
                           dropped=len(missing), padded=extra)


def _count(k: int, noun: str) -> str:
    return f"{k} {noun}" if k == 1 else f"{k} {noun}s"


def _describe_duplicates(duplicates: dict, where: dict, why: str, limit: int = 5) -> str:
    shown = sorted(duplicates)[:limit]
    detail = ", ".join(f"{i} (ranks {where[i]})" for i in shown)
    more = f", ... ({len(duplicates)} in all)" if len(duplicates) > len(shown) else ""
    return f"{why}; duplicated indices: {detail}{more}" if duplicates else why
