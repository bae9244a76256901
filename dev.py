#!/usr/bin/env python3
"""Set up nanodist and run it: the only two commands a reader needs.

    python3 dev.py book    # virtualenv + every dependency, then build the book, executing every chapter
    python3 dev.py test    # virtualenv + every dependency, then the whole suite (what CI runs)

    python3 dev.py book --cached   # build from the outputs committed in the notebooks: no execution, < 1 min
    python3 dev.py site-check      # open every built page in the system's headless Chromium (see book/tools)

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
TORCH_SPEC = "torch>=2.6"


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


def test(pytest_args: list[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="nanodist-results-") as results:
        env = venv_env(NANODIST_RESULTS_DIR=results)
        notebooks = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "book").glob("*.ipynb"))
        run([PY, "-m", "pytest", "tests", *notebooks, "--nbval", "--nbval-cell-timeout=600",
             "-p", "no:cacheprovider", *pytest_args], cwd=ROOT, env=env)
    build_book(execute=False, strict=True)
    site_check(require=True)  # CI installs Chromium (.ci/run); without it the check fails here, never skips


def main(argv: list[str]) -> None:
    cmd = argv[0] if argv else "help"
    if cmd not in ("setup", "book", "test", "site-check"):
        sys.exit(__doc__)
    if sys.version_info < (3, 10):
        sys.exit(f"dev.py: nanodist needs Python >= 3.10, this is {sys.version.split()[0]}")
    setup()
    try:
        if cmd == "book" and "--cached" in argv[1:]:
            build_book(execute=False, strict=False)
        elif cmd == "book":
            say("building the book re-executes every chapter: about 10 minutes on 2 CPU cores "
                "(`python3 dev.py book --cached` renders the committed outputs instead, in under a minute)")
            t0 = time.monotonic()
            build_book(execute=True, strict=False)
            say(f"executed and built in {time.monotonic() - t0:.0f} s")
        elif cmd == "site-check":
            site_check(require="--require" in argv[1:])
        elif cmd == "test":
            test(argv[1:])
    except subprocess.CalledProcessError as e:
        sys.exit(f"dev.py: {cmd} failed (exit {e.returncode})")


if __name__ == "__main__":
    main(sys.argv[1:])
