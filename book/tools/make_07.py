"""Writes book/07_debugging.ipynb (unexecuted): Chapter 7's cells, kept as code so the chapter can be reviewed in diffs.

    python book/tools/make_07.py && jupyter nbconvert --to notebook --execute --inplace book/07_debugging.ipynb
"""
from chapter_cells import HIDDEN, SOLUTION, MACHINE, Chapter  # noqa: F401  (book/tools/chapter_cells.py)

chapter = Chapter()
md, code, exercise = chapter.md, chapter.code, chapter.exercise

md(r"""
# 7. Debugging and profiling: which rank, and why

The questions people bring about distributed training are rarely "how does all-reduce work". They are
"the job stopped printing an hour ago: which rank hung, and where?", "why does my loss differ from the
single-GPU run?", "why is it slower than it should be?". A distributed bug has a property an ordinary bug
lacks: the process that shows the symptom is usually not the one that caused it. The rank that raises a
timeout is the one that waited, not the one that never came.

This chapter turns the tools of the earlier chapters into a method. By the end of it you will be able to:
- go from a symptom (a hang, a crash, a wrong loss, a growing memory) to its cause and the rank
  responsible, with the tool that names it, for twelve classic failures, each planted on a rank chosen at
  random and diagnosed on your machine;
- triage a hang: every rank's Python stack, "who waits for whom" from each rank's collective sequence
  numbers, and what `monitored_barrier`, `TORCH_DISTRIBUTED_DEBUG=DETAIL` and torch's flight recorder report
  on gloo (and where they stop);
- know which environment variable turns on which diagnostic, and which of them work only on GPUs;
- record one real training step with `torch.profiler`, draw its compute and communication lanes, read off
  how much communication hides under compute, and check the trace against nanodist's own record of the step;
- run the parity harness on your own model: does {term}`DDP`, {term}`ZeRO` or {term}`FSDP` train it as one process would, and if
  not, at which step and in which tensor does it first leave?

**The code:** [`nanodist/diverge.py`](@REPOSITORY_URL@/blob/main/nanodist/diverge.py) (the watchdog),
[`nanodist/check.py`](@REPOSITORY_URL@/blob/main/nanodist/check.py),
[`nanodist/flight.py`](@REPOSITORY_URL@/blob/main/nanodist/flight.py),
[`nanodist/profile.py`](@REPOSITORY_URL@/blob/main/nanodist/profile.py),
[`nanodist/parity.py`](@REPOSITORY_URL@/blob/main/nanodist/parity.py) and the launcher's report in
[`nanodist/launch.py`](@REPOSITORY_URL@/blob/main/nanodist/launch.py); **the lab:**
[`labs/lab07_debug.py`](@REPOSITORY_URL@/blob/main/labs/lab07_debug.py), and `--profile` on Labs 3, 4 and 5.
""")

code(r"""
import importlib.util
import inspect
import os
import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.distributed.constants
from IPython.display import Markdown, display
from myst_nb import glue

import nanodist as nd
from nanodist import experiment, parity, plots, profile
from nanodist.exercises import check, compare, expect
from nanodist.launch import resolve_script
from nanodist.results import REFERENCE_DIR, REPO_ROOT, Table, load, provenance, references

spec = importlib.util.spec_from_file_location("lab07_debug", resolve_script("lab07_debug"))
lab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lab)  # the lab's faults, their readers and its tables, to show them here


def run_triage(faults):
    # Lab 7's triage of `faults` ("all", or names), each on a rank drawn at random: its results record
    out = subprocess.run([sys.executable, str(resolve_script("lab07_debug")), "--fault", *faults,
                          "--seed", str(random.randrange(2**31))], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=240)
    written = re.search(r"^wrote (.+\.jsonl)$", out.stdout, re.M)
    assert written, out.stdout[-3000:] + out.stderr[-3000:]
    return load(REPO_ROOT / written.group(1))


def short(line, width=150):
    return line if len(line) <= width else line[:width - 5] + " [...]"
""")

md(r"""
## Twelve failures, each on a rank chosen at random

Lab 7 plants a classic failure on one rank of a small training run (2 ranks, or 3 where only a majority can
say which rank is the odd one out), lets it fail, reads what the tools printed, and says which rank caused it.
It never reads which rank it broke: the diagnosis comes from the tools' output alone, and the results file
records both, so a wrong diagnosis would show. Each faulty run sets a collective timeout of
{glue:text}`timeout_s` s (`NANODIST_TIMEOUT`), so a hang ends in seconds, not torch's default half hour.

The cell below runs all twelve, each on a rank drawn at random every time the chapter runs
(`python labs/lab07_debug.py --fault all` does the same from a shell):
""")

