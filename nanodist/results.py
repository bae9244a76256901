"""Results files: what every lab run writes as it goes, and how the book reads them back.

A lab writes one file per run, `<results dir>/<lab>/<run-id>.jsonl` (rank 0 only), one JSON object
a line, appended as the run goes -- a run that is killed keeps every line it wrote:

    rec = Recorder("lab03_ddp", config=vars(args))   # after nanodist.init()
    rec.step(step=0, time_s=0.41, loss=3.2)          # a "step" line, written now
    rec.metrics["tokens_per_s"] = 12345.0
    rec.save()                                        # a "metrics" line and an "end" line; returns the path

The lines: a "header" (configuration, world, hardware), then "step", "metrics", "stop" (a run that
stopped itself, with the reason) and "end" lines. A resumed run (`Recorder(..., run_id=the old one)`)
appends a "resume" line and goes on in the same file; steps after its checkpoint run again, and the
reader keeps the last record of each step, so every step counts once.

`load()` folds a file into one record (header fields, `steps`, `metrics`, `complete`, `stopped`, `resumes`).
`load_all()` reads every file under the results directory *and* `labs/results/reference/` (runs
brought from other machines, e.g. a 2-GPU box), skipping a bad file with a warning that names it, and
`table()` flattens them into rows that the plots use -- so numbers from any machine land in the same figure.

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
import warnings
from pathlib import Path

import psutil
import torch

from .group import Group
from .table import Table

SCHEMA_VERSION = 2  # 1: one JSON object per run, written at the end (still read)
REPO_ROOT = Path(__file__).resolve().parents[1]
REFERENCE_DIR = REPO_ROOT / "labs" / "results" / "reference"


class ResultsError(ValueError):
    """A results file is malformed; the message names the file and the field."""


# ----------------------------------------------------------------------------- where

TRACE_SUFFIX = ".trace.json"  # torch.profiler Chrome traces (--profile), kept beside their run's results file


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
    """Appends one run's steps and metrics to its results file as they come (global rank 0 writes).

    run_id: the run this is (default: NANODIST_RUN_ID, else a new one). When the file of that run exists
    already -- a run resumed from a checkpoint -- lines are appended after a "resume" line.
    """

    def __init__(self, lab: str, config: dict | None = None, argv: list[str] | None = None, group=None,
                 run_id: str | None = None, directory: str | Path | None = None):
        self.group = Group.resolve(group)
        self.lab = lab
        self.config = dict(config or {})
        self.argv = list(sys.argv if argv is None else argv)
        self.run_id = run_id or new_run_id()
        self.directory = Path(directory) if directory is not None else None
        self.steps: list[dict] = []
        self.metrics: dict = {}
        self._written_metrics: dict = {}
        self._file = None
        self._started = False  # this Recorder wrote its header (or resume line) already

    @property
    def path(self) -> Path:
        return (self.directory or results_dir() / self.lab) / f"{self.run_id}.jsonl"

    def trace_path(self, name: str, rank: int, run_id: str | None = None) -> Path:
        """Where a profiler trace of this run goes: beside its results file, named for the run (`run_id`: rank 0's,
        which every rank should use; each rank's Recorder has an id of its own), `name` and the rank."""
        path = self.path.with_name(f"{run_id or self.run_id}.{name}.rank{rank}{TRACE_SUFFIX}")
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def _identity(self) -> dict:
        g = self.group
        nnodes = max(1, g.size // max(int(os.environ.get("LOCAL_WORLD_SIZE", g.size)), 1))
        return {"schema_version": SCHEMA_VERSION, "lab": self.lab, "run_id": self.run_id,
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "argv": self.argv, "config": self.config, "world_size": g.size,
                "nnodes": int(os.environ.get("NANODIST_NNODES", nnodes)),
                "backend": g.backend if g.backend != "local" else "gloo", "device": g.device.type,
                "hardware": hardware_fingerprint(),
                **({"launch_id": os.environ["NANODIST_LAUNCH_ID"]} if os.environ.get("NANODIST_LAUNCH_ID") else {})}

    def _write(self, kind: str, **fields) -> None:
        if self.group.rank != 0:
            return
        if self._file is None:
            path = self.path
            path.parent.mkdir(parents=True, exist_ok=True)
            resumed = path.exists() and path.stat().st_size > 0
            self._file = open(path, "a", encoding="utf-8")
            if not self._started:
                if resumed:
                    self._file.write("\n")  # a line a killed run did not finish stays a line of its own
                self._file.write(json.dumps({"kind": "resume" if resumed else "header",
                                             **_jsonable(self._identity())}, allow_nan=False) + "\n")
                self._started = True
        self._file.write(json.dumps({"kind": kind, **_jsonable(fields)}, allow_nan=False) + "\n")
        self._file.flush()  # in the kernel now: a SIGKILL of this process loses nothing

    def step(self, step: int, time_s: float, **values) -> None:
        """Record one step: its index, wall time in seconds, and any scalar metrics (loss, tokens/s...)."""
        row = {"step": int(step), "time_s": float(time_s), **values}
        self.steps.append(row)
        self._write("step", **row)

    def stop(self, reason: str, **fields) -> None:
        """The run stopped itself (e.g. a non-finite loss): say why, in the file."""
        self._write("stop", reason=reason, **fields)
        self.save()

    def save(self, directory: str | Path | None = None) -> Path | None:
        """Write what changed in `metrics` and an "end" line (global rank 0; the others return None). A
        `directory` moves the file there (the lines written so far come along)."""
        if self.group.rank != 0:
            return None
        if directory is not None and Path(directory) != self.path.parent:
            old = self.path
            if self._file is not None:
                self._file.close()
                self._file = None
            self.directory = Path(directory)
            if old.exists():
                self.directory.mkdir(parents=True, exist_ok=True)
                os.replace(old, self.path)
        changed = {k: v for k, v in self.metrics.items() if self._written_metrics.get(k, _MISSING) is not v}
        if changed:
            self._write("metrics", **changed)
            self._written_metrics.update(changed)
        self._write("end")
        self._file.close()
        self._file = None
        return self.path

    def record(self) -> dict:
        """What a reader of the file will see (the folded record), from this process's memory."""
        return validate(_jsonable({**self._identity(), "steps": self.steps, "metrics": self.metrics}))


_MISSING = object()


# ----------------------------------------------------------------------------- reading

def _fold(lines: list[dict], source: str) -> dict:
    """One record from a results file's lines: the header's fields, the last record of each step, the merged
    metrics, whether the run ended ("complete") or stopped itself ("stopped": the reason), and every resume
    ("resumes": when, at which world size and on what, one entry per "resume" line)."""
    if not lines or lines[0].get("kind") != "header":
        raise ResultsError(f"{source}: the first line is not a header (kind 'header')")
    record = {k: v for k, v in lines[0].items() if k != "kind"}
    steps: dict[int, dict] = {}
    metrics: dict = {}
    record.update(complete=False, stopped=None, resumes=[])
    for i, line in enumerate(lines[1:], start=2):
        kind = line.get("kind")
        body = {k: v for k, v in line.items() if k != "kind"}
        if kind == "step":
            if "step" not in body or isinstance(body["step"], bool) or not isinstance(body["step"], int):
                raise ResultsError(f"{source}: line {i}: field 'step' is missing or not an integer")
            steps[body["step"]] = body
        elif kind == "metrics":
            metrics.update(body)
        elif kind == "stop":
            record["stopped"] = body.get("reason", "")
        elif kind == "resume":
            record["resumes"].append({k: body.get(k) for k in ("created", "world_size", "nnodes", "backend", "device",
                                                               "launch_id") if k in body})
            record["complete"] = False
        elif kind == "end":
            record["complete"] = True
        else:
            raise ResultsError(f"{source}: line {i}: unknown kind {kind!r}")
    record["steps"] = [steps[k] for k in sorted(steps)]
    record["metrics"] = metrics
    return record


def dump(record: dict, path: str | Path) -> Path:
    """Write a folded record (what load() returns) as a results file: for copying runs between machines."""
    path = Path(path)
    record = validate(_jsonable({k: v for k, v in record.items() if not k.startswith("_")}), str(path))
    head = {k: v for k, v in record.items() if k not in ("steps", "metrics", "complete", "stopped", "resumes")}
    lines = [{"kind": "header", **head}] + [{"kind": "step", **s} for s in record["steps"]]
    lines += [{"kind": "metrics", **record["metrics"]}] + ([{"kind": "end"}] if record.get("complete", True) else [])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line, allow_nan=False) + "\n" for line in lines))
    return path


