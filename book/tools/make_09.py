"""Writes book/09_tensor_parallel.ipynb (unexecuted): Chapter 9's cells, kept as code so the chapter can be reviewed
in diffs.

    python book/tools/make_09.py && jupyter nbconvert --to notebook --execute --inplace book/09_tensor_parallel.ipynb
"""
from chapter_cells import HIDDEN, SOLUTION, MACHINE, Chapter  # noqa: F401  (book/tools/chapter_cells.py)

chapter = Chapter()
md, code, exercise = chapter.md, chapter.code, chapter.exercise

md(r"""
# 9. Tensor parallelism: splitting a layer

Data parallelism in all its forms (Chapters 3–5) gives every GPU whole layers to compute. FSDP shards the
*storage* of a layer, but gathers it whole to compute, and keeps each layer's activations whole for its
micro-batch. When one layer's activations at the sequence length you need no longer fit, or when the global
batch has fewer sequences than you have GPUs, data parallelism has nothing left to split. The next step,
taken by Megatron-LM {cite}`shoeybi2019megatron` and described in the Ultra-Scale Playbook
{cite}`tazi2025playbook`, is to split each layer's matrices across GPUs: {term}`tensor parallelism` (TP).

By the end of the chapter you will be able to:
- split a linear layer by columns or by rows and say what each costs in communication;
- place Megatron's two conjugate operators, $f$ and $g$, in a transformer block and say why a block costs
  two all-reduces forward and two backward;
- read nanodist's column- and row-parallel layers, its split attention heads and its vocabulary-parallel loss,
  and check them against one process and against torch's `parallelize_module`;
- count the bytes one block sends and the activations it keeps, against the formulas, with and without
  {term}`sequence parallelism` (SP);
- put TP and data parallelism on a 2-D mesh, and keep dropout right across it;
- say when TP pays: not on a laptop's two cores, and where on a real cluster.

**The code:** [`nanodist/tp.py`](@REPOSITORY_URL@/blob/main/nanodist/tp.py), with the formulas in
[`nanodist/costmodel.py`](@REPOSITORY_URL@/blob/main/nanodist/costmodel.py) and the projections in
[`nanodist/scaling.py`](@REPOSITORY_URL@/blob/main/nanodist/scaling.py); **the lab:**
[`labs/lab09_tp.py`](@REPOSITORY_URL@/blob/main/labs/lab09_tp.py).
""")

code("""
import inspect

import matplotlib.pyplot as plt
import torch
from IPython.display import Markdown
from myst_nb import glue

import nanodist as nd
from nanodist import costmodel, plots, tp
from nanodist.exercises import check, compare, expect
from nanodist.results import Table, provenance
from nanodist.scaling import CLUSTERS, MODELS, best_strategy, project

MIB = 2**20


def caption(name, record):
    \"\"\"Glue a figure's provenance line (machine, backend, world size, torch, date) for the text below it.\"\"\"
    glue(name, Markdown(f"*{provenance(record)}*"), display=False)
""")

md(r"""
## Two ways to split a linear layer

A linear layer computes $Y = X W^\top$, with $X$ of shape (tokens, in) and $W$ of shape (out, in). Split $W$
over $n$ ranks in one of two ways:

- **by its rows** (output features): rank $r$ keeps $W_r$, computes $Y_r = X W_r^\top$, the $r$-th slice of
  $Y$'s columns, from the *whole* $X$. Nothing is sent. This is a **column-parallel** layer (the columns of
  $Y$ are split);
- **by its columns** (input features): rank $r$ keeps the columns $W_{:,r}$ and multiplies only its slice
  $X_r$ of $X$'s columns. Each product is a *partial sum* of $Y$: $Y = \sum_r X_r W_{:,r}^\top$. The ranks
  add them up with an all-reduce. This is a **row-parallel** layer.

(The names are Megatron's, who writes $Y = XA$ with $A = W^\top$: a column-parallel layer splits $A$'s columns,
which are $W$'s rows; a row-parallel one splits $A$'s rows, $W$'s columns.) In one process, with two "ranks" as
two slices:
""")

code(r"""
g = torch.Generator().manual_seed(0)
X, W = torch.randn(5, 6, generator=g), torch.randn(8, 6, generator=g)
Y = X @ W.T
column = torch.cat([X @ W_r.T for W_r in W.chunk(2, dim=0)], dim=1)                 # each rank: a slice of Y's columns
row = sum(X_r @ W_r.T for X_r, W_r in zip(X.chunk(2, dim=1), W.chunk(2, dim=1)))   # each rank: a partial sum of Y
assert torch.allclose(column, Y, atol=1e-6) and torch.allclose(row, Y, atol=1e-6)
print("column-parallel: the slices put side by side are Y:", torch.allclose(column, Y, atol=1e-6))
print("row-parallel:    the partial products added up are Y:", torch.allclose(row, Y, atol=1e-6))
""")

