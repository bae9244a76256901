"""The one training loop every lab uses: accumulation, mixed precision, clipping, LR schedule, eval, logging.

    cfg = TrainConfig(steps=100, total_batch_tokens=8192, micro_batch=8, seq_len=64)
    trainer = Trainer(model, optimizer, train_stream, cfg, val_data=val_stream, recorder=rec)
    history = trainer.fit()            # one dict per step: loss, lr, time, tokens/s, grad norm

The arithmetic of a step: the *total batch* (tokens per optimizer step, the number that matters for
the optimisation) is split over `world_size` ranks and, if that is still too much to hold at once,
over `grad_accum` micro-steps per rank:

    total_batch_tokens = micro_batch x seq_len x world_size x grad_accum

so adding ranks at a fixed total batch (strong scaling) means fewer accumulation steps per rank,
and the optimisation is the same. Under a DDP wrapper the first grad_accum - 1 micro-steps run in
`no_sync()`: gradients accumulate locally and are averaged across ranks once, on the last one.
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .group import Group
from .runtime import print0, synchronize


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
                 is_main: bool | None = None):
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
            self.run = wandb.init(project=project, config=config, name=name, mode=mode, dir=directory,
                                  reinit="create_new", settings=wandb.Settings(silent=True, console="off"))
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


class Trainer:
    """Runs `cfg.steps` optimizer steps of `model` on batches from `train_data`.

    - model: any module returning (logits, loss) from model(x, y); DDP-wrapped, or bare with an optimizer
      that averages gradients itself (ZeRO). A module with `no_sync()` gets it for all but the last micro-step.
    - optimizer: a torch.optim.Optimizer. If it has an attribute `max_grad_norm`, it clips the synchronised
      gradient itself (sharded optimizers do: only they see the averaged gradient) and the trainer does not.
    - train_data / val_data: iterators of (x, y) micro-batches of shape (micro_batch, seq_len).
    - recorder: a nanodist.results.Recorder to receive per-step results (optional).
    """

    def __init__(self, model, optimizer, train_data, cfg: TrainConfig, val_data=None, recorder=None, group=None):
        self.model, self.optimizer, self.cfg = model, optimizer, cfg
        self.train_data, self.val_data, self.recorder = train_data, val_data, recorder
        self.group = Group.resolve(group)
        self.grad_accum = grad_accum_steps(cfg.total_batch_tokens, cfg.micro_batch, cfg.seq_len,
                                           self.group.size)
        self.tokens_per_step = cfg.micro_batch * cfg.seq_len * self.group.size * self.grad_accum
        autocast(cfg.dtype, self.group.device)  # validate early
        for group in optimizer.param_groups:
            group.setdefault("base_lr", group["lr"])  # groups may have their own lr; the schedule scales it
        if hasattr(optimizer, "max_grad_norm"):
            optimizer.max_grad_norm = cfg.grad_clip or None
        self.step = 0
        self.history: list[dict] = []
        self._wandb, self._bar = None, None

    def _sync_device(self) -> None:
        synchronize(self.group.device)

    def _mean_over_ranks(self, value: float) -> float:
        if self.group.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.group.comm_device)
        dist.all_reduce(t, group=self.group.pg)
        return t.item() / self.group.size

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean validation loss over eval_batches micro-batches per rank, averaged over ranks."""
        if self.val_data is None:
            return None
        self.model.eval()
        losses = []
        for _ in range(self.cfg.eval_batches):
            x, y = next(self.val_data)
            with autocast(self.cfg.dtype, self.group.device):
                _, loss = self.model(x, y)
            losses.append(loss.float().item())
        self.model.train()
        return self._mean_over_ranks(sum(losses) / len(losses))

    def train_step(self) -> dict:
        """One optimizer step: grad_accum micro-steps, clipping, the update. Returns what was measured."""
        cfg, step = self.cfg, self.step
        lr = lr_at(step, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = group["base_lr"] * lr / cfg.lr
        self._sync_device()
        t0 = time.perf_counter()
        loss_sum = 0.0
        for micro in range(self.grad_accum):
            x, y = next(self.train_data)
            last = micro == self.grad_accum - 1
            sync = contextlib.nullcontext() if last or not hasattr(self.model, "no_sync") else self.model.no_sync()
            with sync:
                with autocast(cfg.dtype, self.group.device):
                    _, loss = self.model(x, y)
                (loss / self.grad_accum).backward()
            loss_sum += loss.detach()
        grad_norm = None
        if cfg.grad_clip and not hasattr(self.optimizer, "max_grad_norm"):
            # Under DDP the gradients are already averaged, so every rank clips by the same global norm.
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip).item()
        self.optimizer.step()
        if grad_norm is None and getattr(self.optimizer, "last_grad_norm", None) is not None:
            grad_norm = float(self.optimizer.last_grad_norm)  # a sharded optimizer clipped, and measured the norm
        self.optimizer.zero_grad(set_to_none=True)
        self._sync_device()
        dt = time.perf_counter() - t0
        self.step += 1
        return {"step": step, "time_s": dt, "loss": (loss_sum / self.grad_accum).item(), "lr": lr,
                "tokens_per_s": self.tokens_per_step / dt,
                **({"grad_norm": grad_norm} if grad_norm is not None else {})}

    def fit(self, max_steps: int | None = None) -> list[dict]:
        """Train until cfg.steps (or `max_steps` more steps: fit can be called again to go on). Returns history."""
        cfg, group = self.cfg, self.group
        if self._wandb is None:  # opened on the first call, closed when the last step is done
            self._wandb = WandbLogger(cfg.wandb, cfg.wandb_project, {**asdict(cfg), "world_size": group.size},
                                      name=cfg.run_name, is_main=Group.world().is_main)
            if cfg.progress and group.is_main:
                from tqdm.auto import tqdm
                self._bar = tqdm(total=cfg.steps, desc=cfg.run_name or "train", leave=False)
        stop = cfg.steps if max_steps is None else min(cfg.steps, self.step + max_steps)
        try:
            while self.step < stop:
                row = self.train_step()
                step = row["step"]
                if cfg.log_every and (step % cfg.log_every == 0 or step == cfg.steps - 1):
                    row["loss_all_ranks"] = self._mean_over_ranks(row["loss"])  # every rank takes part
                at_end = step == cfg.steps - 1
                if (cfg.eval_every and (step + 1) % cfg.eval_every == 0) or at_end:
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
        except BaseException:
            self._close()
            raise
        if self.step >= cfg.steps:
            self._close()
        return self.history

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._wandb is not None:
            self._wandb.finish()
