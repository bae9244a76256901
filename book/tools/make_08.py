"""Writes book/08_scaling.ipynb (unexecuted): Chapter 8's cells, kept as code so the chapter can be reviewed in diffs.

    python book/tools/make_08.py && jupyter nbconvert --to notebook --execute --inplace book/08_scaling.ipynb
"""
from chapter_cells import HIDDEN, SOLUTION, MACHINE, Chapter  # noqa: F401  (book/tools/chapter_cells.py)

chapter = Chapter()
md, code, exercise = chapter.md, chapter.code, chapter.exercise

md(r"""
# 8. Scaling: from your laptop to 1,024 GPUs

Every chapter so far measured one small machine. The question a reader brings to a real cluster is
different: *what will this do on 64 GPUs, or 1,024, and which strategy should I use?* This chapter answers
it with a model of one training step that you can check: it is built from the formulas of Chapters 2–5,
its parameters come from places you can name, and it is judged against measurements someone else
published, which it never saw while its parameters were set.

By the end of the chapter you will be able to:
- take a training step apart into compute, communication and the part of the communication that hides
  under the backward pass, for {term}`DDP`, {term}`ZeRO`-1/2 and {term}`FSDP`;
- say where each number of a projection comes from: a datasheet, a published measurement, or a run of
  your own;
- calibrate a projection on some measured runs and judge it on others, and read the residuals;
- compare ring, tree and hierarchical all-reduce by what each call pays in latency, and say when it matters;
- fit Amdahl's law to your own strong-scaling runs and say what its serial fraction means;
- say when communication hides behind compute, from the ratio of a GPU's FLOP/s to its link's bandwidth,
  and find that point on your own machine;
- choose a strategy for a model on a cluster, and say what would change the choice.

Every number about a GPU cluster in this chapter is a **projection** unless a table says *measured*
and names who measured it.

**The code:** [`nanodist/scaling.py`](@REPOSITORY_URL@/blob/main/nanodist/scaling.py) on [`nanodist/costmodel.py`](@REPOSITORY_URL@/blob/main/nanodist/costmodel.py) and [`nanodist/memory.py`](@REPOSITORY_URL@/blob/main/nanodist/memory.py); **the labs:** [`labs/lab03_ddp.py`](@REPOSITORY_URL@/blob/main/labs/lab03_ddp.py) with `--worlds`, `--micro-batches` and `--timeline`, [`labs/lab05_fsdp.py`](@REPOSITORY_URL@/blob/main/labs/lab05_fsdp.py) with `--worlds`.
""")

code("""
import dataclasses
import inspect
import math

import matplotlib.pyplot as plt
from IPython.display import Markdown
from myst_nb import glue

import nanodist as nd
from nanodist import costmodel, plots, scaling
from nanodist.exercises import check, compare, expect
from nanodist.results import Table, hardware_fingerprint, load_all, provenance
from nanodist.scaling import CLUSTERS, GPUS, MODELS, calibrate, project, published


def caption(name, record):
    \"\"\"Glue a figure's provenance line (machine, backend, world size, torch, date) for the text below it.\"\"\"
    glue(name, Markdown(f"*{provenance(record)}*"), display=False)
""")

md(r"""
## One step, taken apart

A data-parallel step on $N$ GPUs does three things: each GPU computes the forward and backward pass of its
share of the batch, the GPUs exchange gradients (and, for ZeRO and FSDP, parameters), and each updates
its weights. `nanodist.scaling.project` puts a number on each:

$$
t_\text{compute} = \frac{\text{tokens per GPU per step} \times \text{FLOPs per token}}{\text{peak FLOP/s} \times e},
\qquad
t_\text{comm} = \sum_\text{collectives} \frac{\text{busbw factor} \times \text{bytes}}{\text{bus bandwidth}}
$$

$$
t_\text{update} = \frac{30 \times \text{parameters the GPU updates}}{\text{HBM bandwidth}},
\qquad
t_\text{step} = t_\text{compute} + t_\text{update} + t_\text{comm} - \min\left(\rho \times \text{window},\; t_\text{hideable}\right)
$$

- FLOPs per token are Chapter 3's $6 \times$ (weights in matmuls) plus attention's $12 L h s$;
- the collectives and their bytes are Chapter 4's and 5's: DDP all-reduces the gradients; ZeRO-1/2
  reduce-scatter them and all-gather the updated parameters; FSDP all-gathers the parameters for the forward
  and again for the backward of every {term}`micro-batch`, and reduce-scatters the gradients; the busbw factor is
  Chapter 2's, $2(N-1)/N$ for an all-reduce and $(N-1)/N$ for the others;
- $e$, the **compute efficiency**, is the fraction of the peak the model's FLOPs reach when nothing waits for
  the network: no datasheet gives it;
- the **window** is the compute that communication can run under: for DDP and ZeRO, the backward of the
  last micro-batch (two thirds of its compute: earlier micro-batches do not synchronise, Chapter 3's
  `no_sync`), for FSDP the whole step (it {term}`prefetch`es); ZeRO's all-gather after the update never hides;
- $\rho$, the **overlap**, is the fraction of that window the network really gets (0: none, 1: all of it);
- the **update** is bound by memory, not arithmetic: a fused AdamW with fp32 master weights reads the weight,
  the gradient and two moments (16 bytes a parameter) and writes the weight, the moments and the bf16 copy (14),
  for every parameter under DDP and for its $1/N$ shard under ZeRO and FSDP.

Here is one projection taken apart: the Ultra-Scale Playbook's 1-billion-parameter model {cite}`tazi2025playbook`
in DDP on 64 H100s, with $e = 0.38$ and $\rho = 1$ chosen by hand for the example.
""")

code(r"""
one_b = MODELS["Playbook 1B"]
p = project(one_b, CLUSTERS["dgx-h100-ib"], gpus=64, strategy="ddp", micro_batch=1, grad_accum=4,
            compute_efficiency=0.38, overlap=1.0)
Table([
    {"quantity": "parameters", "value": f"{one_b.params / 1e9:.3f} B"},
    {"quantity": "FLOPs per token", "value": f"{one_b.flops_per_token() / 1e9:.2f} G"},
    {"quantity": "tokens per GPU per step", "value": p.tokens_per_gpu_step},
    {"quantity": "compute (s)", "value": round(p.compute_s, 3)},
    {"quantity": "AdamW update (s)", "value": round(p.optimizer_s, 3)},
    {"quantity": "gradient all-reduce (s), all of it", "value": round(p.comm_s, 3)},
    {"quantity": "window: last micro-batch's backward (s)", "value": round(p.compute_s / 4 * 2 / 3, 3)},
    {"quantity": "exposed communication (s)", "value": round(p.exposed_comm_s, 3)},
    {"quantity": "step (s)", "value": round(p.step_s, 3)},
    {"quantity": "tokens/s per GPU", "value": round(p.tokens_per_s_per_gpu)},
    {"quantity": "MFU", "value": f"{100 * p.mfu:.1f} %"},
    {"quantity": "memory per GPU (GB)", "value": round(p.memory_GB, 1)},
])
""")

md(r"""
All of it is arithmetic you can redo by hand (`tests/test_scaling.py` does, for set-ups this chapter does
not show). The hard part is not the arithmetic: it is the four numbers it cannot do without, the peak,
the bandwidths, $e$ and $\rho$.

## Where the numbers come from

A projection is only as good as its inputs, so each one carries its source. The GPUs' peaks and the
links' bandwidths come from datasheets and from measurements their makers published:
""")

code(r"""
Table([{"GPU": g.name, "peak bf16 (TFLOP/s)": g.peak_flops / 1e12, "memory (GB)": round(g.memory_GB, 1),
        "HBM (TB/s)": g.hbm_GBps / 1e3, "source": g.source} for g in GPUS.values()])
""")

code(r"""
links = {c.intra.name: c.intra for c in CLUSTERS.values()} | {c.inter.name: c.inter for c in CLUSTERS.values()}
Table([{"link": link.name, "bus bandwidth (GB/s)": round(link.busbw_GBps, 1), "source": link.source}
       for link in links.values()])
""")

