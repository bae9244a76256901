"""Writes book/05_fsdp.ipynb (unexecuted): Chapter 5's cells, kept as code so the chapter can be reviewed in diffs.

    python book/tools/make_05.py && jupyter nbconvert --to notebook --execute --inplace book/05_fsdp.ipynb
"""
from chapter_cells import HIDDEN, SOLUTION, MACHINE, Chapter  # noqa: F401  (book/tools/chapter_cells.py)

chapter = Chapter()
md, code, exercise = chapter.md, chapter.code, chapter.exercise

md(r"""
# 5. FSDP: sharding the parameters too

{term}`ZeRO` stages 1 and 2 (Chapter 4) {term}`shard` the optimizer state and the gradients, but every rank still holds
every parameter: $2\Psi$ bytes in {term}`mixed precision`, a floor that no number of GPUs lowers. A 70-billion
parameter model needs 140 GB for its {term}`bf16` weights alone, nearly twice what an 80 GB H100 holds.

**Fully sharded data parallelism** ({term}`FSDP`, the ZeRO paper's stage 3 {cite}`rajbhandari2020zero`; PyTorch's implementation is described in {cite}`zhao2023fsdp`) removes the floor. Each rank keeps
$1/N$ of the parameters, and a piece of the model is assembled only while it computes: gathered from
all ranks just before its forward, thrown away just after, gathered again for its backward, and its
gradient reduce-scattered so that each rank keeps the $1/N$ it owns. The memory of the model states
falls to $(2 + 2 + K)\Psi / N$; the price is more communication, and this chapter measures how much.

nanodist has its own FSDP, `nanodist.FSDP`, built on the same gradient-sync engine as {term}`DDP` and the
sharded optimizers, and tested equal to torch's FSDP2 (`torch.distributed.fsdp.fully_shard`) and to
one process, at 1 to 4 ranks. By the end of the chapter you will be able to:
- explain FSDP's gather / compute / free cycle and read it off a timeline of a real step;
- say how a flat parameter buffer differs from FSDP2's per-parameter sharding, and what each costs;
- account for a rank's peak memory during a step: shards, gathered units, activations;
- predict FSDP's communication volume (1.5 × DDP's) and check it against a run;
- choose between DDP, ZeRO-1, ZeRO-2 and FSDP for a given model and memory budget;
- write the same with PyTorch's FSDP2: `fully_shard`, a mixed-precision policy, meta-device
  initialisation, explicit {term}`prefetch`, CPU offload and hybrid sharding ({term}`HSDP`).

**The code:** [`nanodist/fsdp.py`](@REPOSITORY_URL@/blob/main/nanodist/fsdp.py) on [`nanodist/sync.py`](@REPOSITORY_URL@/blob/main/nanodist/sync.py); **the lab:** [`labs/lab05_fsdp.py`](@REPOSITORY_URL@/blob/main/labs/lab05_fsdp.py).
""")

code("""
import datetime
import inspect
import warnings

import matplotlib.pyplot as plt
import torch
from IPython.display import Markdown
from myst_nb import glue

import nanodist as nd
from nanodist import plots
from nanodist.costmodel import bytes_per_step
from nanodist.data import CharTokenizer, TokenStream, generate_corpus
from nanodist.exercises import check, compare, expect
from nanodist.fsdp import FSDP, FSDPTimeline, Unit, dim0_layout, flat_layout
from nanodist.memory import memory_table, zero_memory_bytes
from nanodist.model import GPT, GPTConfig
from nanodist.results import Table, hardware_fingerprint, provenance

MiB = 2**20


def caption(name, record):
    \"\"\"Glue a figure's provenance line (machine, backend, world size, torch, date) for the text below it.\"\"\"
    glue(name, Markdown(f"*{provenance(record)}*"), display=False)
""")

md(r"""
## The idea: gather, compute, free

FSDP cuts the model into **units**: the submodules you name (every transformer block, typically) plus
the **root**, which holds whatever no unit does (here the token and position embeddings, the final
LayerNorm, and the output layer, which shares its weight with the token embedding). Each rank keeps
$1/N$ of every unit, its **shard**, in fp32: the master copy that the optimizer updates. Around each
unit, in every step:

1. **forward**: all-gather the unit's shards into its full parameters, run the unit, free them;
2. **backward**: all-gather them again, run the unit's backward, **reduce-scatter** its gradient so that
   each rank receives the average of the part it owns, free the parameters and the full gradient;
3. **step**: the optimizer updates each rank's shards, with no communication at all.

Only the unit that is computing needs its full parameters, so a rank holds its shards plus one or two
gathered units at a time instead of the whole model. The model states shrink by $N$:
""")

code(r"""
print("stage 3, 7.5e9 parameters, mixed-precision AdamW, 64 ranks:",
      f"{zero_memory_bytes(7.5e9, 64, 3)['total'] / 2**30:.2f} GiB per rank;",
      f"stage 2: {zero_memory_bytes(7.5e9, 64, 2)['total'] / 2**30:.2f} GiB")
""")

md(r"""
**Communication.** Each step gathers every unit twice (forward and backward) and reduce-scatters its
gradient once. By Chapter 2's ring algorithms each of these sends $\frac{N-1}{N}$ of the unit's bytes
from every rank, so FSDP sends $3\frac{N-1}{N}\Psi$ bytes per rank and step, where DDP's all-reduce sends
$2\frac{N-1}{N}\Psi$: **1.5 times as much**. `nanodist.costmodel.bytes_per_step` counts it for each way of
keeping data-parallel ranks in sync (bytes per rank and step, for a model of 1 GiB):
""")

code(r"""
strategies = ["ddp", "zero1", "zero1-allreduce", "zero2", "fsdp", "fsdp-keep"]
volume = Table({"ranks": n, **{s: f"{bytes_per_step(s, 2**30, n) / 2**30:.2f} GiB" for s in strategies}} for n in (2, 8, 64))
for n in (2, 8, 64):
    assert abs(bytes_per_step("fsdp", 1, n) / bytes_per_step("ddp", 1, n) - 1.5) < 1e-12
volume
""")

md(r"""
ZeRO-1 and ZeRO-2 reduce-scatter the gradients and all-gather the updated parameters: 2 halves, as
DDP (Chapter 4). They differ in memory only: ZeRO-2 frees the gradient outside its own slice. nanodist's
`DistAdamW(zero_stage=1)` does something else, `zero1-allreduce`: it all-reduces, so that every rank
still holds the whole averaged gradient after the step, as under DDP, and then all-gathers: 3 halves. `fsdp-keep` is FSDP with
`reshard_after_forward=False`: each unit stays gathered from its forward until its backward, one
all-gather fewer, as much traffic as DDP, and memory closer to ZeRO-2's.

## Units and flat parameters

Using it looks like DDP, with one more argument, the units:

```python
model = GPT(cfg)
fsdp = nd.FSDP(model, units=list(model.blocks))                       # every Block a unit, the rest the root
opt = torch.optim.AdamW(fsdp.configure_param_groups(0.1), lr=3e-3)    # steps this rank's shards
loss = fsdp(x, y)[1]; loss.backward(); opt.step(); opt.zero_grad()
```

**How a unit is stored.** nanodist lays a unit's parameters end to end in one flat buffer, pads it to
a multiple of $N$, and gives rank $r$ the $r$-th of $N$ equal pieces. PyTorch's first FSDP (its `FlatParameter`)
does the same. torch's FSDP2 does something else: it cuts
*each parameter* along its first dimension, so that every parameter is a `DTensor` with {term}`placement`
`Shard(0)` whose rank-$r$ part is the $r$-th chunk of its rows (`torch.chunk`'s rule). Here are both
layouts for a small unit, a `Linear(4, 5)` and a `Linear(4, 3)`, on 3 ranks, computed by the
same functions `nanodist.FSDP` uses:
""")

