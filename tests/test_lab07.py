"""Lab 7 (debugging): every fault planted on a rank chosen at random here, and diagnosed by the lab from the tools'
output alone -- the rank it names must be the one the test chose, within the demo's bounds."""
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nanodist.results import load

pytestmark = pytest.mark.dist
LAB = Path(__file__).resolve().parents[1] / "labs" / "lab07_debug.py"
WORLD = {"hang": 2, "dead-peer": 2, "nan": 2, "desync": 3, "mismatch": 3, "uneven-data": 2, "skip-backward": 3,
         "set-epoch": 3}
EVIDENCE = {  # what the tool itself said, in the line the diagnosis was read from
    "hang": r"rank {r} is not in a collective \(last: #\d+ DDP [^;]*; now at faults.py:\d+ hang",
    "dead-peer": r"rank {r}: killed by SIGKILL",
    "nan": r"non-finite values at step 2: .* the loss was nan on rank {r}\.",
    "desync": r"ranks with identical copies: .*",
    "mismatch": r"Detected mismatch between collectives on ranks\. Rank \d+ is running collective",
    "uneven-data": r"rank {r} reads 13 samples, but a rank's share of 30 samples is 30 / 2 = 15",
    "skip-backward": r"rank {r}: waits in collective #\d+ \(DDP buffer broadcast\)",
    "set-epoch": r"duplicated indices: \d+ \(ranks \[\d, \d\]\)",
}
WHAT = {"hang": "hangs outside any collective", "dead-peer": "was killed by a signal", "nan": "its loss was NaN at step 2",
        "desync": "holds other values of emb.weight", "mismatch": "all-reduces a tensor of shape [4] where the others' is [3]",
        "uneven-data": "reads only 13 samples",
        "skip-backward": "waits in DDP buffer broadcast while the others wait in DDP all-reduce of bucket 0",
        "set-epoch": "reads samples the other ranks read too"}


def run_lab(args, tmp_path, timeout=120):
    out = subprocess.run([sys.executable, str(LAB), *args], capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "NANODIST_RESULTS_DIR": str(tmp_path)})
    return out


@pytest.mark.parametrize("fault", list(WORLD))
def test_each_fault_is_diagnosed_on_the_rank_it_was_planted_on(fault, tmp_path):
    bad = random.randrange(WORLD[fault])
    out = run_lab(["--fault", fault, "--rank", str(bad)], tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    (row,) = load(next(tmp_path.rglob("*.jsonl")))["metrics"]["faults"]
    assert row["planted_rank"] == row["diagnosed_rank"] == bad, row
    assert row["diagnosis"].startswith(f"rank {bad}: {WHAT[fault]}"), row
    assert re.search(EVIDENCE[fault].format(r=bad), row["evidence"]), row
    assert row["seconds"] <= (15 if fault == "hang" else 30) + 5, row  # + starting the ranks
    assert f"diagnosis: rank {bad}: " in out.stdout


def test_a_taken_port_is_named(tmp_path):
    out = run_lab(["--fault", "port-in-use"], tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    (row,) = load(next(tmp_path.rglob("*.jsonl")))["metrics"]["faults"]
    assert row["planted_rank"] is row["diagnosed_rank"] is None
    assert re.fullmatch(r"no rank: port \d+ was already in use \(EADDRINUSE\) when torchrun started its rendezvous",
                        row["diagnosis"]), row
    assert "EADDRINUSE" in row["evidence"] and row["seconds"] <= 30


@pytest.mark.parametrize("args, message", [
    (["--fault", "desync", "--rank", "3"], "--rank 3: desync runs on 3 ranks"),
    (["--fault", "all", "--rank", "2"], "--rank 2:"),
    (["--fault", "fancy"], "invalid choice: 'fancy'"),
    (["--rank", "0"], "the following arguments are required: --fault"),
])
def test_bad_input_is_a_clear_message(args, message, tmp_path):
    out = run_lab(args, tmp_path)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr
