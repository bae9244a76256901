"""The one training loop every lab uses: accumulation, mixed precision, clipping, LR schedule, eval, logging.

    cfg = TrainConfig(steps=100, total_batch_tokens=8192, micro_batch=8, seq_len=64)
    trainer = Trainer(model, optimizer, train_stream, cfg, val_data=val_stream, recorder=rec)
    history = trainer.fit()            # one dict per step: loss, lr, time, tokens/s, grad norm

The arithmetic of a step: the *total batch* (tokens per optimizer step, the number that matters for
the optimisation) is split over `world_size` ranks and, if that is still too much to hold at once,
over `grad_accum` micro-steps per rank:

    total_batch_tokens = micro_batch x seq_len x world_size x grad_accum

so adding ranks at a fixed total batch (strong scaling) means fewer accumulation steps per rank,
and the optimisation is the same. The first grad_accum - 1 micro-steps run with gradient sync off:
gradients accumulate locally and are averaged across ranks once, on the last one. The Trainer says
so, and asks for the clipped norm, through one protocol (nanodist.parallel.GradientSync) that
nanodist's DDP and sharded optimizers, torch DDP and torch FSDP2 all satisfy.

The learning rate follows a torch LambdaLR (warm-up, then cosine, lr_at). state_dict() holds the
whole training state -- step, tokens seen, model, optimizer, schedule, the training stream's cursor,
this rank's random generators and the run id -- and load_state_dict() resumes it bit for bit.
evaluate() reads the same first eval_batches validation batches every time and changes nothing.

A step whose global gradient norm is not finite (a NaN or inf loss or gradient on any rank) stops the
run on every rank with one message naming the step and the ranks whose loss was not finite
(TrainConfig(nonfinite="skip") skips such steps instead, as torch's GradScaler does, and counts them).
Scalars are read from the device once per log interval on a GPU (every step on a CPU, where reading
costs nothing), so a step queues its work without waiting.
"""
from __future__ import annotations

import math
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .group import Group
from .parallel import gradient_sync
from .results import new_run_id
from . import state
from .runtime import print0, rng_state, set_rng_state


@dataclass
class TrainConfig:
    """Everything about the loop itself (the model, data and optimizer are arguments of Trainer)."""

    steps: int = 50
    total_batch_tokens: int | None = None  # None: micro_batch x seq_len x world_size (no accumulation)
    micro_batch: int = 8
    seq_len: int = 64
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # the cosine decay ends at lr x min_lr_ratio
    warmup_steps: int = 5
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    dtype: str = "fp32"  # or "bf16": autocast on CPU and CUDA
    eval_every: int = 0  # 0: evaluate once, at the end (if validation data is given)
    eval_batches: int = 4
    log_every: int = 10
    nonfinite: str = "stop"  # a step with a NaN/inf loss or gradient: "stop" the run, or "skip" the step
    checkpoint_every: int = 0  # save a checkpoint every this many steps, and at the end (needs checkpoints=)
    progress: bool = True  # tqdm bar on rank 0
    wandb: bool = False
    wandb_project: str = "nanodist"
    run_name: str | None = None


def grad_accum_steps(total_batch_tokens: int | None, micro_batch: int, seq_len: int, world_size: int) -> int:
    """Micro-steps per rank per optimizer step; a clear error when the numbers do not divide."""
    per_micro_step = micro_batch * seq_len * world_size
    if total_batch_tokens is None:
        return 1
    if total_batch_tokens <= 0 or total_batch_tokens % per_micro_step:
        raise ValueError(
            f"total batch of {total_batch_tokens} tokens is not a positive multiple of micro_batch x seq_len x "
            f"world_size = {micro_batch} x {seq_len} x {world_size} = {per_micro_step}: choose a total batch of "
            f"{per_micro_step * max(1, round(max(total_batch_tokens, 1) / per_micro_step))} tokens, or change "
            f"the micro-batch, sequence length or number of ranks")
    return total_batch_tokens // per_micro_step


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over warmup_steps, then cosine decay from lr to lr x min_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - 1 - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def autocast(dtype: str, device: torch.device):
    """bf16 autocast on the run's device type (CPU or CUDA); a no-op for fp32."""
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype must be 'fp32' or 'bf16', got {dtype!r}")
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")


class WandbLogger:
    """wandb on rank 0 only. Offline unless the user configured wandb; never prompts; never required.

    If wandb is missing or fails to start, the run goes on and says so once.
    """

    def __init__(self, enabled: bool, project: str, config: dict, name: str | None = None, directory=None,
                 is_main: bool | None = None, run_id: str | None = None):
        self.run = None
        self.message = None
        if not enabled or not (Group.world().is_main if is_main is None else is_main):
            return
        try:
            import wandb
        except ImportError:
            self.message = "wandb is not installed: training continues without it (pip install wandb)"
            print0(self.message)
            return
        if os.environ.get("WANDB_MODE") == "":
            del os.environ["WANDB_MODE"]  # wandb itself rejects an empty mode
        mode = os.environ.get("WANDB_MODE") or ("online" if _wandb_configured() else "offline")
        try:
            # reinit="create_new": a lab that trains several models in one process gets one run per model.
            # A run id, when given, makes a resumed run continue the same wandb run; a lab that trains several
            # models in one run keeps them apart by name.
            wid = None if run_id is None else re.sub(r"[^A-Za-z0-9_-]", "-", f"{run_id}-{name or 'train'}")
            self.run = wandb.init(project=project, config=config, name=name, mode=mode, dir=directory,
                                  reinit="create_new", id=wid, resume="allow" if wid else None,
                                  settings=wandb.Settings(silent=True, console="off"))
        except Exception as e:  # a wandb outage must never stop training
            self.message = f"wandb could not start ({type(e).__name__}: {e}): training continues without it"
            print0(self.message)
            return
        if mode == "offline" and not WandbLogger._said_offline:
            WandbLogger._said_offline = True  # once per process, however many runs it opens
            self.message = f"wandb is logging offline under {Path(self.run.dir).parents[1]} (run `wandb login` to log online)"
            print0(self.message)

    _said_offline = False

    def log(self, values: dict, step: int) -> None:
        if self.run is not None:
            try:
                self.run.log(values, step=step)
            except Exception as e:  # tracking must never stop training
                print0(f"wandb stopped logging ({type(e).__name__}: {e}); training continues")
                self.run = None

    def finish(self) -> None:
        if self.run is not None:
            try:
                self.run.finish()
            except Exception as e:
                print0(f"wandb could not finish cleanly ({type(e).__name__}: {e})")
            self.run = None


def _wandb_configured() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" in netrc.read_text()
    except OSError:
        return False


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


class NonFiniteError(RuntimeError):
    """The loss or the gradient stopped being finite; raised on every rank at once."""


class _StepTimer:
    """Wall time of a step without making the host wait: CUDA events on a GPU, perf_counter on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start


class Trainer:
    """Runs `cfg.steps` optimizer steps of `model` on batches from `train_data`.

    - model: any module returning (logits, loss) from model(x, y). Wrapped (nanodist.DDP, torch DDP, torch
      fully_shard), or bare with an optimizer that averages gradients itself (nanodist's ZeRO optimizers).
    - optimizer: a torch.optim.Optimizer; the Trainer drives its lr with a LambdaLR (group lrs keep their ratios).
    - train_data: an iterator of (x, y) micro-batches of shape (micro_batch, seq_len); its state_dict() (a
      TokenStream's cursor) is part of the Trainer's.
    - val_data: an iterator of validation micro-batches; the first eval_batches are read once and reused.
    - recorder: a nanodist.results.Recorder, which gets every step as it is logged (optional).
    - group: the ranks that train together, averaging their gradients (default: the world).
    - mesh, data_dim: instead of group, a nanodist Mesh (Group.world().mesh({"data": 2, "tensor": 2})) whose
      `data_dim` dimension averages the gradients and splits the batches; the ranks of its other dimensions
      (tensor parallelism) share each batch, so train_data must give them the same one (a TokenStream with
      rank=mesh[data_dim].rank, world_size=mesh[data_dim].size). The world, every rank of the mesh, keeps what
      happens once per run: the run id, the state's world size, the non-finite report, the progress bar.
    - checkpoints: a nanodist.checkpoint.CheckpointManager; with cfg.checkpoint_every, fit() saves every that
      many steps and at the end, and a non-finite stop leaves its reason beside the checkpoints.
    """

    def __init__(self, model, optimizer, train_data, cfg: TrainConfig, val_data=None, recorder=None, group=None,
                 checkpoints=None, mesh=None, data_dim: str = "data"):
        self.model, self.optimizer, self.cfg, self.checkpoints = model, optimizer, cfg, checkpoints
        self.train_data, self.val_data, self.recorder = train_data, val_data, recorder
        if mesh is not None:
            if group is not None:
                raise ValueError("Trainer: give group= (the ranks that train together) or mesh= (and its data "
                                 "dimension, data_dim=), not both")
            if data_dim not in mesh.names:
                raise ValueError(f"Trainer: the mesh has dimensions {list(mesh.names)}, none named {data_dim!r}: "
                                 f"name the one that splits the batches with data_dim=")
            self.group, self.world = mesh[data_dim], Group.world()  # the data dimension; every rank of the mesh
        else:
            self.group = Group.resolve(group)
            self.world = self.group  # a group of its own is a run of its own (lab03's sweeps of sub-worlds)
        self.mesh = mesh
        if not cfg.lr > 0:
            raise ValueError(f"TrainConfig.lr must be a positive number, got {cfg.lr!r}")
        if cfg.nonfinite not in ("stop", "skip"):
            raise ValueError(f"TrainConfig.nonfinite must be 'stop' or 'skip', got {cfg.nonfinite!r}")
        self.grad_accum = grad_accum_steps(cfg.total_batch_tokens, cfg.micro_batch, cfg.seq_len, self.group.size)
        self.tokens_per_step = cfg.micro_batch * cfg.seq_len * self.group.size * self.grad_accum
        autocast(cfg.dtype, self.group.device)  # validate early
        self.sync = gradient_sync(model, optimizer, self.group)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg) / cfg.lr)
        self.step = 0
        self.tokens_seen = 0
        self.skipped_steps = 0
        # one run id for all ranks (rank 0's): a sharded checkpoint keeps one copy of it
        self.run_id = self.world.broadcast_object(recorder.run_id if recorder is not None else new_run_id())
        self.history: list[dict] = []
        self._pending: list[dict] = []  # steps whose scalars are still on the device
        # On a GPU the scalars of a step (loss, norm, timing events) are read every log_every steps (or every 20
        # when nothing is logged): the host runs ahead of the device in between. On a CPU reading costs nothing.
        self._flush_every = 1 if self.group.device.type != "cuda" else (cfg.log_every or 20)
        self._timer = _StepTimer(self.group.device)
        self._val_batches = None
        self._wandb, self._bar = None, None

    # --- the state ----------------------------------------------------------------------------------

    @property
    def _global_rank(self) -> int:
        """This process's rank in the whole run: the key of its random generators in the state, unique even where
        the Trainer's group is one dimension of a mesh (two tensor-parallel peers share a data-group rank). A
        Trainer on Group.local() is a run of its own, inside a larger launch: rank 0 of it."""
        return 0 if self.group.backend == "local" else self.group.global_rank(self.group.rank)

    def state_dict(self, weights: bool = True) -> dict:
        """Everything a resumed run needs (see ARCHITECTURE.md), in the layout of nanodist.state: the model and
        the optimizer keyed by the bare model's parameter names, sharded tensors as DTensors of their global
        shape -- the same whatever the world size, the wrapper's packing or the order of a param group. Call it
        between steps, on every rank (a collective where a wrapper's layout needs one). (weights=False: the model
        and optimizer entries are None, for a caller that takes them itself.)"""
        self._flush()
        data = self.train_data.state_dict() if hasattr(self.train_data, "state_dict") else None
        return {"step": self.step, "tokens_seen": self.tokens_seen, "skipped_steps": self.skipped_steps,
                "run_id": self.run_id, "world_size": self.world.size, "config": asdict(self.cfg),
                "model": state.model_state_dict(self.model) if weights else None,
                "optimizer": state.optimizer_state_dict(self.model, self.optimizer) if weights else None,
                "scheduler": self.scheduler.state_dict(), "data": {"train": data},
                "rng": {f"rank{self._global_rank}": rng_state()}}

    def state_snapshot(self):
        """The state copied now, between steps, and `finish(group=None)` returning it as state_dict() would have:
        a collective on `group` (the trainer's ranks, in order), which may run later in another thread (an
        asynchronous save). A wrapper that offers `state_snapshot(optimizer)` (nanodist.FSDP) copies its shards
        now and lays them out in finish(); otherwise the state is laid out now and copied."""
        take = getattr(state.bare_module(self.model), "state_snapshot", None)
        if callable(take):
            saved = state.clone(self.state_dict(weights=False))
            layout = take(self.optimizer)

            def finish(group=None):
                saved["model"], saved["optimizer"] = layout(group)
                return saved

            return finish
        saved = state.clone(self.state_dict())
        return lambda group=None: saved

    def load_state_dict(self, saved: dict) -> None:
        """Resume from state_dict() -- saved at this or another world size, by this or another packing: the next
        step is exactly the one the saved run took next. A rank the saved run did not have -- resuming at a
        larger world size -- seeds its generators from the run's step and its rank."""
        state.load_model_state_dict(self.model, saved["model"])
        state.load_optimizer_state_dict(self.model, self.optimizer, saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
        if saved["data"]["train"] is not None:
            self.train_data.load_state_dict(saved["data"]["train"])
        me = self._global_rank
        mine = saved["rng"].get(f"rank{me}")
        if mine is not None:
            set_rng_state(mine)
        elif saved.get("world_size", self.world.size) == self.world.size:
            raise ValueError(f"this training state holds the random generators of {sorted(saved['rng'])}, not of "
                             f"rank{me}: load on every rank the state that rank saved")
        else:
            from .runtime import seed_everything
            seed_everything(int(saved["step"]) * 1_000_003 + me)
            print(f"rank {me}: the saved run had {saved['world_size']} ranks, so this rank has no saved "
                  f"random state: seeded from the step and the rank", flush=True)
        self.step, self.tokens_seen = int(saved["step"]), int(saved["tokens_seen"])
        self.skipped_steps = int(saved.get("skipped_steps", 0))
        self.run_id = saved["run_id"]

    # --- one step -----------------------------------------------------------------------------------

    def _mean_over_ranks(self, value: float) -> float:
        if self.group.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.group.comm_device)
        dist.all_reduce(t, group=self.group.pg)
        return t.item() / self.group.size

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean validation loss over the same eval_batches micro-batches every time, averaged over ranks.
        Touches neither the training stream nor any random generator."""
        if self.val_data is None:
            return None
        if self._val_batches is None:
            self._val_batches = [next(self.val_data) for _ in range(self.cfg.eval_batches)]
        was_training = self.model.training
        self.model.eval()
        losses = []
        for x, y in self._val_batches:
            with autocast(self.cfg.dtype, self.group.device):
                _, loss = self.model(x, y)
            losses.append(loss.float())
        self.model.train(was_training)
        return self._mean_over_ranks(torch.stack(losses).mean().item())

    def train_step(self) -> dict:
        """One optimizer step: grad_accum micro-steps, the norm (clipping), the update. Returns the step's row,
        whose scalars may still be device tensors (read at the next flush)."""
        cfg, step = self.cfg, self.step
        lr = lr_at(step, cfg)
        start = self._timer.start()
        loss_sum = torch.zeros((), device=self.group.device)
        for micro in range(self.grad_accum):
            self.sync.set_requires_gradient_sync(micro == self.grad_accum - 1)
            x, y = next(self.train_data)
            with autocast(cfg.dtype, self.group.device):
                _, loss = self.model(x, y)
            (loss / self.grad_accum).backward()
            loss_sum += loss.detach().float()
        # The global norm of the synchronised gradient, every step: it clips, and a NaN or inf anywhere shows in it.
        norm = self.sync.clip_grad_norm_(cfg.grad_clip if cfg.grad_clip else math.inf)
        skipped = False
        opt_start = self._timer.start()
        # "skip" must know before the update: one read per step, as torch's GradScaler does with a non-fused
        # optimizer. The default, "stop", reads nothing here: the flush finds a non-finite row and stops the run.
        if cfg.nonfinite == "skip" and not torch.isfinite(norm).item():
            skipped = True
            self.skipped_steps += 1
        else:
            self.optimizer.step()
        opt_end = self._timer.start()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        end = self._timer.start()
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        row = {"step": step, "start": start, "end": end, "opt_start": opt_start, "opt_end": opt_end,
               "loss": loss_sum / self.grad_accum, "lr": lr, "grad_norm": norm.detach(), "skipped": skipped,
               # a device tensor, read only if this step stops the run: was this rank's own gradient finite?
               "local_finite": getattr(self.sync, "local_gradient_finite", None)}
        self._pending.append(row)
        return row

    def _flush(self) -> None:
        """Read the pending steps' scalars (one wait for the device), stop on a non-finite value, log them."""
        if not self._pending:
            return
        rows, self._pending = self._pending, []
        check = getattr(self.sync, "check_pending", None)  # DDP on a GPU checks its syncs a step late: read the last
        if callable(check):
            check()
        for row in rows:
            row["time_s"] = self._timer.seconds(row.pop("start"), row.pop("end"))
            row["optimizer_s"] = self._timer.seconds(row.pop("opt_start"), row.pop("opt_end"))  # the update alone
            row["tokens_per_s"] = self.tokens_per_step / row["time_s"] if row["time_s"] > 0 else float("inf")
            row["loss"], row["grad_norm"] = float(row["loss"]), float(row["grad_norm"])
            local_finite = row.pop("local_finite")
            if row.pop("skipped"):
                row["skipped"] = True  # only skipped steps carry the flag
            if self.cfg.nonfinite == "stop" and not (math.isfinite(row["grad_norm"]) and math.isfinite(row["loss"])):
                self._stop_nonfinite(row, local_finite)
            self._log(row)

    def _stop_nonfinite(self, row: dict, local_finite=None) -> None:
        # The norm is global, so every rank sees it at the same step; the losses say where it came from, and, when
        # every loss was finite, each rank's own gradient before averaging (nanodist's wrappers keep that verdict).
        world = self.world  # every rank reaches this step, and the report names ranks of the whole run
        losses = world.all_gather_object(row["loss"])
        bad = [world.global_rank(r) for r, v in enumerate(losses) if not math.isfinite(v)]
        grads = world.all_gather_object(None if local_finite is None else bool(local_finite))
        bad_grads = [world.global_rank(r) for r, ok in enumerate(grads) if ok is False]
        if bad:
            where = f"the loss was {', '.join(f'{losses[world.ranks.index(r)]} on rank {r}' for r in bad)}"
        elif bad_grads:
            where = (f"every rank's loss was finite, but the gradient of {_ranks(bad_grads)} was non-finite before "
                     f"the ranks averaged it: a backward on {'that rank' if len(bad_grads) == 1 else 'those ranks'} "
                     f"overflowed, or a hook or a custom autograd function wrote a NaN or inf")
        else:
            where = "every rank's loss was finite, so a gradient became non-finite in backward"
        msg = (f"non-finite values at step {row['step']}: the global gradient norm is {row['grad_norm']} and {where}. "
               f"The run stops here, on every rank. Lower the learning rate or check the data at that step; "
               f"TrainConfig(nonfinite='skip') skips such steps instead (as torch's GradScaler does).")
        if self.recorder is not None:
            self.recorder.stop(msg, step=row["step"])
        if self.checkpoints is not None:  # a restarted group finds it and stops at once, instead of looping
            self.checkpoints.mark_stopped(msg)
        self._close()
        raise NonFiniteError(msg)

    def _log(self, row: dict) -> None:
        cfg, step = self.cfg, row["step"]
        if cfg.log_every and (step % cfg.log_every == 0 or step == cfg.steps - 1):
            row["loss_all_ranks"] = self._mean_over_ranks(row["loss"])  # every rank takes part
        if (cfg.eval_every and (step + 1) % cfg.eval_every == 0) or step == cfg.steps - 1:
            val = self.evaluate()
            if val is not None:
                row["val_loss"] = val
        self.history.append(row)
        if self.recorder is not None:
            self.recorder.step(**row)
        self._wandb.log({k: v for k, v in row.items() if k != "step"}, step=step)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")

    def fit(self, max_steps: int | None = None) -> list[dict]:
        """Train until cfg.steps (or `max_steps` more steps: fit can be called again to go on). Returns history."""
        cfg, group = self.cfg, self.world
        if self._wandb is None:  # opened on the first call, closed when the last step is done
            self._wandb = WandbLogger(cfg.wandb, cfg.wandb_project, {**asdict(cfg), "world_size": group.size},
                                      name=cfg.run_name, is_main=Group.world().is_main, run_id=self.run_id)
            if cfg.progress and group.is_main:
                from tqdm.auto import tqdm
                self._bar = tqdm(total=cfg.steps, initial=self.step, desc=cfg.run_name or "train", leave=False)
        stop = cfg.steps if max_steps is None else min(cfg.steps, self.step + max_steps)
        every = cfg.checkpoint_every if self.checkpoints is not None else 0
        try:
            while self.step < stop:
                self.train_step()
                if len(self._pending) >= self._flush_every or self.step == stop:
                    self._flush()
                if every and (self.step % every == 0 or self.step == cfg.steps):
                    self.checkpoints.save(self)
        except BaseException:
            self._close()
            raise
        if self.step >= cfg.steps:
            if self.checkpoints is not None:
                self.checkpoints.wait()
            self._close()
        return self.history

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._wandb is not None:
            self._wandb.finish()