code(r"""
shapes = [(5, 4), (5,), (3, 4), (3,)]
names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
numels = [torch.Size(s).numel() for s in shapes]
flat, dim0 = flat_layout(numels, 3), dim0_layout(shapes, 3)
plots.fsdp_layouts(flat, dim0, names, numels)
plots.show()
""")

code(r"""
sizes = [sum(b - a for _, a, b in pieces) for pieces in flat]
rows = Table({"rank": r, "flat: elements held": sizes[r],
              "flat: padding": sum(b - a for k, a, b in flat[r] if k is None),
              "Shard(0): elements held": sum(b - a for _, a, b in dim0[r])} for r in range(3))
assert len(set(sizes)) == 1 and sum(sizes) == 42 and sum(numels) == 40
rows
""")

md(r"""
The flat buffer gives every rank exactly the same number of elements (40 elements, padded to 42, in
three pieces of 14), and a unit's all-gather is one collective on one contiguous buffer. But a piece
ignores the parameters' boundaries: `fc1.weight` straddles ranks 0 and 1. Per-parameter sharding keeps
every parameter's own shape (rank $r$ holds rows of each matrix), so each shard is meaningful alone.
That matters for what comes after:

- an optimizer that needs **whole matrices**, such as Muon (Chapter 4), cannot run on flat pieces;
  `make_muon_optimizer` refuses an FSDP model with a clear error. With `Shard(0)` it could gather just
  the rows of one matrix;
- **checkpoints** (Chapter 6) want a layout that does not depend on how units were packed.
  `FSDP.state_dict()` therefore hands out every parameter as a `DTensor` `Shard(0)` of its own shape,
  FSDP2's layout, moving the pieces with one all-to-all per unit;
- per-parameter dtypes are easy with `Shard(0)`; a flat buffer needs one dtype per unit, so nanodist
  raises a clear error for a unit that mixes them. Frozen parameters may sit in a trainable unit: their
  part of the unit's gradient is computed and dropped, as in torch's FSDP1 with `use_orig_params`.

FSDP2 pays for its layout at every collective: it copies the shards into one flat buffer before the
all-gather and copies the gathered buffer out into the parameters afterwards (and the same for the
gradients). nanodist's parameters are views into the gathered buffer, so there is nothing to copy.

**The code.** The whole cycle is a handful of module hooks. Before a unit's forward, wait for its
gather and start the next unit's (prefetch); after it, free the parameters and hook its output so that
backward gathers them again:
""")

code(r"""
print(inspect.getsource(FSDP._pre_forward))
print(inspect.getsource(FSDP._post_forward))
print(inspect.getsource(FSDP._pre_backward))
""")

md(r"""
The gather itself makes the full buffer's memory exist again (`resize_` of its storage, the trick
PyTorch's FSDP uses too), all-gathers the shards into it, and, once it has arrived, points the module's
attributes at views of it. Autograd saved those same views for backward, so when a unit is gathered
again for its backward they find their data:
""")

code(r"""
print(inspect.getsource(Unit.gather))
print(inspect.getsource(Unit._install))
""")

md(r"""
The reduce-scatter is launched by the gradient-sync engine of Chapter 4 (`nanodist.sync.GradSync`): a
unit's full parameter buffer is one "parameter" of the engine, whose hook fires when its gradient is
complete, and the engine launches the units' reduce-scatters in the same order on every rank and
waits for all of them at the end of backward.

## Proven equal to torch FSDP2 and to one process

`tests/test_fsdp.py` trains the same GPT for 20 steps three ways, nanodist FSDP, torch FSDP2 with the
same units, and one process on the whole batch, at 1, 2, 3 and 4 ranks, with a tied embedding and
units whose sizes do not divide by 3, and in bf16. Losses, gradient norms and parameters agree, though
not bitwise: nanodist's flat reduction adds numbers in another order than one process does. At the first
step, from identical parameters, they agree to a few roundings; over 20 AdamW steps those roundings grow,
and the test allows what it measured on several CPU kernel paths, with a margin. It also trains a copy
with a planted bug, one rank's gradients 1.001 times too large, and checks that the same comparisons
catch it: a tolerance that let that through would prove nothing. The chapter's lab trains the lab
GPT with DDP, ZeRO-1, ZeRO-2, nanodist FSDP and torch FSDP2 from the same weights on the same data;
the five runs follow each other step for step:
""")

code(r"""
timed = nd.launch("lab05_fsdp", nproc=2, echo=False, args=["--no-progress"])
t = timed.results["metrics"]
impls = t["impls"]
print("\n".join(line.strip() for line in timed.lines(0) if line.strip().startswith(("ddp", "zero", "fsdp", "ratio", "nanodist"))))
assert set(impls) == {"ddp", "zero1", "zero2", "fsdp", "fsdp2"} and all(r["median_step_s"] > 0 for r in impls.values())
""", MACHINE)

code(r"""
# Losses and gradient norms are floating-point results of training: they differ between CPUs in their last
# digits, so this cell shows them and checks them here instead of nbval comparing them. The bounds are those of
# tests/test_fsdp.py, which measures them on several CPU kernel paths: at step 0 the parameters are identical and
# only the order of the gradient sums differs (a few fp32 roundings, below 1e-7 measured); over 20 AdamW steps
# those roundings grow, because AdamW gives a gradient at rounding level a full-size update (up to 1.2e-4
# measured). A wrong average, one rank's gradient 1.001 x too large, moves the step-0 norm by 5e-4 at 2 ranks:
# the test plants that error and checks that the same bounds catch it.
for name in ("zero1", "zero2", "fsdp", "fsdp2"):
    for key in ("losses", "grad_norms"):
        ours, ddp = impls[name][key], impls["ddp"][key]
        assert abs(ours[0] - ddp[0]) <= 1e-5 * ddp[0], (name, key)
        assert all(abs(a - b) <= 2e-3 * abs(b) for a, b in zip(ours, ddp)), (name, key)
Table({"step": s, **{name: round(impls[name]["losses"][s], 4) for name in impls}} for s in (0, 1, 5, 10, 19))
""", MACHINE)