md(r"""
A link's *{term}`bus bandwidth`* is what nccl-tests reports as `busbw`: the rate at which a ring collective moves
data through each GPU's link (Chapter 2). It is below the line rate ({term}`NVLink`'s 450 GB/s each way gives about
370 GB/s of ring bus bandwidth: protocol overhead). Across nodes with one network card per GPU, NCCL runs
one ring (a *channel*) through each card, so the eight rings of a node cross between nodes side by side
and eight 400 Gb/s cards give about eight times 46 GB/s. One number in the table is an assumption, and says so: a PCIe-only box's ring
bandwidth.

$e$ and $\rho$ have no datasheet. They are properties of a software stack on a machine: kernels, fusion,
how the gradient buckets are scheduled. So they are **calibrated**: set from measured runs. The rule that
makes a check honest is that the runs a projection is judged on are never the runs it was calibrated on.

## Checked against published measurements

### The Ultra-Scale Playbook's data-parallel benchmark

The Playbook's figure *Throughput Scaling with Data Parallelism* trains its 1B model with pure data
parallelism on nodes of 8 H100s, holding the global batch fixed. Its interactive benchmark data holds the
set-up of every bar (micro-batch and accumulation) and three more pure-DP runs of the same model that are not
in the figure. Those three are the calibration rows; the six bars are judged.
""")

code(r"""
pb = published("playbook_dp")
print(pb.about)
print("source:", pb.citation)
print("model:", pb.model)
print("settings:", pb.settings)
Table({"nodes": g // 8, "GPUs": g, "micro-batch x accumulation": f"{mb} x {ga}", "measured tokens/s/GPU": round(tok),
       "role": role} for role, rows in (("calibration", pb.calibration), ("judged", pb.judged))
      for g, mb, ga, tok, *_ in rows)
""")

md(r"""
The network is the Playbook's own measurement of its cluster: all-reduce bandwidth at 256 MB for 1 to 64
nodes (NVLink inside a node, AWS EFA across). It is not a datasheet figure, and it matters, as the end of
this section shows.
""")

code(r"""
Table({"nodes": n, "GPUs": 8 * n, "all-reduce bus bandwidth (GB/s), measured": bw} for n, bw in pb.cluster.by_nodes)
""")

md(r"""
Calibrating takes the calibration row whose communication is the smallest share of its step (the first
line below says which, and how small) to set $e$, and tries every $\rho$ from 0 to 1 on all three rows:
""")

code(r"""
cal = calibrate(pb.model, pb.cluster, pb.strategy, pb.calibration)
print(cal.how)
print(f"compute efficiency e = {cal.compute_efficiency:.3f}, overlap rho = {cal.overlap:.2f}")
for g, mb, ga, tok, *_ in pb.calibration:
    q = project(pb.model, pb.cluster, g, pb.strategy, mb, ga, cal.compute_efficiency, cal.overlap)
    print(f"  calibration row {g:>3} GPUs, {mb} x {ga:>2}: measured {tok:>6}, projected {q.tokens_per_s_per_gpu:7.0f} "
          f"({100 * (q.tokens_per_s_per_gpu / tok - 1):+.0f} %)")
glue("pb_e", cal.compute_efficiency, display=False)
glue("pb_rho", cal.overlap, display=False)
odd = max(pb.calibration, key=lambda r: abs(math.log(project(pb.model, pb.cluster, r[0], "ddp", r[1], r[2],
                                                             cal.compute_efficiency, cal.overlap).tokens_per_s_per_gpu / r[3])))
glue("pb_odd", Markdown(f"{odd[0]} GPUs with micro-batches of {odd[1]}"), display=False)
glue("pb_odd_ratio", project(pb.model, pb.cluster, odd[0], "ddp", odd[1], odd[2], cal.compute_efficiency,
                             cal.overlap).tokens_per_s_per_gpu / odd[3], display=False)
""")

md(r"""
$\rho$ comes out {glue:text}`pb_rho:.2f`: on that cluster and stack, the gradient all-reduce cost its full
measured time. What the rows cannot say is why: full overlap with about a third less bandwidth than the
Playbook measured (it measured with 256 MB messages; the gradient buckets are 25 MiB, and small messages
move slower) fits them about as well. $\rho$ and the bandwidth are measured together here, not apart. One calibration row, {glue:md}`pb_odd`, is {glue:text}`pb_odd_ratio:.1f` times
slower than the projection: the model cannot explain it, and no setting of $e$ or $\rho$ would without
spoiling the others.

Now the six bars, projected with these two numbers fixed. Two caveats before reading the residuals. The bars
are the Playbook's best run at each node count, and the calibration rows are runs that lost to them. And
two bars share their number of GPUs and tokens per GPU per step with a calibration row (8 GPUs; 128 GPUs),
so they test the model less than the other four do.
""")

code(r"""
judged = scaling.check(pb.model, pb.cluster, pb.strategy, pb.judged, cal)
assert all(r["within"] for r in judged), judged
worst = max(judged, key=lambda r: abs(r["residual %"]))
glue("pb_worst", Markdown(f"{worst['residual %']:+.1f} % at {worst['GPUs']} GPUs"), display=False)
last = project(pb.model, pb.cluster, 256, "ddp", 1, 1, cal.compute_efficiency, cal.overlap)
glue("pb_last", Markdown(f"each GPU computes one sequence ({last.compute_s:.2f} s) and then waits for an all-reduce "
                         f"of {last.collectives['all_reduce'] / 1e9:.1f} GB of fp32 gradients, of which each link "
                         f"carries almost twice as much, 2(N-1)/N, at {last.link.busbw_GBps:.0f} GB/s of bus "
                         f"bandwidth ({last.comm_s:.2f} s)"), display=False)
Table(judged)
""")

code(r"""
fig, ax = plt.subplots(figsize=(6.4, 3.2))
gpus = [r["GPUs"] for r in judged]
ax.plot(gpus, [r["measured tokens/s/GPU"] for r in judged], "o-", color=plots.PALETTE[0], label="measured (Playbook)")
ax.plot(gpus, [r["projected"] for r in judged], "s--", color=plots.PALETTE[1], label="projected (calibrated on other runs)")
ax.fill_between(gpus, [0.8 * r["measured tokens/s/GPU"] for r in judged], [1.2 * r["measured tokens/s/GPU"] for r in judged],
                color=plots.PALETTE[0], alpha=0.12, label="±20 % of measured")
ax.set(xscale="log", xlabel="GPUs (8 per node)", ylabel="tokens/s per GPU", ylim=(0, None),
       title="Playbook 1B, pure data parallelism")
ax.set_xticks(gpus, [str(g) for g in gpus])
ax.spines[["top", "right"]].set_visible(False)
plots.legend_below(ax)
plots.show(fig)
""")

md(r"""
Every bar is within ±20 %, the worst {glue:md}`pb_worst`. The fall in throughput is the network, met as the
accumulation shrinks from 16 micro-batches a step to 1 at a fixed global batch: at 256 GPUs {glue:md}`pb_last`.

Now the same projection with the network's *datasheet* rate instead of the Playbook's measurement: a
p5.48xlarge node has 3,200 Gb/s of EFA, 400 GB/s, about what NVLink gives. Same calibration rows, same
rule:
""")

code(r"""
datasheet = scaling.Cluster("p5 datasheet: EFA 3,200 Gb/s", GPUS["H100 SXM"], 8, pb.cluster.intra,
                            scaling.Link("EFA, 400 GB/s", 400.0, source="AWS p5.48xlarge: 3,200 Gbps EFA"))
cal_ds = calibrate(pb.model, datasheet, pb.strategy, pb.calibration)
ds = scaling.check(pb.model, datasheet, pb.strategy, pb.judged, cal_ds)
assert not all(r["within"] for r in ds)
glue("ds_missed", Markdown(", ".join(f"{r['residual %']:+.0f} % at {r['GPUs']} GPUs" for r in ds if not r["within"])),
     display=False)
Table({"GPUs": a["GPUs"], "measured": a["measured tokens/s/GPU"], "measured link: projected": a["projected"],
       "residual %": a["residual %"], "datasheet link: projected": b["projected"], "residual % ": b["residual %"]}
      for a, b in zip(judged, ds))
""")

md(r"""
With the datasheet the projection misses: {glue:md}`ds_missed`. EFA's measured all-reduce bandwidth falls
with the number of nodes (the table above), and a datasheet says nothing of that. **Measure your network** (nccl-tests, or Lab 2 on yours) before you trust a
projection across nodes.

What the projection does not hold: the memory. The Playbook's benchmark data gives each run's memory per
GPU; the formula (model states plus activations and logits) comes out lower:
""")

code(r"""
mem = [{"GPUs": g, "micro-batch": mb, "measured (GB)": m,
        "projected (GB)": round(project(pb.model, pb.cluster, g, "ddp", mb, ga, cal.compute_efficiency, 0.0).memory_GB, 1)}
       for g, mb, ga, tok, mfu, m in pb.judged]
short = [1 - r["projected (GB)"] / r["measured (GB)"] for r in mem]
assert all(s > 0 for s in short)
glue("mem_short", Markdown(f"{100 * min(short):.0f} to {100 * max(short):.0f} %"), display=False)
Table(mem)
""")

md(r"""
Short by {glue:md}`mem_short`. The formula counts the model states (18 bytes a parameter here: bf16 weights, fp32
gradients, AdamW's fp32 master copy and moments), each layer's activations as `Transformer.activation_bytes`
lists them, and the loss's logits; what it leaves out is what a real stack adds on top, the {term}`bf16`
gradients next to their fp32 accumulation, DDP's buckets, the allocator's fragmentation. Memory projections
are a floor: leave room above them.

### torchtitan's FSDP at 8 and 128 GPUs

The second point set: torchtitan's published table for Llama 3.1 8B with FSDP on 8 and on 128 H100s (96 GB
parts, 400 Gb/s per GPU across hosts), local batch 2 sequences of 8,192 tokens, eager mode
{cite}`liang2025torchtitan`. Its one calibration row (8 GPUs) cannot tell $\rho$: one row fits any $\rho$, by
trading it against $e$. So both ends are calibrated and checked:
""")

code(r"""
tt = published("torchtitan_fsdp")
print(tt.about)
rows = []
for overlap in (0.0, 1.0):
    c = calibrate(tt.model, tt.cluster, tt.strategy, tt.calibration, overlap=overlap)
    for r in scaling.check(tt.model, tt.cluster, tt.strategy, tt.judged, c):
        rows.append({"overlap": overlap, "e": round(c.compute_efficiency, 3), **r})
assert all(r["within"] for r in rows)
glue("tt_worst", max(abs(r["residual %"]) for r in rows), display=False)
Table(rows)
""")

md(r"""
Within {glue:text}`tt_worst:.1f` % either way. This check is weaker than the first: the network across hosts is nearly
as fast as NVLink inside one, so the projection barely changes from 8 GPUs to 128, and what the check confirms
is that at 16,384 tokens per GPU per step an 8B model's FSDP traffic (8 bytes a parameter: two bf16
all-gathers and an fp32 reduce-scatter) is a small fraction of the step even with no overlap at all. That is
the lesson the two point sets share: what decides is the tokens each GPU computes between synchronisations,
against what its network moves in that time.

### Latency: ring, tree and hierarchical all-reduce

Both checks count bandwidth only. Every collective call also pays a latency before its first byte counts, and
a gradient all-reduce is many calls: DDP sends buckets of 25 MiB (torch's default), {glue:text}`pb_buckets` of them for
the 1B model's fp32 gradients. How much latency a call pays depends on the algorithm. NCCL, the library under
PyTorch on NVIDIA GPUs, keeps a model of it to choose an algorithm per call (its `tuning.cc`; the figures here are
from a 2.19-era version, protocol *Simple*, the one large messages use, and they change between versions), and
`scaling.Latency` holds it:
""")

code(r"""
dgx = dataclasses.replace(CLUSTERS["dgx-h100-ib"], latency=scaling.NCCL_NVLINK)
lat = dgx.latency
print(lat.source)
BUCKET = 25 * 2**20  # torch DDP's bucket_cap_mb=25 (MiB)
glue("pb_buckets", math.ceil(4 * MODELS["Playbook 1B"].params / BUCKET), display=False)
for name, value in (("lat_base", lat.ring_base_s), ("lat_intra", lat.ring_intra_s), ("lat_inter", lat.ring_inter_s),
                    ("lat_tree", lat.tree_intra_s)):
    glue(name, 1e6 * value, display=False)
glue("gpus_per_node", dgx.gpus_per_node, display=False)
Table([{"latency": "ring: base, per call", "µs": 1e6 * lat.ring_base_s},
       {"latency": "ring: a hop inside a node (NVLink)", "µs": 1e6 * lat.ring_intra_s},
       {"latency": "ring: a hop across nodes (network)", "µs": 1e6 * lat.ring_inter_s},
       {"latency": "tree: a hop, inside or across", "µs": 1e6 * lat.tree_intra_s}])
""")

md(r"""
- a **ring** all-reduce on $N$ GPUs takes $2(N-1)$ steps, each one hop along the ring; inside a node a hop costs
  {glue:text}`lat_intra:.1f` µs over {term}`NVLink`, across nodes {glue:text}`lat_inter:.1f` µs, and the ring crosses
  between nodes $2 \times$ nodes times;
- a **tree** (NCCL's double binary tree) reduces up a tree and broadcasts down it: $2 \times$ ((GPUs per node
  $- 1$) hops inside a node $+ \log_2$(nodes) hops across), at {glue:text}`lat_tree:.0f` µs a hop;
- a **hierarchical** all-reduce reduce-scatters inside each node, all-reduces each GPU's shard across nodes (the
  {glue:text}`gpus_per_node` rings of a node side by side) and all-gathers inside the node again: $2(g-1)$ hops inside
  and $2(n-1)$ across, each stage paying a ring's base latency ({glue:text}`lat_base:.1f` µs).

Ring and tree move about $2S$ bytes through every GPU's link; the hierarchical one moves as much across nodes and
pays its NVLink stages on top, as this model does not overlap them. In latency they differ a lot. A projection, for
one call on the DGX cluster above:
""")

code(r"""
calls, fastest = [], {}
for gpus in (8, 64, 256, 1024):
    for size in (BUCKET, 1e9):
        row = {"GPUs": gpus, "message": "25 MiB" if size == BUCKET else f"{size / 1e9:g} GB"}
        for algo in scaling.ALL_REDUCE_ALGORITHMS:
            t = dgx.all_reduce_time(size, gpus, algo)
            row[f"{algo}: latency (ms)"] = round(1e3 * t["latency_s"], 3)
            row[f"{algo} (ms)"] = round(1e3 * t["s"], 2)
        fastest[gpus, size] = row["fastest"] = min(scaling.ALL_REDUCE_ALGORITHMS,
                                                   key=lambda a: dgx.all_reduce_time(size, gpus, a)["s"])
        calls.append(row)
assert fastest[8, BUCKET] == "ring" and fastest[1024, BUCKET] == "tree"
ring_1024 = dgx.all_reduce_latency(1024, "ring")
glue("ring_1024_ms", 1e3 * ring_1024, display=False)
glue("tree_1024_ms", 1e3 * dgx.all_reduce_latency(1024, "tree"), display=False)
glue("bucket_1024_share", 100 * ring_1024 / dgx.all_reduce_time(BUCKET, 1024, "ring")["s"], display=False)
glue("ring_1gb_share", 100 * ring_1024 / dgx.all_reduce_time(1e9, 1024, "ring")["s"], display=False)
hier_64 = dgx.all_reduce_time(1e9, 64, "hierarchical")["s"] / dgx.all_reduce_time(1e9, 64, "ring")["s"]
assert hier_64 > 1 and fastest[1024, 1e9] == "tree"
glue("hier_64", hier_64, display=False)
Table(calls)
""")

code(r"""
fig, axes = plt.subplots(1, 2, figsize=(6.8, 3.0), sharey=True)
sizes = [2**k for k in range(16, 33)]  # 64 KiB to 4 GiB
for ax, gpus in zip(axes, (64, 1024)):
    for i, algo in enumerate(scaling.ALL_REDUCE_ALGORITHMS):
        ax.plot(sizes, [dgx.all_reduce_time(s, gpus, algo)["s"] for s in sizes], color=plots.PALETTE[i], label=algo)
    ax.axvline(BUCKET, color="#999999", lw=0.8)
    ax.text(BUCKET, 2e-5, " 25 MiB", fontsize=9, color="#666666")
    ax.set(xscale="log", yscale="log", xlabel="all-reduce size (bytes)", title=f"{gpus} H100s, {gpus // 8} nodes")
    ax.spines[["top", "right"]].set_visible(False)
axes[0].set(ylabel="seconds per call (projected)")
fig.suptitle("One all-reduce under NCCL's latency model: a projection", fontsize=10, y=1.04)
plots.legend_below(axes[0], ncol=3)
plots.show(fig)
""")

