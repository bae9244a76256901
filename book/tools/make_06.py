"""Writes book/06_checkpoint.ipynb (unexecuted): Chapter 6's cells, kept as code so the chapter can be reviewed in diffs.

    python book/tools/make_06.py && jupyter nbconvert --to notebook --execute --inplace book/06_checkpoint.ipynb
"""
from chapter_cells import HIDDEN, SOLUTION, MACHINE, Chapter  # noqa: F401  (book/tools/chapter_cells.py)

chapter = Chapter()
md, code, exercise = chapter.md, chapter.code, chapter.exercise

md(r"""
# 6. Checkpoints: losing minutes, not the run

A training run on many machines fails. A GPU falls off the bus, a node reboots, a NaN appears, the job's
time slot ends. Meta's report on Llama 3 counted 419 unexpected interruptions in 54 days of pre-training on 16,384 GPUs,
about one every three hours {cite}`grattafiori2024llama3`. What it
loses each time is everything since its last **checkpoint**, plus the time to start again. This chapter
makes that small, and *exact*: the resumed run takes the very steps the uninterrupted one would have
taken, bit for bit.

That is harder than `torch.save(model.state_dict())`. By the end of the chapter you will be able to:
- list everything a training run's state holds, and show what goes wrong when one piece is forgotten;
- save it **atomically** (complete or absent, never half), **safely** (a file cannot run code), in one
  **full** file or **{term}`sharded <shard>`** across ranks with `torch.distributed.checkpoint` ({term}`DCP`);
- resume a run killed by `kill -9` under `torchrun --max-restarts`, and prove it bit-exact by hashes;
- resume a sharded checkpoint at another number of ranks, reading every sample exactly once;
- choose how often to save from the measured save time and a failure rate (the Young/Daly interval);
- write the same with DCP directly: `get_state_dict` / `set_state_dict`, a `Stateful` application state,
  `dcp.save`, `dcp.async_save`, `dcp.load`, and a conversion to one `torch.save` file.

Everything but the last section is `nanodist.checkpoint` and `labs/lab06_checkpoint.py`.

**The code:** [`nanodist/checkpoint.py`](@REPOSITORY_URL@/blob/main/nanodist/checkpoint.py); **the lab:** [`labs/lab06_checkpoint.py`](@REPOSITORY_URL@/blob/main/labs/lab06_checkpoint.py).
""")

code("""
import inspect
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from IPython.display import Markdown
from myst_nb import glue

import nanodist as nd
from nanodist import checkpoint, plots
from nanodist.check import check_sampler_exactly_once
from nanodist.checkpoint import CheckpointError, CheckpointManager, fingerprint, read_meta, verify
from nanodist.costmodel import checkpoint_overhead, young_daly_interval
from nanodist.data import CharTokenizer, TokenStream, generate_corpus
from nanodist.exercises import check, compare, expect
from nanodist.model import GPT, GPTConfig
from nanodist.results import Table, provenance
from nanodist.train import TrainConfig, Trainer

home, scratch = Path.cwd(), tempfile.mkdtemp(prefix="nanodist-ch6-")
os.chdir(scratch)  # the chapter's checkpoints go to a temporary folder, and paths are named relative to it
work = Path(".")


def caption(name, record):
    \"\"\"Glue a figure's provenance line (machine, backend, world size, torch, date) for the text below it.\"\"\"
    glue(name, Markdown(f"*{provenance(record)}*"), display=False)
""")

md(r"""
## What a training state is

Here is a small run, in this process: a GPT with dropout, AdamW, a learning-rate schedule with warm-up, and
a shuffled token stream. A `CheckpointManager` saves it every 3 steps.
""")

code(r"""
text = generate_corpus(30_000, seed=0)
tok = CharTokenizer(text)
tokens = torch.tensor(tok.encode(text))


def make_trainer(manager=None, steps=10):
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", vocab_size=tok.vocab_size, block_size=16, dropout=0.1))
    stream = TokenStream(tokens, batch_size=4, block_size=16, seed=0)
    cfg = TrainConfig(steps=steps, total_batch_tokens=4 * 16, micro_batch=4, seq_len=16, lr=3e-3, warmup_steps=4,
                      progress=False, log_every=0, checkpoint_every=3)
    return Trainer(model, torch.optim.AdamW(model.parameters(), lr=3e-3), stream, cfg, checkpoints=manager)


straight = make_trainer()
straight_losses = [h["loss"] for h in straight.fit()]

saver = make_trainer(CheckpointManager(work / "small", format="full", keep=5))
saver.fit(max_steps=6)
print([p.name for p in saver.checkpoints.complete()])
""")

md(r"""
`Trainer.state_dict()` is everything the next step depends on:
""")

code(r"""
state = saver.state_dict()


def size(value):
    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(size(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(size(v) for v in value)
    return 0


what = {"model": "every parameter, by name", "optimizer": "AdamW's step and moments, by parameter name",
        "scheduler": "where the learning-rate schedule is", "data": "the stream's global cursor: epoch, windows read",
        "rng": "each rank's random generators (python, numpy, torch, CUDA)", "step": "optimizer steps taken",
        "tokens_seen": "tokens trained on", "skipped_steps": "steps skipped for a non-finite loss",
        "run_id": "the run's name: results and wandb continue it", "world_size": "ranks that saved it",
        "config": "the TrainConfig"}
Table({"entry": k, "holds": what[k], "tensors (KiB)": round(size(state[k]) / 1024, 1)} for k in state)
""")

md(r"""
Most of the bytes are the model and the optimizer (AdamW keeps two moments per parameter: twice the
model). The rest is small, and every piece of it matters. To see how much, resume the run at step 6
from its checkpoint, exactly, and then four times more, each time putting one piece back to what a
fresh start has:
""")