md(r"""
The gradient norms agree as well, which is a check worth making on your own machine before you trust
FSDP2 on CPU. In some torch releases gloo's `ReduceOp.AVG` silently *summed* in FSDP2's
reduce-scatter, so gradients came out $N$ times too large (pytorch/pytorch#162338). AdamW hides such
an error, because its update $m/\sqrt{v}$ barely changes when every gradient is scaled by the same
factor, but the gradient norm shows it at once, and so would SGD. With this torch FSDP2 averages
correctly. On an affected release, `model.set_force_sum_reduction_for_comms(True)` makes FSDP2 reduce
with `SUM` and divide by $N$ itself. nanodist always reduces with `SUM` and divides.

**What the module holds, and clipping.** Between steps, `layer.weight` is this rank's piece of the
weight: the same 1-D (possibly empty) `Parameter` the optimizer steps, and `fsdp.module.named_parameters()`
names them all. Only while a unit is gathered are its attributes views of the full buffer. So reading a
weight never touches freed memory, and `layer.weight.requires_grad_(False)` after wrapping freezes what
the optimizer steps. One consequence to know: `torch.nn.utils.clip_grad_norm_(fsdp.parameters(), 1.0)`
sees only this rank's pieces, so it returns a rank-local norm and clips each rank by a different factor
(torch's FSDP1 behaves the same). Call `fsdp.clip_grad_norm_(1.0)`, which adds up every rank's squares in
one all-reduce; the Trainer always does. In FSDP2 the parameters are DTensors, and the same torch call
returns the global norm. `tests/test_fsdp.py` checks all three.

One more trap, which the lab avoids: build the {term}`device mesh` for a CPU run explicitly on the CPU
(`init_device_mesh("cpu", ...)`; `nd.Group.device_mesh` does). On a machine with GPUs, `fully_shard`
with a gloo group and no mesh would put the parameters on a GPU.

## The timeline of a step

`FSDP(..., observer=FSDPTimeline())` records when each unit's all-gather started and arrived, when its
parameters were freed, and its reduce-scatter. One launch of Lab 5 records a step with prefetch and
one without, the same step's memory, operation by operation, and two more measurements that the next
sections use:
""")

code(r"""
lab = nd.launch("lab05_fsdp", nproc=2, echo=False,
                args=["--memory-only", "--timeline", "--checkpointing-compare", "--steps", "6", "--no-progress"])
m = lab.results["metrics"]
tl = m["timeline"]
caption("prov_lab", lab.results)
glue("prefetch_ms", 1e3 * tl["prefetch"]["step_s"], display=False)
glue("no_prefetch_ms", 1e3 * tl["no_prefetch"]["step_s"], display=False)
glue("prefetch_story", Markdown(  # one step each, on a machine whose cores also run the collectives: either way
    "here prefetch saved a little" if tl["prefetch"]["step_s"] < tl["no_prefetch"]["step_s"] else
    "here prefetch saved nothing, and the step with it was even the slower one"), display=False)
plots.fsdp_timeline({"prefetch on": tl["prefetch"]["events"], "prefetch off": tl["no_prefetch"]["events"]})
plots.show()
assert 0 < tl["prefetch"]["step_s"] and 0 < tl["no_prefetch"]["step_s"]
""", MACHINE)

md(r"""
{glue:md}`prov_lab`

Read a panel from the top left. Forward gathers the root and then each block in turn (light: the
all-gather in flight; dark: the parameters gathered); each block is freed as soon as its forward is
done. Backward runs the blocks in reverse order, gathering each one again, and its reduce-scatter (red)
starts the moment its gradient is complete; the engine waits for all of them when backward ends, which
is why every red bar reaches the end. The root stays gathered throughout, as in FSDP2: it is needed
first in forward and last in backward.

With prefetch, block $i+1$'s all-gather starts when block $i$ starts computing, in forward, and block
$i-1$'s when block $i$'s backward starts. The check below reads the events:
""")

code(r"""
def held_at_once(events):
    live, most = set(), 0
    for e in events:
        if e["unit"] == "root":
            continue
        if e["event"] == "gather_started":
            live.add(e["unit"])
        elif e["event"] == "freed":
            live.discard(e["unit"])
        most = max(most, len(live))
    return most


on, off = tl["prefetch"]["events"], tl["no_prefetch"]["events"]
order = [(e["unit"], e["event"]) for e in on]
assert order.index(("blocks.1", "gather_started")) < order.index(("blocks.0", "freed"))  # prefetched in forward
assert held_at_once(on) == 2 and held_at_once(off) == 1
print("blocks gathered at once, at most: with prefetch", held_at_once(on), "- without", held_at_once(off))
""")

md(r"""
Prefetch holds two blocks at once instead of one, and in exchange the next block's parameters are
(partly) on their way while the current one computes. Here, the step with prefetch took
{glue:text}`prefetch_ms:.1f` ms and the one without {glue:text}`no_prefetch_ms:.1f` ms: {glue:md}`prefetch_story`. On a
few CPU cores the all-gather competes with the computation for the same cores, so overlap gains little or
nothing, unlike on a GPU,
where the collective runs alongside the compute kernels (though NCCL's kernels take some of the
GPU's multiprocessors to do it).

## Memory over one step

`nanodist.memory` counts memory itself, so it works on CPU, where torch keeps no allocation
statistics. An `AllocationTracker` (a `TorchDispatchMode`) sees every operation's output; a storage
created in the step is counted from then until a weak reference says it was freed, and storage resizes
(how FSDP allocates and frees a gathered unit) are counted as they happen. `LiveBytes` adds which of
those bytes are saved activations (through autograd's saved-tensor hooks) and which are gathered units
(FSDP's events). On a GPU, `torch.cuda.max_memory_allocated` measures the same peak from the
allocator. Here is one FSDP step and one DDP step of the lab GPT, on rank 0:
""")

code(r"""
top = max(max(tl["memory_trace"][name]["trace"]["total"]) for name in ("ddp", "fsdp")) / 2**20
for name in ("ddp", "fsdp"):
    ax = plots.memory_over_step(tl["memory_trace"][name]["trace"])
    ax.set_ylim(0, 1.15 * top)  # one scale for both plots
    ax.set_title(f"{name.upper()}: bytes allocated during one step", fontsize=10, loc="left")
    plots.show()
""")

md(r"""
{glue:md}`prov_lab`

Both curves climb through forward as activations are saved and fall through backward as they are
used. The picture makes the point of the rest of this chapter: at this {term}`micro-batch` (8 sequences of 64
tokens), **activations dominate**. Above the orange band are gradients and temporaries. DDP's
gradients live in its buckets, allocated once and kept from step to step, so they count as held and
sit below this curve's zero; FSDP's gradient shards are made by each step's reduce-scatters and stay
until `zero_grad` (the level after the optimizer). FSDP's blue band is the gathered units: at most two
blocks and the root.

The **peak** of a rank is what it holds throughout (parameters or their shards, the optimizer state,
and for DDP its gradient buckets) plus the highest point of the curve. Its parts can be predicted: the shards (with
the gradient shards), two gathered units and the root, one unit's full gradient before its
reduce-scatter, and the saved activations. Lab 5 prints the comparison:
""")