md(r"""
The trick that makes TP affordable is to **chain the two**. A column-parallel layer leaves each rank with a
slice of the features; an element-wise function (GELU) can run on a slice; and a row-parallel layer takes
exactly such a slice as its input. So the MLP, `fc` → GELU → `proj`, needs no communication between its two
matmuls and one all-reduce at its end. Attention splits the same way, by heads: `qkv` column-parallel (each
rank computes the queries, keys and values of its heads), attention runs head by head, and the output
projection is row-parallel.

## Megatron's f and g

Backward runs the same picture in reverse, and Megatron's paper names the two places where ranks meet
{cite}`shoeybi2019megatron`:

- $f$, before a column-parallel layer: **identity forward** (every rank has the whole $X$) and an
  **all-reduce backward** (each rank's slab contributes only a part of $\partial L/\partial X$);
- $g$, after a row-parallel layer: an **all-reduce forward** (the partial products) and **identity
  backward** (every rank needs the whole $\partial L/\partial Y$, and has it).

They are *conjugate*: each does in one direction what the other does in the other. A block (attention, then
MLP) therefore costs **two all-reduces forward and two backward**, each of the activations' size
$b \times s \times h$.
""")

code(r"""
fig, axes = plt.subplots(2, 1, figsize=(plots.COLUMN_IN, 6.0))
plots.tensor_parallel_block(sequence=False, ax=axes[0])
plots.tensor_parallel_block(sequence=True, ax=axes[1])
fig.tight_layout()
plots.show(fig)
""")

md(r"""
The second panel is sequence parallelism, which comes later in the chapter. In nanodist the two operators are
two small autograd functions, and the layers use them around a matmul on the local piece of the weight:
""")

code(r"""
for obj in (tp.CopyToTensorParallel, tp.ReduceFromTensorParallel):
    print(inspect.getsource(obj))
print(inspect.getsource(tp.ColumnParallelLinear.forward))
print(inspect.getsource(tp.RowParallelLinear.forward))
""")

md(r"""
The weights are `DTensor`s of their global shape, sharded on the group's device mesh: a column-parallel weight
is `Shard(0)`, a row-parallel one `Shard(1)` with its bias replicated. The arithmetic runs on `to_local()`, this
rank's piece, with nanodist's own collectives. The DTensors are there so that a checkpoint, the optimizer's
state and the global gradient norm see whole tensors: a TP = 2 checkpoint loads into one process
(`tests/test_trainer_mesh.py` resumes one bit for bit at TP = 2 and loads it at TP = 1).

Two parts of the course's GPT need care:

- **the fused `qkv` layer** holds $W_q$, $W_k$ and $W_v$ stacked. Cutting its rows in $n$ plain slabs would give
  rank 0, at TP = 2, all of $q$ and half of $k$. `ColumnParallelLinear(..., split=3)` cuts each of the three in $n$ and gives
  rank $r$ the stack $[q_r; k_r; v_r]$ (torch calls this placement `_StridedShard`), so the attention's
  `chunk(3)` finds this rank's heads. The attention infers its number of heads from the activations, so the
  model's code does not change;
- **the vocabulary.** The token embedding and the output layer (tied: one matrix) are the largest tensors of a
  model with a large vocabulary. `tensor_parallel(model, group, vocab=True)` splits them by vocabulary: an
  embedding lookup becomes $g$ over each rank's masked rows (every id lives on exactly one rank), the head is
  column-parallel, and `VocabParallelCrossEntropy` computes the loss from the split logits with three
  all-reduces of one number per position (the largest logit, the softmax's denominator, the target's logit),
  never gathering the $b \times s \times V$ logits. Its backward sends nothing.

## Proven: the same numbers as one process

Lab 9 splits the course's GPT over the first $n$ ranks of one launch, in four ways (TP; TP + SP; each with the
vocabulary split too), runs one forward and backward, gathers every gradient whole and compares it with the same
model in one process. It also splits the GPT's MLP with nanodist's layers and with torch's own
`parallelize_module` (`ColwiseParallel`, `RowwiseParallel`) and compares the two; and, with four ranks, it builds
a 2 × 2 mesh, which comes later in the chapter:
""")

