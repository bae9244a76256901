"""--compile, the flag every training lab shares: the model's computation goes through torch.compile and trains as
the eager model does (the same losses up to the reordering a compiler may do), its parameter names unchanged."""
import argparse

import pytest
import torch
import torch.distributed as dist

from nanodist import experiment
from nanodist.group import Group
from nanodist.testing import within

SMALL = ["--model", "tiny", "--micro-batch", "2", "--seq-len", "16", "--steps", "6", "--no-progress"]


def train(extra: list[str], wrapper: str = "single", optimizer: str = "adamw"):
    parser = argparse.ArgumentParser()
    experiment.add_arguments(parser)
    args = parser.parse_args(SMALL + extra)
    data = experiment.load_data(args)
    run = experiment.build(args, data, Group.world(), wrapper=wrapper, optimizer=optimizer)
    run.trainer.fit(max_steps=args.steps)
    return run, experiment.summarize(run)


@pytest.mark.numerical
def test_a_compiled_model_trains_as_the_eager_one(results_dir, tmp_path, monkeypatch):
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is active in this test process")
    # compile afresh: inductor's on-disk cache does not tell apart kernels compiled under another
    # ATEN_CPU_CAPABILITY, and a warm one from the other kernel path gave NaN losses (torch 2.13)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    eager_run, eager = train([])
    compiled_run, compiled = train(["--compile"])
    assert not eager["compiled"] and compiled["compiled"]
    assert compiled_run.raw._compiled_call_impl is not None  # the forward runs the compiled code
    assert list(compiled_run.raw.state_dict()) == list(eager_run.raw.state_dict())  # no "_orig_mod." prefix
    within("6 losses, compiled vs eager", compiled["losses"], eager["losses"], 1e-4,
           "the compiler fuses and reorders fp32 arithmetic: rounding-level differences through 6 AdamW steps")
    assert compiled["losses"][-1] < compiled["losses"][0]


def test_under_fsdp_the_layers_inside_each_unit_are_compiled():
    from nanodist.model import GPT, GPTConfig
    raw = GPT(GPTConfig.preset("tiny", vocab_size=64, block_size=16))
    experiment.compile_model(raw, "fsdp")
    assert all(block._compiled_call_impl is None for block in raw.blocks)  # the unit's own hooks stay eager
    assert all(layer._compiled_call_impl is not None for block in raw.blocks for layer in block.children())
    assert raw._compiled_call_impl is None