code(r"""
# The peak is the allocator's, traced during the step: it includes the kernels' own scratch memory, which
# depends on the CPU (MKL's and oneDNN's buffers), so it is shown and checked here, not compared by nbval.
bound = max(impls["fsdp"]["peak_bound"], key=lambda b: b["peak"] / b["bound"])
parts = ["shards", "units", "unit_grad", "activations"]
assert all(b["peak"] <= b["bound"] for b in impls["fsdp"]["peak_bound"])
glue("peak_ratio", bound["peak"] / (bound["bound"] - bound["unit_grad"]), display=False)
Table([{**{p: f"{bound[p] / MiB:.2f} MiB" for p in parts}, "sum": f"{bound['bound'] / MiB:.2f} MiB",
        "measured peak": f"{bound['peak'] / MiB:.2f} MiB"}])
""", MACHINE)

md(r"""
The measured peak stays under the sum of its parts; without the gradient term it is
{glue:text}`peak_ratio:.2f` × shards + two units + activations. It is below the sum because the parts
do not peak together: the activations are largest at the end of forward, when no gradient exists yet.

### Model states: the formula for all four stages

Lab 5's `--memory-only` mode trains one step at each stage, DDP (0), DistAdamW at stages 1 and 2 and
FSDP (3), and measures every tensor the ranks hold, as Chapter 4 did for stages 0 to 2. Two more
launches give 1 and 4 ranks:
""")

code(r"""
four = nd.launch("lab05_fsdp", nproc=4, echo=False,  # 1 and 4 ranks: the first N ranks of one launch of 4
                 args=["--memory-only", "--worlds", "1", "4", "--steps", "1", "--no-progress"])
stages = {n: [s for s in four.results["metrics"]["memory"] if s["world_size"] == n] for n in (1, 4)}
stages[2] = lab.results["metrics"]["memory"]
runs = [{"label": s["label"], "stage": s["stage"], "world_size": n, "rank": r, "num_params": s["num_params"], **rep}
        for n in (1, 2, 4) for s in stages[n] for r, rep in enumerate(s["memory"])]
table = memory_table(runs, param_bytes=4, grad_bytes=4, optim_bytes_per_param=8)
for row in table:  # every rank of every run: exact, but for AdamW's step counters
    assert row["params_measured"] == row["params_formula"] and row["grads_measured"] == row["grads_formula"]
    assert row["optimizer_state_measured"] - row["state_scalars"] == row["optimizer_state_formula"]
plots.zero_memory(table.where(rank=0))
plots.show()
""")

code(r"""
n_params = runs[0]["num_params"]
per_rank = {(r["world_size"], r["stage"]): r["total_measured"] for r in table.where(rank=0)}
ratio_w2 = per_rank[2, 3] / per_rank[2, 0]
assert ratio_w2 <= 0.52
glue("n_params", n_params, display=False)
glue("stage3_w2", ratio_w2, display=False)
glue("stage3_w4", per_rank[4, 3] / per_rank[4, 0], display=False)
""")

md(r"""
The lab GPT has {glue:text}`n_params:,` parameters, and every unit's size divides by 1, 2 and 4, so
stage 3 holds exactly $16\Psi/N$ bytes here: {glue:text}`stage3_w2:.2f` of DDP's bytes per rank at 2
ranks and {glue:text}`stage3_w4:.2f` at 4 (fp32, AdamW; the extra is the step counters, one per
parameter shard). At stage 3 every bar shrinks with $N$; at stage 2 the parameters do not.

## Communication volume, measured

FSDP's timeline says how many bytes each unit gathered and reduced. Every rank sends $\frac{N-1}{N}$ of
each buffer in a ring, so the lab adds up what a rank sent in one step and compares it with what DDP's
all-reduce of the same gradients sends:
""")

code(r"""
predicted = t["bytes_per_step_predicted"]
measured = impls["fsdp"]["bytes_sent"]
assert abs(measured / predicted["fsdp"] - 1) < 0.02
assert measured < predicted["fsdp"]  # byte counts, the same on every machine: the root's second gather is missing
glue("sent_ratio", t["ratio_bytes_sent_fsdp_vs_ddp"], display=False)
glue("pad_pct", 100 * (measured / predicted["fsdp"] - 1), display=False)
Table([{"": "bytes per rank and step", "DDP (cost model)": f"{predicted['ddp'] / MiB:.2f} MiB",
        "FSDP (cost model)": f"{predicted['fsdp'] / MiB:.2f} MiB", "FSDP (counted in the run)": f"{measured / MiB:.2f} MiB"}])
""")

md(r"""
FSDP sent {glue:text}`sent_ratio:.2f` × DDP's bytes, {glue:text}`pad_pct:.2f` % from the predicted 1.5.
The shortfall is the root (embeddings, final norm and head): it is gathered once per step instead of
twice, since it stays gathered between forward and backward, while its gradient is reduce-scattered
like every other unit's. (The padding of the units' buffers works the other way: it adds a few bytes.)

## Time per step

The same timed run compares the implementations step by step, taking turns so that a disturbance on
the machine hits all of them alike:
""")

code(r"""
ratio = t["ratio_step_fsdp_vs_fsdp2"]
assert 0 < ratio < 3
caption("prov_timed", timed.results)
glue("fsdp_vs_fsdp2", ratio, display=False)
step_ms = {name: 1e3 * r["median_step_s"] for name, r in impls.items()}
plots.bars(list(step_ms), list(step_ms.values()), "median step (ms)", "step time, 2 gloo ranks")
plots.show()
""", MACHINE)

md(r"""
The repository keeps runs of this lab measured on the machines these pages were built on, and on a GPU box, under `labs/results/reference/`: one H200 and one H100, each with the 124 M `gpt2` preset at a world of one over nccl (no bytes travel, so their ratios show each implementation's own overhead), and the small preset on two ranks sharing the H200 through gloo. Your run comes first; each row says where it was measured:
""")

code(r"""
refs = nd.results.references("lab05_fsdp", match=lambda r: "ratio_step_fsdp_vs_fsdp2" in r["metrics"])
assert refs, "the repository ships a reference run of lab 5 (labs/results/reference/lab05_fsdp)"
nd.results.beside(timed.results, refs, {
    "model": lambda r: r["config"]["model"],
    "FSDP / FSDP2 step": lambda r: r["metrics"]["ratio_step_fsdp_vs_fsdp2"],
    "model states, FSDP / DDP": lambda r: r["metrics"]["ratio_states_fsdp_vs_ddp"],
    "bytes sent, FSDP / DDP": lambda r: r["metrics"]["ratio_bytes_sent_fsdp_vs_ddp"]})
""", MACHINE)

