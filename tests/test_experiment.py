"""The experiment builder: a typed, frozen run configuration read from a lab's flags (which it never edits), and
registries of wrappers and optimizers that a lab extends without touching nanodist/experiment.py."""
import argparse
import dataclasses
import re
from pathlib import Path

import pytest
import torch

from nanodist import experiment
from nanodist.ddp import NaiveDDP
from nanodist.group import Group
from nanodist.testing import spawn

REPO = Path(__file__).resolve().parents[1]


def parse(*flags):
    p = argparse.ArgumentParser()
    experiment.add_arguments(p)
    p.add_argument("--no-prefetch", action="store_true")  # a lab's own flag that maps onto a field
    p.add_argument("--impl", default="x")  # a lab's own flag that is no field
    return p.parse_args(["--model", "tiny", "--micro-batch", "2", "--seq-len", "16", "--steps", "4", *flags])


def test_the_configuration_reads_the_flags_and_leaves_them_as_parsed():
    args = parse("--model", "auto", "--no-prefetch", "--bucket-mb", "2")
    before = dict(vars(args))
    cfg = experiment.RunConfig.from_args(args, "cpu", shared_memory="off")
    assert vars(args) == before  # args is never edited
    assert (cfg.model, cfg.prefetch, cfg.bucket_mb, cfg.shared_memory) == ("small", False, 2.0, "off")
    assert not hasattr(cfg, "impl")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.steps = 3
    variant = cfg.replace(checkpointing=True)
    assert variant.checkpointing and not cfg.checkpointing and variant.steps == cfg.steps
    assert experiment.RunConfig.from_args(args, "cuda").model == "gpt2"  # --model auto follows the device
    assert cfg.to_dict()["micro_batch"] == 2


def test_no_lab_edits_its_parsed_flags():
    """Variants are cfg.replace(...), never `args.x = ...` between runs (the bug class this replaced)."""
    edits = {p.name: re.findall(r"^\s*args\.\w+\s*=[^=]", p.read_text(), re.M) for p in (REPO / "labs").glob("lab*.py")}
    edits["experiment.py"] = re.findall(r"^\s*args\.\w+\s*=[^=]", (REPO / "nanodist" / "experiment.py").read_text(),
                                        re.M)
    assert not any(edits.values()), edits


def registered_worker(rank, world):
    name = "test-naive-ddp"

    @experiment.register_wrapper(name, doc="NaiveDDP, registered by a test")
    def _(raw, ctx):
        return NaiveDDP(raw, group=ctx.group)

    try:
        experiment.register_wrapper(name)(lambda raw, ctx: raw)
        refused = None
    except ValueError as e:
        refused = str(e)
    cfg = experiment.RunConfig.from_args(parse(), "cpu")
    data = experiment.load_data(cfg)
    runs = {w: experiment.build(cfg, data, Group.world(), wrapper=w) for w in (name, "nanodist-pg")}
    for run in runs.values():
        run.trainer.fit(max_steps=2)
    return {"refused": refused, "type": type(runs[name].model).__name__,
            "losses": {w: [h["loss"] for h in r.trainer.history] for w, r in runs.items()}}


@pytest.mark.dist
def test_a_set_up_registered_outside_the_package_builds_and_trains():
    for out in spawn(registered_worker, 2, timeout=120):
        assert "registered already" in out["refused"] and out["type"] == "NaiveDDP"
        mine, ddp = out["losses"].values()
        # the same averaged gradients by another route: equal up to the order of float additions
        assert mine == pytest.approx(ddp, rel=1e-5)


@pytest.mark.parametrize("wrapper, optimizer, message", [
    ("none", "adamw", "exactly one of them must average"),
    ("nanodist", "dist-adamw", "exactly one of them must average"),
    ("fsdp", "muon", "needs whole parameters"),
    ("fsdp2", "muon", "needs whole parameters"),
    ("fsdp2", "zero-redundancy-adamw", "needs whole parameters"),
    ("ddp", "adamw", "wrapper must be one of"),
])
def test_set_ups_that_do_not_go_together_are_refused_by_name(wrapper, optimizer, message):
    with pytest.raises(ValueError, match=message):
        experiment.check_setup(wrapper, optimizer)


def every_setup_worker(rank, world):
    cfg = experiment.RunConfig.from_args(parse(), "cpu")
    data = experiment.load_data(cfg)
    built = []
    for w in experiment.WRAPPERS:
        for o in experiment.OPTIMIZERS:
            try:
                experiment.check_setup(w, o)
            except ValueError:
                continue
            run = experiment.build(cfg, data, Group.world(), wrapper=w, optimizer=o)
            run.trainer.fit(max_steps=1)
            built.append((w, o, isinstance(run.optimizer, torch.optim.Optimizer)))
    return built


@pytest.mark.dist
def test_every_registered_set_up_that_goes_together_builds_and_steps():
    built = spawn(every_setup_worker, 1, timeout=120)[0]
    assert all(ok for _, _, ok in built) and len(built) >= 12, built