md(r"""
On one node the ring wins at every size (few hops, each cheap). At 1,024 GPUs a ring all-reduce pays
{glue:text}`ring_1024_ms:.1f` ms of latency per call, {glue:text}`bucket_1024_share:.0f` % of a 25 MiB bucket's time,
where the tree pays {glue:text}`tree_1024_ms:.2f` ms: that is why NCCL switches to trees at scale, and why a larger
bucket (fewer calls) helps there. Even a 1 GB ring all-reduce spends {glue:text}`ring_1gb_share:.0f` % of its time in
latency at that scale. The hierarchical all-reduce cuts the ring's latency but, with its stages one after the other,
pays for NVLink on top of the network: at 1 GB on 64 GPUs it takes {glue:text}`hier_64:.1f` times the ring's time.

Does adding this latency, paid by each of DDP's buckets, improve the Playbook check? The same calibration and the
same six bars, with the fastest algorithm per call (as NCCL's tuner would choose); the measured bandwidths lose the
latency of the 256 MB message they were measured with:
""")

code(r"""
pb_lat = dataclasses.replace(pb.cluster, latency=scaling.NCCL_NVLINK)
cal_lat = calibrate(pb.model, pb_lat, pb.strategy, pb.calibration)
with_lat = scaling.check(pb.model, pb_lat, pb.strategy, pb.judged, cal_lat)
missed = [r for r in with_lat if not r["within"]]
assert [r["GPUs"] for r in missed] == [128, 256] and all(r["residual %"] < 0 for r in missed)
glue("lat_missed", Markdown(", ".join(f"{r['residual %']:+.0f} % at {r['GPUs']} GPUs" for r in missed)), display=False)
Table({"GPUs": a["GPUs"], "measured": a["measured tokens/s/GPU"], "bandwidth only: residual %": a["residual %"],
       "+ NCCL latency per bucket: projected": b["projected"], "residual %": b["residual %"]}
      for a, b in zip(judged, with_lat))
""")

md(r"""
It does not: with a latency per bucket the projection misses {glue:md}`lat_missed`, too slow where the nodes are
many (each bucket's latency grows with them) and a step's compute is short. NCCL's tuning figures are what its tuner compares algorithms with, not a
measurement of this cluster, and calls that follow each other may hide part of each other's latency; the
Playbook's data cannot tell which. So the projections this chapter checks, and the strategy table below, count
bandwidth only, with bandwidths measured at large messages; the latency model is for what it is good at:
comparing algorithms and bucket sizes, as projections.

## Your machine: strong scaling, weak scaling and Amdahl

On your machine nothing is published: everything is measured. Lab 3 can measure several world sizes in one
launch (`--worlds 1 2 3 4`: each world size on the launch's first $N$ ranks while the others wait), in
turns, so the machine's background load falls on all of them alike. **Strong scaling** keeps the global
batch fixed (here 12 sequences a step, which 1, 2, 3 and 4 ranks divide); **weak scaling** keeps each rank's
work fixed (here 12 sequences a step on every rank), so $N$ ranks do $N$ times the work per step. At one
rank the two are the same run.
""")

code(r"""
LAB = ["--impl", "nanodist", "--model", "small", "--seq-len", "64", "--steps", "15", "--no-progress"]
# strong: 12 sequences a step in all, in micro-batches of 1; weak: 12 sequences a step on every rank
strong = nd.launch("lab03_ddp", nproc=4, echo=False, args=LAB + ["--scaling", "strong", "--micro-batch", "1",
                                                                 "--worlds", "1", "2", "3", "4", "--total-batch", str(12 * 64)])
weak = nd.launch("lab03_ddp", nproc=4, echo=False, args=LAB + ["--scaling", "weak", "--micro-batch", "12",
                                                               "--worlds", "1", "2", "3", "4"])
# Lab 5's FSDP on the same strong-scaling batch (fewer steps: its steps are slower)
fsdp = nd.launch("lab05_fsdp", nproc=4, echo=False, args=["--impl", "fsdp", "--model", "small", "--seq-len", "64",
                                                          "--steps", "10", "--no-progress", "--micro-batch", "1",
                                                          "--worlds", "1", "2", "3", "4", "--total-batch", str(12 * 64)])
at2 = {kind: next(r["speedup"] for r in run.results["metrics"]["sweep"] if r["world_size"] == 2)
       for kind, run in (("strong", strong), ("weak", weak))}
glue("strong_2", at2["strong"], display=False)
glue("weak_2", at2["weak"], display=False)
caption("prov_scaling", strong.results)
print("\n".join(strong.lines(0)[1:] + weak.lines(0)[1:-1] + fsdp.lines(0)[1:-1]))
sweeps = {"strong": strong.results["metrics"]["sweep"], "weak": weak.results["metrics"]["sweep"],
          "fsdp": fsdp.results["metrics"]["sweep"]}
assert [r["world_size"] for r in sweeps["strong"]] == [1, 2, 3, 4] == [r["world_size"] for r in sweeps["fsdp"]]
assert all(r["speedup"] > 0 for r in sweeps["weak"])
cores = hardware_fingerprint()["cpu_logical_cores"]
""", MACHINE)

md(r"""
Amdahl's law says that if a fraction $s$ of the work cannot be split, $N$ ranks give a strong-scaling
speedup of

$$ S(N) = \frac{1}{s + (1 - s)/N}. $$

`scaling.serial_fraction` finds $s$ by least squares on $1/S - 1/N = s\,(1 - 1/N)$, over the world sizes
this machine has cores for (beyond them, ranks wait for a core, which Amdahl's law does not model), and its
uncertainty by resampling the measured steps. On a two-core machine there is a single world size above 1, and
the fit is that one point, its error only the spread of the steps:
""")

code(r"""
fit = scaling.serial_fraction(sweeps["strong"], max_world=cores)
fit_fsdp = scaling.serial_fraction(sweeps["fsdp"], max_world=cores)
serial, err = fit["serial"], fit["stderr"]
glue("serial_pct", Markdown(f"{100 * serial:.0f} ± {100 * err:.0f} %"), display=False)
glue("serial_fsdp_pct", Markdown(f"{100 * fit_fsdp['serial']:.0f} ± {100 * fit_fsdp['stderr']:.0f} %"), display=False)
fsdp_2 = next(r["speedup"] for r in sweeps["fsdp"] if r["world_size"] == 2)
glue("fsdp_2", fsdp_2, display=False)
glue("fsdp_explain", Markdown(
    "the collectives of a micro-batch took longer than the compute a second rank saved, so the step got slower."
    if fsdp_2 < 1 else "the collectives of a micro-batch ate into what a second rank saved, and the speedup fell "
    "short of DDP's."), display=False)
glue("fsdp_meaning", Markdown(
    "above 100 %: no serial fraction explains a step that got slower with more ranks (what grew is the "
    "communication, which Amdahl's law has no term for)" if fit_fsdp["serial"] >= 1 else
    "the share of FSDP's step that more ranks did not shorten"), display=False)
glue("serial_worlds", Markdown(", ".join(map(str, fit["worlds"]))), display=False)
assert err >= 0 and fit["worlds"] == [n for n in (1, 2, 3, 4) if n <= cores] == fit_fsdp["worlds"]
for name, f in (("DDP (lab 3)", fit), ("FSDP (lab 5)", fit_fsdp)):
    print(f"{name}: serial fraction s = {f['serial']:.3f} ± {f['stderr']:.3f} (bootstrap standard error), fitted on "
          f"world sizes {f['worlds']}")
axes = plots.scaling({
    "strong": {"measured": {"DDP, measured": [(r["world_size"], r["speedup"]) for r in sweeps["strong"]],
                            "FSDP, measured": [(r["world_size"], r["speedup"]) for r in sweeps["fsdp"]]},
               "predicted": {f"Amdahl, s = {serial:.2f}": lambda n: scaling.amdahl(serial, n)}},
    "weak": {"measured": {"measured": [(r["world_size"], r["speedup"]) for r in sweeps["weak"]]}},
}, max_ranks=4)
for ax in axes[:, 0]:
    ax.axvline(cores, color="#999999", lw=0.8)
    ax.text(cores, 3.5, f" {cores} cores", fontsize=9, color="#666666")
plots.show()
""", MACHINE)