md(r"""
{glue:md}`prov_timed`

A nanodist FSDP step took {glue:text}`fsdp_vs_fsdp2:.2f` × as long as an FSDP2 step on the same model and
units. Two things explain most of the difference on CPU ranks, and neither is FSDP's algorithm.
gloo has no true reduce-scatter: `reduce_scatter_tensor` runs a whole all-reduce and keeps one
slice, so FSDP2 on gloo sends twice the gradient bytes it needs, where nanodist uses its own ring
reduce-scatter (Chapter 2). And FSDP2 copies every unit's shards into a flat buffer before each
all-gather and out of it afterwards, the price of its per-parameter layout. With NCCL on GPUs both
differences shrink: NCCL has a true reduce-scatter, and the copies run at GPU memory bandwidth.

FSDP is slower than DDP here: it sends 1.5 × the bytes, and it waits for every gather before a unit
can compute. What it buys is memory.

## Fitting in a budget

`--budget MiB` marks the configurations whose peak per rank fits. With a small micro-batch the
activations shrink and the model states are most of the memory, which is where FSDP helps:
""")

code(r"""
budget = nd.launch("lab05_fsdp", nproc=2, echo=False,
                   args=["--micro-batch", "1", "--budget", "10", "--steps", "6", "--no-progress"])
b = budget.results["metrics"]["impls"]
caption("prov_budget", budget.results)
print("\n".join(line.strip() for line in budget.lines(0) if line.strip().startswith(("ddp", "zero", "fsdp"))))
assert set(b) == set(impls)
""", MACHINE)

code(r"""
# peaks traced from the runs (kernels' scratch memory included): shown and checked here, not compared by nbval
fits = {name: r["fits_budget"] for name, r in b.items()}
glue("peak8_fsdp", max(mem["peak"] for mem in impls["fsdp"]["memory"]) / MiB, display=False)
glue("peak8_ddp", max(mem["peak"] for mem in impls["ddp"]["memory"]) / MiB, display=False)
assert not fits["ddp"] and fits["fsdp"] and fits["fsdp2"]
peaks = {name: max(mem["peak"] for mem in r["memory"]) / MiB for name, r in b.items()}
assert all(fits[name] == (peaks[name] <= 10) for name in b)
Table({"configuration": name, "peak per rank (MiB)": round(peaks[name], 2), "fits in 10 MiB": fits[name]} for name in b)
""", MACHINE)

md(r"""
{glue:md}`prov_budget`

At one sequence per micro-step, DDP and ZeRO-1/2 need more than 10 MiB per rank; both FSDPs fit.
(nanodist's ZeRO-1 peaks higher than DDP: it keeps autograd's gradients and its bucket's all-reduced
copy at the same time, where DDP's gradients *are* views of its buckets.) At 8 sequences FSDP's peak
was {glue:text}`peak8_fsdp:.1f` MiB against DDP's {glue:text}`peak8_ddp:.1f` MiB: activations were most
of it, and FSDP cannot shrink activations. {term}`Activation checkpointing <activation checkpointing>` can.

## Activation checkpointing

`torch.utils.checkpoint` runs a block's forward without saving its intermediate results, keeping only
its input; in backward it runs the block's forward again to recompute them. nanodist's GPT does it per
block with `model.activation_checkpointing = True` (the non-reentrant variant, which works with
autograd hooks such as FSDP's). FSDP has to know: the recomputed forward happens inside backward, so
the unit must stay gathered, and nanodist's hooks check for that. The lab measured both:
""")

code(r"""
# saved activations and the traced peak of the runs: shown and checked here, not compared by nbval
ck = m["checkpointing"]
saved_ratio = ck["on"]["activations_max"] / ck["off"]["activations_max"]
assert saved_ratio < 0.5 and ck["on"]["peak"] < ck["off"]["peak"]
glue("ck_saved_off", ck["off"]["activations_max"] / MiB, display=False)
glue("ck_saved_on", ck["on"]["activations_max"] / MiB, display=False)
glue("ck_peak_off", ck["off"]["peak"] / MiB, display=False)
glue("ck_peak_on", ck["on"]["peak"] / MiB, display=False)
Table({"checkpointing": k, "saved activations (MiB)": round(v["activations_max"] / MiB, 2),
       "peak per rank (MiB)": round(v["peak"] / MiB, 2)} for k, v in ck.items())
""", MACHINE)

code(r"""
glue("ck_time_ratio", ck["on"]["median_step_s"] / ck["off"]["median_step_s"], display=False)
print(f"step time with checkpointing / without: {ck['on']['median_step_s'] / ck['off']['median_step_s']:.2f}")
assert ck["on"]["median_step_s"] > 0 and ck["off"]["median_step_s"] > 0
""", MACHINE)

md(r"""
Saved activations fell from {glue:text}`ck_saved_off:.1f` to {glue:text}`ck_saved_on:.1f` MiB and the
peak from {glue:text}`ck_peak_off:.1f` to {glue:text}`ck_peak_on:.1f` MiB per rank; a step took
{glue:text}`ck_time_ratio:.2f` × as long. The usual estimate is one more forward pass, about a third of
the step's compute, since backward costs about twice the forward. Only block inputs are kept, so the
activations now grow with the number of blocks times one block's input, and the largest single block's
intermediates, recomputed one block at a time.

## Mixed precision

`FSDP(..., param_dtype=torch.bfloat16)` casts the fp32 shards to bf16 before the all-gather, so the
gathered units, the compute, and the all-gathers are all in bf16: half the bytes. The shards (the master
weights), their gradients and the optimizer state stay fp32, and the gradients are reduce-scattered in
fp32 (`reduce_dtype=torch.bfloat16` halves those bytes too, at some cost in precision: a sum of many
bf16 numbers loses their small parts). One process is enough to see the pieces:
""")

code(r"""
text = generate_corpus(20_000, seed=0)
tok = CharTokenizer(text)
tokens = torch.tensor(tok.encode(text))


def curve(model, opt, steps):  # train `steps` steps, on the same batches every time: the losses
    stream = TokenStream(tokens, batch_size=8, block_size=32, rank=0, world_size=1, seed=0)
    losses = []
    for _ in range(steps):
        x, y = next(stream)
        loss = model(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train(param_dtype, steps=30):
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", vocab_size=tok.vocab_size, block_size=32))
    fsdp = FSDP(model, units=list(model.blocks), param_dtype=param_dtype)   # a world of one: no process group
    return fsdp, curve(fsdp, torch.optim.AdamW(fsdp.configure_param_groups(0.1), lr=3e-3), steps)


fp32, losses32 = train(None)
bf16, losses16 = train(torch.bfloat16)
unit = bf16.units[0]
x, y = next(TokenStream(tokens, batch_size=8, block_size=32, rank=0, world_size=1, seed=1))
bf16(x, y)[1].backward()
grad = next(bf16.parameters()).grad
print("shard:", unit.shard.dtype, "| gathered parameters:", unit.full.dtype, "| gradient shard:", grad.dtype)
print(f"gathered bytes of {unit.name}: fp32 {fp32.units[0].full_bytes} B, bf16 {unit.full_bytes} B")
assert unit.shard.dtype == grad.dtype == torch.float32 and unit.full.dtype == torch.bfloat16
assert unit.full_bytes * 2 == fp32.units[0].full_bytes
""")