code(r"""
lab = nd.launch("lab09_tp", nproc=4, echo=False, args=["--tp-sizes", "1", "2", "--no-progress"])
m = lab.results["metrics"]
caption("prov_lab", lab.results)
rows = m["equivalence"]
assert all(r["worst_gradient"] <= r["tolerance"] for r in rows), rows
assert all(abs(r["loss"] - r["loss_one_process"]) <= r["tolerance"] * r["loss_one_process"] for r in rows if "loss" in r)
split = max(r["worst_gradient"] for r in rows if r["tp"] > 1)
glue("worst_split", split, display=False)
glue("tol_margin", Markdown(f"{rows[0]['tolerance'] / split:.0f} times" if split > 0 else "far"), display=False)
Table({"ranks": r["tp"] * r.get("data", 1), "set-up": r["set-up"],
       "loss": round(r["loss"], 6) if "loss" in r else "", "one process": round(r.get("loss_one_process", 0), 6) or "",
       "worst gradient difference": f"{r['worst_gradient']:.1e}", "tolerance": f"{r['tolerance']:.0e}"} for r in rows)
""", MACHINE)

md(r"""
{glue:md}`prov_lab`

Every gradient agrees with one process to within a relative $10^{-5}$ of its tensor's largest value. Not
bit for bit: a row-parallel layer's all-reduce adds the partial products in another order than one matmul
does, and each of those sums rounds differently in fp32 (and the vocabulary-parallel loss computes its softmax
by its own formula: hence a difference even at TP = 1); the largest difference of a split model here was
{glue:text}`worst_split:.1e`, so the tolerance sits {glue:md}`tol_margin` above it. `tests/test_tp.py` plants an
error of $10^{-3}$ (one rank's slab of one weight $\times 1.001$) and checks that the same comparison catches it. The tests run the same comparison at TP = 1, 2
and 4, take three optimizer steps, and check that TP = 3 on a model with 4 heads stops with a message naming
the heads.

## What it sends: counted against the formula

`nanodist.record_traffic()` lists every collective the TP layers issue, with its size. The lab takes the
difference between a model of two blocks and one of one block, so what remains is one block's traffic, forward
and backward, and puts it beside `costmodel.tensor_parallel_traffic`, the formula:

$$
\text{TP, per block:}\quad 2 \times \text{all-reduce}(S)\ \text{forward} + 2 \times \text{all-reduce}(S)\ \text{backward},
\qquad S = b \times s \times h \times \text{bytes}
$$

On a ring each rank sends $2(n-1)/n$ of an all-reduce's size (Chapter 2).
""")

code(r"""
MIB = 2**20
tr = {(r["tp"], r["sequence_parallel"]): r for r in m["traffic"]}
assert all(r["equal"] for r in m["traffic"]) and tr[(1, False)]["counted"] == []
two = tr[(2, False)]
glue("act_kib", two["activation_bytes"] / 1024, display=False)
cfg = lab.results["config"]
glue("lab_shape", Markdown(f"$h$ = {nd.model.GPTConfig.preset(cfg['model']).n_embd}, and its batch of {cfg['batch']} "
                           f"sequences of {cfg['seq_len']} tokens"), display=False)
glue("tp2_block_mib", two["ring_bytes_counted"] / MIB, display=False)
Table({"phase": phase, "collective": kind, "bytes": nbytes, "counted in the run": count,
       "formula": dict(((p, k, b), c) for p, k, b, c in two["formula"]).get((phase, kind, nbytes), 0)}
      for phase, kind, nbytes, count in two["counted"])
""")

md(r"""
The lab's model has {glue:md}`lab_shape` makes $S$ = {glue:text}`act_kib:.0f` KiB of fp32 activations. At
TP = 2 one block sends {glue:text}`tp2_block_mib:.2f` MiB from each rank, every byte of it counted in the run and
equal to the formula's.
""")

chapter.predict(
    "9.1",
    "The same block at TP = 4 (four ranks, plain TP, the same batch): how many MiB does each rank send for one "
    "block, forward and backward? Write `prediction = <MiB>` (to 3 decimals), then run the cell after it: it "
    "launches the lab on 4 ranks and counts.",
    "prediction = ...   # MiB each rank sends for one block at TP = 4",
    "four = nd.launch(\"lab09_tp\", nproc=4, echo=False, args=[\"--parts\", \"traffic\", \"--tp-sizes\", \"4\", "
    "\"--no-progress\"])\n"
    "row = next(r for r in four.results[\"metrics\"][\"traffic\"] if not r[\"sequence_parallel\"])\n"
    "assert row[\"equal\"]\n"
    "measured = round(row[\"ring_bytes_counted\"] / MIB, 3)",
    "The size of each all-reduce does not depend on n; what a ring makes each rank send of it does (Chapter 2).",
    "# 4 all-reduces of S = batch x seq_len x n_embd x 4 bytes, each costing 2 (n - 1) / n = 1.5 of it per rank:\n"
    "run = four.results[\"config\"]\n"
    "S = run[\"batch\"] * run[\"seq_len\"] * nd.model.GPTConfig.preset(run[\"model\"]).n_embd * 4\n"
    "prediction = round(4 * 1.5 * S / 2**20, 3)   # 1.5 times TP = 2's: the same all-reduces, 3/4 of each x 2",
    rel_tol=0.01,
)