md(r"""
{glue:md}`prov_scaling`

The serial fraction fitted to DDP here is {glue:md}`serial_pct`, from world sizes {glue:md}`serial_worlds`. It is
the share of a step that more ranks do not shorten: the work every rank repeats whatever its share of the
batch (the optimizer step) and the communication, which Amdahl's law counts as serial although it grows with
the number of ranks. Past the vertical line there are more ranks than cores: the ranks take turns
on the cores and the speedup falls, which no serial fraction explains, so those points are shown, not
fitted.

Lab 5's FSDP on the same batch measured a speedup of {glue:text}`fsdp_2:.2f` at 2 ranks, and its fitted serial
fraction is {glue:md}`serial_fsdp_pct`: {glue:md}`fsdp_meaning`. On one rank FSDP communicates nothing. On more, it
gathers the parameters and reduce-scatters the gradients for every micro-batch, one collective per unit, and here a
micro-batch is one sequence: {glue:md}`fsdp_explain` A bigger micro-batch (more tokens between the collectives) is
the cure, as the criterion below says.

At 2 ranks this run measured a strong-scaling speedup of {glue:text}`strong_2:.2f` and a weak-scaling one of
{glue:text}`weak_2:.2f`. Weak scaling is the kinder of the two in principle: each rank keeps its full
micro-batch of work while the all-reduce stays the same size, so the share of the step spent communicating
does not grow. That is why large-scale training grows the global batch with the number of GPUs, and why
the Playbook's benchmark, which held the global batch fixed, is strong scaling and fell apart at 256 GPUs.
""")

code(r"""
for lab in ("lab03_ddp", "lab05_fsdp"):
    reference = nd.results.references(lab, match=lambda r: "sweep" in r["metrics"])
    print(f"{len(reference)} sweep(s) committed under labs/results/reference/{lab}")
    for r in reference:
        rows = [row for row in r["metrics"]["sweep"] if row["micro_batch"] == r["metrics"]["sweep"][0]["micro_batch"]]
        if r["metrics"]["scaling"] == "strong" and [row["world_size"] for row in rows][:2] == [1, 2]:
            f = scaling.serial_fraction(rows, max_world=r["hardware"].get("cpu_logical_cores"))
            print(f"  {r['metrics']['impl']}, strong scaling: s = {f['serial']:.3f} ± {f['stderr']:.3f} on world sizes "
                  f"{f['worlds']}; {provenance(r)}")
        elif all("backward_s" in row for row in r["metrics"]["sweep"]):
            k_ref = scaling.knee(r["metrics"]["sweep"])
            print(f"  {r['metrics']['impl']}, knee: {k_ref['tokens']:.0f} tokens per rank (all-reduce "
                  f"{1e3 * k_ref['comm_s']:.0f} ms); {provenance(r)}")
        else:
            speedups = ", ".join(f"{row['speedup']:.2f} at {row['world_size']}" for row in rows if "speedup" in row)
            print(f"  {r['metrics']['impl']}, {r['metrics']['scaling']} scaling: speedups {speedups} ranks; "
                  f"{provenance(r)}")
""")

md(r"""
## When communication hides

DDP's all-reduce can only hide under the backward pass of the micro-batch that synchronises, which does two
thirds of its FLOPs. For a model of $P$ parameters ($6P$ FLOPs per token, roughly) on GPUs computing $F$
FLOP/s whose ring bus bandwidth is $B$ bytes/s, $T$ tokens in that micro-batch take $\frac{2}{3} \cdot 6PT / F$
seconds of backward, and an all-reduce of 2-byte gradients takes about $2 \cdot 2P / B$. They are equal at

$$ T^* \approx \frac{F}{B}, $$

the ratio of the GPU's arithmetic to its network, in FLOPs per byte: the same ratio the JAX scaling book
compares a batch with {cite}`austin2025scaling`. With fewer tokens per GPU per micro-batch, the network sets
the pace; with more, the GPU does. The model size cancels. With fp32 gradients $T^*$ doubles; computing at
$e$ times the peak, it shrinks by $e$. The table gives both ends: bf16 gradients at the peak, and the
Playbook's set-up (fp32 gradients, $e$ = {glue:text}`pb_e:.2f`).
""")

code(r"""
rows = []
for name, cluster in CLUSTERS.items():
    for label, link in (("inside a node", cluster.intra), ("across nodes", cluster.inter)):
        peak = scaling.overlap_threshold_tokens(6e9, 10**9, cluster.gpu.peak_flops, link.busbw_GBps, grad_bytes=2)
        ours = scaling.overlap_threshold_tokens(6e9, 10**9, cal.compute_efficiency * cluster.gpu.peak_flops,
                                                link.busbw_GBps, grad_bytes=4)
        rows.append({"cluster": cluster.name, "ring": label, "bus bandwidth (GB/s)": round(link.busbw_GBps),
                     "T*: bf16 gradients, peak": round(peak), "T*: fp32 gradients, e x peak": round(ours),
                     "in sequences of 4,096": round(ours / 4096, 2)})
glue("h100_peak", rows[0]["T*: bf16 gradients, peak"], display=False)
glue("h100_tokens", rows[0]["T*: fp32 gradients, e x peak"], display=False)
glue("h100_seq", Markdown("less than one sequence of 4,096" if rows[0]["in sequences of 4,096"] < 1 else
                          f"{rows[0]['in sequences of 4,096']:.1f} sequences of 4,096"), display=False)
Table(rows)
""")

md(r"""
On H100s over NVLink, {glue:text}`h100_peak:.0f` tokens per GPU in the synchronising micro-batch hide DDP's
all-reduce of bf16 gradients at the peak, and {glue:text}`h100_tokens:.0f` ({glue:md}`h100_seq`) in the Playbook's
set-up, provided the stack overlaps at all; the Playbook's runs show what happens when it does not.

The same ratio for this machine, from two numbers it measured: the matrix-multiply rate of one core
(`nanodist.perf`, what Chapter 3's {term}`MFU` divides by) and the bus bandwidth of gloo's all-reduce, fitted
as in Chapter 2 but now, and at the sizes of a whole model's gradients ({glue:md}`fit_sizes`: on a shared machine
the bandwidth drifts from run to run, so the prediction below uses one measured minutes before the run it
predicts):
""")

code(r"""
import torch

from nanodist.perf import measure_matmul_flops

# Lab 2 again, at the sizes of a whole model's gradient bucket: on a shared machine gloo's bandwidth drifts between
# runs, so the knee below is predicted from a fit made minutes before it is measured
FIT = ["--min-bytes", "8M", "--max-bytes", "64M"]
fit_run = nd.launch("lab02_allreduce", nproc=2, echo=False, args=["--ops", "dist.all_reduce", *FIT, "--repeats", "5"]).results
caption("prov_fit", fit_run)
glue("fit_sizes", Markdown(f"{FIT[1][:-1]} to {FIT[3][:-1]} MiB"), display=False)
ar = costmodel.fit_results(fit_run, ops=["dist.all_reduce"])["dist.all_reduce"]
threads = torch.get_num_threads()
torch.set_num_threads(1)  # one thread, as each rank under torchrun
try:
    rate = measure_matmul_flops("cpu", torch.float32)
finally:
    torch.set_num_threads(threads)
t_cpu = scaling.overlap_threshold_tokens(6e9, 10**9, rate, ar.bandwidth_GBps, grad_bytes=4, gpus=2)
glue("cpu_gflops", rate / 1e9, display=False)
glue("cpu_busbw", ar.bandwidth_GBps, display=False)
glue("cpu_tokens", t_cpu, display=False)
glue("cores_here", cores, display=False)
assert rate > 0 and ar.bandwidth_GBps > 0 and t_cpu > 0
print(f"one thread: {rate / 1e9:.1f} GFLOP/s of fp32 matmul; gloo all-reduce: {ar.bandwidth_GBps:.2f} GB/s of bus "
      f"bandwidth, 2 ranks; fp32 gradients: T* = {t_cpu:.0f} tokens per rank in the synchronising micro-batch")
""", MACHINE)

md(r"""
{glue:md}`prov_fit`

One thread of this machine computes {glue:text}`cpu_gflops:.0f` GFLOP/s and gloo's all-reduce moves
{glue:text}`cpu_busbw:.2f` GB/s: at 2 ranks, the criterion puts the knee at {glue:text}`cpu_tokens:.0f` tokens per
rank in the synchronising micro-batch.

Now measure it. Lab 3 with `--timeline` records, for every step, when the backward's autograd work ended, when
each gradient bucket left and when the gradients were synchronised. With one bucket (`--bucket-mb` larger than
all of the model's gradients) the all-reduce leaves only at the end of the backward, so the two sides of the
criterion are timed apart: the backward, which grows with the tokens, and the all-reduce, which does not (timed
on the rank that launched it last, which waits for the transfer alone, not for a slower peer). The sweep runs
the medium model at {glue:text}`knee_world` ranks over micro-batches from {glue:text}`knee_min_tokens` to
{glue:text}`knee_max_tokens` tokens per rank, in one launch:
""")