@pytest.mark.parametrize("flags, world, message", [
    (["--tp", "3"], 4, "--tp 3 does not divide the 4 rank(s)"),
    (["--sequence-parallel"], 2, "give --tp 2 or more with it"),
    (["--tp", "2", "--sequence-parallel", "--seq-len", "15"], 2, "--seq-len 15 is not a multiple of 2"),
    (["--tp", "8"], 8, "the tiny model has 4"),
    (["--tp", "0"], 2, "--tp must be a positive integer"),
])
def test_tensor_parallel_flags_that_cannot_work_are_refused_before_any_work(flags, world, message):
    assert message in experiment.check_args(parse(*flags), world)


def test_a_wrapper_that_cannot_average_tensor_parallel_parameters_is_refused_by_name():
    with pytest.raises(ValueError, match="cannot average a model split by tensor parallelism.*use tp, nanodist"):
        experiment.check_setup("naive", "adamw", tp=2)
    with pytest.raises(ValueError, match="cannot average a model split by tensor parallelism"):
        experiment.check_setup("torch", "adamw", tp=2)
    with pytest.raises(ValueError, match="needs whole parameters, and tensor parallelism splits them"):
        experiment.check_setup("nanodist", "muon", tp=2)
    for wrapper in ("fsdp2", "nanodist", "nanodist-pg", "tp"):  # they take the DTensors, over the data dimension
        experiment.check_setup(wrapper, "adamw", tp=2)


def tp_worker(rank, world, sequence):
    """The Trainer of a --tp run (every rank one tensor-parallel group, a data dimension of one) against the same
    run in one process: the same batches (the data dimension has one rank), the same losses and norms."""
    cfg = experiment.RunConfig.from_args(parse("--micro-batch", "4"), "cpu")
    data = experiment.load_data(cfg)
    split = experiment.build(cfg.replace(tp=world, sequence_parallel=sequence), data, Group.world(), wrapper="tp")
    alone = experiment.build(cfg, data, Group.world(), wrapper="single")
    for run in (split, alone):
        run.trainer.fit(max_steps=3)
    rows = lambda run: [(h["loss"], h["grad_norm"]) for h in run.trainer.history]  # noqa: E731
    return {"split": rows(split), "alone": rows(alone), "world": split.trainer.world.size,
            "data": split.trainer.group.size, "tokens": split.trainer.tokens_per_step}


@pytest.mark.dist
@pytest.mark.numerical
@pytest.mark.parametrize("sequence", [False, True], ids=["tp2", "tp2-sp"])
def test_a_tensor_parallel_run_trains_as_one_process(sequence):
    for out in spawn(tp_worker, 2, args=(sequence,), timeout=180):
        assert (out["world"], out["data"], out["tokens"]) == (2, 1, 4 * 16)  # every rank: the whole batch
        for (loss, norm), (want_loss, want_norm) in zip(out["split"], out["alone"]):
            # fp32 sums split differently over two ranks: ~1e-7 relative; AdamW's first steps move by lr
            # whatever the gradient's size, so the losses stay within rounding of each other
            assert loss == pytest.approx(want_loss, rel=1e-5) and norm == pytest.approx(want_norm, rel=1e-4)


def refused_tp_worker(rank, world):
    cfg = experiment.RunConfig.from_args(parse(), "cpu").replace(tp=1)
    data = experiment.load_data(cfg)
    try:
        experiment.build(cfg, data, Group.world(), wrapper="tp")
    except ValueError as e:
        return str(e)
    return "built"


@pytest.mark.dist
def test_the_tp_wrapper_refuses_a_data_dimension_it_would_not_average():
    for said in spawn(refused_tp_worker, 2, timeout=120):
        assert "averages nothing, and the data dimension has 2 ranks" in said, said


def mesh_worker(rank, world):
    """--tp 2 on 4 ranks: a 2 x 2 mesh, trained with nanodist DDP (through the process group, and through shared
    memory) and with torch's FSDP2 on the data dimension."""
    cfg = experiment.RunConfig.from_args(parse(), "cpu").replace(tp=2)
    data = experiment.load_data(cfg)
    out = {}
    for wrapper in ("nanodist-pg", "nanodist", "fsdp2"):
        run = experiment.build(cfg, data, Group.world(), wrapper=wrapper)
        run.trainer.fit(max_steps=3)
        out[wrapper] = [h["loss"] for h in run.trainer.history]
        out["shape"] = (run.trainer.group.size, run.trainer.world.size, run.trainer.tokens_per_step)
        out[f"{wrapper} shared memory"] = getattr(run.model, "shared_memory", None)
    return out


@pytest.mark.dist
@pytest.mark.numerical
def test_a_2x2_run_averages_over_the_data_dimension_with_either_wrapper():
    for out in spawn(mesh_worker, 4, timeout=240):
        assert out["shape"] == (2, 4, 2 * 2 * 16)  # 2 data ranks of micro-batch 2 x 16 tokens; 4 ranks in all
        # the same batches and weights, averaged over the data dimension by two implementations: equal within
        # rounding (AdamW's first steps move by lr whatever the gradient's size)
        assert out["nanodist-pg"] == pytest.approx(out["fsdp2"], rel=1e-5), out
        # "nanodist" reduces each data group's buckets through shared memory: every rank is on this machine
        assert out["nanodist shared memory"] is True and out["nanodist-pg shared memory"] is False, out
        assert out["nanodist"] == pytest.approx(out["nanodist-pg"], rel=1e-5), out
