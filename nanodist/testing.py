"""Run a function on N real processes with a process group: how the tests prove distributed code.

    def check(rank, world_size, n):              # module-level, so it can be pickled
        t = torch.arange(n, dtype=torch.float32)
        ...
        return t.tolist()                        # anything picklable comes back to the parent

    outs = spawn(check, world_size=3, args=(10,), timeout=60)   # [rank0's value, rank1's, rank2's]

Faster than torchrun (no agent; workers forked from a server that imported torch once, so a worker starts in
a fraction of a second instead of importing torch anew), and as strict: a rank that raises fails the call with
that rank's traceback; a run past `timeout` seconds is killed, every process, and raises TimeoutError.

`within(label, got, want, rel, why)` is how an equivalence test compares floating-point results: the tolerance comes
with its reason, the assertion names the worst element, and with NANODIST_SPREAD_LOG set every comparison also
records the deviation it saw, so that `python3 dev.py spread` can measure it on each CPU kernel path.
"""
from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback as tb
from typing import Any, Callable

from .runtime import free_port


class WorkerError(RuntimeError):
    """A rank raised; `.rank` is which, and the message holds its traceback."""

    def __init__(self, rank: int, traceback: str):
        super().__init__(f"rank {rank} failed:\n{traceback}")
        self.rank, self.traceback = rank, traceback


def _worker(fn, rank, world_size, port, backend, args, kwargs, results, timeout):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    import torch
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from . import diverge, runtime

    def report_divergence(report: str) -> None:  # the watchdog is about to end this process: say why first
        results.put((rank, False, f"the divergence detector ended this rank:\n{report}"))
        results.close()
        results.join_thread()

    diverge.fatal_hooks.append(report_divergence)
    try:
        runtime.init(backend=backend, timeout=timeout)
        value = fn(rank, world_size, *args, **kwargs)
        # Plain pickle copies tensors by value; the queue's own pickler would send shared-memory handles
        # that die with this process before the parent reads them.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:
        results.put((rank, False, tb.format_exc()))
        results.close()
        results.join_thread()  # the report must reach the parent before we vanish
        os._exit(1)  # do not wait in a collective the failed rank will never join
    runtime.shutdown()
    results.close()
    results.join_thread()


def _context():
    """Fresh interpreters, as "spawn" gives, without paying torch's import in each: where the platform has it, a
    fork server that has imported torch and nanodist once forks every worker (nothing has run in it: no
    threads, no CUDA, no process group). Elsewhere (Windows), "spawn". NANODIST_SPAWN=spawn forces the latter."""
    method = os.environ.get("NANODIST_SPAWN", "forkserver")
    if method not in mp.get_all_start_methods():
        method = "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed", "nanodist", "nanodist.testing"])
    return ctx


def _others_reports(results, wait_s: float) -> str:
    """What the other ranks said after one died (their errors explain the death more often than not)."""
    said, deadline = [], time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            rank, ok, value = results.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break
        if not ok:
            said.append(f"\nrank {rank} said:\n{value}")
    return "".join(said)


def spawn(fn: Callable, world_size: int, args: tuple = (), kwargs: dict | None = None, timeout: float = 120,
          backend: str = "gloo") -> list[Any]:
    """Run fn(rank, world_size, *args, **kwargs) on `world_size` processes; return their values by rank."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, backend, args, kwargs or {}, results,
                                               timeout), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{fn.__name__} on {world_size} ranks did not finish within {timeout:g} s; "
                                   f"ranks that never returned: {sorted(set(range(world_size)) - set(values))}")
            try:
                rank, ok, value = results.get(timeout=min(left, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in values]
                if dead:
                    raise WorkerError(dead[0], f"process exited with code {procs[dead[0]].exitcode} "
                                               f"without reporting (killed, or crashed in native code)"
                                               + _others_reports(results, min(3.0, max(0.0, left))))
                continue
            if not ok:
                raise WorkerError(rank, value)
            values[rank] = pickle.loads(value)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
    return [values[r] for r in range(world_size)]


def _script_worker(path: str, args: list, env: dict, out_path: str, err_path: str) -> None:
    import runpy
    import sys
    code = 1
    try:
        os.environ.clear()
        os.environ.update(env)
        for fd, name in ((1, out_path), (2, err_path)):
            f = os.open(name, os.O_WRONLY | os.O_TRUNC)
            os.dup2(f, fd)
            os.close(f)
        sys.argv = [path, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(path)))  # what `python path` puts first
        try:
            runpy.run_path(path, run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)  # what the interpreter does with sys.exit("message")
        except BaseException:
            tb.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def run_script(path, args=(), env: dict | None = None, timeout: float = 120):
    """`python path *args` with environment `env` (the whole environment, as subprocess's env=), in a process
    forked from the fork server that has imported torch and nanodist: what a test of a script's command line
    needs (its exit code, stdout and stderr, as a subprocess.CompletedProcess) without paying torch's import
    each time. Not for a script whose imports the environment changes (PYTHONPATH has no effect here)."""
    import subprocess
    import tempfile
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="nanodist-script-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        for name in (out, err):
            open(name, "w").close()
        env = dict(os.environ if env is None else env)
        proc = ctx.Process(target=_script_worker, args=(str(path), [str(a) for a in args], env, out, err))
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired([str(path), *map(str, args)], timeout)
        with open(out, errors="replace") as f_out, open(err, errors="replace") as f_err:
            return subprocess.CompletedProcess([str(path), *map(str, args)], proc.exitcode, f_out.read(), f_err.read())


def deviation(got, want, abs_floor: float = 0.0) -> float:
    """The largest |got - want| / max(|want|, abs_floor) over two equal-length sequences of numbers or tensors."""
    import torch
    g, w = (torch.as_tensor(x).detach().double().flatten() for x in (got, want))
    if g.shape != w.shape:
        raise ValueError(f"cannot compare {tuple(g.shape)} values with {tuple(w.shape)}")
    if g.numel() == 0:
        return 0.0
    if not (torch.isfinite(g).all() and torch.isfinite(w).all()):
        return math.inf
    return float(((g - w).abs() / w.abs().clamp_min(abs_floor or torch.finfo(torch.float64).tiny)).max())


def within(label: str, got, want, rel: float, why: str, abs_floor: float = 0.0) -> float:
    """Assert that every element of `got` is within `rel` (relative to |want|, or to abs_floor where |want| is
    smaller) of `want`; `why` says where the tolerance comes from. Returns the deviation seen."""
    if not why:
        raise ValueError("a tolerance needs its reason (why=...)")
    dev = deviation(got, want, abs_floor)
    log = os.environ.get("NANODIST_SPREAD_LOG")
    if log:
        import torch
        with open(log, "a") as f:
            f.write(json.dumps({"label": label, "deviation": dev, "rel": rel, "why": why,
                                "capability": torch.backends.cpu.get_cpu_capability(),
                                "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]}) + "\n")
    assert dev <= rel, (f"{label}: deviates by {dev:.3g} (relative), beyond the tolerance {rel:g} "
                        f"({why})")
    return dev


class LogLines:
    """What a logger says inside a `with` (every record, on every rank: the rank filter of nanodist's own handler
    does not apply), as `.lines`.

        with LogLines() as log:
            nd.DDP(model)
        assert any("different values" in line for line in log.lines)
    """

    def __init__(self, name: str = "nanodist"):
        import logging

        class _Keep(logging.Handler):
            def emit(inner, record):
                self.lines.append(record.getMessage())

        self.lines: list[str] = []
        self._logger, self._handler = logging.getLogger(name), _Keep()

    def __enter__(self) -> "LogLines":
        self._logger.addHandler(self._handler)
        return self

    def __exit__(self, *exc) -> None:
        self._logger.removeHandler(self._handler)