code(r"""
glue("timeout_s", lab.TIMEOUT_S, display=False)
glue("plant_at", lab.PLANT_AT, display=False)
glue("torch_timeout_min", round(torch.distributed.constants.default_pg_timeout.total_seconds() / 60), display=False)
run = run_triage(["all"])
rows = {r["fault"]: r for r in run["metrics"]["faults"]}
assert all(r["log"] for r in rows.values()), rows  # every faulty run left the tools' lines
print(provenance(run, ranks="2 or 3 ranks per fault (the column 'ranks')"), "Seed", run["config"]["seed"])
Table({"fault": r["fault"], "ranks": r["world_size"], "planted on rank": r["planted_rank"],
       "the tools named rank": r["diagnosed_rank"], "seconds": r["seconds"]} for r in rows.values())
""", MACHINE)

code(r"""
# every fault named on the rank it was planted on, in bounded time: a hang within the timeout it set
assert set(rows) == set(lab.FAULTS) and len(rows) == 12, rows.keys()  # "twelve" in the text
for r in rows.values():
    assert r["diagnosis"] is not None and r["diagnosed_rank"] == r["planted_rank"], r
    assert r["seconds"] <= (15 if r["fault"] == "hang" else 30) + 5, r  # + starting the ranks
print(f"{len(rows)} faults, each named on the rank it was planted on; the slowest took "
      f"{max(r['seconds'] for r in rows.values()):.0f} s. The diagnoses:")
for r in rows.values():
    print(textwrap.fill(f"{r['fault']}: {r['diagnosis']}", 78, subsequent_indent="    "))
""", MACHINE)

md(r"""
Each diagnosis is a rank and a reason read from one line of a tool's output: the *evidence* below. Port in use
is the one failure without a rank: it happens before any rank starts.

## From symptom to cause: a decision tree

Start from what you see, not from what you suspect:

1. **The run stops printing** (a hang). Ask where every rank is.
   - One rank is *not in a collective* while the others wait in one: that rank is stuck in its own code (a
     deadlock, a slow save, an `input()`); its stack says where. → *hang*
   - Every rank is in a collective, but not the same one: their control flow diverged (one skipped a backward,
     took a branch, ran one more step). → *skip-backward*
   - Every rank is in the same collective, with different shapes or dtypes. → *mismatch*
   - The run hangs at a point every rank must reach (a barrier, a checkpoint), one rank still inside a
     collective: the ranks called different numbers of collectives, and the extra calls paired up with the
     wrong partners silently until then. → *no-sync-forward*
2. **The run crashes.** When a rank *dies* (a signal, the out-of-memory killer), the first rank to fail is the
   cause and the others fail because it left: the launcher's root-cause report names it. → *dead-peer* When
   every rank raises the same error, the first to exit is only the fastest: read the rank the message names.
   → *nan* And a launch can fail before any rank exists. → *port-in-use*
3. **No error, but the numbers are wrong.**
   - The replicas are not equal. → *desync*
   - Samples are read twice, or never. → *set-epoch*, *uneven-data*
   - The logged curve depends on which rank logs it. → *rank-local-metric*
   - Everything agrees across ranks, yet differs from one process: run the parity harness (the last section).
4. **Memory grows every step** on one rank. → *memory-blowup*

Every branch, with the tool that decides it, and below the table what that tool printed on your machine in the
run above:
""")

code(r"""
assert all(r["evidence"] and lab.FAULTS[name].symptom and lab.FAULTS[name].tool for name, r in rows.items())
display(Table({"symptom": lab.FAULTS[name].symptom, "fault": name, "the tool that names it": lab.FAULTS[name].tool}
              for name in rows).wrapped())
print("What each tool said here:")
for name, r in rows.items():
    print(textwrap.fill(f"{name}: {short(r['evidence'], 300)}", 78, subsequent_indent="    "))
""", MACHINE)