md(r"""
The all-reduces do not shrink as TP grows: every rank sends $2(n-1)/n$ of the block's activations (once their
size at TP = 2, 1.5 times at 4, approaching twice), four times over. That is the first reason TP stays inside a node, on NVLink, where a GPU's link is an order of
magnitude faster than across nodes.

## Activation memory, and sequence parallelism

What TP saves is memory. Each rank keeps $1/n$ of the block's weights, and of the activations that lie
*between* a column- and a row-parallel layer: $q$, $k$, $v$, the attention's output, the MLP's inner
activations. What it does not split are the activations outside that span: the two LayerNorms' inputs and the
inputs of `qkv` and `fc`, the same on every rank. `costmodel.activation_bytes` counts, for the course's GPT, what
one block saves for its backward, in units of $bsh$ values (Korthikanti et al.'s formula {cite}`korthikanti2022reducing`
for this model):

| saved for backward | one process | TP over $n$ | TP + SP over $n$ |
|---|---|---|---|
| LayerNorms' inputs, `qkv`'s and `fc`'s inputs | 4 | 4 | 4 / $n$ |
| $q$, $k$, $v$; attention's output; GELU's input; the MLP `proj`'s input (GELU's output) | 12 | 12 / $n$ | 12 / $n$ |

(Megatron's per-layer $34\,sbh + 5\,as^2b$ is in *bytes* of fp16: the same 16 values at 2 bytes each, plus two
1-byte dropout masks, plus, per head, the attention's $s \times s$ softmax output, its dropout mask and the
dropped-out result. This model has no dropout in the
lab, and the fused attention kernel keeps one number per row, its log-sum-exp, instead of the scores. Those small
terms, and each LayerNorm's mean and $1/\sigma$, are in the formula too.)

**Sequence parallelism** {cite}`korthikanti2022reducing` splits the rest along the sequence. Outside each
column-to-row span (from a row-parallel layer's output to the next column-parallel layer's input) each rank keeps
$s/n$ positions of the residual stream, and the LayerNorms and dropouts run on them.
$g$ becomes a *reduce-scatter* (sum the partial outputs and cut them along the sequence) and $f$ an
*all-gather* of the sequence before a column-parallel layer. A ring all-reduce is a reduce-scatter followed by
an all-gather, so the forward sends what TP sends. Backward sends two all-gathers more, one per
column-parallel layer: it keeps only its shard of the input for backward (the point of SP) and gathers it again
there for its weight's gradient. And a replicated parameter used on a shard of the positions (a LayerNorm's, a
row-parallel bias) gets only that shard's part of its gradient: nanodist passes each such parameter through an
$f$ of its own, whose backward all-reduces its gradient (Megatron sums them all in one go after the backward).
""")

code(r"""
print(inspect.getsource(tp.SequenceGatheredLinear))
""")

code(r"""
sp = tr[(2, True)]
glue("sp_over_tp", sp["ring_bytes_counted"] / two["ring_bytes_counted"], display=False)
Table({"phase": phase, "collective": kind, "bytes": nbytes, "counted in the run": count,
       "formula": dict(((p, k, b), c) for p, k, b, c in sp["formula"]).get((phase, kind, nbytes), 0)}
      for phase, kind, nbytes, count in sp["counted"])
""")

md(r"""
At TP = 2 with SP, one block sends {glue:text}`sp_over_tp:.2f` times what plain TP sends: the re-gather
backward (two of the four backward all-gathers), and the small all-reduces of the parameters' gradients (the
all-reduce row). What it buys is the
activations:
""")

code(r"""
mem = m["memory"]
# on a CPU every saved tensor is predictable (fp32, the fused attention kernel): equal to the byte; a GPU's
# attention kernel may keep a few more numbers per row (padding, its random state): within 2 %
exact = m["device"] == "cpu"
assert all(abs(max(r["measured_per_rank"]) - r["formula"]["total"]) <= (0 if exact else 0.02 * r["formula"]["total"])
           for r in mem), mem
one = next(r for r in mem if r["tp"] == 1)
glue("mem_tp1_mib", one["formula"]["total"] / MIB, display=False)
Table({"TP": r["tp"], "SP": r["sequence_parallel"], "measured per rank (bytes)": max(r["measured_per_rank"]),
       "formula (bytes)": int(r["formula"]["total"]), "of one process": f"{max(r['measured_per_rank']) / max(one['measured_per_rank']):.3f}"}
      for r in mem)
""")