code(r"""
KNEE = {"model": "medium", "seq_len": 16, "micro_batches": [1, 4, 16], "world": 2}
sweep = nd.launch("lab03_ddp", nproc=KNEE["world"], echo=False, args=[
    "--impl", "nanodist-pg", "--model", KNEE["model"], "--seq-len", str(KNEE["seq_len"]), "--steps", "8",
    "--no-progress", "--bucket-mb", "100", "--worlds", str(KNEE["world"]),
    "--micro-batches", *map(str, KNEE["micro_batches"]), "--timeline"]).results
caption("prov_knee", sweep)
rows = sweep["metrics"]["sweep"]
k = scaling.knee(rows)
P, fpt = rows[0]["params"], rows[0]["flops_per_token"]
predicted = scaling.overlap_threshold_tokens(fpt, P, rate, ar.bandwidth_GBps, grad_bytes=4, gpus=KNEE["world"])
e_cpu = 2 / 3 * fpt / k["backward_per_token_s"] / rate  # the backward's FLOPs per token / its measured time per token
comm_predicted = costmodel.busbw_factor("all_reduce", KNEE["world"]) * 4 * P / (ar.bandwidth_GBps * 1e9)
ratio = k["tokens"] / predicted
# measured / predicted = e x (the all-reduce in the step / Lab 2's prediction of it): the two ways the criterion's
# inputs can be off. The tolerance: a factor of 4 low to 2 high. The backward runs below one thread's matmul peak
# (e < 1: small matrices, the non-matmul work), and the all-reduce in a step follows a backward that has just
# walked all of the model's memory, on a machine whose gloo bandwidth drifts between launches.
assert abs(ratio - e_cpu * k["comm_s"] / comm_predicted) < 1e-9 * ratio
assert 0.25 <= ratio <= 2, (k, predicted, e_cpu)
for name, value in (("knee_measured", k["tokens"]), ("knee_predicted", predicted), ("knee_ratio", ratio),
                    ("e_cpu", e_cpu), ("comm_measured_ms", 1e3 * k["comm_s"]),
                    ("comm_predicted_ms", 1e3 * comm_predicted), ("comm_ratio", k["comm_s"] / comm_predicted),
                    ("backward_fixed_ms", 1e3 * k["backward_fixed_s"]), ("knee_params_m", P / 1e6)):
    glue(name, value, display=False)
tokens = [r["tokens_per_step"] / KNEE["world"] for r in rows]
glue("knee_crossing", Markdown(
    f"at {k['crossing_tokens']:.0f} tokens" if k["crossing_tokens"] > 0 else
    "at no batch at all: its fixed part alone takes as long as the all-reduce"), display=False)
glue("knee_world", KNEE["world"], display=False)
glue("knee_min_tokens", min(tokens), display=False)
glue("knee_max_tokens", max(tokens), display=False)
print(f"{P / 1e6:.1f} M parameters, {KNEE['world']} ranks: the backward takes {1e3 * k['backward_fixed_s']:.1f} ms + "
      f"{1e6 * k['backward_per_token_s']:.0f} us per token (e = {e_cpu:.2f} of one thread's matmul rate); the all-reduce "
      f"{1e3 * k['comm_s']:.1f} ms (Lab 2's fit: {1e3 * comm_predicted:.1f} ms)")
print(f"T*: measured {k['tokens']:.0f} tokens per rank, predicted {predicted:.0f} (measured / predicted = {ratio:.2f}); "
      f"the measured backward, fixed part included, reaches the all-reduce at {k['crossing_tokens']:.0f} tokens")
fig, ax = plt.subplots(figsize=(6.4, 3.2))
ax.plot(tokens, [1e3 * r["backward_s"] for r in rows], "o", color=plots.PALETTE[0], label="backward (measured)")
ax.plot(tokens, [1e3 * (k["backward_fixed_s"] + k["backward_per_token_s"] * t) for t in tokens], "-", lw=0.8,
        color=plots.PALETTE[0])  # its fit, a + bT
ax.plot(tokens, [1e3 * r["comm_s"] for r in rows], "s", color=plots.PALETTE[1], label="all-reduce (measured)")
ax.axhline(1e3 * k["comm_s"], color=plots.PALETTE[1], lw=0.8)
ax.axvline(k["tokens"], color=plots.PALETTE[2], ls="-", lw=1.2, label=f"T*, measured: {k['tokens']:.0f}")
ax.axvline(predicted, color=plots.PALETTE[3], ls="--", lw=1.2, label=f"T*, predicted: {predicted:.0f}")
ax.set(xscale="log", xlabel="tokens per rank in the synchronising micro-batch", ylabel="ms", ylim=(0, None),
       title="Where the backward's work outgrows the all-reduce")
ax.set_xticks(tokens, [f"{t:.0f}" for t in tokens])
ax.spines[["top", "right"]].set_visible(False)
plots.legend_below(ax)
plots.show(fig)
""", MACHINE)

md(r"""
{glue:md}`prov_knee`

The backward is a line, $a + bT$: $b$ is what each token's work costs, and $a$ ({glue:text}`backward_fixed_ms:.0f` ms
here) what every backward pays whatever the batch, such as launching hundreds of small operations and allocating the
gradients of {glue:text}`knee_params_m:.0f` M parameters. The criterion compares the work that grows with the
tokens with the bytes, so its $T^*$ is where $bT$ equals the all-reduce ({glue:text}`comm_measured_ms:.0f` ms):
{glue:text}`knee_measured:.0f` tokens per rank, measured, against {glue:text}`knee_predicted:.0f` predicted from the
matmul peak and Lab 2's bandwidth, a ratio of {glue:text}`knee_ratio:.2f`. The ratio is the product of the two ways
the prediction's inputs can be off, and the cell prints both: the backward ran at {glue:text}`e_cpu:.2f` of the
matmul peak, and the all-reduce in the step took {glue:text}`comm_ratio:.2f` times what Lab 2's fit predicts for it
(the cell asserts the ratio between a quarter and twice: $e$ is below 1 on any machine, and the all-reduce inside
a step follows a backward that has just walked all of the model's memory). The measured backward itself, fixed
part included, takes as long as the all-reduce {glue:md}`knee_crossing`; on a GPU, whose fixed part is small,
that point and $T^*$ coincide.

Nothing hides here: with {glue:text}`cores_here` cores and {glue:text}`knee_world` ranks each computing on one,
gloo's thread takes its time from a backward, which is why Chapter 3's timeline showed buckets leaving during the
backward but finishing after it.
""")

md(r"""
Where the bandwidth comes from moves the prediction. The same knee, predicted with the link fitted to your
run minutes ago, and with links fitted to the committed reference runs of Lab 2 (other machines: the
projection's second kind of source), against the one measured:
""")

code(r"""
links = {"your Lab 2 run, minutes ago": scaling.Link.from_costmodel(ar, "gloo, this machine")}
for ref in nd.results.references("lab02_allreduce", match=lambda r: r["world_size"] == 2 and "sweep" in r["metrics"]):
    fitted = costmodel.fit_results(ref, ops=["dist.all_reduce"], min_bytes=8 * 2**20)["dist.all_reduce"]
    links[f"reference: {provenance(ref)}"] = scaling.Link.from_costmodel(fitted, "gloo, reference machine")
knee_rows = [{"bandwidth from": name, "bus bandwidth (GB/s)": round(link.busbw_GBps, 2),
              "T* (tokens per rank)": round(scaling.overlap_threshold_tokens(fpt, P, rate, link.busbw_GBps, grad_bytes=4,
                                                                             gpus=KNEE["world"])),
              "how the link was made": link.source} for name, link in links.items()]
knee_rows.append({"bandwidth from": "measured: the sweep above", "T* (tokens per rank)": round(k["tokens"])})
assert len(knee_rows) >= 3 and knee_rows[0]["T* (tokens per rank)"] == round(predicted)
Table(knee_rows)
""", MACHINE)

md(r"""
## Which strategy for my model on my cluster

With $e$ and $\rho$ set, the projection answers the practical question: for a model, a cluster and a
global batch, which strategy is fastest among those that fit in memory? `scaling.best_strategy` tries DDP,
ZeRO-1, ZeRO-2 and FSDP, with and without full activation recomputation (which costs a forward pass), and
of those within 1 % of the fastest keeps the simplest. The table is a projection, made with the Playbook
calibration's compute efficiency ({glue:text}`pb_e:.2f`) and two overlaps: full ($\rho$ = 1, what PyTorch's DDP and
FSDP are built to reach) and the Playbook's calibrated {glue:text}`pb_rho:.2f`. The global batch is $2^{23}$ tokens
(about eight million, in the range of Llama-scale runs), in micro-batches of one sequence.
""")

code(r"""
choices, best = [], {}
for model in ("Playbook 1B", "Llama 2 7B", "Llama 3 70B"):
    for cluster in ("dgx-h100-ib", "pcie-h100"):
        for gpus in (8, 64, 1024):
            row = {"model": model, "cluster": CLUSTERS[cluster].name, "GPUs": gpus}
            for rho in (1.0, cal.overlap):
                b = best[model, cluster, gpus, rho] = scaling.best_strategy(MODELS[model], CLUSTERS[cluster], gpus, 2**23,
                                                                            cal.compute_efficiency, rho)
                name = f"rho = {rho:g}"
                row[name] = "none fits" if b is None else b.strategy + (" + recompute" if b.recompute else "")
                row[f"{name}: tokens/s/GPU"] = None if b is None else round(b.tokens_per_s_per_gpu)
                row[f"{name}: bound by"] = None if b is None else b.bottleneck
            full = best[model, cluster, gpus, 1.0]
            row["memory/GPU (GB), rho = 1"] = None if full is None else round(full.memory_GB, 1)
            choices.append(row)
# what the text below says of the table
rho0 = cal.overlap
assert all(best["Playbook 1B", "dgx-h100-ib", g, 1.0].strategy == "ddp" for g in (8, 64))
assert all(best["Playbook 1B", "dgx-h100-ib", g, r].bottleneck == "compute" for g in (8, 64, 1024) for r in (1.0, rho0))
assert best["Playbook 1B", "dgx-h100-ib", 1024, 1.0].strategy == "fsdp"
assert best["Playbook 1B", "dgx-h100-ib", 1024, rho0].strategy == "zero1"
ddp_1024 = project(MODELS["Playbook 1B"], CLUSTERS["dgx-h100-ib"], 1024, "ddp", 1, 2, cal.compute_efficiency, 1.0)
glue("ddp_1024_step", ddp_1024.step_s, display=False)
glue("ddp_1024_update_ms", 1e3 * ddp_1024.optimizer_s, display=False)
assert all(best[m, "pcie-h100", 1024, r].bottleneck == "communication" for m in ("Playbook 1B", "Llama 2 7B")
           for r in (1.0, rho0))
assert all(b is None or b.strategy != "ddp" for (m, *_), b in best.items() if m != "Playbook 1B")
assert all(best["Llama 3 70B", c, 8, r] is None for c in ("dgx-h100-ib", "pcie-h100") for r in (1.0, rho0))
assert all(best["Llama 3 70B", c, g, r].strategy == "fsdp" and best["Llama 3 70B", c, g, r].recompute
           for c in ("dgx-h100-ib", "pcie-h100") for g in (64, 1024) for r in (1.0, rho0))
assert best["Llama 3 70B", "pcie-h100", 64, rho0].bottleneck == "communication"
Table(choices)
""")

md(r"""
Read it as a set of rules with reasons (the cell checks each against the table):
- **the network decides when the tokens per GPU between synchronisations run short.** On NVLink and
  {term}`InfiniBand` with a card per GPU, the 1B model is compute-bound at every size, and plain DDP is the
  choice up to 64 GPUs. At 1,024 GPUs, with two sequences per GPU per step, a DDP step is short
  ({glue:text}`ddp_1024_step:.2f` s), and two costs that were small decide: the all-reduce, and the update of every
  parameter on every GPU ({glue:text}`ddp_1024_update_ms:.0f` ms of HBM traffic). With overlap FSDP wins (all of its
  communication hides under the whole step, and each GPU updates only its shard); without, ZeRO-1 (its
  reduce-scatter and all-gather move 4 + 2 bytes a parameter through each link where DDP's fp32 all-reduce moves
  8, and its update is sharded too). On PCIe boxes with one network card a node, both the 1B and the 7B model are bound by
  communication at 1,024 GPUs, whatever the overlap;
- **memory decides from a few billion parameters.** DDP keeps 18 bytes a parameter on every GPU (2 for bf16
  weights, 4 for fp32 gradients, 12 for AdamW's fp32 master copy and moments): a 7B model's states do not fit
  in 80 GB, so ZeRO and FSDP {term}`shard` them;
- **large models: FSDP with recomputation, and more than one node.** 70B does not fit on 8 GPUs in any
  data-parallel form: the layers themselves must be split (tensor and pipeline parallelism, Chapter 9 and
  the next). Without overlap, FSDP of 70B on PCIe boxes is bound by communication even at 64 GPUs:
  its all-gathers and reduce-scatter repeat every micro-batch, so accumulating more does not amortise them.

### Adding tensor parallelism: a 2-D mesh

Chapter 9 splits each layer's matrices over the GPUs of a node (tensor parallelism, TP, with sequence
parallelism), and runs the data-parallel strategy across nodes on what is left: a 2-D mesh.
`project(..., tp=n, sequence_parallel=True)` projects it (Chapter 9 takes it apart), and
`best_strategy(..., tp_sizes=(1, 2, 4, 8))` tries each TP size too. For the 70B model, the same global batch
and the same $e$, a projection again:
""")

code(r"""
mesh_rows, with_tp = [], {}
for cluster in ("dgx-h100-ib", "pcie-h100"):
    for gpus in (64, 1024):
        for rho in (1.0, cal.overlap):
            b = with_tp[cluster, gpus, rho] = scaling.best_strategy(MODELS["Llama 3 70B"], CLUSTERS[cluster], gpus,
                                                                    2**23, cal.compute_efficiency, rho,
                                                                    tp_sizes=(1, 2, 4, 8))
            a = best["Llama 3 70B", cluster, gpus, rho]
            mesh_rows.append({"cluster": CLUSTERS[cluster].name, "GPUs": gpus, "rho": rho,
                              "data parallelism only": a.strategy + (" + recompute" if a.recompute else ""),
                              "tokens/s/GPU": round(a.tokens_per_s_per_gpu),
                              "with TP": b.row()["strategy"] + (" + recompute" if b.recompute else ""),
                              "tokens/s/GPU ": round(b.tokens_per_s_per_gpu)})
nv, pcie = with_tp["dgx-h100-ib", 64, 1.0], with_tp["pcie-h100", 64, 1.0]
assert nv.tp > 1 and not nv.recompute and pcie.tp == 1 and pcie.recompute
glue("mesh_tp", nv.tp, display=False)
glue("mesh_gain", 100 * (nv.tokens_per_s_per_gpu / best["Llama 3 70B", "dgx-h100-ib", 64, 1.0].tokens_per_s_per_gpu - 1),
     display=False)
Table(mesh_rows)
""")

md(r"""
Inside a DGX node, on NVLink, TP = {glue:text}`mesh_tp` with SP divides the 70B model's activations enough to
train without recomputing, {glue:text}`mesh_gain:.0f` % faster at 64 GPUs with full overlap. On the PCIe boxes the
same all-reduces, four per layer and micro-batch, cross a link several times slower, cost more than the
recomputation they would save, and the choice at 64 GPUs stays FSDP with recomputation. TP pays where the
node's own link is fast.

The calculator below lets you change any of it.

### A what-if calculator

In JupyterLab the cell below shows controls for the model, the cluster, the GPUs, the batch, $e$ and $\rho$,
and projects all four strategies for the choice. The web version of this book has no Python behind the
page, so it hides the widget; the table and chart after it are the same function, computed when the book
was built.
""")

code(r"""
scaling.calculator(model="Llama 2 7B", cluster="dgx-h100-ib", gpus=64, micro_batch=1, grad_accum=4,
                   compute_efficiency=round(cal.compute_efficiency, 2), overlap=1.0)
""", {"tags": ["remove-output"]})

code(r"""
scaling.strategy_table(MODELS["Llama 2 7B"], CLUSTERS["dgx-h100-ib"], 64, 1, 4, round(cal.compute_efficiency, 2), 1.0)
""")

code(r"""
fig, axes = plt.subplots(1, 2, figsize=(6.8, 3.0), sharey=True)
counts = [8, 16, 32, 64, 128, 256, 512, 1024]
for ax, overlap in zip(axes, (1.0, 0.0)):
    for i, strategy in enumerate(scaling.STRATEGIES):
        ys = [project(MODELS["Llama 2 7B"], CLUSTERS["pcie-h100"], g, strategy, 1, max(1, 2**23 // (g * 4096)),
                      cal.compute_efficiency, overlap).tokens_per_s_per_gpu for g in counts]
        ax.plot(counts, ys, "o-", ms=3, color=plots.PALETTE[i], label=strategy)
    ax.set(xscale="log", xlabel="GPUs", title=f"overlap {overlap:g}")
    ax.set_xticks([8, 64, 512], ["8", "64", "512"])
    ax.spines[["top", "right"]].set_visible(False)
axes[0].set(ylabel="tokens/s per GPU (projected)")
fig.suptitle("Llama 2 7B on PCIe H100 boxes, one NIC a node: a projection", fontsize=10, y=1.04)
plots.legend_below(axes[0], ncol=2)
plots.show(fig)
""")

md(r"""
Memory is not in the chart (DDP would not fit a 7B model at all); the chart is about time only, to show
how the network punishes each strategy when nothing overlaps. ZeRO-2 and FSDP communicate every micro-batch
(ZeRO-2 a reduce-scatter, FSDP two all-gathers and a reduce-scatter), DDP and ZeRO-1 once a step: with many
micro-batches FSDP moves many times DDP's bytes, hides them all when it overlaps, and suffers most when it
cannot.

## Exercises
""")

chapter.predict(
    "8.1",
    "Llama 3 70B with FSDP and full recomputation on 64 H100 PCIe GPUs, one network card a node, no overlap "
    "($\\rho = 0$), compute efficiency 0.38, micro-batches of one sequence. Accumulating 32 micro-batches a step "
    "instead of 16 doubles the tokens per step: by how many percent does the projected throughput (tokens/s per "
    "GPU) change? Write `prediction = <percent>` (a whole number), then run the cell after it.",
    "prediction = ...   # percent change of tokens/s per GPU, 16 -> 32 micro-batches a step",
    "model, cluster = MODELS[\"Llama 3 70B\"], CLUSTERS[\"pcie-h100\"]\n"
    "t16, t32 = (project(model, cluster, 64, \"fsdp\", 1, ga, 0.38, 0.0, recompute=True).tokens_per_s_per_gpu\n"
    "            for ga in (16, 32))\n"
    "measured = round(100 * (t32 / t16 - 1))",
    "What does FSDP communicate per micro-batch, and what does DDP communicate per step?",
    "# FSDP all-gathers the parameters twice and reduce-scatters the gradients for every micro-batch: twice the\n"
    "# micro-batches, twice the compute and twice the communication -- the same share, the same throughput.\n"
    "# (DDP would gain: its all-reduce is once a step, whatever the accumulation.)\n"
    "prediction = 0",
    measured_by="the projection gives",
)

chapter.predict(
    "8.2",
    "Take the Playbook's calibrated projection (the `cal` above) and its 256-GPU configuration (micro-batch 1, "
    "accumulation 1). If the stack overlapped the all-reduce completely ($\\rho = 1$) instead of not at all, by how "
    "many percent would the projected tokens/s per GPU rise? Write `prediction = <percent>` (a whole number; the "
    "check allows 5 % of it either way), then run the cell after it.",
    "prediction = ...   # percent more tokens/s per GPU with overlap 1 than with overlap 0, a whole number",
    "base, full = (project(pb.model, pb.cluster, 256, \"ddp\", 1, 1, cal.compute_efficiency, o).step_s for o in (0.0, 1.0))\n"
    "measured = round(100 * (base / full - 1))",
    "The residual table above has the 256-GPU step and its exposed communication; the rest of the step is compute "
    "and the AdamW update (`project(...).compute_s` and `.optimizer_s`). Which part of a step can the all-reduce "
    "hide under, and how long is it here?",
    "# the window is the backward of the one micro-batch, 2/3 of the compute; the all-reduce is longer than that,\n"
    "# so the whole window hides: the step loses 2/3 x compute,\n"
    "# (compute + update + all-reduce) / (compute / 3 + update + all-reduce)\n"
    "prediction = 33",
    rel_tol=0.05, measured_by="the projection gives",
)

exercise(
    "8.3",
    "An A100 does 312 TFLOP/s in bf16. Its nodes have NVLink 3 (say 230 GB/s of ring bus bandwidth) and one "
    "200 Gb/s HDR InfiniBand card per GPU (say 23 GB/s each, 8 a node). Using $T^* \\approx F/B$ (bf16 gradients, "
    "at the peak), how many tokens per GPU in the synchronising micro-batch does DDP need across nodes to hide its "
    "all-reduce? (An integer.)",
    "round(312e12 / (8 * 23e9))",
    "answer = ...  # tokens per GPU per step",
    "Across nodes a ring goes through all the cards of a node at once: what is the bus bandwidth then?",
    "answer = round(312e12 / (8 * 23e9))  # 8 cards x 23 GB/s = 184 GB/s",
)

exercise(
    "8.4",
    "A strong-scaling run measures a speedup of 3.2 at 4 ranks. What serial fraction $s$ does Amdahl's law "
    "give? (Solve $S = 1 / (s + (1 - s)/N)$ for $s$; 3 decimals.)",
    "round((1 / 3.2 - 1 / 4) / (1 - 1 / 4), 3)",
    "answer = ...  # the serial fraction",
    "Write 1/S - 1/N = s (1 - 1/N), as the fit does.",
    "answer = round((1 / 3.2 - 1 / 4) / (1 - 1 / 4), 3)  # 0.083",
)

exercise(
    "8.5",
    "Using `project`, find the smallest number of micro-batches (accumulation, micro-batch 1) at which the Playbook 1B "
    "in DDP on 256 GPUs of the Playbook's cluster, with the calibrated $e$ and $\\rho = 0$, reaches 27,000 tokens/s per GPU. "
    "(Accumulating more grows the tokens per GPU per step, and with them the global batch.)",
    "next(ga for ga in range(1, 65) if project(pb.model, pb.cluster, 256, 'ddp', 1, ga, cal.compute_efficiency, 0.0)"
    ".tokens_per_s_per_gpu >= 27_000)",
    "answer = ...  # micro-batches per step",
    "Loop over the accumulation and stop at the first that reaches the target.",
    "answer = next(ga for ga in range(1, 65)\n"
    "              if project(pb.model, pb.cluster, 256, \"ddp\", 1, ga, cal.compute_efficiency, 0.0).tokens_per_s_per_gpu >= 27_000)",
)

md(r"""
## Summary

- A data-parallel step is compute, plus communication, minus what hides: compute from FLOPs per token, the
  GPU's peak and a compute efficiency $e$; communication from Chapter 2's busbw factors, the strategy's bytes
  and the link's bus bandwidth; hiding from a window (the last micro-batch's backward for DDP and ZeRO, the
  whole step for FSDP) and an overlap $\rho$.
- Peaks and bandwidths come from datasheets and published measurements; $e$ and $\rho$ from measured runs.
  Calibrate on some runs, judge on others: the Playbook's six DP points come out within
  {glue:md}`pb_worst` at worst with $e$ = {glue:text}`pb_e:.2f` and $\rho$ = {glue:text}`pb_rho:.0f` taken from three other runs.
- Measure the network: a datasheet bandwidth misses the Playbook's points ({glue:md}`ds_missed`), because real
  all-reduce bandwidth falls with the number of nodes.
- Latency is per call: a ring pays $2(N-1)$ hops, a tree $2((g-1) + \log_2 n)$ on $n$ nodes of $g$ GPUs, so at
  scale small messages go by tree and larger buckets pay less. Charged per 25 MiB bucket on top of the Playbook's
  measured bandwidths, NCCL's tuning latencies miss its largest runs ({glue:md}`lat_missed`): a latency model is for comparing
  algorithms, not (here) for predicting a step.
- Memory projections are a floor: real stacks add buffers and fragmentation on top of states, activations and
  logits.
- Amdahl's serial fraction summarises strong scaling; on a machine with fewer cores than ranks it also
  counts the waiting for cores. Weak scaling holds up better: grow the batch with the GPUs.
- DDP's communication hides when the tokens per GPU in the synchronising micro-batch exceed about $F/B$, the
  FLOP/s over the link's bytes/s: {glue:text}`h100_peak:.0f` on H100s over NVLink (bf16 gradients, at the peak);
  measured on this machine with gloo at 2 ranks, {glue:text}`knee_measured:.0f` tokens per rank against
  {glue:text}`knee_predicted:.0f` predicted.
- Few tokens per GPU between synchronisations make the network the bound; a few billion parameters make
  memory the bound (ZeRO, FSDP); tens of billions need their layers split: Chapter 9.
""")

chapter.write("08_scaling.ipynb")