md(r"""
## Hangs: who waits for whom

A hang is the hardest failure to read, because nothing is printed: every rank that called the collective
waits, and the one that did not call it is busy somewhere else. Three things make it speak.

**A timeout that you choose.** torch's default collective timeout on gloo is {glue:text}`torch_timeout_min`
minutes (shorter on NCCL): set one fitting your step time (`nd.init(timeout=...)`, or `NANODIST_TIMEOUT`), so a hang becomes an error.

**A watchdog that asks every rank where it is.** nanodist numbers each collective a rank launches. When a
collective has waited `NANODIST_STALL_S` seconds, the waiting ranks ask every rank, through the rendezvous
store (not through the process group, which is the thing stuck), for its collective number and its
Python stack. A rank whose last collective is behind the others' and that is not in one is the rank holding
everyone up; ranks in *different* collectives have diverged. Here is what it printed for the hang above:
""")

code(r"""
said = [line for line in rows["hang"]["log"] if "nanodist:" in line]
assert any(f"rank {rows['hang']['planted_rank']} is not in a collective" in line for line in said), said
hang_waits, hang_last = map(int, re.search(r"in collective #(\d+) .*\(last: #(\d+)", said[-1]).groups())
assert hang_last < hang_waits, said[-1]
glue("hang_waits", hang_waits, display=False)
glue("hang_last", hang_last, display=False)
for line in said:
    print(textwrap.fill(line, 78, subsequent_indent="    "))
""", MACHINE)

md(r"""
The collective numbers are the *who waits for whom*: the waiting ranks are in collective
{glue:text}`hang_waits`, the missing one's last was {glue:text}`hang_last` and it is in none now, and its stack
(`now at ...`) shows the line it is on.

**Every rank's stack when the job is stopped.** When a launch runs past its own timeout,
`nanodist.launch` asks each rank for its Python stack (`faulthandler`, through a signal the ranks
register at start) and, when `py-spy` is installed, takes `py-spy dump` of each rank as well: py-spy reads a
process from outside, so it needs nothing registered in advance and works on any Python process (`py-spy dump
--native --pid PID` adds the C++ frames). The same hang as above, with the watchdog off
and the collective timeout long, stopped by the launcher instead:
""")

code(r"""
hang_rank = random.randrange(2)
try:
    nd.launch("lab07_debug", nproc=2, echo=False, timeout=10,  # long after the hang began, on a slow machine too
              args=["--fault", "hang", "--rank", str(hang_rank)], env={"NANODIST_STALL_S": "0", "NANODIST_TIMEOUT": "60"})
    raise AssertionError("the hang finished")
except nd.LaunchTimeout as e:
    stopped = e
where = str(stopped).split("Where each rank was", 1)[1]
print("Where each rank was" + where[:1500])
spied = [re.sub(r"\x1b\[[0-9;]*m", "", ln.split("py-spy:", 1)[1])  # without py-spy's colours
         for ln in stopped.output.splitlines() if ln.startswith(f"[rank{hang_rank}]:py-spy:")]
main = next((i for i, ln in enumerate(spied) if "MainThread" in ln), None)
if main is None:
    print("(py-spy is not installed here: pip install py-spy)")
else:
    print(f"py-spy's dump of rank {hang_rank}, its main thread:")
    print("\n".join(spied[main:main + 6]))
stacks = {int(r): line for r, line in re.findall(r"rank (\d+): (.*)", where)}
assert "hang" in stacks[hang_rank] and "hang" not in stacks[1 - hang_rank], stacks  # faults.hang on that rank only
""", MACHINE)

md(r"""
**What torch itself offers, on gloo.** Three tools ship with torch; Lab 7 uses each where it works.

- `torch.distributed.monitored_barrier(timeout=..., wait_all_ranks=True)`: a barrier in which rank 0
  waits for each rank in turn and names those that did not arrive. It is implemented for gloo only, and it
  is a collective like any other: it can only name a rank that is *late*, so put it at a point every rank
  must reach (the end of an epoch, before a checkpoint).
- `TORCH_DISTRIBUTED_DEBUG=DETAIL`: before every collective the ranks pass a monitored barrier and compare a
  fingerprint (operation, shapes, dtypes) on a helper gloo group, and a mismatch raises on every rank, naming
  both calls. That is two extra exchanges per call, and in torch 2.13 on gloo it crashes torch's own
  `DistributedDataParallel` at construction (a segmentation fault; `tests/test_lab07.py` checks that it
  still does): use it on a small reproduction, not on the run.
- The flight recorder (`TORCH_FR_BUFFER_SIZE=N`): each process group keeps its last N collectives, their
  sequence numbers and sizes. On NCCL it has long existed, with each entry's state (scheduled, started,
  completed), dumped on a timeout with `TORCH_NCCL_DUMP_ON_TIMEOUT=1` and read across ranks by torch's
  `fr_trace` tool. In torch 2.13 gloo's process groups record too, and `nanodist.flight` reads them; on gloo
  an entry's state stays "scheduled", so the recorder says which collectives a rank *called*, not which
  finished.

What they said in the run above: the mismatch (DETAIL's fingerprints, the tensor shapes differing), and the
forward outside `no_sync()` (the barrier naming the rank that never arrived; the flight recorder's count of
collectives on every rank, one rank having called more):
""")