code(r"""
step6 = work / "small" / "step_00000006"
fresh = make_trainer()
curves = {"uninterrupted": straight_losses}


def resumed(forget=None):
    t = make_trainer()
    checkpoint.load(step6, t)
    if forget == "random generators":
        torch.manual_seed(0)  # what a restarted script does at its start
    elif forget == "data position":
        t.train_data.load_state_dict(fresh.train_data.state_dict())  # the stream from its beginning
    elif forget == "optimizer state":
        t.optimizer.state.clear()  # AdamW's moments from zero
    elif forget == "learning-rate schedule":
        t.scheduler.load_state_dict(fresh.scheduler.state_dict())  # warm-up again
    return [h["loss"] for h in t.fit()]


for forget in (None, "random generators", "data position", "optimizer state", "learning-rate schedule"):
    curves["resumed exactly" if forget is None else f"forgot the {forget}"] = straight_losses[:6] + resumed(forget)

exact = curves["resumed exactly"] == straight_losses
assert exact and all(c[6:] != straight_losses[6:] for k, c in curves.items() if k.startswith("forgot"))
forgotten = [k for k in curves if k.startswith("forgot")]
fig, axes = plt.subplots(2, 2, figsize=(6.6, 5.2), sharex=True, sharey=True, gridspec_kw={"hspace": 0.45})
for ax, name in zip(axes.flat, forgotten):
    ax.plot(straight_losses, color="#333333", lw=3, label="uninterrupted = resumed exactly")
    ax.plot(curves[name], color=plots.PALETTE[3], lw=1.4, marker=".", label="resumed, one piece forgotten")
    ax.axvline(5.5, color="gray", ls=":")
    ax.set_title(name, fontsize=10)
    ax.spines[["top", "right"]].set_visible(False)
for ax in axes[1]:
    ax.set_xlabel("step")
for ax in axes[:, 0]:
    ax.set_ylabel("training loss")
axes[1, 0].legend(loc="upper left", bbox_to_anchor=(0.0, -0.3), ncol=2, frameon=False)
fig.suptitle("Resumed at step 6 (dotted line): exactly, and with one piece forgotten")
plots.show()
Table({"run": k, "equal to uninterrupted": c == straight_losses,
       "first step that differs": next((i for i, (x, y) in enumerate(zip(c, straight_losses)) if x != y), "none")}
      for k, c in curves.items())
""")

md(r"""
The losses themselves are floating-point results of training, whose last digits differ from one CPU to
another; the equalities above hold on every CPU. Here they are, as this machine computed them:
""")

code(r"""
assert all(len(c) == len(straight_losses) for c in curves.values()) and curves["resumed exactly"] == straight_losses
Table({"run": k, "loss at step 7": round(c[7], 4), "loss at step 9": round(c[9], 4)} for k, c in curves.items())
""", MACHINE)

md(r"""
Only the exact resume takes the same steps; every forgotten piece changes the run, each for its own reason:
- **random generators**: dropout draws other masks from step 6 on;
- **data position**: the stream starts its epoch again and the model sees the first batches twice (and,
  by the end of the epoch, never sees the ones it skipped);
- **optimizer state**: AdamW's moments restart from zero, so its first updates are large (the
  bias correction divides by a small $1 - \beta^t$);
- **learning-rate schedule**: the warm-up runs again, and the learning rate jumps back to its start.

None of these crash. A run that forgets one just trains a little differently, or a little worse. That is
why the tests of `nanodist.checkpoint` compare the final parameters with `torch.equal` and never with a
tolerance.

A few details decide whether such a state can be reused at all:
- the optimizer's state is keyed by **parameter name**, not by position, so that it still fits if
  parameters are reordered or wrapped differently;
- the data position is one **global cursor** (windows read by all ranks in this epoch), from which any
  number of ranks derives its next windows;
- the random generators are stored **per rank**, under keys `rank0`, `rank1`, ..., because each rank
  draws its own.

## Two formats

**Full**: rank 0 gathers everything into one `state.pt`. Plain torch reads it, at any world size:
""")

code(r"""
full = torch.load(step6 / "state.pt", weights_only=True)
print(sorted(full), "step", full["step"], "| rng of", sorted(full["rng"]), "| wte", tuple(full["model"]["wte.weight"].shape))
meta = read_meta(step6)
assert meta["code"]["torch"] == torch.__version__  # the versions that wrote it (this machine's: not printed here)
print(json.dumps({**{k: meta[k] for k in ("state_format", "format", "step", "world_size")},
                  "written by": sorted(meta["code"])}, indent=1))
""")

md(r"""
Beside it, `meta.json` records the state format, the code that wrote it, the world size, the model's
parameter names and shapes, the optimizer, the configuration, and the size and CRC-32 checksum of every
file. `load()` reads it first, to refuse a checkpoint that does not fit before touching anything.

**Sharded**: every rank writes its own part with `torch.distributed.checkpoint` (DCP), and one
`.metadata` file says where each piece of each tensor lives. Nothing is gathered, so no rank needs
memory for the whole model, and each rank writes its own files (in parallel, where the file system takes
many writers, as the parallel file systems of clusters do). Under {term}`FSDP` each parameter and each moment is
saved as a `DTensor` with {term}`placement` `Shard(0)` of its *global* shape. The flat padded buffers of
Chapter 5 are a runtime layout and never reach the disk. This is what lets DCP load the same files at
another world size: it reads, for each rank, whichever rows that rank now owns.

## Atomic: complete or absent

A process can die at any instruction, including in the middle of a save. If it dies halfway through
overwriting the only checkpoint, the run has lost everything. `CheckpointManager` never overwrites:
""")

code(r"""
print(inspect.getsource(CheckpointManager._commit))
""")

md(r"""
The files are written into a temporary directory `.tmp-step_XXXXXXXX-<id>`, each one fsynced (on its way
to the disk, not just in the page cache), their checksums are written into `meta.json`, the directory
is renamed to `step_XXXXXXXX` (a rename within one file system is atomic), and only then is `latest`
replaced, by another rename. A resumed run that saves a step again swaps the new directory with the old
one in a single system call (`_swap_in`: Linux's `renameat2` with `RENAME_EXCHANGE`), so the step is
never missing. On a local POSIX file system (ext4, XFS, ...) a crash at any point therefore leaves either
the old state or the new one. The promise is only as good as the file system's renames: a network file
system (NFS, a bucket mounted as files) may not make them atomic or durable, and off Linux, where nanodist
has no call that exchanges two directories (macOS has one, `renamex_np`, that nanodist does not use yet), a
re-saved step is moved aside first, so for that moment `find()` falls back to the previous step. Here a save dies after
DCP has written its files and before the commit; the test suite does the same with a real `SIGKILL` in
both formats. (`LOCK` in the listing is the run's claim on the folder, taken at its first save: a second
run pointed at the same folder is refused, naming the holder, instead of resuming and pruning the first
one's checkpoints; a restart of the same run, or a run whose holder died on this machine, takes it over.)
""")

code(r"""
mgr = CheckpointManager(work / "atomic", format="sharded")
t = make_trainer(mgr)
t.fit(max_steps=3)                                  # step_00000003: committed
commit = CheckpointManager._commit
CheckpointManager._commit = lambda *args: (_ for _ in ()).throw(SystemExit("killed while saving"))
try:
    t.fit(max_steps=3)                              # the save of step 6 dies before its rename
except SystemExit as e:
    print("the run died:", e)
finally:
    CheckpointManager._commit = commit
listing = sorted(p.name[:len(".tmp-step_00000006-")] + "<id>" if p.name.startswith(".tmp") else p.name
                 for p in (work / "atomic").iterdir())
print(listing, "| latest ->", (work / "atomic" / "latest").read_text().strip())
assert ".tmp-step_00000006-<id>" in listing and mgr.find("auto").name == "step_00000003"
t2 = make_trainer(mgr)
mgr.resume(t2, "auto")
t2.fit()                                            # the next save removes the partial one
print(sorted(p.name for p in (work / "atomic").iterdir()))
assert not list((work / "atomic").glob(".tmp-*"))
""")

md(r"""
**Damaged files.** Disks and copies fail quietly. Every file's size and checksum is checked before
loading; a damaged newest checkpoint is named, and `find("auto")` falls back to the previous good one
with a warning. A checkpoint asked for by path is never silently replaced:
""")

code(r"""
victim = work / "small" / "step_00000006" / "state.pt"
data = bytearray(victim.read_bytes())
data[len(data) // 2] ^= 0xFF  # one flipped byte
victim.write_bytes(bytes(data))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    chosen = CheckpointManager(work / "small", format="full").find("auto")
print("warning:", caught[0].message)
print("chosen:", chosen.name)
try:
    verify(victim.parent)
except CheckpointError as e:
    print("error:", e)
assert chosen.name == "step_00000003"
""")

md(r"""
**Safe to load.** A `torch.save` file is a pickle, and unpickling can call any function: a checkpoint
downloaded from somewhere could run code on your machine as it loads. Since torch 2.6, `torch.load`
defaults to `weights_only=True`, which rebuilds tensors and plain values only. The risk is what is left:
code that passes `weights_only=False` (older scripts often do, to load a whole optimizer or a config
object), an older torch, and DCP's `.metadata`, also a pickle, which torch 2.13 reads with no
restriction. nanodist passes `weights_only=True` itself, and reads `.metadata` with an unpickler that
knows DCP's metadata classes and nothing else. A crafted one is refused before anything runs:
""")

code(r"""
class RunsCode:
    def __reduce__(self):
        return print, ("this would have been os.system(...)",)


crafted = work / "crafted"
shutil.copytree(work / "atomic" / "step_00000009", crafted)
(crafted / ".metadata").write_bytes(__import__("pickle").dumps(RunsCode()))
try:
    checkpoint.read_dcp_metadata(crafted)
except CheckpointError as e:
    print(e)
print(sorted(checkpoint._DCP_GLOBALS)[:4], "...")
""")

md(r"""
## A run killed by `kill -9`, resumed bit for bit

Now the real thing, on 2 ranks under `torchrun --max-restarts=1` (`nd.launch(..., restarts=1)`). Lab 6
trains 8 steps and saves every 4. In the killed run rank 1 sends itself `SIGKILL` before step 6, on the
first attempt only. Here is what happens to every rank:

1. rank 1 dies at once: no Python clean-up, no message, its half of the next collective never comes;
2. torchrun's agent sees a worker exit with a signal, stops the other rank (SIGTERM, then SIGKILL), and,
   with restarts left, starts **the whole group again**: every rank is a new process, with
   `TORCHELASTIC_RESTART_COUNT=1` and the same `TORCHELASTIC_RUN_ID`;
3. the new ranks meet again (rendezvous) and each one loads `latest`, here the step-4 checkpoint;
4. they train steps 4 to 7 again: the work lost is the 2 steps since the checkpoint, plus the restart.

Three set-ups: nanodist {term}`DDP` with AdamW, DistMuon with DistAdamW ({term}`ZeRO`, Chapter 4), and nanodist FSDP
(Chapter 5), saving sharded checkpoints but for ZeRO, which saves full ones. Each runs once uninterrupted and
once killed:
""")

code(r"""
TINY = "--model tiny --micro-batch 2 --seq-len 16 --total-batch 192 --no-progress --steps 8 --checkpoint-every 4"
SAVES = {"ddp": "--checkpoint-format sharded", "zero": "--checkpoint-format full", "fsdp": "--checkpoint-format sharded"}
killed, uninterrupted = {}, {}
for impl, saves in SAVES.items():
    uninterrupted[impl] = nd.launch("lab06_checkpoint", nproc=2, echo=False, timeout=120,
                                    args=f"{TINY} {saves} --impl {impl} --checkpoint-dir {work / ('u-' + impl)}")
    killed[impl] = nd.launch("lab06_checkpoint", nproc=2, echo=False, timeout=120, restarts=1,
                             args=f"{TINY} {saves} --impl {impl} --checkpoint-dir {work / ('k-' + impl)} --die-at 6")
print("\n".join(line for line in killed["fsdp"].output.splitlines()
                if "killed" in line or "resumed" in line or "trained" in line or "restart" in line.lower()))
assert all(run.restarts == 1 for run in killed.values()) and all(run.restarts == 0 for run in uninterrupted.values())
""", MACHINE)

code(r"""
rows = []
for impl in killed:
    a, b = uninterrupted[impl].results, killed[impl].results
    losses_a = [s["loss"] for s in a["steps"]]
    losses_b = [s["loss"] for s in b["steps"]]
    assert killed[impl].restarts == 1 and b["metrics"]["resumed"]["step"] == 4
    assert a["metrics"]["fingerprint"] == b["metrics"]["fingerprint"] and losses_a == losses_b
    assert [s["step"] for s in b["steps"]] == list(range(8)) and len(b["resumes"]) == 1
    folder = work / ("k-" + impl)  # the killed run's checkpoints: committed, intact, nothing half-written left
    assert (folder / "latest").read_text().strip() == "step_00000008" and not list(folder.glob(".tmp-*"))
    verify(folder / "step_00000008")  # every file against the checksum saved with it
    rows.append({"set-up": impl, "checkpoint": SAVES[impl].replace("--checkpoint-format ", ""),
                 "restarts": killed[impl].restarts, "resumed at step": b["metrics"]["resumed"]["step"],
                 "SHA-256 equal": a["metrics"]["fingerprint"] == b["metrics"]["fingerprint"],
                 "loss curves equal": losses_a == losses_b})
Table(rows)
""")

md(r"""
The hashes themselves, which, like the losses, come out otherwise on another CPU (its kernels round
differently), but equal to each other on every CPU:
""")

code(r"""
assert all(uninterrupted[i].results["metrics"]["fingerprint"] == killed[i].results["metrics"]["fingerprint"]
           for i in killed)
Table({"set-up": impl, "uninterrupted: SHA-256": uninterrupted[impl].results["metrics"]["fingerprint"][:16],
       "killed and resumed: SHA-256": killed[impl].results["metrics"]["fingerprint"][:16]} for impl in killed)
""", MACHINE)

md(r"""
The **fingerprint** is a SHA-256 over every parameter and every optimizer-state tensor, whole and by
name (`nanodist.checkpoint.fingerprint`), so two runs have the same fingerprint exactly when their
states are bitwise equal, whatever the layout of their shards. The killed runs end with the same hash
as the uninterrupted ones, and their loss curves are equal to the last bit.

The resumed run is the *same run*: the lab takes the run id from the checkpoint, so rank 0 appends to
the same results file (after a `resume` line) and wandb continues the same run. Steps 4 and 5 ran twice;
readers of the file keep the last record of each step, so each step counts once:
""")

code(r"""
path = Path(killed["fsdp"].results["_path"])
lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]  # (a blank line ends a cut one)
print("one results file:", [line["kind"] + (f" {line['step']}" if line["kind"] == "step" else "") for line in lines])
steps = [line["step"] for line in lines if line["kind"] == "step"]
assert [line["kind"] for line in lines].count("resume") == 1 and sorted(set(steps)) == list(range(8))
""")

md(r"""
Why bit-exact and not merely close? Each step is deterministic given the state, and the state is all of
it: the parameters, AdamW's moments and step count, the schedule's position, the data cursor, every
rank's generators. The collectives are deterministic too: the same ranks add the same numbers in the
same order. Remove any one of these and the hashes differ, as the first section showed.

Two conditions make this true, and both matter off a laptop. The comparison is **within one machine**:
the same run on another CPU or GPU gives other hashes, because other kernels round differently, so a
killed run equals its uninterrupted twin on each machine, not across machines. And on GPUs it needs
**deterministic kernels**: some CUDA kernels add in an order that varies from run to run (atomic adds in
scatter and index operations, some cuBLAS and cuDNN algorithms), so a bit-exact resume there needs
`torch.use_deterministic_algorithms(True)` (with `CUBLAS_WORKSPACE_CONFIG=:4096:8` and
`torch.backends.cudnn.benchmark = False`, or cuDNN's autotuner may pick another algorithm after the restart) and the same NCCL
configuration after the restart: NCCL picks its algorithm, protocol and channels from the topology and
the message size, and another choice adds the same numbers in another order.

## Resharding: resuming at another world size

The sharded checkpoint of the uninterrupted FSDP run was written by 2 ranks. Resume it on 3, train and
save, then resume that on 1. The **global batch stays the same**: Chapter 3's point that the total batch
is a property of the optimisation, not of the cluster, holds across a {term}`reshard` too. Every run here asks
for 192 tokens per step (`--total-batch 192`, 12 windows of 16 tokens) with {term}`micro-batches <micro-batch>` of 2 windows,
so the Trainer accumulates gradients over 3 micro-steps at 2 ranks, 2 at 3 ranks and 6 at 1 rank (that
is why 12 windows: it divides by 2 × 2, 3 × 2 and 1 × 2). A reshard that kept the micro-batch and let the
batch follow the number of ranks would change the learning problem at the restart.
""")

