"""Results files: what every lab run writes, and how the book reads them back.

A lab writes one JSON file per run, `<results dir>/<lab>/<run-id>.json` (rank 0 only):

    rec = Recorder("lab03_ddp", config=vars(args))   # after nanodist.init()
    rec.step(step=0, time_s=0.41, loss=3.2)          # per-step timings and metrics
    rec.metrics["tokens_per_s"] = 12345.0
    rec.save()                                        # rank 0 writes; returns the path

`load_all()` reads every file under the results directory *and* `labs/results/reference/` (runs
brought from other machines, e.g. a 2-GPU box), validating each, and `table()` flattens them
into rows that the plots use — so numbers from any machine land in the same figure.

The results directory is NANODIST_RESULTS_DIR if set (the test suite points it at a temporary
folder), otherwise `labs/results/` in this repository.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import socket
import sys
import uuid
from pathlib import Path

import psutil
import torch

from .group import Group
from .table import Table

SCHEMA_VERSION = 1
REPO_ROOT = Path(__file__).resolve().parents[1]
REFERENCE_DIR = REPO_ROOT / "labs" / "results" / "reference"


class ResultsError(ValueError):
    """A results file is malformed; the message names the file and the field."""


# ----------------------------------------------------------------------------- where

def results_dir() -> Path:
    """Where lab runs write: $NANODIST_RESULTS_DIR, else labs/results/ of this repository."""
    env = os.environ.get("NANODIST_RESULTS_DIR")
    return Path(env) if env else REPO_ROOT / "labs" / "results"


def new_run_id() -> str:
    """A sortable, unique run id: UTC time plus a random suffix (NANODIST_RUN_ID overrides)."""
    return os.environ.get("NANODIST_RUN_ID") or (
        datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%f") + "-" + uuid.uuid4().hex[:4])


# ----------------------------------------------------------------------------- hardware fingerprint

def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _physical_cores() -> int | None:
    return psutil.cpu_count(logical=False)


def hardware_fingerprint() -> dict:
    """The machine a run measured: CPU, cores, memory, GPUs, and the versions that shape the numbers."""
    gpus = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    mem_gb = round(psutil.virtual_memory().total / 2**30, 1)
    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception:
            nccl = None
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_model": _cpu_model(),
        "cpu_logical_cores": os.cpu_count(),
        "cpu_physical_cores": _physical_cores(),
        "memory_gb": mem_gb,
        "gpu_count": len(gpus),
        "gpu_names": gpus,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "gloo": torch.distributed.is_gloo_available(),
    }


# ----------------------------------------------------------------------------- schema

# field -> (types, required). Validation is hand-written so that errors name the file and field.
_FIELDS = {
    "schema_version": (int, True),
    "lab": (str, True),
    "run_id": (str, True),
    "created": (str, True),
    "argv": (list, True),
    "config": (dict, True),
    "world_size": (int, True),
    "nnodes": (int, True),
    "backend": (str, True),
    "device": (str, True),
    "steps": (list, True),
    "metrics": (dict, True),
    "hardware": (dict, True),
}
_STEP_FIELDS = {"step": int, "time_s": (int, float)}


def validate(record, source: str = "<record>") -> dict:
    """Check a results record against the schema; raise ResultsError naming `source` and the field."""
    if not isinstance(record, dict):
        raise ResultsError(f"{source}: a results file holds one JSON object, found {type(record).__name__}")
    for name, (types, required) in _FIELDS.items():
        if name not in record:
            if required:
                raise ResultsError(f"{source}: field '{name}' is missing")
            continue
        value = record[name]
        if not isinstance(value, types) or (types is int and isinstance(value, bool)):
            raise ResultsError(f"{source}: field '{name}' should be {types.__name__}, got {type(value).__name__} "
                               f"({value!r:.60})")
    if record["schema_version"] > SCHEMA_VERSION:
        raise ResultsError(f"{source}: field 'schema_version' is {record['schema_version']} but this nanodist "
                           f"reads up to {SCHEMA_VERSION}: update nanodist")
    for name in ("world_size", "nnodes"):
        if record[name] < 1:
            raise ResultsError(f"{source}: field '{name}' must be >= 1, got {record[name]}")
    for i, step in enumerate(record["steps"]):
        if not isinstance(step, dict):
            raise ResultsError(f"{source}: field 'steps[{i}]' should be an object, got {type(step).__name__}")
        for name, types in _STEP_FIELDS.items():
            if name not in step:
                raise ResultsError(f"{source}: field 'steps[{i}].{name}' is missing")
            if not isinstance(step[name], types) or isinstance(step[name], bool):
                raise ResultsError(f"{source}: field 'steps[{i}].{name}' should be a number, got {step[name]!r:.60}")
    if "hostname" not in record["hardware"]:
        raise ResultsError(f"{source}: field 'hardware.hostname' is missing")
    return record


def _jsonable(x):
    """Make config values JSON-safe (paths, devices, dtypes, numpy and torch scalars)."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        return _jsonable(x.item())
    if hasattr(x, "item") and callable(x.item):
        try:
            return _jsonable(x.item())
        except (TypeError, ValueError):
            pass
    return str(x)