code(r"""
for name, keep in (("mismatch", r"Detected mismatch"), ("no-sync-forward", r"monitoredBarrier|flight recorder")):
    print(f"-- {name}")
    seen = set()
    for line in rows[name]["log"]:  # what each rank printed (the launcher's summary repeats it)
        said = re.sub(r"^(\[rank\d+\]:)+ *(RuntimeError: )?", "", line)
        if line.startswith("[rank") and re.search(keep, line) and said not in seen:
            seen.add(said)
            print(textwrap.fill(short(line, 400), 78, subsequent_indent="    "))
    assert seen, rows[name]["log"]
""", MACHINE)

md(r"""
**On GPUs, NCCL.** torch's NCCL process group runs a watchdog thread that watches every collective; on a timeout torch tears the
process down (`TORCH_NCCL_ASYNC_ERROR_HANDLING`) and, with `TORCH_NCCL_DUMP_ON_TIMEOUT=1`, each rank first
writes its flight recorder to a file, so that `fr_trace` can say which rank stopped at which collective.
`NCCL_DEBUG=INFO` prints what NCCL chose (rings, trees, transports) and why a connection failed. None of
this runs on a CPU: the table below marks it.

## The environment variables

Every diagnostic above is a variable away. Those marked GPU-only are read by NCCL or by torch's CUDA build;
each of the others appears in the torch installed here or in nanodist (`tests/test_lab07.py` checks):
""")

code(r"""
Table({"variable": name, "read by": scope, "what it does": what} for name, scope, what in lab.ENVIRONMENT).wrapped()
""")

md(r"""
Set them for every rank: in the shell before `torchrun`, or in `nd.launch(..., env={...})`. Variables that torch
reads when the process group is made (`TORCH_DISTRIBUTED_DEBUG`, `TORCH_FR_BUFFER_SIZE`) do nothing if set later.

## A profiler trace of one step

Whether a step is slow because of compute, communication, or communication that fails to hide under
compute is a question for a profiler. `--profile` on Labs 3, 4 and 5 records one more step of the run under
`torch.profiler` on every rank and exports a Chrome trace (open it in https://ui.perfetto.dev).
`nanodist.profile.read_trace` reads it back as two lanes, compute and communication, and the list of
collectives in the order they were launched; the fraction of the communication lane that has compute
running beside it is the **overlap**.

The profiler is torch's own, and the code is what you would write at work: a `torch.profiler.profile` around
one step (CUDA too on a GPU; `record_shapes` keeps each collective's tensor sizes), a labelled span to find the
step by, and `export_chrome_trace`. These are the lines of `nanodist.experiment.profile_step` that do it:
""")

code(r"""
source = inspect.getsource(experiment.profile_step).splitlines()
start = next(i for i, line in enumerate(source) if "activities = " in line)
stop = next(i for i, line in enumerate(source) if "profiled = step()" in line)
export = next(line for line in source if "export_chrome_trace" in line)
print(textwrap.dedent("\n".join(source[start:stop + 1])))
print("...")
print(export.strip())
""")

md(r"""
The same step of nanodist's DDP, 2 ranks, the small model, its gradients all-reduced by gloo as on a GPU
(`--shared-memory off`: on CPU ranks nanodist otherwise reduces through shared memory, synchronously, in the
backward's own thread), twice: with the default 25 MiB gradient buckets, and with buckets of half a megabyte:
""")