code(r"""
first = work / "u-fsdp" / "step_00000004"
at3 = nd.launch("lab06_checkpoint", nproc=3, echo=False, timeout=120,
                args=f"{TINY} --impl fsdp --checkpoint-dir {work / 'at3'} --checkpoint-every 2 --resume {first}")
second = work / "at3" / "step_00000006"
at1 = nd.launch("lab06_checkpoint", nproc=1, echo=False, timeout=120,
                args=f"{TINY} --impl fsdp --checkpoint-dir {work / 'at1'} --resume {second}")
print(sorted(p.name for p in first.iterdir()), "<- written by 2 ranks")
assert at3.results["metrics"]["windows"]["world_size"] == 3 and at1.results["metrics"]["windows"]["world_size"] == 1
for run in (uninterrupted["fsdp"], at3, at1):  # one global batch: 12 windows per step, whatever the world size
    m = run.results["metrics"]
    assert m["windows"]["stop"] - m["windows"]["start"] == 12 * (8 - (m["resumed"]["step"] if m["resumed"] else 0))
""", MACHINE)

code(r"""
chain = [(2, "saved", first, uninterrupted["fsdp"].results), (3, "resumed", second, at3.results),
         (1, "resumed", None, at1.results)]
rows = []
for world, how, saved_path, rec in chain:
    m = rec["metrics"]
    r = {"ranks": world, "starts at step": m["resumed"]["step"] if m["resumed"] else 0}
    if m["resumed"]:
        r["state at load = state saved"] = m["resumed"]["fingerprint"] == read_meta(m["resumed"]["path"])["fingerprint"]
        assert r["state at load = state saved"] and m["resumed"]["world_size"] == world
    rows.append(r)
Table(rows)
""")

md(r"""
At each load point the state's fingerprint equals the one recorded when the checkpoint was saved: every
parameter and every AdamW moment arrived whole, although 2 ranks wrote them and 3 (then 1) read them.

The data must reshard too. The stream's state is the global cursor; a run at $W$ ranks deals the rest
of the epoch's window order to its own ranks, rank $r$ taking positions $c + r, c + r + W, \ldots$ Lab 6
records which positions each rank read. Across the three segments, the sampler checker of Chapter 3
confirms that every window up to the last cursor was read exactly once:
""")

code(r"""
segments = [rec["metrics"]["windows"] for _, _, _, rec in chain]
read = []
fig, ax = plt.subplots(figsize=(6.6, 2.6))
for i, (seg, nxt) in enumerate(zip(segments, segments[1:] + [None])):
    stop = nxt["start"] if nxt else seg["stop"]
    for r, ps in enumerate(seg["positions"]):
        mine = [p for p in ps if p < stop]
        read += mine
        ax.scatter(mine, [i + 0.15 * r] * len(mine), s=12, color=plots.PALETTE[r],
                   label=f"rank {r}" if i == 1 else None)  # the 3-rank segment names every rank once
coverage = check_sampler_exactly_once([read], segments[-1]["stop"], drop_last=True)
ax.set(xlabel="position in the epoch's window order", yticks=[0, 1, 2], yticklabels=["2 ranks", "3 ranks", "1 rank"],
       title="Windows read across two reshards: each position once")
ax.legend(ncol=3, loc="upper left", bbox_to_anchor=(0, -0.35), frameon=False)
plots.show()
print(f"{len(read)} windows, each read once:", sorted(read) == list(range(segments[-1]["stop"])))
""")

md(r"""
Two details make the reshard work. Ranks that did not exist when the checkpoint was saved (rank 2 of 3)
have no saved generators; they seed theirs from the step and their rank, and say so. And a **full**
checkpoint reshards as well: rank 0 wrote whole tensors, so any world size can cut them again (the test
suite loads one saved at 2 ranks at 3 and at 1).

## What saving costs, and how often to save

Lab 6's `--bench` saves the same FSDP training state in four ways, taking turns: full, sharded, and
each **asynchronously**. An asynchronous save copies the state in memory between two steps and lets a
background thread do the rest: lay the copy out and write it with DCP on a process group of its own, so
its collectives never meet the training's. Training waits only for the copy. All times include fsync.
""")

code(r"""
bench = nd.launch("lab06_checkpoint", nproc=2, echo=False, timeout=120,
                  args="--bench --model small --micro-batch 2 --seq-len 32 --no-progress --repeats 3")
b = bench.results["metrics"]
caption("prov_bench", bench.results)
assert all(o["total_s"] > 0 and o["load_s"] > 0 and o["bytes"] > 0 for o in b["kinds"].values())
Table({"save": k, "training blocked (ms)": round(1e3 * o["blocked_s"], 1), "saved (ms)": round(1e3 * o["total_s"], 1),
       "loaded (ms)": round(1e3 * o["load_s"], 1), "size (MiB)": round(o["bytes"] / 2**20, 2)} for k, o in b["kinds"].items())
""", MACHINE)

code(r"""
glue("bench_params", b["params"] / 1e6, display=False)
glue("medium_mib", 4 * GPT(GPTConfig.preset("medium")).num_params() / 2**20, display=False)
glue("ratio_sharded", b["ratio_sharded_vs_full_save"], display=False)
glue("ratio_async", b["ratio_async_blocked_vs_sync_sharded"], display=False)
glue("ratio_async_full", b["ratio_async_blocked_vs_sync_full"], display=False)
loads = [o["load_s"] for o in b["kinds"].values()]
glue("load_spread", max(loads) / min(loads), display=False)
r_full = b["ratio_async_blocked_vs_sync_full"]
glue("async_full_story", Markdown(  # the gather dominates a small full save, so the ratio sits near 1, either side
    "so it saves a part of the time" if r_full < 0.8 else "so it saves little" if r_full <= 1.0 else
    "so it saves little, and here it even blocked longer than the whole synchronous save did: the two differ by "
    "less than the noise of a few CPU cores"), display=False)
glue("sharded_story", Markdown(  # which save is faster depends on the machine: the sentence says what this one did
    "slower: on one machine both go to the same disk, so writing in parallel buys little, while DCP does work "
    "that a full save does not, planning the save collectively (each rank's plan is gathered on one rank, made "
    "global and sent back) and writing `.metadata`. At a few MiB that fixed cost decides"
    if b["ratio_sharded_vs_full_save"] > 1 else
    "faster: each rank wrote only its own shards, while the full save gathered the state on rank 0 first, "
    "although DCP does work that a full save does not, planning the save collectively and writing `.metadata`"),
    display=False)
assert b["kinds"]["sharded-async"]["blocked_s"] <= b["kinds"]["sharded-async"]["total_s"]
assert abs(b["kinds"]["full"]["bytes"] - b["kinds"]["sharded"]["bytes"]) / b["kinds"]["full"]["bytes"] < 0.1
""", MACHINE)