def load(path: str | Path) -> dict:
    """Read and validate one results file (.jsonl, or a schema-1 .json); errors name the file and the field.

    A last line cut short (the run was killed while writing it) is ignored."""
    path = Path(path)
    text = path.read_text()
    if path.suffix == ".json":
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            raise ResultsError(f"{path}: not valid JSON ({e})") from None
        if isinstance(record, dict):
            record = {"complete": True, "stopped": None, "resumes": [], **record}
    else:
        parsed = []  # (line number, object or the decoding error)
        for i, line in enumerate(text.split("\n"), start=1):
            if line.strip():
                try:
                    parsed.append((i, json.loads(line)))
                except json.JSONDecodeError as e:
                    parsed.append((i, e))
        lines = []
        for k, (i, obj) in enumerate(parsed):
            if isinstance(obj, json.JSONDecodeError):
                after = parsed[k + 1][1] if k + 1 < len(parsed) else None
                if after is None or (isinstance(after, dict) and after.get("kind") == "resume"):
                    continue  # a line cut short when the run was killed: everything before it stands
                raise ResultsError(f"{path}: line {i} is not valid JSON ({obj})") from None
            lines.append(obj)
        if not lines:
            raise ResultsError(f"{path}: the file is empty (the run wrote nothing before it ended)")
        if not all(isinstance(line, dict) for line in lines):
            raise ResultsError(f"{path}: every line must be one JSON object")
        record = _fold(lines, str(path))
    record = validate(record, str(path))
    record["_path"] = str(path)
    return record