code(r"""
PROFILE = ["--impl", "nanodist", "--model", "small", "--steps", "6", "--no-progress", "--profile", "--shared-memory", "off"]
profiled = {mb: nd.launch("lab03_ddp", nproc=2, echo=False, args=PROFILE + ["--bucket-mb", str(mb)]).results
            for mb in (25, 0.5)}
traces = {}
for mb, rec in profiled.items():
    p = rec["metrics"]["profile"]["nanodist"][0]  # rank 0's
    traces[mb] = profile.read_trace(Path(rec["_path"]).parent / p["trace"])  # beside the run's results file
    print(f"buckets of {mb} MiB: {len(p['collectives'])} collectives traced, "
          f"{len(p['own_record'])} in DDP's own record; "
          f"profiled step {1e3 * p['profiled_step_s']:.1f} ms, unprofiled {1e3 * p['unprofiled_step_s']:.1f} ms")
glue("profile_caption", Markdown(f"*{provenance(profiled[25])}*"), display=False)
for mb, name in ((25, "25"), (0.5, "05")):
    glue(f"overlap_{name}", 100 * traces[mb].overlap(), display=False)
    glue(f"step_{name}_ms", 1e3 * profiled[mb]["metrics"]["profile"]["nanodist"][0]["unprofiled_step_s"], display=False)


def bucket_launches(mb):
    # when DDP launched each bucket's all-reduce, in seconds from the start of the profiled step: the trace's
    # collectives that DDP's own record lists (the control numbers' 5-element all-reduce is not a bucket)
    own = {tuple(entry) for entry in profiled[mb]["metrics"]["profile"]["nanodist"][0]["own_record"]}
    return [c.start_s for c in traces[mb].collectives if (c.kind, c.numel) in own]


launches = {mb: bucket_launches(mb) for mb in profiled}
for mb, name in ((25, "25"), (0.5, "05")):
    glue(f"launch_{name}", 100 * launches[mb][0] / traces[mb].step_s, display=False)
glue("buckets_05", len(launches[0.5]), display=False)
# Which collectives there are, and what runs between their launches, is the structure; how much compute runs
# beside them is timing (it moves from run to run on 2 shared cores), shown and not asserted.
assert len(launches[25]) == 1 < len(launches[0.5]), launches  # the whole gradient in one bucket, or several
first, last = launches[0.5][0], launches[0.5][-1]
between = sum(max(0.0, min(b, last) - max(a, first)) for a, b in profile.union(traces[0.5].compute))
assert between > 0, launches  # the backward still computed after the first small bucket's all-reduce was launched
""", MACHINE)

code(r"""
h200 = [r for r in references("lab03_ddp") if r["device"] == "cuda" and r["world_size"] == 2
        and "profile" in r["metrics"]][0]
h200_trace = profile.read_trace(REFERENCE_DIR / "lab03_ddp" / (h200["metrics"]["profile"]["nanodist"][0]["trace"]
                                                                + ".gz"))  # committed compressed
assert h200_trace.device == "cuda" and h200_trace.collectives and all(t.collectives for t in traces.values())
fig, axes = plt.subplots(3, 1, figsize=(6.6, 6.4))
plots.trace_lanes(traces[25], axes[0], "your machine, 25 MiB buckets")
plots.trace_lanes(traces[0.5], axes[1], "your machine, 0.5 MiB buckets")
plots.trace_lanes(h200_trace, axes[2], "H200 (reference), 25 MiB buckets")
fig.tight_layout()
plots.show(fig)
glue("h200_caption", Markdown(f"*{provenance(h200)}*"), display=False)
for name, value in (("h200_compute_ms", h200_trace.busy_s("compute")), ("h200_step_ms", h200_trace.step_s),
                    ("h200_comm_ms", h200_trace.busy_s("communication"))):
    glue(name, 1e3 * value, display=False)
""", MACHINE)

md(r"""
Top and middle: {glue:md}`profile_caption` Bottom: the reference run committed with the book, {glue:md}`h200_caption`
Its two ranks share one GPU and talk through gloo, so the gradients travel through the host.

Read the lanes. With one 25 MiB bucket the small model's whole gradient is one all-reduce, launched when the
backward is over ({glue:text}`launch_25:.0f` % into the step): only DDP's own last operations on the gradients
can run beside it ({glue:text}`overlap_25:.0f` % of its time had compute beside it in this run).
Cut into {glue:text}`buckets_05` half-megabyte buckets, the first all-reduce is launched
{glue:text}`launch_05:.0f` % into the step, while the backward still computes the earlier layers' gradients:
the overlap Chapter 3 built DDP for ({glue:text}`overlap_05:.0f` % of the communication had compute beside it).
Which collectives there are, and where in the step they start, hold on every run; how much compute runs beside
them moves from run to run on two shared cores, and more of it is not a faster step here: gloo's thread takes its core from the compute it
runs beside (unprofiled, the step took {glue:text}`step_25_ms:.1f` ms with one bucket and
{glue:text}`step_05_ms:.1f` ms with the small ones).
Overlap pays where the network is a device of its own, as a GPU's is. On the GPU the
kernels are short and far apart: they keep it busy {glue:text}`h200_compute_ms:.1f` ms of a
{glue:text}`h200_step_ms:.1f` ms profiled step (a model this small leaves the GPU waiting for the host most of
the time), and the {glue:text}`h200_comm_ms:.1f` ms all-reduce through the host starts after the backward's last
kernel, with nothing left to hide it under. No NCCL kernel is in this trace: its two ranks share one GPU and
talk through gloo. A trace of NCCL's overlap needs two GPUs.

The trace and nanodist's own record must tell the same story. DDP records each bucket's all-reduce as it
launches it (Chapter 3's timeline); the trace records the `c10d` operators the process group ran. The same
collectives, in the same order, or the profile says where they part:
""")