code(r"""
plots.activation_memory(mem)
plt.title("one block's saved activations, per rank")
plots.show()
""")

md(r"""
Measured by autograd's saved-tensor hooks on block 0 (parameters left out), the bytes equal the formula's
exactly on a CPU, where the fused attention kernel and fp32 make every saved tensor predictable: one process
keeps {glue:text}`mem_tp1_mib:.2f` MiB for one block of the lab's batch.
""")

chapter.predict(
    "9.2",
    "At TP = 4 *without* sequence parallelism, what fraction of one process's saved activations does one block keep "
    "on each rank? Use the table's two rows of units ($bsh$), ignoring the small terms; write `prediction = <fraction>` "
    "(2 decimals), then run the cell after it (the lab on 4 ranks, TP = 1 and 4, the small terms included).",
    "prediction = ...   # TP = 4 without SP, as a fraction of one process",
    "four = nd.launch(\"lab09_tp\", nproc=4, echo=False, args=[\"--parts\", \"memory\", \"--tp-sizes\", \"1\", \"4\", "
    "\"--no-progress\"])\n"
    "kept = {r[\"tp\"]: max(r[\"measured_per_rank\"]) for r in four.results[\"metrics\"][\"memory\"] "
    "if not r[\"sequence_parallel\"]}\n"
    "measured = round(kept[4] / kept[1], 2)",
    "Which of the 16 units are split by TP, and which stay whole on every rank?",
    "# 4 units stay whole, 12 are split four ways: (4 + 12 / 4) / 16\n"
    "prediction = round((4 + 12 / 4) / 16, 2)   # 0.44: the replicated part is why SP exists",
    rel_tol=0.03,
)

md(r"""
## Dropout across the ranks

Dropout draws random masks, and TP changes which ranks must draw the *same* ones:

- where the activations are **replicated** (the residual stream without SP), every rank must draw the same
  mask, or their copies of the stream diverge;
- where a rank holds **its own slice** (its heads; with SP, its positions), each must draw its own, or the
  ranks' slices would be dropped in lockstep, which one process never does.

The model's generator stays in step on every rank (the labs seed it alike; data-parallel replicas then draw the
same masks on their different sequences, as in Megatron by default). Where a rank's slice is dropped,
`tp.ShardedRandom` takes one number from that shared generator and seeds, inside a fork of the generators, a
stream from it and the rank. The draw is part of the shared stream, so activation checkpointing's recompute,
which restores the generators, draws it again and finds the same masks:
""")

code(r"""
print(inspect.getsource(tp.ShardedRandom.__call__))
""")

md(r"""
`tests/test_tp.py` checks the three promises at TP = 2, with and without SP: the replicated logits are equal on
both ranks with dropout on, each rank's own stream differs from the other's, and a backward with activation
checkpointing gives exactly the gradients of one without.

## Two dimensions: data × tensor

TP over the GPUs of a node and data parallelism across nodes make a **2-D mesh**. nanodist arranges the world's
ranks row by row, the last dimension varying fastest, as torch's `init_device_mesh` does, so the tensor-parallel
groups are neighbours (one node) and each data group takes one rank of every tensor group:
""")

code(r"""
tp_size, data_size = 2, 2
Table({"rank": r, "data coordinate": r // tp_size, "tensor coordinate": r % tp_size,
       "its tensor group": [d * tp_size + t for t in range(tp_size) for d in [r // tp_size]],
       "its data group": [d * tp_size + r % tp_size for d in range(data_size)]} for r in range(tp_size * data_size))
""")