md(r"""
{glue:md}`prov_bench`

For this {glue:text}`bench_params:.2f` M-parameter model, the sharded save took {glue:text}`ratio_sharded:.2f` ×
the full save's time, {glue:md}`sharded_story`. On a cluster, with many writers and a state no rank
could gather, the sharded save is the one that scales.

An asynchronous sharded save blocked training for {glue:text}`ratio_async:.2f` × a synchronous one: it only
copies each rank's shards in memory. An asynchronous *full* save blocked for {glue:text}`ratio_async_full:.2f` ×
a synchronous full save: a full checkpoint must first gather the whole state on rank 0, through
collectives of the training's own process group, and that happens while training waits; only the write
goes to the background, {glue:md}`async_full_story`. Loads are timed in turns as well; the slowest kind took {glue:text}`load_spread:.1f` × the
fastest. The two sharded checkpoints are the same kind of files (written by another thread, that is
all), and so are the two full ones. The sizes on disk are the same: the same tensors, in one file or in
one per rank. Small models on a few CPU cores make noisy ratios; `torchrun --nproc_per_node=2 labs/lab06_checkpoint.py --bench
--model medium` runs the same comparison on the `medium` preset, about {glue:text}`medium_mib:.0f` MiB of fp32 parameters
(three times that with AdamW's two moments).

**How often?** Saving every $\tau$ seconds of training costs $C/\tau$ of the time, where $C$ is the time
training is blocked per save. A failure, arriving on average every $M$ seconds (the mean time between
failures of the whole job), loses on average half an interval of work, $\tau/2$, plus the restart $R$.
The expected fraction of time lost is therefore about
$$\frac{C}{\tau} + \frac{\tau/2 + R}{M},$$
smallest at **Young's interval** $\tau^* = \sqrt{2CM}$ {cite}`young1974checkpoint` (Daly refined it for large $C/M$ {cite}`daly2006checkpoint`). Both are in
`nanodist.costmodel`:
""")

code(r"""
print(inspect.getsource(young_daly_interval))
print(inspect.getsource(checkpoint_overhead))
""")

md(r"""
Take the save times just measured, and a failure rate that is **an assumption, not a measurement**: a
job of 1,000 machines where each fails once in 1,000 days, so one failure a day ($M$ = 24 h), and a
restart of 5 minutes:
""")

code(r"""
M, R = 24 * 3600.0, 300.0  # assumed: one failure a day, five minutes to restart
C_sync = b["kinds"]["sharded"]["blocked_s"]
C_async = b["kinds"]["sharded-async"]["blocked_s"]
taus = [10 ** (k / 20) for k in range(0, 101)]  # 1 s to 1e5 s
fig, ax = plt.subplots(figsize=(6.4, 3.6))
for label, C in (("synchronous sharded", C_sync), ("asynchronous sharded", C_async)):
    ax.loglog(taus, [100 * checkpoint_overhead(t, C, M, R) for t in taus], label=label)
    best = young_daly_interval(C, M)
    ax.scatter([best], [100 * checkpoint_overhead(best, C, M, R)], zorder=3)
ax.set(xlabel="seconds of training between saves", ylabel="expected time lost (%)",
       title="Save cost vs lost work (measured save times, assumed failure rate)")
plots.legend_below(ax, ncol=2)
plots.show()
glue("tau_sync", young_daly_interval(C_sync, M), display=False)
glue("tau_async", young_daly_interval(C_async, M), display=False)
glue("loss_sync", 100 * checkpoint_overhead(young_daly_interval(C_sync, M), C_sync, M, R), display=False)
assert young_daly_interval(C_async, M) < young_daly_interval(C_sync, M)
""", MACHINE)

md(r"""
{glue:md}`prov_bench`

With these save times the best interval is {glue:text}`tau_sync:.0f` s for synchronous saves and
{glue:text}`tau_async:.0f` s for asynchronous ones, and the time lost at the synchronous optimum is about
{glue:text}`loss_sync:.2f` % (restart included). Both save times come from the {glue:text}`bench_params:.2f` M-parameter model above; a real
model's save takes seconds to minutes, and the interval grows with its square root. The curve is flat
around its minimum: saving twice as often or half as often as $\tau^*$ costs little, so round it
to something convenient. What matters is that the expected loss stays small *whatever* happens, which is
what atomic commits and exact resumes buy.
""")

