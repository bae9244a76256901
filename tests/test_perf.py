"""MFU: FLOPs per token from the model's shape, a peak rate from a GPU's datasheet or a CPU's measured matmuls."""
import argparse

import pytest
import torch

from nanodist import experiment, perf
from nanodist.model import GPT, GPTConfig


@pytest.mark.parametrize("name, key", [("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"),
                                       ("NVIDIA H100 NVL", "H100 NVL"), ("NVIDIA H200", "H200"),
                                       ("NVIDIA A100-SXM4-80GB", "A100"), ("NVIDIA L4", "L4"), ("NVIDIA L40S", None),
                                       ("Tesla T4", None)])
def test_gpu_names_map_to_the_datasheet_table(name, key):
    assert perf._gpu_key(name) == key


def test_cpu_peak_is_measured_and_mfu_is_the_ratio():
    peak = perf.peak_flops("cpu", "fp32")
    assert peak.flops > 1e8 and "measured" in peak.source
    assert perf.peak_flops("cpu", "fp32").flops == peak.flops  # measured once per process
    assert perf.mfu(1000.0, 6e6, 2, 1e10) == pytest.approx(1000 * 6e6 / 2 / 1e10)
    assert perf.mfu(1000.0, 6e6, 2, None) is None
    with pytest.raises(ValueError, match="'bf16' or 'fp32'"):
        perf.peak_flops("cpu", "fp16")


def test_gpt2_preset_has_gpt2_small_size_and_flops():
    with torch.device("meta"):
        m = GPT(GPTConfig.preset("gpt2"))
    assert m.num_params() == 124_475_904  # GPT-2 small with the vocabulary padded to 50304
    cfg = m.config
    n = m.num_params() - cfg.block_size * cfg.n_embd  # the position embedding does no matmul
    assert m.flops_per_token(1024) == 6 * n + 12 * cfg.n_layer * cfg.n_embd * 1024
    assert m.flops_per_token(1024, num_params=m.num_params()) == m.flops_per_token(1024)


def test_model_auto_is_small_on_cpu_and_gpt2_on_gpu():
    assert experiment.auto_model("cpu") == "small" and experiment.auto_model("cuda") == "gpt2"
    p = argparse.ArgumentParser()
    experiment.add_arguments(p)
    args = p.parse_args([])
    assert args.model == "auto"
    model = experiment.build_model(args, 65, "cpu")
    assert model.config.n_embd == GPTConfig.preset("small").n_embd
    args.model = "gpt2"
    assert experiment.build_model(args, 65, "meta").config.vocab_size == 50304  # keeps GPT-2's vocabulary


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_known_gpu_has_a_datasheet_peak():
    peak = perf.peak_flops("cuda", "bf16")
    name = torch.cuda.get_device_name()
    assert (peak.flops is None) == (perf._gpu_key(name) is None), (name, peak)