def load_all(lab: str | None = None, roots=None, include_reference: bool = True) -> list[dict]:
    """Every results file (optionally of one lab) under the results dir and the reference dir, oldest first.

    A file that cannot be read is skipped with a warning naming it and what is wrong, so one broken file never
    hides the others."""
    if roots is None:
        roots = [results_dir()] + ([REFERENCE_DIR] if include_reference else [])
    reference = REFERENCE_DIR.resolve()
    explicit = {Path(r).resolve() for r in roots}
    seen, records = set(), []
    for root in map(Path, roots):
        if not root.is_dir():
            continue
        for path in sorted([*root.rglob("*.jsonl"), *root.rglob("*.json")]):
            if path.name.endswith(TRACE_SUFFIX):  # a profiler's trace beside its run's file, not a results file
                continue
            resolved = path.resolve()
            # labs/results/ contains reference/: walk into it only when it was asked for as a root.
            if reference in resolved.parents and reference not in explicit:
                continue
            try:
                rec = load(path)
            except (ResultsError, OSError, UnicodeDecodeError) as e:
                warnings.warn(f"skipping results file {path}: {e}", stacklevel=2)
                continue
            key = (rec["lab"], rec["run_id"])
            if (lab is None or rec["lab"] == lab) and key not in seen:
                seen.add(key)
                records.append(rec)
    return sorted(records, key=lambda r: (r["created"], r["run_id"]))


def shown(path: str | os.PathLike) -> str:
    """`path` as a printed line should show it: relative to the current directory where it lies inside it or
    beside it (labs/results/... from the repository, ../labs/results/... from book/), so that no machine's
    folders end up in a committed notebook; whole where it lies elsewhere (a temporary results folder)."""
    if path is None:  # Recorder.save() on a rank other than 0: nothing written, nothing to show
        return ""
    rel = os.path.relpath(path)
    return rel if not rel.startswith(os.pardir + os.sep + os.pardir) else str(path)


def check_writable(directory: str | Path | None = None) -> Path:
    """Make sure results can be written under `directory` (default: the results directory), before a run spends
    any time: creates it, writes and removes a probe file. Raises ResultsError saying what to do."""
    directory = Path(directory) if directory is not None else results_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ResultsError(f"cannot write results under {directory} ({e.strerror or e}): choose a writable folder "
                           f"with NANODIST_RESULTS_DIR=/some/folder, or fix the permissions") from None
    return directory


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


def provenance(record: dict, ranks: str | None = None) -> str:
    """One line saying where a record's numbers were measured: machine, backend, world size, torch, date.
    `ranks` replaces the world size where the record's own is not the runs' (a triage that launched others).

        "Measured on Intel Xeon ... (2 cores, no GPU), gloo, 2 ranks on 1 node, torch 2.13.0, 2026-11-23."
    """
    hw = record.get("hardware", {})
    cores = hw.get("cpu_logical_cores")
    gpus = hw.get("gpu_names") or []
    gpu = f"{len(gpus)} x {gpus[0]}" if gpus else "no GPU"
    machine = f"{hw.get('cpu_model', 'unknown CPU')} ({cores} cores, {gpu})" if cores else hw.get("cpu_model", "?")
    W, nodes = record.get("world_size", "?"), record.get("nnodes", 1)
    ranks = ranks or f"{W} rank{'s' if W != 1 else ''}" + (f" on {nodes} nodes" if nodes and nodes > 1 else "")
    date = str(record.get("created", ""))[:10]
    return f"Measured on {machine}, {record.get('backend', '?')}, {ranks}, torch {hw.get('torch', '?')}, {date}."


# ----------------------------------------------------------------------------- the reader's runs beside the references

def is_reference(record: dict) -> bool:
    """Whether a loaded record came from labs/results/reference/ (a run measured on another machine)."""
    path = record.get("_path")
    return bool(path) and REFERENCE_DIR.resolve() in Path(path).resolve().parents


def references(lab: str, match=None) -> list[dict]:
    """The committed reference runs of `lab` (labs/results/reference/<lab>/), oldest first; `match(record)` keeps
    only the runs comparable to the reader's (same mode, same sizes)."""
    return [r for r in load_all(lab, roots=[REFERENCE_DIR]) if match is None or match(r)]


def shares_gpus(record: dict) -> bool:
    """Whether a record's ranks shared GPUs (more ranks than GPUs, through gloo): a stand-in for a GPU box whose
    timings are the host's copies and gloo's, not what one GPU per rank would give."""
    gpus = len(record.get("hardware", {}).get("gpu_names") or [])
    return record.get("device") == "cuda" and record.get("world_size", 1) > gpus * record.get("nnodes", 1)


def machine(record: dict) -> str:
    """A short name for the machine a record measured: its GPU if it used one, else its CPU and core count."""
    hw = record.get("hardware", {})
    gpus = hw.get("gpu_names") or []
    if record.get("device") == "cuda" and gpus:
        return f"{len(gpus)} x {gpus[0]}" + (" (shared by the ranks)" if shares_gpus(record) else "")
    cores = hw.get("cpu_logical_cores")
    return f"{hw.get('cpu_model', 'unknown CPU')}" + (f" ({cores} cores)" if cores else "")


def beside(current, refs: list[dict], values: dict) -> Table:
    """The reader's run(s) and the reference runs, one row each, with where each was measured and the chosen values.

    current: a record or a list of them (this run); refs: records from references(); values: {column: fn(record)}
    -- a value a record lacks shows as None."""
    def row(record, source):
        out = {"run": source, "measured on": machine(record), "backend": record.get("backend"),
               "ranks": record.get("world_size"), "date": str(record.get("created", ""))[:10]}
        for name, fn in values.items():
            try:
                v = fn(record)
            except (KeyError, IndexError, TypeError, ZeroDivisionError):
                v = None
            out[name] = round(v, 3) if isinstance(v, float) else v
        return out
    current = current if isinstance(current, list) else [current]
    return Table([row(r, "this run") for r in current] + [row(r, "reference") for r in refs])
