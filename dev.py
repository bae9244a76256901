#!/usr/bin/env python3
"""Set up nanodist and run it: the only two commands a reader needs.

    python3 dev.py book    # virtualenv + every dependency, then build the book, executing every chapter
    python3 dev.py test    # virtualenv + every dependency, then the whole suite (what CI runs)

    python3 dev.py book --cached   # build from the outputs committed in the notebooks: no execution, < 1 min
    python3 dev.py site-check      # open every built page in the system's headless Chromium (see book/tools)
    python3 dev.py spread [TESTS]  # the tests marked numerical on every CPU kernel path: deviation vs tolerance

`test` runs twice what depends on floating-point arithmetic: the whole suite first, then the notebooks and the
tests marked `numerical` again on a second CPU kernel path of this machine (another vector ISA for torch's
kernels, MKL and oneDNN, and another thread count). A compared output or a tolerance that holds only on the
kernels that wrote it fails there (CONTRIBUTING: "Outputs that every machine reproduces").

`python3 dev.py setup` only prepares `.venv`. Needs nothing but Python >= 3.10 and pip.

torch is installed with care: the default PyPI wheel for Linux carries several GB of CUDA
libraries, which a CPU laptop does not want. In order of preference, setup uses
  1. a torch the venv already has;
  2. a torch the Python running this script already has (the venv is made with
     --system-site-packages so it sees it);
  3. a torch wheel that pip finds without an index (pip's configured --find-links,
     e.g. a local wheel folder);
  4. the CPU-only wheel index of pytorch.org when this machine has no NVIDIA GPU (Linux, Windows);
  5. PyPI (GPU machines, macOS).
Set NANODIST_TORCH_INDEX to an index URL to force one (e.g. a CUDA index on a GPU box).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / ("python.exe" if os.name == "nt" else "python")
STAMP = VENV / ".nanodist-installed"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
TORCH_SPEC = "torch>=2.9"


def say(msg: str) -> None:
    print(f"[dev] {msg}", flush=True)


def run(cmd: list, **kw) -> None:
    say(" ".join(str(c) for c in cmd))
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def has_torch(python: str | Path) -> bool:
    probe = "import torch, sys; sys.exit(0)"
    return subprocess.run([str(python), "-c", probe], capture_output=True).returncode == 0


def install_torch() -> None:
    pip = [PY, "-m", "pip", "install"]
    if os.environ.get("NANODIST_TORCH_INDEX"):
        run(pip + ["--index-url", os.environ["NANODIST_TORCH_INDEX"], TORCH_SPEC])
        return
    with tempfile.TemporaryDirectory() as tmp:
        # --no-index keeps pip to its --find-links folders: a wheel already on this machine.
        local = subprocess.run(
            [PY, "-m", "pip", "download", "--no-index", "--no-deps", "--only-binary", ":all:",
             "-d", tmp, TORCH_SPEC], capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("torch-*.whl"))
        if local.returncode == 0 and wheels:
            say(f"using the torch wheel found on this machine: {wheels[-1].name}")
            run(pip + [wheels[-1]])
            return
    no_gpu = shutil.which("nvidia-smi") is None and sys.platform != "darwin"
    if no_gpu:
        say("no NVIDIA GPU here: installing the CPU-only torch build")
        run(pip + ["--index-url", CPU_INDEX, TORCH_SPEC])  # alone: PyPI beside it could win with a CUDA build
    else:
        run(pip + [TORCH_SPEC])


def setup() -> None:
    """Create .venv with every dependency (idempotent: skipped when pyproject.toml is unchanged)."""
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if STAMP.exists() and STAMP.read_text().strip() == want and PY.exists():
        say(".venv is up to date")
        return
    if not PY.exists():
        reuse = has_torch(sys.executable)
        if reuse:
            say(f"{sys.executable} already has torch: the venv will use it (--system-site-packages)")
        run([sys.executable, "-m", "venv", *(["--system-site-packages"] if reuse else []), VENV])
    if not has_torch(PY):
        install_torch()
    run([PY, "-m", "pip", "install", "--upgrade", "pip"], stdout=subprocess.DEVNULL)
    run([PY, "-m", "pip", "install", "-e", f"{ROOT}[book,test]"])
    STAMP.write_text(want + "\n")


def venv_env(**extra: str) -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(VENV)
    env.setdefault("WANDB_MODE", "offline")  # never prompt for a login
    env.update(extra)
    return env


def build_book(execute: bool, strict: bool) -> None:
    cmd = [BIN / "jupyter-book", "build", ROOT / "book"]
    if strict:
        cmd += ["-W", "-n", "--keep-going"]
    with tempfile.TemporaryDirectory() as tmp:
        if not execute:
            # The committed notebooks already carry their outputs (nbval checks them): render those.
            cfg = Path(tmp) / "_config.yml"
            text = (ROOT / "_config.yml").read_text().replace(
                "execute_notebooks: force", "execute_notebooks: \"off\"")
            if "execute_notebooks: \"off\"" not in text:
                sys.exit("dev.py: _config.yml must contain 'execute_notebooks: force'")
            # paths in the config are relative to its folder: the copy lives elsewhere
            text = text.replace(": book/_ext", f": {ROOT / 'book' / '_ext'}")
            cfg.write_text(text)
            cmd += ["--config", cfg]
        run(cmd, cwd=ROOT, env=venv_env())
    say(f"the book is in {ROOT / '_build' / 'html' / 'index.html'}")


def site_check(require: bool) -> None:
    run([PY, ROOT / "book" / "tools" / "site_check.py", *(["--require"] if require else [])], cwd=ROOT,
        env=venv_env())


# The second kernel path, by this machine's first: a narrower vector ISA for torch's own kernels (ATen), MKL's
# fp32 matmuls and oneDNN's (bf16) ones, and another thread count for what runs in the notebook kernel and in
# pytest itself (OMP_NUM_THREADS; ranks started by nanodist.launch or spawn take it too, where it is set).
# A sensitivity check, not an emulation of every CPU.
LOWER_ISA = {
    "AVX512": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "AVX2": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"},
    "SVE256": {"ATEN_CPU_CAPABILITY": "default"},
}
KERNEL_VARS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS")


def kernel_path(env: dict, python: str | Path = PY) -> dict:
    """What torch runs on under `env`: its CPU capability and thread count (asked in a fresh process)."""
    probe = ("import json, torch; print(json.dumps({'capability': torch.backends.cpu.get_cpu_capability(), "
             "'threads': torch.get_num_threads()}))")
    out = subprocess.run([str(python), "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def first_pass_env(**extra: str) -> dict:
    env = venv_env(**extra)
    for k in KERNEL_VARS:  # the first pass runs on the machine's own kernels, whatever the caller's shell set
        env.pop(k, None)
    return env


def own_compile_cache(env: dict, directory: str | Path) -> dict:
    """A torch.compile (inductor) cache of this pass's own: inductor's on-disk cache does not tell kernels compiled
    under another ATEN_CPU_CAPABILITY apart, and reusing them gave NaN losses and a crash (torch 2.13)."""
    return {**env, "TORCHINDUCTOR_CACHE_DIR": str(directory)}


def ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def second_pass_env(first: dict, base: dict | None = None, **extra: str) -> dict | None:
    """The environment of the second kernel path (over `base`, by default the first pass's), or None where this
    CPU has no other path."""
    isa = LOWER_ISA.get(first["capability"])
    if isa is None:
        return None
    return {**(first_pass_env(**extra) if base is None else {**base, **extra}), **isa,
            "OMP_NUM_THREADS": "1" if first["threads"] > 1 else "2"}


def notebooks() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "book").glob("*.ipynb"))


class Phases:
    """Times each phase of `dev.py test` and prints the table at the end (CONTRIBUTING keeps the budget)."""

    def __init__(self):
        self.rows: list[tuple[str, float, str]] = []

    def run(self, name: str, budget_s: float, fn) -> None:
        say(f"phase: {name}")
        t0 = time.monotonic()
        try:
            fn()
        finally:
            took = time.monotonic() - t0
            self.rows.append((name, took, f"{budget_s / 60:.0f} min"))
            say(f"phase {name}: {took / 60:.1f} min")

    def report(self) -> None:
        say("phase times (budget in CONTRIBUTING.md):")
        for name, took, budget in self.rows:
            say(f"  {name:<44} {took / 60:5.1f} min   (budget {budget})")
        say(f"  {'total':<44} {sum(t for _, t, _ in self.rows) / 60:5.1f} min   (budget 30 min)")


def test(pytest_args: list[str]) -> None:
    phases = Phases()
    with tempfile.TemporaryDirectory(prefix="nanodist-results-") as results:
        env = own_compile_cache(first_pass_env(NANODIST_RESULTS_DIR=results, NANODIST_TIME_TABLE="1"),
                                Path(results) / "inductor-first")
        first = kernel_path(env)
        pytest = [PY, "-m", "pytest", "--nbval-cell-timeout=600", "-p", "no:cacheprovider"]
        try:
            phases.run("tests and notebooks (nbval, strict)", 16 * 60, lambda: run(
                pytest + ["tests", *notebooks(), "--nbval", *pytest_args], cwd=ROOT, env=env))
            phases.run("book build (-W) and site check", 1 * 60, lambda: (
                build_book(execute=False, strict=True),
                site_check(require=True)))  # CI installs Chromium (.ci/run); without it this fails, never skips
            second = second_pass_env(first, NANODIST_RESULTS_DIR=results, NANODIST_TIME_TABLE="1")
            if second is None:
                msg = (f"this CPU (torch capability {first['capability']}) has no second kernel path to test on")
                if ci():
                    sys.exit(f"dev.py: {msg}; CI needs one")
                say(f"{msg}: the second pass is skipped (CI runs it)")
                return
            second = own_compile_cache(second, Path(results) / "inductor-second")
            other = kernel_path(second)
            if other["capability"] == first["capability"]:
                sys.exit(f"dev.py: the second kernel path did not take: torch reports {other['capability']} both "
                         f"times (set by ATEN_CPU_CAPABILITY={second['ATEN_CPU_CAPABILITY']})")
            say(f"second kernel path: torch capability {first['capability']} -> {other['capability']}, "
                f"threads {first['threads']} -> {other['threads']}, "
                + ", ".join(f"{k}={second[k]}" for k in KERNEL_VARS if k in second))
            phases.run(f"second kernel path ({other['capability']}): notebooks, numerical tests", 8 * 60,
                       lambda: run(pytest + ["-m", "numerical", "tests", *notebooks(), "--nbval", *pytest_args],
                                   cwd=ROOT, env=second))
        finally:
            phases.report()


def spread(pytest_args: list[str]) -> None:
    """Run the tests marked numerical on every kernel path this CPU has and print, for each comparison made with
    nanodist.testing.within, the deviation seen on each path beside its tolerance."""
    first = kernel_path(first_pass_env())
    paths = {f"{first['capability']} x{first['threads']}": {}}
    cap = first["capability"]
    while cap in LOWER_ISA:
        isa = LOWER_ISA[cap]
        for threads in ("1", "2"):
            probe = kernel_path({**first_pass_env(), **isa, "OMP_NUM_THREADS": threads})
            paths.setdefault(f"{probe['capability']} x{threads}", {**isa, "OMP_NUM_THREADS": threads})
        if probe["capability"] == cap:
            break  # the narrower ISA did not take: no further paths
        cap = probe["capability"]
    seen: dict[str, dict] = {}
    failed = []
    with tempfile.TemporaryDirectory(prefix="nanodist-spread-") as tmp:
        for k, (name, extra) in enumerate(paths.items()):
            log = Path(tmp) / f"path{k}.jsonl"
            env = own_compile_cache({**first_pass_env(NANODIST_RESULTS_DIR=tmp, NANODIST_SPREAD_LOG=str(log)),
                                     **extra}, Path(tmp) / f"inductor-path{k}")
            say(f"kernel path {name}")
            rc = subprocess.run([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "numerical",
                                 *(pytest_args or ["tests"])], cwd=ROOT, env=env).returncode
            if rc != 0:
                failed.append(f"{name} (pytest exit {rc})")
            for line in log.read_text().splitlines() if log.exists() else []:
                r = json.loads(line)
                row = seen.setdefault(r["label"], {"rel": r["rel"], "test": r["test"], "paths": {}})
                row["paths"][name] = max(row["paths"].get(name, 0.0), r["deviation"])
    names = list(paths)
    print(f"{'comparison':<90} {'tolerance':>9} " + " ".join(f"{n:>12}" for n in names) + "   margin")
    for label, row in seen.items():
        devs = [row["paths"].get(n) for n in names]
        worst = max((d for d in devs if d is not None), default=0.0)
        margin = f"{row['rel'] / worst:7.1f}x" if worst > 0 else "  exact"
        print(f"{label[:90]:<90} {row['rel']:9.1e} " + " ".join("           -" if d is None else f"{d:12.2e}"
                                                                   for d in devs) + f"  {margin}")
    if failed:
        sys.exit(f"dev.py spread: tests failed on {', '.join(failed)}")


def main(argv: list[str]) -> None:
    cmd = argv[0] if argv else "help"
    if cmd not in ("setup", "book", "test", "site-check", "spread"):
        sys.exit(__doc__)
    if sys.version_info < (3, 10):
        sys.exit(f"dev.py: nanodist needs Python >= 3.10, this is {sys.version.split()[0]}")
    setup()
    try:
        if cmd == "book" and "--cached" in argv[1:]:
            build_book(execute=False, strict=False)
        elif cmd == "book":
            say("building the book re-executes every chapter: about 5 minutes on 2 CPU cores "
                "(`python3 dev.py book --cached` renders the committed outputs instead, in under a minute)")
            t0 = time.monotonic()
            build_book(execute=True, strict=False)
            say(f"executed and built in {time.monotonic() - t0:.0f} s")
        elif cmd == "site-check":
            site_check(require="--require" in argv[1:])
        elif cmd == "test":
            test(argv[1:])
        elif cmd == "spread":
            spread(argv[1:])
    except subprocess.CalledProcessError as e:
        sys.exit(f"dev.py: {cmd} failed (exit {e.returncode})")


if __name__ == "__main__":
    main(sys.argv[1:])
