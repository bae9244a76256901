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
    "desync": r"ranks with identical copies: (.*; )?rank {r}(;|$)",
    "mismatch": r"Detected mismatch between collectives on ranks\. Rank \d+ is running collective",
    "uneven-data": r"rank {r} reads 13 samples, but a rank's share of 30 samples is 30 / 2 = 15",
    "skip-backward": r"rank {r}: waits in collective #\d+ \(DDP buffer broadcast\)",
    "set-epoch": r"duplicated indices: \d+ \(ranks \[\d, \d\]\)",
}
WHAT = {"hang": "hangs outside any collective", "dead-peer": "was killed by SIGKILL; its peers lost it",
        "nan": "its loss was NaN at step 2",
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
    port = re.fullmatch(r"no rank: port (\d+) was already in use \(EADDRINUSE\) when torchrun started its rendezvous",
                        row["diagnosis"]).group(1)
    assert f"port: {port}," in row["evidence"] and "EADDRINUSE" in row["evidence"] and row["seconds"] <= 30


def test_without_rank_the_faulty_rank_is_drawn_and_seeded(tmp_path):
    out = run_lab(["--fault", "uneven-data", "--seed", "7"], tmp_path)
    assert out.returncode == 0 and "drawn at random (--seed 7 draws the same again)" in out.stdout, out.stdout
    (row,) = load(next(tmp_path.rglob("*.jsonl")))["metrics"]["faults"]
    assert row["planted_rank"] == row["diagnosed_rank"] == random.Random(7).randrange(2)


def _lab():
    import importlib.util
    spec = importlib.util.spec_from_file_location("lab07_debug", LAB)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_diagnoses_read_the_tools_not_the_labs_own_lines():
    """Canned output: each reader takes the tools' lines and refuses what does not single out a rank."""
    lab = _lab()
    # faults.die's own announcement is not the launcher's report
    assert lab.diagnose_dead_peer("[rank1]:rank 1 is about to be killed by SIGKILL") is None
    assert lab.diagnose_dead_peer("x.py failed on rank 1: killed by SIGKILL (exit code -9): the kernel's")[0] == 1
    # a rank slow at first, warned about once, then the one that hangs, named every time after
    out = ("[rank1]: nanodist: waited 1 s; rank 0 is not in a collective (now at x.py:3 save)\n"
           "[rank0]: nanodist: waited 1 s; rank 1 is not in a collective (now at faults.py:61 hang)\n")
    assert lab.diagnose_hang(out)[0] == 1 and lab.diagnose_hang(out)[2].endswith("faults.py:61 hang)")
    # set-epoch: the one rank in every duplicated index, whatever the lists' lengths; else none
    assert lab.diagnose_set_epoch("duplicated indices: 4 (ranks [0, 2]), 6 (ranks [1, 2]), 8 (ranks [0, 1, 2])")[0] == 2
    assert lab.diagnose_set_epoch("duplicated indices: 4 (ranks [0, 2]), 6 (ranks [0, 2])") is None
    assert lab.diagnose_set_epoch("duplicated indices: 4 (ranks [0, 2]), 6 (ranks [0, 1])")[0] == 0
    # majorities: two ranks cannot say which of them is odd
    assert lab.diagnose_skip_backward("rank 0: waits in collective #3 (a) for\nrank 1: waits in collective #3 (b) for") is None
    assert lab.diagnose_desync("out of sync across 3 ranks: 'w'\nranks with identical copies: ranks 0, 2; rank 1")[0] == 1
    assert lab.diagnose_desync("out of sync across 2 ranks: 'w'\nranks with identical copies: rank 0; rank 1") is None



@pytest.mark.parametrize("args, message", [
    (["--fault", "desync", "--rank", "3"], "--rank 3: desync runs on ranks 0 to 2"),
    (["--fault", "all", "--rank", "2"], "--rank 2:"),
    (["--fault", "all", "--rank", "-1"], "--rank -1: hang runs on ranks 0 to 1"),
])
def test_bad_input_is_a_clear_message(args, message, tmp_path):
    out = run_lab(args, tmp_path)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr
