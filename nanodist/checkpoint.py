"""Checkpoints: the whole training state, saved atomically, full or sharded, loaded safely, resumed bit for bit.

    ckpt = CheckpointManager("runs/ckpt", keep=3, format="sharded")   # every rank, after nanodist.init()
    ckpt.resume(trainer, "auto")            # the newest complete checkpoint, if any: the next step is the saved run's
    ...
    ckpt.save(trainer)                      # between steps, on every rank; returns what it cost
    ckpt.wait()                             # an asynchronous save is committed

What is saved: Trainer.state_dict() -- model, optimizer, LR schedule, step and tokens seen, the training
stream's global cursor, every rank's random generators, the run id -- and beside it `meta.json`: the
state format, nanodist's version and commit, the world size, the model's parameter names and shapes,
the optimizer, the configuration, and a checksum of every file. This module talks to the training only
through the Trainer's state_dict() / load_state_dict() (torch's Stateful), whose layout nanodist.state
defines: the model and the optimizer keyed by the bare model's parameter names, sharded tensors as DTensors
of their global shape. It knows no wrapper and no optimizer class: a new one takes part through that
protocol (see nanodist.state), and loads need no optimizer state made up beforehand -- the optimizer's
entries are read as the checkpoint describes them.

Two formats:
- "full": everything gathered to rank 0 into one `state.pt`, plain tensors and Python values, loadable
  by `torch.load(path, weights_only=True)` without nanodist, and at any world size.
- "sharded": torch.distributed.checkpoint (DCP); every rank writes its part. Sharded tensors are DTensors
  Shard(0) of their global shape (the FSDP flat buffers and ZeRO slices are converted to that layout), so
  DCP reshards them when a run resumes at another world size.

Atomic: a checkpoint is written into `.tmp-step_XXXXXXXX-<id>/`, its files fsynced, the directory renamed
to `step_XXXXXXXX/`, and only then `latest` (a one-line file, replaced by rename) points at it. A
checkpoint is complete or absent; a killed save leaves a temporary directory that is ignored and removed
by the next save. Saving a step that exists (a resumed run repeating it) exchanges the two directories in
one step (Linux's renameat2), so the step is always there, old or new.

One run per folder: from its first save or resume, rank 0 holds `<directory>/LOCK` (host, process, torchrun
run, run id); a manager that only finds or inspects checkpoints takes nothing. A second run is
refused with the holder's name; the lock is taken over from this process, from the same torchrun run (a
restart) and from a holder that died on this host (kill -9, then resume). A stale lock of another host is
broken by removing the file. close() gives the folder up.

Safe to load: files are read with weights_only=True (tensors and plain values only), and DCP's
`.metadata`, which torch unpickles freely, is read by an unpickler that knows only DCP's metadata classes;
anything else is refused before it runs. Every file a load reads is one of the checkpoint's own regular
files: a symbolic link, a FIFO or a device, or a storage entry naming a path outside, is refused (a crafted
file could otherwise read any file as state, or block every rank). Writes never follow a symbolic link.

Asynchronous saves copy the state in memory between steps and write it in the background: sharded, a thread
lays the copy out and runs DCP's save on a process group of its own (its collectives cannot meet the
training's); full, the state is gathered to rank 0 first and a thread writes the file. Training is blocked
for the copy (and, full, the gather).
"""
from __future__ import annotations

import contextlib
import ctypes
import datetime
import functools
import io
import json
import os
import pickle
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from . import __version__
from .group import Group
from .results import REPO_ROOT
from .runtime import print0
from .state import dtensor_like, full_tensor

STATE_FORMAT = 1  # bump when the saved layout changes; load() refuses another one with a clear message
FORMATS = ("full", "sharded")
STOPPED = "STOPPED"  # a run that stopped itself (non-finite loss) leaves its reason here
LOCK = "LOCK"  # who holds the folder: one run at a time


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded: the message says which file or what differs, and what to do."""


@dataclass
class SaveReport:
    """What one save cost: the seconds training was blocked, and where it went (path is final once committed)."""

    path: Path
    step: int
    format: str
    blocked_s: float
    asynchronous: bool


# ----------------------------------------------------------------------------- the training state

@functools.lru_cache(maxsize=1)
def code_version() -> dict:
    """nanodist's version and, in a git checkout, the commit: what wrote a checkpoint (asked git once per process:
    the code a process runs does not change under it)."""
    commit = None
    if (REPO_ROOT / ".git").exists():
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                    text=True, timeout=5).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            commit = None
    return {"nanodist": __version__, "commit": commit, "torch": torch.__version__}


# Optimizers that shard another's state, by the update rule they run (a checkpoint of one loads into the other):
# for checkpoints written before the signature recorded the rule.
ALGORITHMS = {"DistAdamW": "AdamW", "DistMuon": "Muon", "ShardedOptimizer": "Muon+AdamW", "MuonAdamW": "Muon+AdamW"}


KINDS = {"adamw": "AdamW", "muon": "Muon"}


def algorithm(optimizer) -> str:
    """The update rule whose state an optimizer keeps: the class name, seen through the wrappers that shard an
    inner optimizer (ZeroOptimizer's `inner`, torch ZeroRedundancyOptimizer's `optim`); for an optimizer whose
    groups each name their rule (nanodist's sharded optimizers, MuonAdamW), those rules ("Muon+AdamW")."""
    for attr in ("inner", "optim"):
        inner = getattr(optimizer, attr, None)
        if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer:
            return algorithm(inner)
    kinds = [g.get("kind") for g in optimizer.param_groups]
    if kinds and all(k in KINDS for k in kinds):
        return "+".join(sorted({KINDS[k] for k in kinds}, reverse=True))
    name = type(optimizer).__name__
    return ALGORITHMS.get(name, name)


def signature(state: dict) -> dict:
    """What must match for a checkpoint to load, read from the state itself (nanodist.state's layout): every
    model entry's name, global shape and dtype, and the optimizer's parameter groups (kinds and sizes)."""
    params = {name: [list(t.shape), str(t.dtype).replace("torch.", "")]
              for name, t in state["model"].items() if torch.is_tensor(t)}
    groups = [{"size": len(g["params"]), "kind": g.get("kind", "adamw" if "betas" in g else "other")}
              for g in state["optimizer"]["param_groups"]]
    return {"params": params, "param_groups": groups}


def _tied(model: dict) -> dict[str, str]:
    """name -> an earlier name of the same tensor (a tied parameter, which a state dict holds under each name):
    entries whose local data is the same memory. Decide on rank 0 (a rank's shard of a small tensor may be empty
    elsewhere) and share the answer."""
    seen, out = {}, {}
    for name, t in model.items():
        local = t.to_local() if hasattr(t, "to_local") else t
        if not torch.is_tensor(local) or local.numel() == 0:
            continue
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape), local.stride(),
               tuple(t.shape))
        if key in seen:
            out[name] = seen[key]
        else:
            seen[key] = name
    return out


def _described(meta: dict, state: dict) -> dict:
    """meta with the signature of the state being saved (which, laid out in the background, may come late)."""
    return {**meta, "signature": {**meta["signature"], **signature(state)}}


def _optimizer_template(dcp_meta, live: dict) -> dict:
    """What DCP loads the saved optimizer state into, built from the checkpoint's own description of it (so no
    optimizer needs its state made up before a load): a state tensor goes into the live optimizer's tensor at the
    same place when it has one of that shape; a tensor of its parameter's shape takes the parameter's layout
    (`live["model"]`: a DTensor there is read as this rank's shard); anything else is read whole."""
    from torch.distributed.checkpoint._traverse import get_element, set_element
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    paths = getattr(dcp_meta, "planner_data", None)
    entries = getattr(dcp_meta, "state_dict_metadata", None)
    if not isinstance(paths, dict) or not isinstance(entries, dict):
        raise CheckpointError("this sharded checkpoint's .metadata does not describe its state (no planner data): "
                              "it was not written by nanodist")
    out: dict = {}
    for fqn, path in sorted(paths.items()):
        if not isinstance(path, tuple) or not path or path[0] != "optimizer" or fqn not in entries:
            continue
        md = entries[fqn]
        if not isinstance(md, TensorStorageMetadata):
            set_element(out, path[1:], None)  # a plain value: DCP hands it over as saved
            continue
        shape = tuple(md.size)
        mine = get_element(live, path)
        if torch.is_tensor(mine) and tuple(mine.shape) == shape:
            value = mine
        else:
            param = live["model"].get(path[2]) if len(path) == 4 and path[1] == "state" else None
            if param is not None and hasattr(param, "device_mesh") and tuple(param.shape) == shape:
                value = torch.distributed.tensor.empty(shape, dtype=md.properties.dtype,
                                                       device_mesh=param.device_mesh, placements=param.placements)
            else:
                value = torch.empty(shape, dtype=md.properties.dtype)
        set_element(out, path[1:], value)
    return out


# ----------------------------------------------------------------------------- full format

def _full(value, group: Group):
    """The whole of a (possibly sharded) value: DTensors gathered (a collective, in the same order on every rank)."""
    if isinstance(value, dict):
        return {k: _full(v, group) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_full(v, group) for v in value)
    if hasattr(value, "full_tensor"):
        return full_tensor(value, to_host=True)
    if torch.is_tensor(value):
        return value.detach().cpu().clone()
    return value


def _gather_full(state: dict, group: Group) -> dict | None:
    """The full training state on the group's rank 0 (None elsewhere). Sharded tensors are gathered; what lives
    on one rank only (a Muon momentum on its owner) and every rank's random generators are collected."""
    full = _full({k: v for k, v in state.items() if k not in ("rng", "optimizer")}, group)
    opt = state["optimizer"]
    tensors = {n: {k: _full(v, group) if hasattr(v, "full_tensor") else None for k, v in st.items()}
               for n, st in opt["state"].items()}  # the DTensors: every rank has each of them
    local = {n: {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in st.items()
                 if not hasattr(v, "full_tensor")} for n, st in opt["state"].items()}
    everyone = group.all_gather_object({"rng": state["rng"], "opt": local})
    if not group.is_main:
        return None
    merged: dict = {}
    for n in opt["state"]:
        entry = {k: v for k, v in tensors[n].items() if v is not None}
        for theirs in everyone:  # a value only one rank holds (Muon's momentum on its owner) comes from that rank
            for k, v in theirs["opt"].get(n, {}).items():
                entry.setdefault(k, v)
        merged[n] = entry
    full["optimizer"] = {"state": merged, "param_groups": opt["param_groups"]}
    full["rng"] = {k: v for theirs in everyone for k, v in theirs["rng"].items()}
    return full


def _localize(saved, template, path: str = ""):
    """A full state, loaded whole on every rank, in the live state's layout: where the live value is a DTensor,
    this rank's chunk of the saved whole tensor."""
    if isinstance(template, dict) and isinstance(saved, dict):
        return {k: _localize(v, template.get(k), f"{path}.{k}" if path else str(k)) for k, v in saved.items()}
    if template is not None and hasattr(template, "device_mesh") and torch.is_tensor(saved):
        if tuple(saved.shape) != tuple(template.shape) and saved.numel() == template.numel():
            return saved  # a state tensor in another layout (AdamW's moments, flat in DistAdamW): the optimizer cuts it
        return dtensor_like(saved, template)
    return saved


# ----------------------------------------------------------------------------- safe loading of DCP

_DCP_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in
    ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
     "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"), ("collections", "OrderedDict"),
     ("torch.serialization", "_get_layout"),  # looks a torch.layout up by name in a fixed table: nothing else
     ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's .metadata and nothing else: a global outside DCP's metadata classes and torch's dtypes
    (a function to call, a class to build) is refused before anything runs."""

    def find_class(self, module, name):
        if (module, name) in _DCP_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                             torch.memory_format)):
            return getattr(torch, name)
        raise CheckpointError(f"refusing to load this checkpoint: its .metadata asks for {module}.{name}, which a "
                              f"DCP checkpoint never contains (the file may have been crafted to run code)")


def read_dcp_metadata(path: Path):
    """DCP's metadata of a sharded checkpoint, through the restricted unpickler; every file it sends DCP to is
    checked to be one of the checkpoint's own regular files (a crafted entry could name any file, or a FIFO that
    blocks the read)."""
    path = Path(path)
    with open(_regular_file(path / ".metadata"), "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise CheckpointError(f"{path / '.metadata'} does not say where the checkpoint's data is: it was not "
                              f"written by torch.distributed.checkpoint")
    for rel in {getattr(info, "relative_path", None) for info in storage.values()}:
        if not isinstance(rel, str) or not rel or rel != Path(rel).name or rel in (".", ".."):
            raise CheckpointError(f"{path / '.metadata'} sends the load to {rel!r}, outside the checkpoint's own "
                                  f"files: refusing it (the file may have been crafted)")
        _regular_file(path / rel)
    return metadata


def _safe_reader(path: Path, metadata):
    """A FileSystemReader that hands DCP the metadata already read through the restricted unpickler."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))


def _safe_planner():
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:  # non-tensor values: plain data only
            from torch.distributed.checkpoint._traverse import set_element
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafePlanner()


def _dcp_error() -> type:
    """torch's CheckpointException (imported when needed, as DCP is): it derives from BaseException, so a user's
    `except Exception` would not see it."""
    from torch.distributed.checkpoint.api import CheckpointException
    return CheckpointException


def _dcp_cause(e: BaseException) -> str:
    """What went wrong inside DCP, rank by rank: its exception lists only 'CheckpointException ranks:...'."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, f in sorted(failures.items()):
            inner = f[0] if isinstance(f, tuple) and f and isinstance(f[0], BaseException) else \
                getattr(f, "exception", f)  # torch keeps (exception, frames) per rank
            parts.append(f"rank {rank}: {type(inner).__name__}" + (f": {str(inner)[:300]}" if str(inner) else ""))
        return "; ".join(parts)
    return f"{type(e).__name__}: {str(e)[:600]}"


@contextlib.contextmanager
def _one_process_is_fine():
    """DCP warns that it 'assumes' a single process when there is no process group: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


# ----------------------------------------------------------------------------- files

def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rename_exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux's renameat2 with RENAME_EXCHANGE); False where the system or the file
    system cannot."""
    if sys.platform != "linux":
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _swap_in(tmp: Path, final: Path) -> None:
    """Give directory `tmp` the name `final`. Where `final` exists (the same step saved again: a resumed run
    repeating it), the two are exchanged in one step -- a reader finds the old checkpoint or the new one, never
    neither -- and the old one, now under tmp's name, is removed. Where the system cannot exchange, the old one
    is renamed aside first: for that moment find() falls back to the previous step."""
    if not final.exists():
        os.rename(tmp, final)
        return
    if _rename_exchange(tmp, final):
        shutil.rmtree(tmp, ignore_errors=True)  # the old checkpoint (a .tmp-* name: the next save removes leftovers)
        return
    aside = final.with_name(f".tmp-replaced-{final.name}-{uuid.uuid4().hex[:8]}")
    os.rename(final, aside)
    os.rename(tmp, final)
    shutil.rmtree(aside, ignore_errors=True)


def _regular_file(path: Path) -> Path:
    """`path`, once it is known to be a regular file that is not a symbolic link: a checkpoint's reads never
    follow a link out of it, and never open a FIFO or a device (the read would block, or never end)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing from the checkpoint") from None
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read ({e.strerror or e})") from None
    if stat.S_ISLNK(mode):
        raise CheckpointError(f"{path} is a symbolic link, which a checkpoint never holds: refusing to follow it "
                              f"(it points at {os.readlink(path)!r})")
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{path} is not a regular file (a directory, a FIFO or a device): refusing to read it")
    return path


def _process_start(pid: int) -> str | None:
    """When process `pid` started (Linux: field 22 of /proc/<pid>/stat); None where that cannot be read. Tells a
    live holder from a new process that happens to have a dead holder's pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _holder_of_this_process() -> dict:
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": _process_start(os.getpid()),
            "torchrun_run": run if run not in (None, "", "none") else None, "run_id": None,
            "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _read_lock(path: Path) -> dict:
    try:
        holder = json.loads(_regular_file(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        holder = None
    if not isinstance(holder, dict):
        raise CheckpointError(f"{path} does not say which run holds this folder: if no run uses it, remove {path}")
    return holder


def _alive(pid, started) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process, alive
        return True
    now = _process_start(pid)
    return started is None or now is None or now == started


def _may_take_over(holder: dict, me: dict) -> bool:
    """This process, the same torchrun run (restarted), or a holder that died on this host."""
    if holder.get("host") == me["host"] and holder.get("pid") == me["pid"]:
        return True
    if me["torchrun_run"] is not None and holder.get("torchrun_run") == me["torchrun_run"]:
        return True
    return holder.get("host") == me["host"] and not _alive(holder.get("pid"), holder.get("started"))


def _crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _manifest(directory: Path) -> dict:
    return {str(p.relative_to(directory)): {"bytes": p.stat().st_size, "crc32": _crc32(p)}
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != "meta.json"}


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def verify(path: Path) -> dict:
    """Check a checkpoint directory against its meta.json (every file present, its size and checksum); return the
    meta. Raises CheckpointError naming the first file that is missing, truncated or corrupted."""
    path = Path(path)
    meta_path = path / "meta.json"
    meta = read_meta(path)
    files = meta.get("files")
    if not isinstance(files, dict) or not all(isinstance(w, dict) and isinstance(w.get("bytes"), int)
                                              and isinstance(w.get("crc32"), str) for w in files.values()):
        raise CheckpointError(f"{meta_path} is corrupted: it does not list the checkpoint's files with their sizes "
                              f"and checksums")
    for name, want in files.items():
        f = path / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointError(f"{meta_path} is corrupted: it names {name!r}, outside the checkpoint")
        size = os.lstat(_regular_file(f)).st_size
        if size != want["bytes"]:
            raise CheckpointError(f"{f} is truncated or changed: {size} bytes, {want['bytes']} when it was saved")
        if _crc32(f) != want["crc32"]:
            raise CheckpointError(f"{f} is corrupted: its checksum differs from the one saved with it")
    return meta


# ----------------------------------------------------------------------------- the manager

class CheckpointManager:
    """Saves, keeps the last `keep`, and finds and loads checkpoints in `directory` (see the module docstring).

    Every rank constructs it (a collective where async_save needs its own process group) and calls save() and
    resume() together. The directory is checked for writing here, before any training."""

    def __init__(self, directory, *, keep: int = 3, format: str = "sharded", async_save: bool = False, group=None,
                 record_fingerprint: bool = False):
        if format not in FORMATS:
            raise ValueError(f"checkpoint format must be one of {', '.join(FORMATS)}, got {format!r}")
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive number of checkpoints, got {keep!r}")
        if directory is None or not str(directory).strip():
            raise CheckpointError("the checkpoint directory is empty: name one (--checkpoint-dir PATH); an empty name "
                                  "would put step_* folders in whatever directory the run starts in")
        self.directory, self.keep, self.format, self.async_save = Path(directory), keep, format, async_save
        self.record_fingerprint = record_fingerprint  # meta.json gets fingerprint(trainer): costs one gather
        self.group = Group.resolve(group)
        self._check_writable()
        self._lock: dict | None = None
        self._locked = False  # taken at the first save or resume: a manager that only looks takes nothing
        self._async_pg = None
        if async_save and self.group.size > 1 and format == "sharded":
            # the background save runs collectives: on a group of its own they cannot meet the training's.
            self._async_pg = dist.new_group(ranks=self.group.ranks, backend="gloo")
        self._pending: dict | None = None
        self._pending_error: BaseException | None = None
        self.reports: list[SaveReport] = []

    def _agree(self, value):
        """Rank 0's value on every rank (the ranks act on one decision)."""
        return self.group.broadcast_object(value)

    def _check_writable(self) -> None:
        problem = None
        if self.group.is_main:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                probe = self.directory / f".probe-{uuid.uuid4().hex[:8]}"
                probe.write_text("ok")
                probe.unlink()
            except OSError as e:
                problem = (f"the checkpoint directory {self.directory} is not writable ({e.strerror or e}): choose "
                           f"another with --checkpoint-dir, or fix its permissions")
        problem = self._agree(problem)
        if problem:
            raise CheckpointError(problem)

    # --- one run per folder ---------------------------------------------------------------------------

    def _take_lock(self) -> None:
        """Rank 0 takes the folder's LOCK (every rank learns the outcome), once: at the first save or resume. A folder is held by one run: two runs
        in one folder would resume each other's steps, delete each other's saves and prune across runs. The lock
        is taken over from a holder that is this process, that belongs to the same torchrun run (a restart), or
        that is dead on this host (a run killed by SIGKILL, resumed). Otherwise: a CheckpointError naming it."""
        if self._locked:
            return
        problem = None
        if self.group.is_main:
            try:
                self._lock = self._acquire()
            except CheckpointError as e:
                problem = str(e)
        problem = self._agree(problem)
        if problem:
            raise CheckpointError(problem)
        self._locked = True

    def _acquire(self) -> dict:
        path, me = self.directory / LOCK, _holder_of_this_process()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except FileExistsError:
            holder = _read_lock(path)
            if not _may_take_over(holder, me):
                raise CheckpointError(
                    f"the checkpoint folder {self.directory} is in use by another run: process {holder.get('pid')} "
                    f"on {holder.get('host')} (run {holder.get('run_id') or 'not yet named'}, since "
                    f"{holder.get('since')}) holds {path}. Give each run its own folder (--checkpoint-dir); if that "
                    f"run is over, remove {path} and start again") from None
            _write_json(path, me)  # taken over: a new file renamed over the old one
            return me
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return me

    def _name_run(self, run_id: str) -> None:
        """Rank 0: the lock names the run once the manager knows it (at the first save)."""
        if self._lock is not None and self._lock.get("run_id") != run_id:
            self._lock = {**self._lock, "run_id": run_id}
            _write_json(self.directory / LOCK, self._lock)

    def release(self) -> None:
        """Give the folder up (rank 0 removes the LOCK, if it is still this process's). close() does it."""
        if self._lock is None:
            return
        path = self.directory / LOCK
        try:
            holder = _read_lock(path)
            if (holder.get("pid"), holder.get("host")) == (self._lock["pid"], self._lock["host"]):
                path.unlink()
        except (CheckpointError, OSError):
            pass  # gone already, or another's now: not ours to remove
        self._lock, self._locked = None, False

    # --- finding --------------------------------------------------------------------------------------

    def complete(self) -> list[Path]:
        """Committed checkpoints, oldest first (by step)."""
        if not self.directory.is_dir():
            return []
        return sorted((p for p in self.directory.glob("step_*")  # a linked step would lead reads out of here
                       if p.is_dir() and not p.is_symlink() and os.path.lexists(p / "meta.json")),
                      key=lambda p: p.name)

    def latest(self) -> Path | None:
        """What `latest` points at, if it names a committed checkpoint; else the newest committed one."""
        pointer = self.directory / "latest"
        try:
            name = pointer.read_text().strip() if pointer.is_file() and not pointer.is_symlink() else ""
        except (OSError, UnicodeDecodeError):  # a damaged pointer: fall back to what the directory holds
            name = ""
        if name.startswith("step_") and "/" not in name and (self.directory / name / "meta.json").is_file():
            return self.directory / name
        found = self.complete()
        return found[-1] if found else None

    def find(self, spec: str | os.PathLike | None) -> Path | None:
        """The checkpoint `spec` names: "auto" (the newest good one, falling back past damaged ones with a
        warning), a path, or "none"/None (start fresh). Decided on rank 0 and agreed by every rank. A run that
        stopped itself (a non-finite loss) left its reason beside the checkpoints: finding one raises it."""
        fresh = spec is None or str(spec) == "none"
        restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0")
        if fresh and not restarted:  # a new run, starting fresh: a reason left by an earlier run is not its own
            if self.group.is_main and os.path.lexists(self.directory / STOPPED) and \
                    not (self.directory / STOPPED).is_dir():
                print0(f"starting fresh: removing {self.directory / STOPPED} left by an earlier run")
                (self.directory / STOPPED).unlink()
            return None
        # a restarted group must not walk into the same NaN again (even one that starts fresh each attempt: it
        # would retrain to the NaN on every restart); rank 0 reads, every rank raises
        reason, problem = None, None
        if self.group.is_main:
            try:
                reason = self.stopped_reason()
            except CheckpointError as e:  # every rank raises it, none waits for rank 0
                problem = str(e)
        reason, problem = self._agree((reason, problem))
        if problem:
            raise CheckpointError(problem)
        if reason is not None:
            raise CheckpointError(f"this run stopped itself earlier and was not restarted: {reason} (remove "
                                  f"{self.directory / STOPPED} to resume anyway, or start fresh with --resume none)")
        if fresh:
            return None
        choice = None
        if self.group.is_main:
            if str(spec) == "auto":
                candidates = self.complete()
                latest = self.latest()
                if latest is not None and latest in candidates:  # latest first, then the older ones
                    candidates = [c for c in candidates if c != latest] + [latest]
                for c in reversed(candidates):
                    try:
                        verify(c)
                        choice = c
                        break
                    except CheckpointError as e:
                        warnings.warn(f"{e}; falling back to the previous checkpoint", stacklevel=2)
            else:
                try:
                    verify(Path(spec))
                    choice = Path(spec)
                except CheckpointError as e:
                    problem = str(e)
        choice, problem = self._agree((choice, problem))
        if problem:
            raise CheckpointError(problem)
        return choice

    # --- saving ---------------------------------------------------------------------------------------

    def _meta(self, trainer) -> dict:
        return {"state_format": STATE_FORMAT, "code": code_version(), "format": self.format,
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "step": trainer.step, "tokens_seen": trainer.tokens_seen, "run_id": trainer.run_id,
                "world_size": self.group.size,
                "signature": {"optimizer": type(trainer.optimizer).__name__, "algorithm": algorithm(trainer.optimizer),
                              "wrapper": type(trainer.model).__name__},
                "config": {k: v for k, v in vars(trainer.cfg).items() if isinstance(v, (int, float, str, bool))
                           or v is None}}

    def save(self, trainer) -> SaveReport:
        """Save the trainer's whole state as step_<step>. Every rank calls it between steps. Synchronous: returns
        once the checkpoint is committed. Asynchronous: returns after the snapshot; wait() commits."""
        self.wait()  # one save at a time: the previous one is committed first
        self._take_lock()
        t0 = time.perf_counter()
        name = f"step_{trainer.step:08d}"
        tmp = None
        if self.group.is_main:
            for stale in self.directory.glob(".tmp-*"):  # saves that a killed process never finished
                shutil.rmtree(stale, ignore_errors=True)
            tmp = self.directory / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
            tmp.mkdir(parents=True)
        tmp = Path(self._agree(str(tmp)))
        if self.group.is_main:
            self._name_run(trainer.run_id)
        meta = self._meta(trainer)
        if self.record_fingerprint:
            meta["fingerprint"] = fingerprint(trainer)
        if self.format == "full":
            state = trainer.state_dict()
            meta = _described(meta, state)
            full = _gather_full(state, self.group)
            if self.async_save:  # rank 0 writes in the background; every rank waits for it in wait()
                self._pending = {"thread": self._background(self._write_full_and_commit, full, tmp, name, meta)
                                 if self.group.is_main else None}
            elif self.group.is_main:
                self._write_full_and_commit(full, tmp, name, meta)
        elif self.async_save:  # copy now; lay out, write and commit in the background, on a group of its own
            finish = trainer.state_snapshot()
            self._pending = {"thread": self._background(self._save_sharded, finish, tmp, name, meta, True)}
        else:
            self._save_sharded(lambda group=None: trainer.state_dict(), tmp, name, meta, False)
        if not self.async_save:
            self.group.barrier()  # every rank returns once the checkpoint is committed
        final = self.directory / name
        report = SaveReport(path=final, step=trainer.step, format=self.format,
                            blocked_s=time.perf_counter() - t0, asynchronous=self.async_save)
        self.reports.append(report)
        return report

    def _write_full_and_commit(self, full: dict, tmp: Path, name: str, meta: dict) -> None:
        with open(tmp / "state.pt", "wb") as f:
            torch.save(full, f)
            f.flush()
            os.fsync(f.fileno())
        self._commit(tmp, name, meta)

    def _save_sharded(self, finish, tmp: Path, name: str, meta: dict, background: bool) -> None:
        """Every rank writes its part with DCP; rank 0, once DCP's last step (it gathers every rank's result)
        is done, commits. In the background (background=True): on the manager's own process group."""
        from torch.distributed.checkpoint import FileSystemWriter
        import torch.distributed.checkpoint as dcp
        group = Group.of(self._async_pg) if background and self._async_pg is not None else self.group
        state = finish(group)
        meta = _described(meta, state)
        with _one_process_is_fine():
            try:
                dcp.save(state, storage_writer=FileSystemWriter(str(tmp), sync_files=True),
                         process_group=group.pg if group.size > 1 else None, no_dist=group.size == 1)
            except _dcp_error() as e:
                raise CheckpointError(f"saving {self.directory / name} failed: {_dcp_cause(e)}") from e
        if self.group.is_main:  # a failure before this leaves the temporary directory, for the next save to clean
            self._commit(tmp, name, meta)

    def _background(self, fn, *args) -> threading.Thread:
        """fn(*args) in a thread; what it raises is kept for wait()."""
        def run():
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 -- wait() reports it on every rank
                self._pending_error = e

        self._pending_error = None
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def _commit(self, tmp: Path, name: str, meta: dict) -> None:
        """Rank 0: checksums into meta.json, fsync, rename into place, point `latest` at it, drop the oldest."""
        meta = {**meta, "files": _manifest(tmp)}
        for f in tmp.rglob("*"):
            if f.is_file():
                _fsync(f)
        _write_json(tmp / "meta.json", meta)
        _fsync(tmp)
        _swap_in(tmp, self.directory / name)
        _fsync(self.directory)
        pointer_tmp = self.directory / f".latest.{uuid.uuid4().hex[:8]}"
        with open(pointer_tmp, "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer_tmp, self.directory / "latest")
        _fsync(self.directory)
        for old in self.complete()[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def wait(self) -> None:
        """Until the asynchronous save in flight (if any) is written and committed -- on every rank: all ranks
        call it, and it returns on none before rank 0 has committed (or raises on all of them, with the cause,
        if any rank's part failed)."""
        pending, self._pending = self._pending, None
        if not pending:
            return
        if pending["thread"] is not None:
            pending["thread"].join()
        error, self._pending_error = self._pending_error, None
        if error is not None:
            cause = _dcp_cause(error) if isinstance(error, _dcp_error()) else error
            error = CheckpointError(f"the asynchronous save failed: {cause}")
        _agree_ok(self.group, error, "the asynchronous save")

    def close(self) -> None:
        """Commit the save in flight and give the folder up."""
        self.wait()
        self.release()

    # --- loading --------------------------------------------------------------------------------------

    def resume(self, trainer, spec: str | os.PathLike | None = "auto") -> Path | None:
        """Load the checkpoint `spec` names (see find) into the trainer; None, with a message, if there is none.
        A run that stopped itself (a non-finite loss) left its reason: resuming it stops at once, with it."""
        self._take_lock()
        path = self.find(spec)
        if path is None:
            if spec not in (None, "none"):
                print0(f"no usable checkpoint in {self.directory}: starting fresh")
            return None
        load(path, trainer, group=self.group, verify_files=False)  # find() has just verified every file
        print0(f"resumed from {path} at step {trainer.step}")
        return path

    def stopped_reason(self) -> str | None:
        f = self.directory / STOPPED
        if f.is_symlink():
            raise CheckpointError(f"{f} is a symbolic link, which nanodist never writes: remove it (it may point at "
                                  f"another file, whose content would be read as the reason the run stopped)")
        if not f.exists():
            return None
        if not f.is_file():
            raise CheckpointError(f"{f} is not a file: remove it")
        return f.read_text(errors="replace").strip()

    def mark_stopped(self, reason: str) -> None:
        """Rank 0 writes why the run stopped itself beside the checkpoints (a torchrun restart then stops too).
        Written to a new file and renamed over STOPPED: a symbolic link there is replaced, never followed."""
        if self.group.is_main:
            tmp = self.directory / f".{STOPPED}.{uuid.uuid4().hex[:8]}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(reason + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.directory / STOPPED)
            _fsync(self.directory)


def _check_format(meta: dict) -> None:
    if meta.get("state_format") != STATE_FORMAT:
        code = meta.get("code", {})
        raise CheckpointError(f"this checkpoint has state format {meta.get('state_format')} (written by nanodist "
                              f"{code.get('nanodist')}, commit {code.get('commit')}); this code reads format "
                              f"{STATE_FORMAT} (nanodist {__version__}). Load it with the code that wrote it.")


def _check_compatible(meta: dict, template: dict, trainer, tied: dict) -> None:
    """The saved signature against the live state's (what the saved values are about to go into)."""
    saved = meta.get("signature")
    if not isinstance(saved, dict) or not isinstance(saved.get("params"), dict):
        raise CheckpointError("this checkpoint's meta.json has no signature of the model it holds: it was not written "
                              "by nanodist's CheckpointManager")
    mine = {**signature(template), "optimizer": type(trainer.optimizer).__name__, "algorithm": algorithm(trainer.optimizer)}
    problems = []
    for name in sorted(set(saved["params"]) | set(mine["params"])):
        a, b = saved["params"].get(name), mine["params"].get(name)
        if a is None and tied.get(name) in saved["params"]:
            continue  # a tied parameter saved under one of its names (nanodist's FSDP before it kept both)
        if a is None:
            problems.append(f"the model has {name} {b[0]}, the checkpoint does not")
        elif b is None:
            problems.append(f"the checkpoint has {name} {a[0]}, the model does not")
        elif a[0] != b[0]:
            problems.append(f"{name}: saved with shape {tuple(a[0])}, the model has {tuple(b[0])}")
    if problems:
        raise CheckpointError("this checkpoint is from another model: " + "; ".join(problems[:5]) +
                              (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))
    # The update rule decides whether the state maps, not the class that shards it: AdamW's moments saved by
    # torch's AdamW, DistAdamW or ZeroOptimizer(AdamW) load into any of them (groups matched by parameter names).
    # A checkpoint written before the signature named the rule: the same class still loads, and its Muon group,
    # which named no kind then, was signed "other".
    legacy = "algorithm" not in saved
    saved_algorithm = saved.get("algorithm") or ALGORITHMS.get(saved["optimizer"], saved["optimizer"])
    same_rule = saved_algorithm == mine["algorithm"] or (legacy and saved["optimizer"] == mine["optimizer"])

    def kinds(groups):
        return sorted("other" if legacy and g["kind"] == "muon" else g["kind"] for g in groups)
    if not same_rule or kinds(saved["param_groups"]) != kinds(mine["param_groups"]):
        raise CheckpointError(f"this checkpoint holds the state of {saved['optimizer']} (groups "
                              f"{[g['kind'] for g in saved['param_groups']]}), this run uses {mine['optimizer']} "
                              f"({[g['kind'] for g in mine['param_groups']]}): build the same optimizer")


def _agree_ok(group: Group, error: BaseException | None, what: str) -> None:
    """Every rank learns whether any rank failed (and why): all raise together, none waits for a peer."""
    message = None if error is None else (str(error) if isinstance(error, CheckpointError)
                                          else f"{type(error).__name__}: {str(error)[:300]}")
    everyone = group.all_gather_object(message) if group.size > 1 else [message]
    failed = [(r, m) for r, m in enumerate(everyone) if m is not None]
    if failed:
        r, m = failed[0]
        raise CheckpointError(f"{what} failed on rank {r}" + (f" (and {len(failed) - 1} other rank(s))"
                                                              if len(failed) > 1 else "") + f": {m}") from error


def load(path, trainer, group=None, verify_files: bool = True) -> dict:
    """Load the checkpoint at `path` into `trainer` (every rank). Returns its meta. Raises CheckpointError saying
    what differs when it does not fit this model and optimizer -- on every rank, when any rank fails. Every file
    is checked against the size and checksum saved with it first (verify_files=False skips that read)."""
    path = Path(path)
    group = Group.resolve(group)
    meta, dcp_meta, state, error = None, None, None, None
    try:
        meta = verify(path) if verify_files and group.is_main else read_meta(path)
        _check_format(meta)
        if meta["format"] == "sharded":
            dcp_meta = read_dcp_metadata(path)  # refuses a crafted .metadata here, with its own message
    except Exception as e:  # noqa: BLE001 -- every rank must hear of it
        error = e
    _agree_ok(group, error, f"loading {path}")
    template = trainer.state_dict()  # the live state (nanodist.state's layout): what the saved values go into
    everywhere = group.broadcast_object(_tied(template["model"]) if group.is_main else None)
    tied = {}
    try:
        _check_compatible(meta, template, trainer, everywhere)
        tied = {n: first for n, first in everywhere.items() if n not in meta["signature"]["params"]}
        for name in tied:  # saved under its other name only: loaded from there
            template["model"].pop(name)
        if meta["format"] == "sharded":  # the optimizer's entries as the checkpoint describes them
            template["optimizer"] = _optimizer_template(dcp_meta, template)
    except Exception as e:  # noqa: BLE001
        error = e
    _agree_ok(group, error, f"loading {path}")
    if meta["format"] == "full":
        try:
            try:
                saved = torch.load(_regular_file(path / "state.pt"), map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 -- any failure to read is this file's fault: say which
                raise CheckpointError(f"cannot read {path / 'state.pt'}: {type(e).__name__}: {str(e)[:300]}") from e
            state = _localize(saved, template)
        except Exception as e:  # noqa: BLE001
            error = e
        _agree_ok(group, error, f"loading {path}")
    else:
        import torch.distributed.checkpoint as dcp
        saved_ranks = {f"rank{r}" for r in range(meta["world_size"])}
        template["rng"] = {k: v for k, v in template["rng"].items() if k in saved_ranks}
        try:
            with _one_process_is_fine():
                dcp.load(template, storage_reader=_safe_reader(path, dcp_meta), planner=_safe_planner(),
                         process_group=group.pg if group.size > 1 else None, no_dist=group.size == 1)
        except (Exception, _dcp_error()) as e:  # DCP gathers every rank's failure and raises it on all of them
            raise CheckpointError(f"cannot load the sharded checkpoint {path}: {_dcp_cause(e)}") from e
        state = template
    for name, first in tied.items():
        state["model"][name] = state["model"][first]
    try:
        trainer.load_state_dict(state)
    except Exception as e:  # noqa: BLE001
        error = e
    _agree_ok(group, error, f"loading {path}")
    return meta


def read_meta(path) -> dict:
    """A checkpoint's meta.json (plain JSON: safe to read from anywhere)."""
    f = Path(path) / "meta.json"
    if not os.path.lexists(f):
        raise CheckpointError(f"{path} is not a complete checkpoint: it has no meta.json")
    try:
        meta = json.loads(_regular_file(f).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f} is corrupted ({e})") from None
    except OSError as e:  # a directory named meta.json, a file that cannot be read
        raise CheckpointError(f"{f} cannot be read ({e.strerror or e})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{f} is corrupted: it holds a {type(meta).__name__}, not a checkpoint's description")
    return meta


def fingerprint(trainer) -> str:
    """SHA-256 of every parameter and optimizer-state tensor, whole and by name: equal for two runs exactly when
    their states are bitwise equal, whatever the world size, the wrapper or the layout of the shards (every
    wrapper's state holds a tied parameter under each of its names). A collective."""
    import hashlib
    full = _gather_full(trainer.state_dict(), trainer.world)
    digest = None
    if trainer.world.is_main:
        h = hashlib.sha256()
        items = [(f"model.{n}", t) for n, t in full["model"].items()]
        items += [(f"optimizer.{n}.{k}", t) for n, st in full["optimizer"]["state"].items() for k, t in st.items()]
        for name, t in sorted(items, key=lambda kv: kv[0]):
            if torch.is_tensor(t):
                t = t.detach().cpu().contiguous()
                # An optimizer's state tensor by its elements in order: DistAdamW keeps AdamW's moments flat,
                # torch's AdamW in the parameter's shape -- the same state.
                shape = tuple(t.shape) if name.startswith("model.") else (t.numel(),)
                h.update(f"{name}:{t.dtype}:{shape}".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        digest = h.hexdigest()
    return trainer.world.broadcast_object(digest)
