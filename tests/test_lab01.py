"""Lab 1 end to end: one process, two ranks, and two "nodes" on one host."""
import os
from pathlib import Path

import pytest

import nanodist as nd
from nanodist.results import load_all
from nanodist.testing import run_script

LAB = Path(__file__).resolve().parents[1] / "labs" / "lab01_ranks.py"
pytestmark = pytest.mark.dist


def check_reports(results, world_size, nnodes):
    m = results["metrics"]
    assert results["world_size"] == world_size and results["nnodes"] == nnodes
    assert m["broadcast_ok"] and m["all_reduce_ok"] and m["init_seed_identical"] and m["data_seed_distinct"]
    ranks = m["ranks"]
    assert [r["rank"] for r in ranks] == list(range(world_size))
    assert len({r["pid"] for r in ranks}) == world_size
    assert all(r["all_reduce"] == world_size * (world_size + 1) / 2 for r in ranks)
    return ranks


def test_plain_python_is_a_world_of_one(results_dir):
    out = run_script(LAB, ["--repeats", "2"], env={**os.environ, "NANODIST_RESULTS_DIR": str(results_dir)})
    assert out.returncode == 0, out.stderr
    assert "rank 0/1 local_rank 0 node 0 gloo/cpu" in out.stdout
    (record,) = load_all("lab01_ranks", roots=[results_dir])
    check_reports(record, 1, 1)
    assert len(record["steps"]) == 2


def test_two_ranks_with_gloo(results_dir):
    run = nd.launch("lab01_ranks", nproc=2, args=["--repeats", "2"], timeout=120, echo=False)
    ranks = check_reports(run.results, 2, 1)
    assert [r["local_rank"] for r in ranks] == [0, 1]
    assert {r["env"]["MASTER_PORT"] for r in ranks} == {str(run.port)}
    assert all(r["backend"] == "gloo" and r["device"] == "cpu" for r in ranks)


def test_two_nodes_on_one_host(results_dir):
    run = nd.launch("lab01_ranks", nproc=2, nnodes=2, args=["--repeats", "2"], timeout=120, echo=False)
    ranks = check_reports(run.results, 4, 2)
    assert sorted((r["node_rank"], r["local_rank"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in ranks:  # global rank = node rank * ranks per node + local rank
        assert r["rank"] == r["node_rank"] * 2 + r["local_rank"]
        assert r["local_world_size"] == 2


def test_help_describes_the_lab():
    out = run_script(LAB, ["--help"], timeout=60)
    assert out.returncode == 0 and "--numel" in out.stdout and "torchrun" in out.stdout
