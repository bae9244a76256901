"""Every lab checks every flag before any work starts: one line saying what is wrong and what to do, exit code 2,
no traceback. Plain `python lab.py` (a world of one) is enough: the checks run before any process group."""
import os
from pathlib import Path

import pytest

from nanodist.testing import run_script

LABS = Path(__file__).resolve().parents[1] / "labs"
SMALL = ["--model", "tiny", "--micro-batch", "2", "--seq-len", "16", "--steps", "5", "--no-progress"]


def run(lab: str, args: list[str], results_dir, env=None):
    """`python labs/<lab> *args`, forked from a process that has imported torch (2 s saved per run)."""
    env = {**os.environ, "NANODIST_RESULTS_DIR": str(results_dir), **(env or {})}
    return run_script(LABS / lab, args, env=env, timeout=120)


@pytest.mark.parametrize("lab, args, message", [
    ("lab03_ddp.py", ["--micro-batch", "0"], "--micro-batch must be a positive integer, got 0"),
    ("lab03_ddp.py", ["--seq-len", "0"], "--seq-len must be a positive integer, got 0"),
    ("lab03_ddp.py", ["--bucket-mb", "0"], "--bucket-mb must be a positive finite number, got 0.0"),
    ("lab03_ddp.py", ["--threads", "0"], "--threads must be a positive integer, got 0"),
    ("lab03_ddp.py", ["--lr", "nan"], "--lr must be a positive finite number, got nan"),
    ("lab04_zero.py", ["--micro-batch", "0"], "--micro-batch must be a positive integer, got 0"),
    ("lab04_zero.py", ["--muon-lr", "-1"], "--muon-lr must be a positive finite number, got -1.0"),
    ("lab04_zero.py", ["--total-batch", "100"], "total batch of 100 tokens is not a positive multiple of"),
    ("lab01_ranks.py", ["--numel", "-5"], "--numel must be a positive integer, got -5"),
    ("lab01_ranks.py", ["--repeats", "-3"], "--repeats must be a positive integer, got -3"),
])
def test_a_bad_flag_is_one_line_before_anything_starts(results_dir, lab, args, message):
    out = run(lab, (SMALL if lab != "lab01_ranks.py" else []) + args, results_dir)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr
    assert not list(results_dir.rglob("*.jsonl"))  # nothing ran


def test_a_short_validation_split_is_named_as_such(results_dir, tmp_path):
    text = tmp_path / "short.txt"
    text.write_text(("the quick brown fox jumps over the lazy dog. " * 23)[:1000])  # 900 to train on, 100 to validate
    out = run("lab03_ddp.py", SMALL + ["--impl", "single", "--micro-batch", "8", "--data", str(text)], results_dir)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "validation split (the last 10 %) has 100 tokens" in out.stderr  # not the whole text: it is long enough
    assert "at least 1290 characters" in out.stderr


@pytest.mark.parametrize("lab", ["lab01_ranks.py", "lab02_allreduce.py", "lab03_ddp.py", "lab04_zero.py"])
def test_an_unwritable_results_folder_is_found_before_any_training(tmp_path, lab):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    args = {"lab02_allreduce.py": ["--max-bytes", "8K"], "lab01_ranks.py": []}.get(lab, SMALL)
    out = run(lab, args, results_dir=blocker)
    assert out.returncode == 2, out.stderr
    assert f"cannot write results under {blocker}" in out.stderr and "NANODIST_RESULTS_DIR" in out.stderr
    assert "Traceback" not in out.stderr and "loss" not in out.stdout  # nothing trained
