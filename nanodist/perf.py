"""How well a training step uses the hardware: achieved FLOP/s and MFU (model FLOPs utilisation).

    fpt = model.flops_per_token(seq_len)             # 6 x matmul weights + attention (PaLM, appendix B)
    peak = peak_flops(device, "bf16")                # a GPU's datasheet rate, or this CPU's measured matmul rate
    mfu(tokens_per_s, fpt, world_size, peak.flops)   # the fraction of the peak the model's FLOPs reach

MFU counts the FLOPs the model needs, not the ones the hardware executed (recomputation, padding and
communication do not count), divided by the peak rate of the devices that ran them. On a GPU the peak is
the dense tensor-core rate from the vendor's datasheet (a small table keyed by the device's name); a GPU
not in the table gets no MFU, and the reason says so. On a CPU there is no datasheet to trust: the peak is
the matrix-multiply rate measured on this machine, in this process (so with torchrun's one thread per rank).
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass

import torch

# Dense (no sparsity) peak rates from NVIDIA's datasheets, FLOP/s. fp32 is the plain (non-tensor-core) rate.
GPU_PEAK = {
    "H100 SXM": {"bf16": 989e12, "fp32": 67e12},
    "H100 PCIe": {"bf16": 756e12, "fp32": 51e12},
    "H100 NVL": {"bf16": 835e12, "fp32": 60e12},
    "H200": {"bf16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp32": 19.5e12},
    "L4": {"bf16": 121e12, "fp32": 30.3e12},
}


@dataclass(frozen=True)
class Peak:
    """A peak rate and where it comes from; flops is None when there is none to compare with (see why)."""

    flops: float | None
    source: str


def _gpu_key(name: str) -> str | None:
    """The table's entry for a CUDA device name such as 'NVIDIA H100 80GB HBM3'."""
    n = name.upper()
    if "H200" in n:
        return "H200"
    if "H100" in n:
        if "PCIE" in n:
            return "H100 PCIe"
        return "H100 NVL" if "NVL" in n else "H100 SXM"  # the HBM3 SXM part reports no form factor
    if "A100" in n:
        return "A100"
    if "L4" in re.split(r"[\s_-]+", n):  # not the L40 or L40S
        return "L4"
    return None


_measured: dict = {}


def measure_matmul_flops(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, n: int = 512,
                         seconds: float = 0.3) -> float:
    """The best rate of n x n matrix multiplies on `device` in this process, FLOP/s (measured once, then kept)."""
    device = torch.device(device)
    key = (device.type, dtype, n, torch.get_num_threads())
    if key not in _measured:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        best = float("inf")
        end = time.perf_counter() + seconds
        a @ b  # warm-up
        while time.perf_counter() < end or best == float("inf"):
            t0 = time.perf_counter()
            a @ b
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
        _measured[key] = 2 * n**3 / best
    return _measured[key]


def peak_flops(device: torch.device | str, dtype: str = "fp32") -> Peak:
    """The peak rate to take MFU against: a GPU's datasheet rate for `dtype` ('bf16' or 'fp32'), or on a CPU the
    measured matmul rate (fp32; bf16 on CPUs is emulated or uneven, so fp32 is the honest yardstick)."""
    device = torch.device(device)
    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"dtype must be 'bf16' or 'fp32', got {dtype!r}")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        key = _gpu_key(name)
        if key is None:
            return Peak(None, f"no MFU: {name} is not in nanodist.perf.GPU_PEAK (add its dense {dtype} rate)")
        return Peak(GPU_PEAK[key][dtype], f"{key} datasheet, dense {dtype}")
    if device.type == "cpu":
        flops = measure_matmul_flops("cpu")
        return Peak(flops, f"this CPU's measured fp32 matmul rate ({torch.get_num_threads()} thread(s))")
    return Peak(None, f"no MFU: no peak rate known for a {device.type} device")


def mfu(tokens_per_s: float, flops_per_token: float, world_size: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation: the model's FLOP/s per device over the peak (None without a peak)."""
    if peak is None:
        return None
    return tokens_per_s * flops_per_token / world_size / peak