code(r"""
# bf16 losses depend on the CPU (with AMX or AVX-512 BF16, oneDNN takes other kernels): shown, checked here.
# The bound: bf16 keeps 8 significant bits (a relative rounding of up to 2^-8 = 0.4 % per value); after 30 steps the
# two curves were 0.5 % to 1.9 % apart at the last step on the CPUs measured; 5 % leaves a margin while a
# broken cast (an fp32 shard read as bf16 bits, a gradient left in bf16) is far outside it.
assert abs(losses16[-1] - losses32[-1]) < 0.05 * losses32[-1] and losses16[-1] < losses16[0] - 0.5
glue("bf16_gap_pct", 100 * abs(losses16[-1] - losses32[-1]) / losses32[-1], display=False)
glue("bf16_steps", len(losses16), display=False)
caption("prov_bf16", {"hardware": hardware_fingerprint(), "backend": "one process, no process group", "world_size": 1,
                      "created": datetime.date.today().isoformat()})
Table({"step": s, "fp32 loss": round(losses32[s], 3), "bf16 compute loss": round(losses16[s], 3)} for s in (0, 9, 19, 29))
""", MACHINE)

md(r"""
{glue:md}`prov_bf16`

Both curves fall together, but they do not stay within one rounding of each other: after
{glue:text}`bf16_steps` steps the bf16-compute loss is {glue:text}`bf16_gap_pct:.1f` % from the fp32 one on this
machine. bf16 keeps 8 significant bits (7 stored), so every value of the forward and backward is rounded by up to
0.4 %; the rounded gradients give slightly different updates, and over many steps the two runs follow
slightly different trajectories, as two fp32 runs with different seeds would, only less so. The test
for a broken cast is therefore a bound (5 %, in the cell above) far outside this drift and far inside
what an fp32 shard read as bf16 bits would do. The equivalence test makes the exact comparison
against FSDP2's `MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)` at 2 and
3 ranks. Note the `reduce_dtype`: FSDP2's default, `None`, reduce-scatters the gradients in
`param_dtype`, here bf16, whereas nanodist's default reduces the fp32 gradients of the shards. Pass
`reduce_dtype=torch.float32` to FSDP2 to get nanodist's behaviour.
""")

md(r"""
## The same with PyTorch: FSDP2 in your own code

nanodist's FSDP exists to be read. At work you will write FSDP2, `torch.distributed.fsdp.fully_shard`,
and every idea of this chapter has a line there. Here is a training script's set-up, run in this
notebook's own process as a world of one so that every line runs. Under `torchrun` the same lines run on
every rank: `init_process_group` then reads the rank and the world size from the environment, and the
mesh spans all the ranks (on GPUs: `backend="nccl"` and `init_device_mesh("cuda", (world_size,))`, one
rank per GPU). First the plain wrapping, beside nanodist's FSDP on a copy of the same weights, trained on
the same batches:
""")

code(r"""
import copy

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # under torchrun: ("nccl") alone
mesh = init_device_mesh("cpu", (dist.get_world_size(),))                       # 1-D: every rank shards
cfg = GPTConfig.preset("tiny", vocab_size=tok.vocab_size, block_size=32)

torch.manual_seed(0)
theirs = GPT(cfg)
twin = copy.deepcopy(theirs)
ours = FSDP(twin, units=list(twin.blocks))          # nanodist: every Block a unit, the rest the root

for block in theirs.blocks:                         # FSDP2: fully_shard each Block (a unit) ...
    fully_shard(block, mesh=mesh)
fully_shard(theirs, mesh=mesh)                      # ... then the whole model: the root takes what is left
assert isinstance(theirs, FSDPModule) and isinstance(theirs, GPT)  # the same object, its class swapped

fsdp2_losses = curve(theirs, torch.optim.AdamW(theirs.parameters(), lr=3e-3), steps=8)  # built after wrapping
nanodist_losses = curve(ours, torch.optim.AdamW(ours.parameters(), lr=3e-3), steps=8)
worst = max(abs(a - b) / b for a, b in zip(fsdp2_losses, nanodist_losses))
# one process, fp32: the same arithmetic but for the order of a few sums; 1e-5 relative over 8 AdamW steps
assert worst < 1e-5, worst
Table({"step": i, "FSDP2 loss": round(a, 4), "nanodist FSDP loss": round(b, 4)}
      for i, (a, b) in enumerate(zip(fsdp2_losses, nanodist_losses)) if i in (0, 3, 7))
""", MACHINE)

md(r"""
`fully_shard` turns each module it is given into a unit: it replaces the module's parameters by
`DTensor`s sharded on dim 0 over the mesh (the `Shard(0)` layout above), and registers hooks that
all-gather them before the module's forward and backward and free them after, and reduce-scatter the
gradients. It is called bottom-up, blocks first and the root last, because each call takes the
parameters not already in a unit below it. The optimizer is built *after* wrapping, on the `DTensor`
parameters: each rank's AdamW then keeps state for its own shards only, which is ZeRO's saving, with
nothing to configure. Everything else in a training step is the plain PyTorch you already write.

Four more pieces cover what this chapter did by hand. A model too large for one device is built on the
**{term}`meta device`** (shapes without memory), sharded, and only then materialised, so that each rank
allocates its own shards and never the whole model. **Mixed precision** is a policy per unit. And
**prefetch** can be stated explicitly. FSDP2 overlaps the next unit's gather by itself: in forward through
separate CUDA streams while the CPU runs ahead issuing work, in backward by prefetching in the reverse of
the forward order. Naming the modules, as here, issues each gather earlier from the CPU, or prefetches more
than one unit ahead.
""")

code(r"""
with torch.device("meta"):                     # no memory is allocated: shapes and dtypes only
    big = GPT(cfg)
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16,  # gather and compute in bf16 ...
                              reduce_dtype=torch.float32)  # ... reduce-scatter fp32 gradients (default: bf16)
for block in big.blocks:
    fully_shard(block, mesh=mesh, mp_policy=policy)
fully_shard(big, mesh=mesh, mp_policy=policy)
big.to_empty(device="cpu")                     # every rank allocates its own shards, uninitialised ...
with warnings.catch_warnings():                # (torch: DTensor's random operators on a CPU mesh are "not
    warnings.filterwarnings("ignore", "DTensor random operators")  # complete"; at one rank nothing depends on it)
    big.init_weights()                         # ... and fills them, as GPT's constructor does
blocks = list(big.blocks)
for this, nxt in zip(blocks, blocks[1:]):      # explicit prefetch: gather the next block during this one
    this.set_modules_to_forward_prefetch([nxt])
    nxt.set_modules_to_backward_prefetch([this])
p = big.blocks[0].mlp.fc.weight
print(f"{type(p).__name__}, placements {p.placements}, this rank's shard {tuple(p.to_local().shape)} "
      f"of {tuple(p.shape)}, stored in {p.dtype}")
x, y = next(TokenStream(tokens, batch_size=8, block_size=32, rank=0, world_size=1, seed=0))
logits, loss = big(x, y)
print("computed in", logits.dtype, "| loss finite:", bool(torch.isfinite(loss)))
assert p.dtype == torch.float32 and logits.dtype == torch.bfloat16 and torch.isfinite(loss)
assert big.lm_head.weight is big.wte.weight   # the head still shares the token embedding's weight
""")