# ----------------------------------------------------------------------------- writing

class Recorder:
    """Collects one run's steps and metrics and writes them (rank 0) as a validated results file."""

    def __init__(self, lab: str, config: dict | None = None, argv: list[str] | None = None, group=None):
        self.group = Group.resolve(group)
        self.lab = lab
        self.config = dict(config or {})
        self.argv = list(sys.argv if argv is None else argv)
        self.run_id = new_run_id()
        self.steps: list[dict] = []
        self.metrics: dict = {}

    def step(self, step: int, time_s: float, **values) -> None:
        """Record one step: its index, wall time in seconds, and any scalar metrics (loss, tokens/s...)."""
        self.steps.append({"step": int(step), "time_s": float(time_s), **values})

    def record(self) -> dict:
        g = self.group
        nnodes = max(1, g.size // max(int(os.environ.get("LOCAL_WORLD_SIZE", g.size)), 1))
        rec = {
            "schema_version": SCHEMA_VERSION,
            "lab": self.lab,
            "run_id": self.run_id,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "argv": self.argv,
            "config": self.config,
            "world_size": g.size,
            "nnodes": int(os.environ.get("NANODIST_NNODES", nnodes)),
            "backend": g.backend if g.backend != "local" else "gloo",
            "device": g.device.type,
            "steps": self.steps,
            "metrics": self.metrics,
            "hardware": hardware_fingerprint(),
        }
        return validate(_jsonable(rec))

    def save(self, directory: str | Path | None = None) -> Path | None:
        """Write the file on global rank 0 (other ranks return None). Atomic: no half-written files."""
        if self.group.rank != 0:
            return None
        out = Path(directory) if directory is not None else results_dir() / self.lab
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{self.run_id}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.record(), indent=1, allow_nan=False) + "\n")
        os.replace(tmp, path)
        return path


# ----------------------------------------------------------------------------- reading

def load(path: str | Path) -> dict:
    """Read and validate one results file; errors name the file and the field."""
    path = Path(path)
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ResultsError(f"{path}: not valid JSON ({e})") from None
    record = validate(record, str(path))
    record["_path"] = str(path)
    return record


def load_all(lab: str | None = None, roots=None, include_reference: bool = True) -> list[dict]:
    """Every results file (optionally of one lab) under the results dir and the reference dir, oldest first."""
    if roots is None:
        roots = [results_dir()] + ([REFERENCE_DIR] if include_reference else [])
    reference = REFERENCE_DIR.resolve()
    explicit = {Path(r).resolve() for r in roots}
    seen, records = set(), []
    for root in map(Path, roots):
        if not root.is_dir():
            continue
        for path in sorted(root.rglob("*.json")):
            resolved = path.resolve()
            # labs/results/ contains reference/: walk into it only when it was asked for as a root.
            if reference in resolved.parents and reference not in explicit:
                continue
            rec = load(path)
            key = (rec["lab"], rec["run_id"])
            if (lab is None or rec["lab"] == lab) and key not in seen:
                seen.add(key)
                records.append(rec)
    return sorted(records, key=lambda r: (r["created"], r["run_id"]))


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def summarize(record: dict) -> dict:
    """One flat row for a run: identity, machine, median step time, scalar config and metrics."""
    hw = record["hardware"]
    row = {
        "lab": record["lab"], "run_id": record["run_id"], "world_size": record["world_size"],
        "nnodes": record["nnodes"], "backend": record["backend"], "device": record["device"],
        "host": hw.get("hostname"), "cpu": hw.get("cpu_model"),
        "gpu": (hw.get("gpu_names") or [None])[0], "gpu_count": hw.get("gpu_count", 0),
        "torch": hw.get("torch"), "steps": len(record["steps"]),
        "median_step_s": _median([s["time_s"] for s in record["steps"]]),
    }
    for prefix, d in (("config.", record["config"]), ("", record["metrics"])):
        for k, v in d.items():
            if isinstance(v, (int, float, str, bool)) or v is None:
                row[prefix + k] = v
    return row


def table(records: list[dict] | None = None, lab: str | None = None) -> Table:
    """Aggregate results into a Table, one row per run (default: `load_all(lab)`)."""
    if records is None:
        records = load_all(lab)
    return Table(summarize(r) for r in records)