code(r"""
for mb, rec in profiled.items():
    p = rec["metrics"]["profile"]["nanodist"][0]
    print(f"{mb} MiB buckets:", experiment.profile_line(p).split("; ")[-1])
    assert p["agreement"]["agrees"], p["agreement"]
    assert 0 < p["ratio_profiled_vs_unprofiled"] < 10, p
a = profiled[0.5]["metrics"]["profile"]["nanodist"][0]
record, matched = list(map(tuple, a["own_record"])), []
for c in a["collectives"]:  # the trace in launch order; each of the record's entries matched once, in order
    mine = len(matched) < len(record) and (c["kind"], c["numel"]) == record[len(matched)]
    if mine:
        matched.append(c)
    print(f"{1e3 * c['start_s']:7.2f} ms  {c['kind']} of {c['numel']:>7,} elements   "
          + (f"DDP's record #{len(matched)}" if mine else "(not in DDP's record)"))
extra = a["agreement"]["extra"]
assert len(matched) == len(record) and len(extra) == 1 and extra[0][1] < 64, extra  # DDP's few control numbers
glue("extra_numel", extra[0][1], display=False)
""", MACHINE)

md(r"""
The trace holds one collective more than DDP's record, an all-reduce of {glue:text}`extra_numel` elements: DDP's
control numbers (which parameters got a gradient, and the step's agreement check), not a gradient bucket. The check asks only that the record's collectives
appear in the trace in the record's order. `tests/test_profile.py` checks the same for ZeRO-2
(`labs/lab04_zero.py --profile`) and FSDP (`labs/lab05_fsdp.py --profile`), whose own records are the
sync engine's buckets and FSDP's gather and reduce events.

A profiled step is slower than an unprofiled one (the profiler records every operator): the lab prints both,
and their ratio is the price of looking.

## Is it the same training? The parity harness

The hardest bugs raise no error: the run trains, a little worse than it should. The parity harness asks the
question every data-parallel set-up must answer yes to: *does it train the model as one process would, on the
same global batch?* Give it your model, your batches and your optimizer:

```python
import nanodist as nd
from nanodist import parity

nd.init()                                                  # under torchrun, on every rank
report = parity.harness(model_fn=MyModel,                  # a fresh model, the same weights every call
                        batches=my_batches,                # (step, rank, world_size) -> this rank's (x, y)
                        optimizer=parity.OptimizerSpec(torch.optim.SGD, {"lr": 0.05}),
                        steps=4)
parity.print_harness(report)
```

It trains one process on the whole batch, then each set-up (nanodist's DDP, ZeRO-1, ZeRO-2 and FSDP, and
torch's DDP, ZeRO-1 (`ZeroRedundancyOptimizer` under DDP) and FSDP2), and compares them step by step, in the
order things happen: the loss, each gradient, the gradient norm, each parameter after the update. It reports the
first step and quantity where a set-up leaves one process beyond a tolerance, with the tensor that deviates most
there, or that none did. The tolerances are far above what summing in another order costs, and far below a
gradient off by a thousandth.

`labs/lab07_debug.py --parity` runs it on two families of models (the course's awkward `UserModel` with
AdamW, and a small convolutional network with SGD and momentum), then plants three bugs by monkeypatching,
each on one rank: DDP's bucket all-reduce sending gradients 0.1 % too large, a rank reading another rank's
rows of the batch, and ZeRO-2 stepping one rank's {term}`shard` with a learning rate 1 % too large:
""")

