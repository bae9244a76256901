"""On a GPU: every lab unchanged at a world of one with nccl and with 2 ranks sharing the GPU through gloo; the
distributed pieces equal to their references on CUDA tensors; bf16; steps that never wait for the device.

Marked `cuda`: they run where a GPU is visible (`pytest -m cuda tests/`) and are skipped cleanly elsewhere (CI has
none). Small models and few steps: they check that the CUDA paths work and agree, not how fast they are (the
labs' ratios say that)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nanodist as nd
from nanodist.model import GPT, GPTConfig
from nanodist.optim import DistAdamW, DistMuon, make_muon_optimizer
from nanodist.testing import spawn

pytestmark = [pytest.mark.cuda, pytest.mark.dist,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LABS = Path(__file__).resolve().parents[1] / "labs"
TINY = ["--model", "tiny", "--micro-batch", "2", "--seq-len", "16", "--no-progress"]
LAB_ARGS = {
    "lab01_ranks": ["--repeats", "2"],
    "lab02_allreduce": ["--min-bytes", "4K", "--max-bytes", "16K", "--repeats", "2", "--warmup", "1"],
    "lab03_ddp": TINY + ["--steps", "7"],
    "lab04_zero": TINY + ["--steps", "7"],
    "lab05_fsdp": TINY + ["--steps", "7", "--budget", "0.5"],
    "lab06_checkpoint": TINY + ["--steps", "4"],
}


def backend_env(backend: str, results_dir) -> dict:
    return {"NANODIST_BACKEND": backend, "NANODIST_DEVICE": "cuda", "NANODIST_RESULTS_DIR": str(results_dir)}


# Lab 5's peak accounting is checked against torch's allocator on the small preset: on the tiny one (a peak of ~2 MB)
# what ours cannot see (operations' own temporaries, workspaces) is a fifth of it (0.80 on an H100)
SMALL_LAB05 = ["--model", "small", "--steps", "7", "--budget", "0.5", "--no-progress"]


@pytest.mark.parametrize("lab", list(LAB_ARGS))
def test_every_lab_at_a_world_of_one_with_nccl(lab, tmp_path):
    args = (SMALL_LAB05 if lab == "lab05_fsdp" else LAB_ARGS[lab]) + (
        ["--checkpoint-dir", str(tmp_path / "ck")] if lab == "lab06_checkpoint" else [])
    run = nd.launch(lab, nproc=1, args=args, env=backend_env("nccl", tmp_path), timeout=600, echo=False)
    assert run.results is not None
    assert (run.results["backend"], run.results["device"]) == ("nccl", "cuda")
    if lab == "lab05_fsdp":  # nanodist's peak accounting against torch's allocator, over the same step: ours
        for name, r in run.results["metrics"]["impls"].items():  # counts operations' outputs, a lower bound
            assert 0.9 <= r["ratio_step_peak_vs_cuda"] <= 1.1, (name, r["memory"])  # 1.00-1.06 on an H200


@pytest.mark.parametrize("lab", list(LAB_ARGS))
def test_every_lab_with_two_ranks_sharing_the_gpu_through_gloo(lab, tmp_path):
    args = LAB_ARGS[lab] + (["--checkpoint-dir", str(tmp_path / "ck")] if lab == "lab06_checkpoint" else [])
    run = nd.launch(lab, nproc=2, args=args, env=backend_env("gloo", tmp_path), timeout=600, echo=False)
    assert run.results is not None
    assert (run.results["backend"], run.results["device"]) == ("gloo", "cuda")


def test_bf16_autocast_trains_on_the_gpu(tmp_path):
    run = nd.launch("lab03_ddp", nproc=1, args=TINY + ["--steps", "7", "--dtype", "bf16"],
                    env=backend_env("nccl", tmp_path), timeout=600, echo=False)
    impls = run.results["metrics"]["impls"]
    for r in impls.values():
        assert r["losses"][-1] < r["losses"][0]


def test_nccl_with_more_ranks_than_gpus_stops_with_one_line(tmp_path):
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has a GPU for each of 2 ranks")
    env = {**os.environ, **backend_env("nccl", tmp_path)}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          str(LABS / "lab01_ranks.py")], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.startswith("nanodist")]
    assert lines and "needs one GPU per local rank" in lines[0] and "Traceback" not in "\n".join(lines), out.stderr[-3000:]


# ----------------------------------------------------------------------------- equal to the references, on CUDA

def tiny_gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", vocab_size=64, block_size=16)).cuda()


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, 64, (2, 16), generator=g)
    return x.cuda(), x.roll(1, 1).cuda()


def equivalences(rank, W):
    """nanodist's DDP, DistAdamW and DistMuon on CUDA parameters, against torch DDP + torch's optimizers."""
    out = {}
    ours, ref = tiny_gpt(), tiny_gpt()
    ddp, tddp = nd.DDP(ours), torch.nn.parallel.DistributedDataParallel(ref)
    x, y = batch(rank, 0)
    ddp(x, y)[1].backward()
    tddp(x, y)[1].backward()
    out["ddp"] = max((a.grad - b.grad).abs().max().item() for a, b in zip(ours.parameters(), ref.parameters()))
    for name, make, make_ref, tol in (
            ("adamw", lambda m: DistAdamW(m.parameters(), lr=1e-2),
             lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True), 1e-5),
            ("muon", lambda m: DistMuon([p for p in m.parameters() if p.ndim == 2], lr=0.02),
             lambda m: torch.optim.Muon([p for p in m.parameters() if p.ndim == 2], lr=0.02), 2e-3)):
        ours, ref = tiny_gpt(), tiny_gpt()
        tddp = torch.nn.parallel.DistributedDataParallel(ref)
        opt, ref_opt = make(ours), make_ref(ref)
        for step in range(3):
            x, y = batch(rank, step)
            ours(x, y)[1].backward()
            tddp(x, y)[1].backward()
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        diff = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), ref.parameters()))
        out[name] = (diff, tol)
    return out


@pytest.mark.parametrize("W", [1, 2])
def test_ddp_and_the_sharded_optimizers_equal_torch_on_cuda(W, monkeypatch):
    monkeypatch.setenv("NANODIST_DEVICE", "cuda")  # W = 2: two ranks on one GPU, through gloo
    for out in spawn(equivalences, W, backend="nccl" if W == 1 else "gloo", timeout=300):
        assert out["ddp"] <= 1e-5, out
        for name in ("adamw", "muon"):
            diff, tol = out[name]
            assert diff <= tol, (name, diff)


def sync_free_steps(rank, W):
    """A DistAdamW + DistMuon step, clipping included, under torch.cuda.set_sync_debug_mode("error"): the
    optimizer's part of a step (the batches are copied to the GPU beforehand; forward and backward are torch's)."""
    model = tiny_gpt()
    opt = make_muon_optimizer(model)
    batches = [batch(rank, step) for step in range(3)]
    for step, (x, y) in enumerate(batches):
        model(x, y)[1].backward()
        if step:  # the first step creates the state
            torch.cuda.set_sync_debug_mode("error")
        try:
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return True


def test_a_sharded_optimizer_step_never_waits_for_the_device():
    assert spawn(sync_free_steps, 1, backend="nccl", timeout=300) == [True]


def ring_on_gpu_memory(rank, W):
    from nanodist import collectives
    t = torch.ones(8, device="cuda")
    try:
        collectives.ring_all_reduce(t)
    except ValueError as e:
        return str(e)
    return None


def test_the_ring_over_gloo_refuses_gpu_memory_with_a_message(monkeypatch):
    """gloo's send/recv would read a GPU pointer as host memory (torch aborts the process): nanodist stops first."""
    monkeypatch.setenv("NANODIST_DEVICE", "cuda")
    for msg in spawn(ring_on_gpu_memory, 2, backend="gloo", timeout=300):
        assert msg and "cannot move GPU memory" in msg and "t.cpu()" in msg