md(r"""
The 2 × 2 rows of the equivalence table above are this mesh: nanodist's TP splits every block on the tensor
dimension, each of the two data ranks takes half of the batch, and on the data dimension either torch's FSDP2
shards the parameters and averages the gradients, or nanodist's DDP averages them. What lets DDP do it is one
observation: a DTensor laid out on *another* dimension of the mesh is, on every rank of a data group, the same
piece of the same tensor. So DDP broadcasts, packs and averages its local piece as it would a plain tensor, hands
back a DTensor over the bucket's view, and takes the global norm for clipping from the DTensors' placements. Either way the gradients equal one process's on the whole
batch. `tests/test_trainer_mesh.py` trains all four with the Trainer (`Trainer(model, ..., mesh=mesh)`), and
FSDP2 × torch's own TP likewise. In a lab the mesh is one flag: `--tp 2` (and `--sequence-parallel`) makes the
world a mesh of world/2 data ranks × 2 tensor ranks, splits the model with `nd.tensor_parallel`, and averages
over the data dimension with the wrapper (`nanodist`, `nanodist-pg` or `fsdp2`; `tp` when every rank is in the
one tensor group):

```python
cfg = experiment.RunConfig.from_args(args).replace(tp=2, sequence_parallel=True)
run = experiment.build(cfg, data, nd.Group.world(), wrapper="nanodist")   # 4 ranks: DDP over 2 data x TP over 2
run.trainer.fit()
```

nanodist's FSDP and its sharded optimizers flatten parameters into shards of their own; given TP's DTensors they
stop with a message that says what to use instead. One limit comes from torch 2.13 itself: FSDP2 over nanodist's
head-by-head `qkv` is a stride within a shard that its `DTensor` cannot describe. It trains right, and
`nanodist.state.full_tensor` gathers it by hand (the table's FSDP2 rows), but `torch.distributed.checkpoint`
cannot write it, so nanodist refuses to checkpoint that one set-up, and says so; DDP × TP checkpoints as TP does.

## Step time: TP against DP, on this machine

The same global batch, trained three ways on two ranks: data parallelism (each rank half the sequences, one
gradient all-reduce per step), TP over both ranks (each rank all the sequences and half of every block's
matmuls), and TP + SP; the three take turns, step by step:
""")

code(r"""
timed = nd.launch("lab09_tp", nproc=2, echo=False, args=["--parts", "time", "--steps", "12", "--no-progress"])
t = timed.results["metrics"]["time"]
caption("prov_time", timed.results)
print("\n".join(line.strip() for line in timed.lines(0) if " ms " in line or line.strip().startswith(("ratio", "bytes", "collectives"))))
assert t["ratio_step_tp_vs_dp"] > 0 and t["ratio_step_tp_sp_vs_dp"] > 0
glue("ratio_tp_dp", t["ratio_step_tp_vs_dp"], display=False)
glue("ratio_sp_dp", t["ratio_step_tp_sp_vs_dp"], display=False)
glue("tp_verdict", Markdown("did not pay here: TP's step was the slower" if t["ratio_step_tp_vs_dp"] > 1 else
                            "paid here, which is unusual for CPU ranks: the machine had cores or bandwidth to spare"),
     display=False)
glue("sp_over_tp_step", t["ratio_step_tp_sp_vs_dp"] / t["ratio_step_tp_vs_dp"], display=False)
""", MACHINE)

code(r"""
sent, calls = t["bytes_per_step"], t["collectives_per_step"]  # bytes from the formulas; collectives counted
assert sent["tp"] > sent["dp"] and calls["tp_sp"] > calls["tp"] > calls["dp"]
glue("dp_kib", sent["dp"] / 1024, display=False)
glue("tp_kib", sent["tp"] / 1024, display=False)
glue("tp_over_dp_bytes", sent["tp"] / sent["dp"], display=False)
glue("sp_over_tp_bytes", sent["tp_sp"] / sent["tp"], display=False)
for key in ("dp", "tp", "tp_sp"):
    glue(f"calls_{key}", calls[key], display=False)
Table([{"set-up": "DP: the fp32 gradients, once a step", "bytes each rank sends per step": round(sent["dp"]),
        "collectives per step": calls["dp"]},
       {"set-up": "TP: 4 all-reduces of the activations per block", "bytes each rank sends per step": round(sent["tp"]),
        "collectives per step": calls["tp"]},
       {"set-up": "TP + SP", "bytes each rank sends per step": round(sent["tp_sp"]), "collectives per step": calls["tp_sp"]}])
""")

md(r"""
{glue:md}`prov_time`

Here TP's step took {glue:text}`ratio_tp_dp:.2f` times DP's, and TP + SP's {glue:text}`ratio_sp_dp:.2f` times:
TP {glue:md}`tp_verdict`. The table says why it should not pay on a laptop's cores, both set-ups going through
the same gloo process group: DP sends the model's gradients, {glue:text}`dp_kib:.0f` KiB from each rank, in
{glue:text}`calls_dp` collectives a step (its gradient bucket and DDP's few control numbers), as the backward
ends; TP sends the activations four times a block, {glue:text}`tp_kib:.0f` KiB, {glue:text}`tp_over_dp_bytes:.1f`
times as much, in {glue:text}`calls_tp` collectives, each in the middle of the computation, which waits for it.
TP + SP sends only {glue:text}`sp_over_tp_bytes:.2f` times TP's bytes, but in {glue:text}`calls_tp_sp`
collectives, and its step took {glue:text}`sp_over_tp_step:.1f` times TP's: between two processes here each
collective's fixed cost weighs more than its bytes. What TP bought, less memory per rank, a small model on a
laptop does not need.

## Where TP pays: Chapter 8's projections on a 2-D mesh

`scaling.project(..., tp=n, sequence_parallel=True)` puts TP into Chapter 8's model of a step: the data-parallel
strategy runs over $N/n$ ranks on $1/n$ of the parameters, each GPU computes $1/n$ of its rank's FLOPs, keeps the
activations `Transformer.activation_bytes(..., tp=n)` counts, and waits for TP's collectives on the node's link
(all of them exposed: this projection does not overlap them). Every number below is a **projection**, with
Chapter 8's hand-picked example values $e$ = 0.38 and $\rho$ = 1, the same at every TP size (a GPU's $1/n$-wide
matmuls may run less efficiently; the projection does not say). Llama 3 70B with FSDP on 512 H100s (DGX nodes of
8, InfiniBand), sequences of 8,192 tokens, a global batch of 1,024 of them (two per GPU, in micro-batches of one):
""")

code(r"""
llama, dgx = MODELS["Llama 3 70B"], CLUSTERS["dgx-h100-ib"]
rows = [project(llama, dgx, 512, "fsdp", 1, 2 * n, 0.38, 1.0, recompute=recompute, tp=n, sequence_parallel=n > 1)
        for n in (1, 2, 4, 8) for recompute in (False, True)]
plain = [p for p in rows if p.tp == 1 and p.recompute][0]
best = max((p for p in rows if p.fits), key=lambda p: p.tokens_per_s_per_gpu)
tp8 = [p for p in rows if p.tp == 8 and not p.recompute][0]
assert not rows[0].fits and best.tp > 1 and not best.recompute and tp8.tokens_per_s_per_gpu < best.tokens_per_s_per_gpu
glue("tp8_tps", tp8.tokens_per_s_per_gpu, display=False)
assert tp8.tokens_per_s_per_gpu > plain.tokens_per_s_per_gpu
glue("fsdp_only_gb", rows[0].memory_GB, display=False)
glue("fsdp_recompute_tps", plain.tokens_per_s_per_gpu, display=False)
glue("best_tp", best.tp, display=False)
glue("best_tps", best.tokens_per_s_per_gpu, display=False)
glue("best_gain", 100 * (best.tokens_per_s_per_gpu / plain.tokens_per_s_per_gpu - 1), display=False)
assert plain.fits  # FSDP alone fits only with recomputation
Table({**p.row(), "TP comm (s)": round(p.tp_comm_s, 3)} for p in rows)
""")

md(r"""
With FSDP alone a sequence of 8,192 tokens needs {glue:text}`fsdp_only_gb:.0f` GB of activations and states per GPU:
it fits (by this count, with no headroom for the allocator) only by recomputing every layer in the backward, a
third more compute
({glue:text}`fsdp_recompute_tps:.0f` tokens/s per GPU). TP = {glue:text}`best_tp` with SP divides the
activations and fits without recomputing: {glue:text}`best_tps:.0f` tokens/s per GPU, {glue:text}`best_gain:.0f` %
more, after paying for its collectives on NVLink. TP = 8 frees memory that is no longer needed and pays more for
collectives: {glue:text}`tp8_tps:.0f` tokens/s per GPU, above FSDP with recomputation but below TP =
{glue:text}`best_tp`.

The second place TP pays is a global batch with fewer sequences than GPUs. Data parallelism cannot give a
GPU less than one sequence; a data-parallel rank of $n$ GPUs can share one:
""")

code(r"""
rows = []
for sequences in (2048, 1024, 512):
    dp_only = best_strategy(llama, dgx, 1024, sequences * llama.seq_len, 0.38, 1.0)
    with_tp = best_strategy(llama, dgx, 1024, sequences * llama.seq_len, 0.38, 1.0, tp_sizes=(1, 2, 4, 8))
    rows.append({"global batch (sequences)": sequences,
                 "data parallelism only": dp_only.row()["strategy"] + (" + recompute" if dp_only.recompute else "")
                 if dp_only else "none: fewer sequences than GPUs",
                 "tokens/s/GPU": round(dp_only.tokens_per_s_per_gpu) if dp_only else "",
                 "with TP": with_tp.row()["strategy"] + (" + recompute" if with_tp.recompute else ""),
                 "tokens/s/GPU ": round(with_tp.tokens_per_s_per_gpu)})
assert rows[-1]["data parallelism only"].startswith("none")
assert len({r["with TP"] for r in rows}) == 1  # one set-up for every batch: the text says so
Table(rows)
""")

md(r"""
On 1,024 GPUs a batch of 512 sequences leaves data parallelism with nothing to give half of the GPUs; with TP a
data-parallel rank is several GPUs and the batch spreads over all of them. (For this model the TP column is the
same set-up at every batch: memory chose it already.) The largest published runs combine it so, for instance
Llama 3's 405B {cite}`grattafiori2024llama3`: TP inside the node (its 8 GPUs, on NVLink), pipeline parallelism
across nodes (the next chapter), data parallelism over the rest.

## Exercises
""")

exercise(
    "9.3",
    "A model with $h$ = 4,096 trains with micro-batches of one sequence of 4,096 tokens, activations in bf16, at "
    "TP = 8 without SP. How many bytes does each GPU send for one block's forward *and* backward on a ring? "
    "(An integer; `costmodel` has everything you need.)",
    "round(costmodel.ring_bytes(costmodel.tensor_parallel_traffic(1, 4096, 4096, 8, act_bytes=2), 8))",
    "answer = ...  # bytes each GPU sends for one block",
    "How many all-reduces does a block make in the two directions together, of what size, and what does a ring "
    "make each rank send of one?",
    "# 4 all-reduces of S = 1 x 4096 x 4096 x 2 bytes, each 2 (8 - 1) / 8 of S per GPU\n"
    "answer = round(4 * 2 * 7 / 8 * 4096 * 4096 * 2)   # about 235 MB for every block of every micro-batch",
)

exercise(
    "9.4",
    "Sequence parallelism makes some replicated parameters' gradients need an all-reduce, where plain TP needs none; "
    "nanodist gives each such parameter an all-reduce of its own. A Llama-style block has RMSNorms (a weight, no "
    "bias) and linear layers without biases. How many such all-reduces does one of its blocks add per backward "
    "under SP? (An integer.)",
    "costmodel.tensor_parallel_traffic(1, 8, 8, 2, sequence=True, bias=False)[('backward', 'all-reduce', 8 * 4)]",
    "answer = ...  # all-reduces of replicated parameters' gradients, one block, one backward",
    "Which of the block's parameters are replicated, and used on only this rank's positions under SP?",
    "answer = 2   # the two norms' weights; no biases to add after the reduce-scatters",
)

exercise(
    "9.5",
    "With the projections above (Llama 3 70B, FSDP, 512 H100s, a global batch of 1,024 sequences, "
    "$e$ = 0.38, $\\rho$ = 1), what is the smallest TP size among 1, 2, 4 and 8 at which the model fits "
    "*without* recomputation and *without* sequence parallelism? (An integer.)",
    "next(n for n in (1, 2, 4, 8) if project(llama, dgx, 512, 'fsdp', 1, 2 * n, 0.38, 1.0, tp=n).fits)",
    "answer = ...  # the TP size",
    "Without SP, 8 h values per token and layer stay whole on every GPU (the norms' and the layers' inputs): "
    "estimate them for 80 layers of 8,192 tokens at 2 bytes, and what is left of 80 GB for the rest.",
    "answer = next(n for n in (1, 2, 4, 8) if project(llama, dgx, 512, \"fsdp\", 1, 2 * n, 0.38, 1.0, tp=n).fits)",
)

md(r"""
## Summary

- A linear layer splits by output features (column-parallel: no communication) or by input features
  (row-parallel: an all-reduce of partial products). Chained, column then row, a transformer's MLP and
  attention each cost one all-reduce forward ($g$) and one backward ($f$): two plus two per block, of the
  activations' size, whatever the TP size. Lab 9 counted them in the run, equal to the formula.
- nanodist's layers keep their weights as DTensors of the global shape (checkpoints and norms see whole
  tensors) and compute on the local pieces; the fused `qkv` is split head by head, and the vocabulary can be
  split with a loss that never gathers the logits. They equal one process and torch's `parallelize_module` at
  TP = 1, 2 and 4, within a stated $10^{-5}$ that a planted $10^{-3}$ error fails.
- TP divides the weights and the activations between its layers, but not the norms' and the layers' inputs;
  sequence parallelism divides those along the sequence, for two more all-gathers in the backward and a small
  all-reduce per replicated parameter. The bytes sent and (on a CPU) the activations kept, counted in the run,
  equal the formulas' to the byte.
- Dropout: the same masks where the activations are replicated, a rank's own where they are split, and
  recomputable either way.
- On a laptop TP {glue:md}`tp_verdict` ({glue:text}`ratio_tp_dp:.2f` times DP's step): it sends the activations
  four times a block. It pays inside a fast node, for models whose activations do not fit or whose global batch
  has fewer sequences than the GPUs: the 2-D mesh, TP inside the node and data parallelism across nodes.
""")

chapter.write("09_tensor_parallel.ipynb")