md(r"""
## The same with PyTorch: DCP in your own code

`CheckpointManager` is built on `torch.distributed.checkpoint` (DCP). Here is DCP on its own, as a
training script at work would call it, on an FSDP2 model (Chapter 5's last sections) in this notebook's
own process, a world of one; under `torchrun` every rank runs the same lines. Four pieces do the work:

- `get_state_dict(model, optimizer)` returns the model's and the optimizer's state dicts in one
  convention, whatever wraps the model (FSDP2, DDP, nothing): keys are parameter names, not the
  optimizer's integer ids, and under FSDP2 each value is a sharded `DTensor`, so no rank gathers
  anything. `set_state_dict` puts them back.
- A `Stateful` object (anything with `state_dict()` and `load_state_dict()`) collects what to save; DCP
  calls those methods itself when it saves and loads. Add the data cursor, the schedule and the random
  generators to it and you have this chapter's training state.
- `dcp.save` writes every rank's shards plus one `.metadata`; `dcp.async_save` does the same from a
  background thread and returns a `Future`; `dcp.load` reads into tensors that already exist, in
  whatever layout the model now has, which is how a checkpoint reshards.
- `dcp_to_torch_save` turns a DCP folder into one ordinary `torch.save` file, for a model hub or for
  code that knows nothing of DCP.
""")

code(r"""
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # torchrun, GPUs: ("cpu:gloo,cuda:nccl")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))


def build():
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", vocab_size=tok.vocab_size, block_size=16))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


class AppState(Stateful):
    # What to save, as one object: DCP calls state_dict() when it saves and load_state_dict() when it loads.
    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)  # sharded DTensors, keyed by name
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state):
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


model, opt = build()
stream = TokenStream(tokens, batch_size=4, block_size=16, seed=0)
for _ in range(3):
    x, y = next(stream)
    model(x, y)[1].backward()
    opt.step()
    opt.zero_grad()

dcp.save({"app": AppState(model, opt)}, checkpoint_id=work / "dcp" / "step_3")     # every rank writes its shards
pending = dcp.async_save({"app": AppState(model, opt)}, checkpoint_id=work / "dcp" / "step_3_async")  # needs a CPU backend
pending.result()                 # a training loop would go on with its next steps and wait only before the next save

fresh, fresh_opt = build()       # a new process after a crash: build the same model, then load into it
dcp.load({"app": AppState(fresh, fresh_opt)}, checkpoint_id=work / "dcp" / "step_3")


def tensors(state, prefix=""):
    for k, v in state.items():
        if isinstance(v, dict):
            yield from tensors(v, f"{prefix}{k}.")
        elif isinstance(v, torch.Tensor):
            yield f"{prefix}{k}", v.full_tensor() if isinstance(v, DTensor) else v


saved = dict(tensors(AppState(model, opt).state_dict()))
loaded = dict(tensors(AppState(fresh, fresh_opt).state_dict()))
print(len(saved), "tensors (the parameters, and AdamW's step, exp_avg and exp_avg_sq for each), e.g.", list(saved)[:2])
print("every one equal after the load:",
      saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved))
print("files:", sorted(p.name for p in (work / "dcp" / "step_3").iterdir()))

dcp_to_torch_save(work / "dcp" / "step_3", work / "dcp" / "step_3.pt")             # one plain file, offline
plain = torch.load(work / "dcp" / "step_3.pt", weights_only=True)
print("torch.load:", list(plain["app"]), "| model keys", list(plain["app"]["model"])[:3], "...")
assert torch.equal(plain["app"]["model"]["wte.weight"], saved["model.wte.weight"])
dist.destroy_process_group()
""")

md(r"""
What DCP does not do is the rest of this chapter. It writes `.metadata` last, so a save killed midway
into a fresh folder leaves a folder that does not load (re-saving into an existing folder can leave the
old `.metadata` beside half-rewritten data: one more reason for a temporary folder and a rename). Which
folder is the newest complete one, and whether a file changed since it was written, are left to you.
Note the process group of the cell above on GPUs: `dcp.async_save` writes from the host, so it needs a
CPU backend beside nccl, `init_process_group("cpu:gloo,cuda:nccl")`. `CheckpointManager` adds the atomic commit and `latest`,
the checksums, and the checks that a checkpoint fits the model before anything is loaded. And the
training state is whatever you put in your `Stateful`: the Trainer adds the data cursor, the schedule
and every rank's random generators, without which the resume would not be exact.

## Bad input

A checkpoint that does not fit is refused before anything is loaded, saying what differs; a missing
`latest` starts a fresh run with a message; a checkpoint directory that cannot be written is an error
before the first step, not at the first save an hour later:
""")

code(r"""
other = GPT(GPTConfig.preset("tiny", vocab_size=tok.vocab_size, block_size=16, n_layer=3))
wrong = Trainer(other, torch.optim.AdamW(other.parameters()), TokenStream(tokens, batch_size=4, block_size=16),
                TrainConfig(steps=2, total_batch_tokens=64, micro_batch=4, seq_len=16, progress=False, log_every=0))
for attempt in (lambda: checkpoint.load(work / "small" / "step_00000003", wrong),
                lambda: CheckpointManager(work / "small" / "step_00000003" / "meta.json" / "sub")):
    try:
        attempt()
    except CheckpointError as e:
        print("CheckpointError:", e)
print("resumed from:", CheckpointManager(work / "empty").resume(make_trainer(), "auto"))
""")

md(r"""
And a run that stopped itself, for a non-finite loss (`TrainConfig(nonfinite="stop")`), leaves its reason in a `STOPPED` file
beside the checkpoints: a group that torchrun restarts reads it and stops at once with the same message,
instead of loading the last checkpoint and walking into the same NaN again, restart after restart.

## Exercises
""")

exercise(
    "6.1",
    "The uninterrupted FSDP run above trained on 2 ranks with micro-batches of 2 windows of 16 tokens and "
    "`--total-batch 192` (tokens per step). What is the data cursor (`consumed`, windows read by all ranks) in "
    "its step-4 checkpoint, where the 3-rank run started reading? Compute it from the set-up.",
    "at3.results['metrics']['windows']['start']",
    "answer = ...  # windows",
    "A step reads the whole global batch, however many ranks share it and in however many micro-steps.",
    "answer = 4 * (192 // 16)  # steps x windows per step (2 ranks x 2 windows x 3 micro-steps)",
)

exercise(
    "6.2",
    "A job's saves block training for 40 s and it fails on average every 8 hours. Using the formula above "
    "(without the restart term), what is the best checkpoint interval, in minutes?",
    "young_daly_interval(40, 8 * 3600) / 60",
    "answer = ...  # minutes",
    "Young: the square root of twice the save time times the mean time between failures.",
    "answer = (2 * 40 * 8 * 3600) ** 0.5 / 60",
)

exercise(
    "6.3",
    "A run at 2 ranks saved its stream with cursor `consumed = 40` and micro-batches of 3 windows. It resumes "
    "at 3 ranks. Write `next_positions(rank)`: the positions in the epoch's window order that `rank` of 3 "
    "reads in its first micro-batch after the resume.",
    "cases=[((r,), [40 + r + 3 * i for i in range(3)]) for r in range(3)]",
    "def next_positions(rank):\n    return ...\n\nanswer = next_positions",
    "Cards dealt from the cursor: rank r takes every W-th position, starting at c + r.",
    "def next_positions(rank):\n    return [40 + rank + 3 * i for i in range(3)]\n\nanswer = next_positions",
)

chapter.predict(
    "6.4",
    "The chapter's first run saved every 3 steps. Train the same set-up for 10 steps with "
    "`CheckpointManager(..., keep=2)`: it saves every 3 steps and at the end of the run, and keeps the newest 2. "
    "Which steps' checkpoints are left in the folder? Write `prediction = [...]` (step numbers, oldest first), "
    "then run the cell after it.",
    "prediction = ...   # [step, step]",
    "kept = make_trainer(CheckpointManager(work / \"exercise-6.4\", format=\"full\", keep=2), steps=10)\n"
    "kept.fit()\n"
    "measured = [int(p.name.removeprefix(\"step_\")) for p in kept.checkpoints.complete()]",
    "List every save the run makes, the last one included; then keep only the newest two.",
    "# saves after steps 3, 6 and 9, and at the end (step 10); keep=2 prunes all but the newest two\n"
    "prediction = [9, 10]",
)

chapter.predict(
    '6.5',
    'Train the set-up of Exercise 4 again (10 steps, a save every 3 steps and at the end), once with '
    '`keep=2` and once with `keep=1`. Then the newest checkpoint gets one flipped byte, as in "Damaged '
    'files" above, and a restarted run calls `resume(trainer, "auto")`. From which step does the '
    'restarted run go on, with `keep=2` and with `keep=1`? Write `prediction = (with_keep_2, '
    'with_keep_1)`, with 0 for a fresh start, then run the cell after it.',
    'prediction = ...   # (step the restarted run goes on from with keep=2, with keep=1; 0: a fresh start)',
    'import contextlib, io\n'
    '\n'
    '\n'
    'def restart_after_damage(keep):\n'
    '    folder = work / f"exercise-6.5-keep{keep}"\n'
    '    make_trainer(CheckpointManager(folder, format="full", keep=keep), steps=10).fit()\n'
    '    newest = CheckpointManager(folder, format="full").latest() / "state.pt"\n'
    '    data = bytearray(newest.read_bytes())\n'
    '    data[len(data) // 2] ^= 0xFF                            # one flipped byte in the newest checkpoint\n'
    '    newest.write_bytes(bytes(data))\n'
    '    restarted = make_trainer()\n'
    '    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):   # its messages would tell\n'
    '        warnings.simplefilter("ignore")\n'
    '        CheckpointManager(folder, format="full", keep=keep).resume(restarted, "auto")\n'
    '    return restarted.step                                   # where the restarted run goes on (0: from scratch)\n'
    '\n'
    '\n'
    'measured = (restart_after_damage(keep=2), restart_after_damage(keep=1))',
    'Which checkpoints are still in the folder when each run ends? Then: what does find("auto") do with '
    'one that fails its checksum?',
    '# keep=2 leaves steps 9 and 10; step 10 fails its checksum and "auto" falls back to step 9. keep=1 leaves only\n'
    '# step 10: nothing to fall back to, so the run starts from scratch -- keep at least 2.\n'
    'prediction = (9, 0)',
)

md(r"""
## Summary

- A training state is the model, the optimizer's state, the schedule, the data cursor, every rank's
  random generators, the step count and the run's identity. Forget any piece and the resumed run
  diverges silently.
- `CheckpointManager` saves it atomically (temporary directory, fsync, rename, `latest` last),
  checksummed, in a full file that plain torch reads or sharded with DCP, synchronously or in the
  background; it keeps the last $k$ and falls back past damaged ones.
- Files are loaded with `weights_only=True` and DCP's metadata with a restricted unpickler: a checkpoint
  cannot run code.
- Under `torchrun --max-restarts`, a SIGKILL costs the steps since the last save and a restart; the resumed
  run is bitwise equal to the uninterrupted one on the same machine, for DDP, ZeRO and FSDP (on GPUs,
  with deterministic kernels and the same NCCL configuration).
- Sharded checkpoints store per-parameter `Shard(0)` tensors of global shape and a global data cursor, so
  they resume at any world size, every sample still read once; keep the global batch fixed across a
  reshard ({term}`gradient accumulation` makes up the difference).
- Save every $\sqrt{2CM}$ seconds; asynchronous saves make $C$ small.
- With DCP directly: `get_state_dict` / `set_state_dict` in a `Stateful`, `dcp.save` / `async_save` /
  `load`, and `dcp_to_torch_save` for one plain file; the atomic commit, checksums and the rest of the
  training state are yours to add.
""")

code(r"""
os.chdir(home)
shutil.rmtree(scratch, ignore_errors=True)
""")

chapter.write("06_checkpoint.ipynb")