md(r"""
The parameters stay fp32 shards (the master weights); the forward ran in bf16. Two more options
matter at scale, and both run here too:

- **CPU offload**: `offload_policy=CPUOffloadPolicy()` keeps the shards, their gradients and so the
  optimizer step on the host, and copies each unit to the GPU only for its gather. It trades PCIe traffic
  for GPU memory (on a CPU-only machine, as here, there is nothing to offload to: the code runs, and
  costs nothing).
- **HSDP**, hybrid sharding: on a 2-D mesh, `fully_shard` shards over one dimension and replicates over
  the other, for instance sharding within each node's 8 GPUs (fast {term}`NVLink`) and replicating across
  nodes, where the slower network then carries one all-reduce of gradient shards instead of every
  gather. The mesh below is 1 × 1 on this machine; on 4 nodes of 8 GPUs it would be
  `init_device_mesh("cuda", (4, 8), mesh_dim_names=("replicate", "shard"))`. The same 2-D meshes carry
  tensor parallelism, later in the course (see the [roadmap](roadmap.md)).
""")

code(r"""
offloaded = GPT(cfg)
fully_shard(offloaded, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=torch.cuda.is_available()))
offloaded(x, y)[1].backward()
print("offloaded: gradient shards on", next(offloaded.parameters()).grad.device)

mesh2d = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
hybrid = GPT(cfg)
fully_shard(hybrid, mesh=mesh2d)                # by position: dim 0 replicates, dim 1 shards (names are labels)
print("HSDP placements:", next(hybrid.parameters()).placements)
dist.destroy_process_group()
""")

md(r"""
## Which one to use

The measured ratios of this chapter and the last, at 2 ranks, in one table (bytes sent from the cost
model; step times are this machine's and move with it):
""")

code(r"""
states = {s: per_rank[2, s] for s in range(4)}
peak1 = {name: max(mem["peak"] for mem in r["memory"]) for name, r in b.items()}
names = {0: "ddp", 1: "zero1", 2: "zero2", 3: "fsdp"}
sent = {0: "ddp", 1: "zero1-allreduce", 2: "zero2", 3: "fsdp"}  # what each measured run sends
labels = {0: "DDP", 1: "ZeRO-1 (DistAdamW, zero_stage=1: all-reduce)", 2: "ZeRO-2 (DistAdamW)", 3: "FSDP"}
use = {0: "the model, its gradients and Adam's state fit on one device",
       1: "code needs every rank's whole averaged gradient after the step",
       2: "the optimizer state does not fit, the parameters do",
       3: "the parameters themselves do not fit: the only choice"}
decision = Table({"method": labels[s], "model states / DDP's": round(states[s] / states[0], 2),
                  "bytes sent / DDP's": round(bytes_per_step(sent[s], 1, 2) / bytes_per_step("ddp", 1, 2), 2),
                  "step time / DDP's": round(impls[names[s]]["median_step_s"] / impls["ddp"]["median_step_s"], 2),
                  "peak / DDP's (1 sequence)": round(peak1[names[s]] / peak1["ddp"], 2),
                  "use when": use[s]} for s in range(4))
assert [states[s] <= states[s - 1] for s in range(1, 4)] == [True] * 3  # each stage holds less than the one before
decision
""", MACHINE)

md(r"""
{glue:md}`prov_timed`

Read it from the top, taking the first method whose memory fits, with one exception: ZeRO-2 holds less
than ZeRO-1 and, done as ZeRO does it, sends no more, so ZeRO-1 is the choice only where its extra
gradient memory buys something. Three cases do: code that reads every parameter's averaged gradient
after the step (`DistAdamW(zero_stage=1)` keeps them, at half again DDP's traffic, as the table shows);
**{term}`gradient accumulation`**, where ZeRO-2 must reduce-scatter after every micro-batch or keep a full-size
accumulation buffer, which gives back its saving; and **pipeline parallelism**, whose many micro-batches
per step raise the same problem (DeepSpeed refuses ZeRO-2 and 3 with its pipeline engine for this
reason). Sharding the parameters is the step that costs communication: FSDP sends 1.5 × DDP's bytes,
which shows on a real cluster where the network is slow (across nodes).

Whether that traffic costs time depends on whether prefetch hides it behind compute. Both grow with the
parameter count $\Psi$: per step a rank computes about $6\Psi$ FLOPs for each of the $T$ tokens it
processes, about $6\Psi T / F$ seconds at $F$ FLOP/s, while it sends $3\frac{N-1}{N}$ of the model's bytes,
about $6\Psi / B$ seconds in bf16 over a link of $B$ bytes/s, whatever $T$ is (with fp32 reductions,
$8\Psi / B$: the threshold below rises by a third). The ratio of the two is
$T B / F$: the gathers hide once each rank processes more than about $F / B$ tokens per step. That is the
criterion the Ultra-Scale Playbook and the JAX scaling book use, and why large models train with FSDP at
a large enough batch per GPU, often combined with tensor and pipeline parallelism (see the [roadmap](roadmap.md)).

## Summary

- FSDP (ZeRO-3) keeps $1/N$ of every parameter on each rank and gathers a unit's parameters only while
  it computes: forward gathers and frees, backward gathers again and reduce-scatters the gradient.
  The model states fall to $(2 + 2 + K)\Psi/N$; the communication rises to $3\frac{N-1}{N}\Psi$, 1.5 ×
  DDP's, both measured here.
- nanodist's units are flat padded buffers cut in $N$ equal pieces; FSDP2 cuts each parameter along
  dim 0 (`DTensor` `Shard(0)`). Flat is one contiguous collective with no copies; per-parameter keeps
  shapes, which whole-matrix optimizers and checkpoints want.
- Prefetch overlaps the next unit's gather with the current unit's compute, at the cost of one more
  gathered unit.
- A step's peak is shards + gathered units + activations + gradients and temporaries in flight; the
  chapter predicted it from its parts and measured it with its own allocation accounting.
- FSDP cannot shrink activations; activation checkpointing trades about one more forward for most of
  them. Mixed precision halves the gathered bytes.
- In PyTorch: `fully_shard` each block, then the model, on a device mesh; build the optimizer after.
  `MixedPrecisionPolicy` (set `reduce_dtype` yourself), the meta device with `to_empty`, explicit
  prefetch, `CPUOffloadPolicy`, and a 2-D mesh for HSDP.

## Exercises
""")

exercise(
    "5.1",
    "A model of 1.5 billion parameters trains in bf16 (2 bytes per parameter) with FSDP on 8 GPUs. How many "
    "GB (1e9 bytes) does each GPU send per step to keep it in sync, with `reshard_after_forward=True`?",
    'bytes_per_step("fsdp", 2 * 1.5e9, 8) / 1e9, rel_tol=1e-3',
    "answer = ...   # GB per GPU and step",
    "How many collectives touch each unit in one step, and what fraction of a buffer does each rank send in a ring?",
    "answer = 3 * (8 - 1) / 8 * 2 * 1.5e9 / 1e9   # two all-gathers and one reduce-scatter, (N-1)/N of 3 GB each")

exercise(
    "5.2",
    "A unit is one `nn.Linear(100, 30)` (a 30 × 100 weight, then a bias of 30). nanodist's FSDP shards it over 4 "
    "ranks. How many padding elements does its flat buffer get, and which ranks hold part of the bias? Answer as "
    "`(padding, [ranks])`. Work it out by hand, then check with `flat_layout`.",
    "(sum(b - a for pieces in flat_layout([3000, 30], 4) for k, a, b in pieces if k is None), "
    "[r for r, pieces in enumerate(flat_layout([3000, 30], 4)) if any(k == 1 for k, _, _ in pieces)])",
    "answer = ...   # (padding, [ranks holding bias elements])",
    "The buffer is the weight's elements followed by the bias's, padded to a multiple of 4; every rank gets one "
    "equal, contiguous piece.",
    "total = 30 * 100 + 30                       # 3030 elements\n"
    "piece = -(-total // 4)                      # ceil(3030 / 4) = 758 each, 3032 in all\n"
    "padding = 4 * piece - total                 # 2\n"
    "bias = range(3000, 3030)                    # the bias's positions in the buffer\n"
    "answer = (padding, sorted({i // piece for i in bias}))")

exercise(
    "5.3",
    "Write `fsdp_bytes_per_rank(num_params, world_size)`: the bytes of parameters, gradients and AdamW state "
    "one rank holds under FSDP in fp32 with AdamW (as Lab 5 runs it), ignoring padding and step counters. "
    "The check tries it on model sizes and world sizes you do not see, and the measured table above shows "
    "what it should give for the lab GPT.",
    "cases=[((n, w), zero_memory_bytes(n, w, 3, 4, 4, 8)['total']) for n in (1000, 124_000_000, 7_000_000_000) "
    "for w in (1, 3, 8)], rel_tol=1e-9",
    "def fsdp_bytes_per_rank(num_params, world_size):\n    return ...\n\n\nanswer = fsdp_bytes_per_rank",
    "Count bytes per parameter for each of the three kinds of model state in fp32 AdamW, then decide which of "
    "them stage 3 divides.",
    "def fsdp_bytes_per_rank(num_params, world_size):\n"
    "    return (4 + 4 + 8) * num_params / world_size   # fp32 parameter, fp32 gradient, two fp32 moments: all sharded\n\n\n"
    "answer = fsdp_bytes_per_rank")

exercise(
    "5.4",
    "With prefetch on, the lab's FSDP held at most two blocks gathered at once, besides the root. Suppose you "
    "turned `reshard_after_forward` off (each block stays gathered from its forward until its backward). How many "
    "of the lab GPT's blocks are gathered at the end of forward?",
    "4",
    "answer = ...   # a number of blocks (the lab runs the 'small' preset: count its blocks in the timeline above)",
    "A block is freed when it is no longer needed; without resharding after forward, when is that?",
    "answer = 4   # every block stays gathered until its backward: the whole model, as in ZeRO-2")

chapter.predict(
    "5.5",
    "nanodist's FSDP reports every all-gather it starts to an observer (`FSDPTimeline`, as in the lab's timeline). "
    "Take the `tiny` GPT: 2 blocks, each a unit, and the root. How many all-gathers does one training step "
    "(forward and backward) start with `reshard_after_forward=True`, the default, and how many with `False`? "
    "Write `prediction = (with_true, with_false)`, then run the cell after it, which counts them in a real step in "
    "this process.",
    "prediction = ...   # (all-gathers with reshard_after_forward=True, with False)",
    "def gathers(reshard_after_forward):\n"
    "    torch.manual_seed(0)\n"
    "    model = GPT(GPTConfig.preset(\"tiny\", vocab_size=tok.vocab_size, block_size=32))\n"
    "    timeline = FSDPTimeline()\n"
    "    fsdp = FSDP(model, units=list(model.blocks), reshard_after_forward=reshard_after_forward, observer=timeline)\n"
    "    x, y = next(TokenStream(tokens, batch_size=8, block_size=32, rank=0, world_size=1, seed=0))\n"
    "    fsdp(x, y)[1].backward()\n"
    "    return sum(e[\"event\"] == \"gather_started\" for e in timeline.events)\n\n\n"
    "measured = (gathers(True), gathers(False))",
    "Go unit by unit: which ones does forward need, which ones does backward need again, and which ones were "
    "never freed in between?",
    "# Forward gathers every unit; backward needs each block again unless it was kept: 2 blocks x 2 + the root,\n"
    "# which stays gathered from its forward to its backward. Kept (False): each unit once.\n"
    "prediction = (2 * 2 + 1, 2 + 1)",
)

chapter.predict(
    '5.6',
    'The unit of the layouts figure, a `Linear(4, 5)` and a `Linear(4, 3)` (40 elements), is '
    'sharded on 3 ranks in the table above: equal padded pieces in the flat layout, uneven ones in '
    "FSDP2's `Shard(0)` layout. On **4** ranks, how many elements does each rank hold in each layout? "
    'Write `prediction = ((flat: rank0, ..., rank3), (Shard(0): rank0, ..., rank3))`, then run the cell '
    'after it, which asks `flat_layout` and `dim0_layout`, the functions of the figure.',
    'prediction = ...   # ((flat layout: elements on ranks 0-3), (Shard(0): elements on ranks 0-3))',
    'unit_shapes = [(5, 4), (5,), (3, 4), (3,)]                    # fc1.weight, fc1.bias, fc2.weight, fc2.bias\n'
    'unit_numels = [torch.Size(s).numel() for s in unit_shapes]\n'
    'held = lambda layout: tuple(sum(b - a for _, a, b in pieces) for pieces in layout)   # padding included\n'
    'measured = (held(flat_layout(unit_numels, 4)), held(dim0_layout(unit_shapes, 4)))',
    "Flat: one buffer cut into 4 equal pieces. Shard(0): each parameter's rows cut separately, ceil(rows "
    '/ 4) at a time, the last ranks taking what is left.',
    '# Flat: 40 elements divide by 4, so 10 each and no padding. Shard(0): fc1 has 5 rows, dealt 2, 2, 1, 0 (4 values a\n'
    '# row for the weight, 1 for the bias); fc2 has 3 rows, dealt 1, 1, 1, 0. Rank 3 holds nothing, and ranks 0-2 hold\n'
    '# exactly what they held at 3 ranks (the table above): per-parameter sharding of small tensors stops shrinking.\n'
    'prediction = ((10, 10, 10, 10), (2 * 4 + 2 + 1 * 4 + 1, 2 * 4 + 2 + 1 * 4 + 1, 1 * 4 + 1 + 1 * 4 + 1, 0))',
)

chapter.write("05_fsdp.ipynb")
