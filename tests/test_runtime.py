"""nanodist.runtime: environment parsing, backend/device choice, init/shutdown, every error is clear."""
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import nanodist as nd
from nanodist import runtime
from nanodist.launch import free_port
from nanodist.runtime import DistConfigError, DistInfo, choose_backend, choose_device, read_env
from nanodist.testing import run_script

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "GROUP_RANK": "0"}
ALL_VARS = list(TORCHRUN) + ["NANODIST_BACKEND", "NANODIST_DEVICE", "NANODIST_TIMEOUT"]


@pytest.fixture
def clean_env(monkeypatch):
    for k in ALL_VARS:
        monkeypatch.delenv(k, raising=False)
    yield monkeypatch
    nd.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has n CUDA GPUs (for backend/device choice only)."""
    def set_gpus(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return set_gpus


# ----------------------------------------------------------------------------- environment

def test_no_torchrun_variables_means_a_world_of_one():
    assert read_env({}) is None


def test_torchrun_environment_is_parsed():
    env = read_env(TORCHRUN)
    assert env == dict(rank=1, world_size=4, local_rank=1, local_world_size=2, node_rank=0,
                       master_addr="127.0.0.1", master_port=29500)
    # a hand-made launch with only the global variables is a single node
    minimal = {k: TORCHRUN[k] for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    assert read_env(minimal)["local_rank"] == 1 and read_env(minimal)["local_world_size"] == 4


@pytest.mark.parametrize("env, message", [
    ({"RANK": "0"}, "RANK set but WORLD_SIZE, MASTER_ADDR, MASTER_PORT missing"),
    ({"LOCAL_RANK": "0"}, "LOCAL_RANK set but RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT missing"),
    ({**TORCHRUN, "WORLD_SIZE": "four"}, "WORLD_SIZE='four' is not an integer"),
    ({**TORCHRUN, "RANK": "4"}, "RANK=4 is outside 0..WORLD_SIZE-1 = 0..3"),
    ({**TORCHRUN, "LOCAL_RANK": "2"}, "LOCAL_RANK=2 is outside"),
    ({**TORCHRUN, "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
])
def test_bad_environment_is_named(env, message):
    with pytest.raises(DistConfigError, match=message.replace("(", r"\(")):
        read_env(env)


def test_partial_environment_error_says_what_to_do():
    with pytest.raises(DistConfigError) as e:
        read_env({"RANK": "0"})
    assert "torchrun" in str(e.value) and "unset them all" in str(e.value)


# ----------------------------------------------------------------------------- backend and device

def test_backend_is_gloo_without_gpus(gpus, monkeypatch):
    monkeypatch.delenv("NANODIST_BACKEND", raising=False)
    gpus(0)
    assert choose_backend(None, 2) == "gloo"
    with pytest.raises(DistConfigError, match="needs CUDA GPUs and this machine has none"):
        choose_backend("nccl", 1)


def test_backend_is_nccl_only_with_a_gpu_per_local_rank(gpus, monkeypatch):
    monkeypatch.delenv("NANODIST_BACKEND", raising=False)
    gpus(1)
    assert choose_backend(None, 1) == "nccl"
    assert choose_backend(None, 2) == "gloo"  # two ranks, one GPU: nccl cannot share it
    with pytest.raises(DistConfigError, match="2 local ranks but 1 GPU"):
        choose_backend("nccl", 2)
    assert choose_backend("gloo", 1) == "gloo"  # an explicit choice wins


def test_backend_env_override_and_unknown(gpus, monkeypatch):
    gpus(0)
    monkeypatch.setenv("NANODIST_BACKEND", "mpi-ish")
    with pytest.raises(DistConfigError, match="unknown backend 'mpi-ish'"):
        choose_backend(None, 1)


def test_device_follows_backend_and_errors_without_cuda(gpus, monkeypatch):
    monkeypatch.delenv("NANODIST_DEVICE", raising=False)
    gpus(0)
    assert choose_device(None, "gloo", 3) == torch.device("cpu")
    with pytest.raises(DistConfigError, match="CUDA is not available"):
        choose_device("cuda", "gloo", 0)
    with pytest.raises(DistConfigError, match="nccl' works on CUDA tensors only"):
        choose_device("cpu", "nccl", 0)
    with pytest.raises(DistConfigError, match="unsupported device 'mps'"):
        choose_device("mps", "gloo", 0)


def test_device_is_the_local_ranks_gpu(gpus):
    gpus(2)
    assert choose_device(None, "nccl", 1) == torch.device("cuda", 1)
    assert choose_device("cuda", "gloo", 3) == torch.device("cuda", 1)  # gloo ranks may share GPUs


# ----------------------------------------------------------------------------- init / shutdown

def test_init_without_torchrun_is_a_world_of_one(clean_env):
    info = nd.init(seed=3)
    assert info == DistInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0,
                            backend="gloo", device=torch.device("cpu"), seed=3)
    assert info.is_main and not info.distributed
    assert dist.is_initialized() and dist.get_world_size() == 1
    t = torch.ones(3)
    dist.all_reduce(t)  # collectives work unchanged at world size one
    assert t.tolist() == [1.0, 1.0, 1.0]
    assert nd.init() is info  # idempotent
    nd.shutdown()
    assert not dist.is_initialized()
    nd.shutdown()  # twice is fine


def test_init_seeds_identically_and_data_seed_differs_per_rank(clean_env):
    nd.init(seed=7)
    a = torch.randn(4)
    torch.manual_seed(7)
    assert torch.equal(a, torch.randn(4))
    seeds = {DistInfo(rank=r, seed=7).data_seed for r in range(8)} | {DistInfo(rank=r, seed=8).data_seed
                                                                      for r in range(8)}
    assert len(seeds) == 16


def test_init_adopts_a_group_it_did_not_create(clean_env):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    info = nd.init()
    assert info.world_size == 1 and info.backend == "gloo"
    assert nd.dist_info() == info
    nd.shutdown()
    assert dist.is_initialized()  # not ours to destroy
    dist.destroy_process_group()


def test_dist_info_without_any_group_is_a_world_of_one(clean_env):
    assert nd.dist_info() == DistInfo()


def test_init_with_partial_environment_raises(clean_env):
    clean_env.setenv("RANK", "0")
    with pytest.raises(DistConfigError, match="WORLD_SIZE, MASTER_ADDR, MASTER_PORT missing"):
        nd.init()
    assert not dist.is_initialized()


def _init_in_subprocess(env: dict, timeout: float = 90):
    code = "import nanodist; nanodist.init()"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env={**{k: v for k, v in os.environ.items() if k not in ALL_VARS}, **env})
    return proc, time.monotonic() - start


class _Waiting:
    """Ranks that can only wait -- for a master nobody runs, a host that does not exist, peers that never come --
    started together at the first test that asks for one: they spend their time asleep, so waiting side by side
    costs what the longest wait does (test_runtime took 52 s with these one after the other)."""

    def __init__(self, cases: dict):
        self.ports, self.runs, self.threads = {}, {}, {}
        for name, env in cases.items():
            self.ports[name] = env.get("MASTER_PORT")
            self.threads[name] = threading.Thread(target=self._run, args=(name, env), daemon=True)
            self.threads[name].start()

    def _run(self, name, env):
        self.runs[name] = _init_in_subprocess(env, timeout=90)

    def result(self, name):
        self.threads[name].join(timeout=120)
        return self.runs[name]


@pytest.fixture(scope="module")
def waiting():
    master = {"MASTER_ADDR": "127.0.0.1"}
    return _Waiting({
        "unreachable": {"RANK": "1", "WORLD_SIZE": "2", **master, "MASTER_PORT": str(free_port()),
                        "NANODIST_TIMEOUT": "3"},  # nothing listens on that port
        "unresolvable": {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "no-such-host.invalid",
                         "MASTER_PORT": "29999", "NANODIST_TIMEOUT": "3"},
        "rank0-alone": {"RANK": "0", "WORLD_SIZE": "3", **master, "MASTER_PORT": str(free_port()),
                        "NANODIST_TIMEOUT": "14"},
        "rank1-alone": {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", **master,
                        "MASTER_PORT": str(free_port()), "NANODIST_TIMEOUT": "6"},
    })


def test_unreachable_master_fails_within_the_timeout(waiting):
    port = waiting.ports["unreachable"]  # nothing listens there
    proc, elapsed = waiting.result("unreachable")
    assert proc.returncode != 0
    assert f"rank 1 could not join the process group at MASTER_ADDR=127.0.0.1 MASTER_PORT={port}" in proc.stderr
    assert "Check that every rank was started" in proc.stderr
    assert elapsed < 60


def test_unresolvable_master_address_is_named(waiting):
    proc, _ = waiting.result("unresolvable")
    assert proc.returncode != 0
    assert "MASTER_ADDR=no-such-host.invalid" in proc.stderr


def test_bad_timeout_env(clean_env):
    clean_env.setenv("NANODIST_TIMEOUT", "soon")
    with pytest.raises(DistConfigError, match="NANODIST_TIMEOUT='soon' is not a number"):
        nd.init()


# ----------------------------------------------------------------------------- printing and logging

def test_print0_prints_on_rank0_only(clean_env, capsys):
    nd.print0("from rank 0")
    clean_env.setenv("RANK", "1")
    nd.print0("from rank 1")
    assert capsys.readouterr().out == "from rank 0\n"


def test_logger_prefixes_rank_and_filters(clean_env, capsys):
    log = nd.get_logger("nanodist.test")
    log.info("hello")
    clean_env.setenv("RANK", "1")
    log.info("hidden on rank 1")
    nd.get_logger("nanodist.test", all_ranks=True).info("shown on rank 1")
    assert capsys.readouterr().out == "[rank 0] hello\n[rank 1] shown on rank 1\n"


def test_a_busy_port_says_address_in_use_and_what_to_do():
    import socket
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    port = squatter.getsockname()[1]
    try:
        proc, elapsed = _init_in_subprocess({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                             "MASTER_PORT": str(port), "NANODIST_TIMEOUT": "20"})
    finally:
        squatter.close()
    assert proc.returncode != 0
    assert f"MASTER_PORT={port}: address in use. Choose another MASTER_PORT (or let nanodist.launch" in proc.stderr
    assert "within" not in proc.stderr.splitlines()[-1]  # not blamed on a timeout


def test_a_rank_waiting_for_its_peers_says_so_within_ten_seconds(waiting):
    port = waiting.ports["rank0-alone"]
    proc, elapsed = waiting.result("rank0-alone")
    assert proc.returncode != 0 and elapsed < 60
    assert (f"[rank 0] still waiting for the other 2 rank(s) of the run to join at MASTER_ADDR=127.0.0.1 "
            f"MASTER_PORT={port}") in proc.stderr and "giving up after 14 s" in proc.stderr


@pytest.mark.parametrize("value", ["0", "-5", "inf", "nan"])
def test_the_timeout_must_be_positive(clean_env, value):
    clean_env.setenv("NANODIST_TIMEOUT", value)
    with pytest.raises(DistConfigError, match=f"NANODIST_TIMEOUT='{value}' must be a positive number of seconds"):
        nd.init()


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, nccl at a world of one is no error")
def test_a_script_that_ends_on_a_set_up_error_prints_one_line():
    """nccl asked for where it cannot run (no GPU here; on a GPU box, more ranks than GPUs): one clear line."""
    import subprocess
    import sys
    code = "import nanodist as nd; nd.init(backend='nccl')"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "NANODIST_BACKEND")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 1 and len(lines) == 1, out.stderr
    assert lines[0].startswith("nanodist: backend 'nccl' needs") and "Traceback" not in out.stderr


@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_rank_dies_with_its_torchrun_agent(tmp_path):
    """A plain torchrun (no nanodist.launch around it) whose agent is killed by SIGKILL: its workers, which called
    nd.init(), stop within seconds instead of training on to the end."""
    script = tmp_path / "worker.py"
    script.write_text("import os, time\nimport nanodist as nd\nnd.init()\n"
                      f"open(os.path.join({str(tmp_path)!r}, 'pid' + os.environ['RANK']), 'w')"
                      ".write(str(os.getpid()))\ntime.sleep(100)\n")
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                              "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(script)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    pids = []
    try:
        deadline = time.monotonic() + 60
        while len(pids) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
            pids = [int(f.read_text()) for f in tmp_path.glob("pid*") if f.read_text()]
        assert len(pids) == 2, "the two workers did not start within 60 s"
        agent.kill()
        agent.wait()
        deadline = time.monotonic() + 10
        while any(_running(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids if _running(p)], "workers outlived their killed agent by 10 s"
    finally:
        for p in pids + [agent.pid]:
            try:
                os.kill(p, 9)
            except OSError:
                pass
        agent.wait()


def _running(pid: int) -> bool:
    import psutil
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.mark.timeout(60)
def test_a_lone_rank_gives_up_within_its_timeout_and_says_when(waiting):
    """Rank 1 of 2 with no rank 0: torch's store client retries past the timeout it is given (28 s of a 10 s
    NANODIST_TIMEOUT); nd.init() keeps the limit it states."""
    out, took = waiting.result("rank1-alone")
    assert out.returncode != 0 and "could not join the process group" in out.stderr and "within 6 s" in out.stderr
    waited = int(out.stderr.split("gave up after ")[1].split(" s")[0])
    # the limit it states, its grace, and a loaded machine's scheduling; `took` adds importing torch
    assert waited <= 6 + runtime.JOIN_GRACE_S + 3 and took < 60, (waited, took, out.stderr[-500:])


def test_a_lab_in_a_partial_torchrun_environment_says_so_in_one_line(tmp_path):
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "NANODIST_RESULTS_DIR": str(tmp_path)}
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    lab = Path(__file__).resolve().parents[1] / "labs" / "lab06_checkpoint.py"
    out = run_script(lab, ["--model", "tiny", "--checkpoint-dir", str(tmp_path / "ck")], env=env, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-800:]
    assert "incomplete distributed environment" in out.stderr and "MASTER_ADDR, MASTER_PORT missing" in out.stderr