code(r"""
parity_run = nd.launch("lab07_debug", nproc=2, echo=False, args=["--parity"]).results
demo = parity_run["metrics"]["parity"]
print(provenance(parity_run))
for case, report in demo["reports"].items():
    print(f"== {demo['about'][case]}")
    parity.print_harness(report)
reports = demo["reports"]
for family in ("user", "conv"):  # correct set-ups: no divergence (ZeRO-2 is DistAdamW's: not SGD, and says so)
    for name, r in reports[family].items():
        assert r.get("diverged") is None and ("skipped" in r) == (family == "conv" and name == "zero2"), (name, r)
found = {bug: reports[bug][setup]["diverged"] for bug, setup in
         (("loud-bucket", "ddp"), ("same-rows", "ddp"), ("fast-shard", "zero2"))}
assert (found["loud-bucket"]["step"], found["loud-bucket"]["quantity"]) == (0, "gradient")
assert (found["same-rows"]["step"], found["same-rows"]["quantity"]) == (0, "loss")
assert (found["fast-shard"]["step"], found["fast-shard"]["quantity"]) == (0, "parameters")
assert reports["fast-shard"]["ddp"]["diverged"] is None  # torch's AdamW under DDP: not the patched update
glue("loud_dev", found["loud-bucket"]["deviation"], display=False)
""", MACHINE)

md(r"""
Each bug is found where it enters. The loud bucket corrupts a gradient before any update, so the gradient is
the first thing off, at the first step. The wrong rows change the data, so the loss itself is off before any
gradient is computed. The fast shard leaves every gradient right and corrupts the parameters its rank updates,
so the first thing off is a parameter after the first step, while DDP beside it, which does not use the
patched update, stays equal. *Where* a divergence first appears points at the code to read.

Two limits. nanodist's ZeRO-1 and ZeRO-2 and its FSDP do not hold whole gradients after the backward, so their
gradients are not compared (the report says so), only what follows from them. And the harness compares averaged-gradient
training: a set-up that is *meant* to differ from one process (a different learning rate per rank, local
SGD, a lossy compression of the gradients) needs its own reference.

## Exercises

The first three are logs from faults you have not seen: the folded cell below planted three faults drawn at
random from the lab's quicker ones, each on a random rank, and kept what the tools printed, with the lab's own
names masked. For each, name the fault (a key of `lab.FAULTS`: the decision tree and the table under it are
your guide) and the rank that caused it, as `answer = ("fault name", rank)`.
""")

code(r"""
#@title Three faults on random ranks (hidden until you open it)
POOL = ["nan", "desync", "mismatch", "uneven-data", "set-epoch", "rank-local-metric", "skip-backward", "memory-blowup"]
drawn = random.sample(POOL, 3)
quiz_rows = {r["fault"]: r for r in run_triage(drawn)["metrics"]["faults"]}
LOGS = {f"7.{i + 1}": quiz_rows[name] for i, name in enumerate(drawn)}
assert all(r["diagnosed_rank"] == r["planted_rank"] for r in LOGS.values()), LOGS


def show(exercise):
    lines = lab.unlabelled(LOGS[exercise])
    for line in lines:
        print(textwrap.fill(short(line, 330), 78, subsequent_indent="    "))
    return lines
""", HIDDEN)

HINT = ("Find the line a tool printed (the watchdog, a check of nanodist.check, torch's error, a memory line), then "
        "the branch of the decision tree that tool decides. The rank is the one that line singles out, which is "
        "not always the rank that printed it.")
for key in ("7.1", "7.2", "7.3"):
    md(f"**{key[2:]}.** The log:")
    code(f"log = show({key!r})\nassert log  # the lines the tools printed", MACHINE)
    exercise(
        key,
        "Which fault, and which rank?",
        f"(LOGS[{key!r}]['fault'], LOGS[{key!r}]['planted_rank'])",
        "answer = ...  # a pair: (the fault's name, a key of lab.FAULTS; the rank that caused it)",
        HINT,
        f"# The fault whose tool printed the log's deciding line, and the rank that line singles out: the lab's own\n"
        f"# reader of that tool's output (lab.FAULTS[name].diagnose) finds the same rank in these lines.\n"
        f"name = LOGS[{key!r}]['fault']\n"
        f"answer = (name, lab.FAULTS[name].diagnose('\\n'.join(LOGS[{key!r}]['log']))[0])",
    )

md(r"""
Two more, *predict, then run*: write your prediction, then run the cell after it, which measures the answer on
your machine.
""")

chapter.predict(
    "7.4",
    "In the hang above, the hang struck at step {glue:text}`plant_at` (counting from 0) before that step's first "
    "collective: the watchdog found the waiting ranks in collective #{glue:text}`hang_waits` and the hanging rank's "
    "last collective was #{glue:text}`hang_last` (collective #1 is step 0's first: none runs before training). Plant the same hang at step 3 instead (`--at 3`). Which two numbers will the "
    "watchdog report? Write `prediction = (the collective the others wait in, the hanging rank's last)`.",
    "prediction = ...   # a pair: (the collective the waiting ranks are in, the hanging rank's last one)",
    "try:\n"
    "    nd.launch(\"lab07_debug\", nproc=2, echo=False, timeout=60, args=[\"--fault\", \"hang\", \"--rank\", \"1\", \"--at\", \"3\"],\n"
    "              env={\"NANODIST_STALL_S\": \"1\", \"NANODIST_TIMEOUT\": \"8\"})\n"
    "    raise AssertionError(\"the hang finished\")\n"
    "except nd.LaunchError as e:\n"
    "    said = [line for line in e.output.splitlines() if \"is not in a collective\" in line][-1]\n"
    "measured = tuple(map(int, re.search(r\"in collective #(\\d+) .*\\(last: #(\\d+)\", said).groups()))",
    "Every step runs the same collectives. How many does one step run, from the two numbers above? Which one "
    "does a step start with, and where is each rank when the hang strikes?",
    "# The hang strikes before step 3's first collective. Steps 0 to 2 ran the same number each: the hanging rank's\n"
    "# last is the end of step 2, and the others wait in the collective after it, step 3's first.\n"
    "per_step = hang_last // lab.PLANT_AT   # the run above: its steps before the hang ran `hang_last` collectives\n"
    "prediction = (3 * per_step + 1, 3 * per_step)",
)

chapter.predict(
    "7.5",
    "The loud bucket above scaled one rank's gradients by 1.001 (0.1 % too large) before DDP averaged them over "
    "the 2 ranks, and the harness found the first divergence in a gradient, off by {glue:text}`loud_dev:.1e` of its "
    "largest element. Predict what it reports when the factor is 1.01. Write `prediction = ...` (the deviation).",
    "prediction = ...   # the deviation the harness reports with a factor of 1.01",
    "loud = nd.launch(\"lab07_debug\", nproc=2, echo=False, args=[\"--parity\", \"--cases\", \"loud-bucket\", \"--loud\", \"1.01\"])\n"
    "measured = loud.results[\"metrics\"][\"parity\"][\"reports\"][\"loud-bucket\"][\"ddp\"][\"diverged\"][\"deviation\"]",
    "Write the averaged gradient with the factor in it, and the difference from the right one. How does the "
    "difference grow with the factor's excess over 1?",
    "# The averaged gradient is (g_0 + s * g_1) / 2, off by (s - 1) * g_1 / 2: linear in s - 1. Ten times the excess\n"
    "# (0.01 against 0.001), ten times the deviation, in the same tensor.\n"
    "prediction = 10 * found[\"loud-bucket\"][\"deviation\"]",
    rel_tol=0.02,
)

md(r"""
## Summary

- A distributed failure shows on the ranks that waited, not on the one that caused it. Start from the
  symptom (a hang, a crash, wrong numbers, growing memory) and ask the tool that decides the branch.
- A hang needs a timeout you chose, then: which rank is not in a collective (nanodist's watchdog), which
  ranks are in different collectives, every rank's stack (faulthandler from inside, py-spy from outside).
- On gloo, `monitored_barrier` names a late rank, `TORCH_DISTRIBUTED_DEBUG=DETAIL` a mismatched collective
  (not under torch's DDP in torch 2.13), and the flight recorder (`TORCH_FR_BUFFER_SIZE`) each rank's
  collectives. On NCCL, the watchdog, `TORCH_NCCL_DUMP_ON_TIMEOUT` and `NCCL_DEBUG` do the rest.
- Silent errors are found by checking what must hold: equal replicas (`assert_params_in_sync`), each sample
  read once (`check_sampler_exactly_once`), the same logged value on every rank (`assert_same_across_ranks`),
  and the same training as one process (the parity harness).
- `--profile` records one step with `torch.profiler` (the same few lines work in any training loop): its
  lanes show how much communication hides under compute, and the trace agrees with nanodist's own record of
  the step. Overlap is not speed: it pays where communication has hardware of its own.
""")

chapter.write("07_debugging.ipynb")
