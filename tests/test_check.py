"""The sync checkers: silent on replicas that agree, loud and precise (name, ranks, max diff) on every rank
when one rank drifts; and the exactly-once sampler check."""
import math

import pytest
import torch
import torch.distributed as dist

from nanodist.check import (assert_grads_in_sync, assert_optimizer_state_in_sync, assert_params_in_sync,
                            check_sampler_exactly_once)
from nanodist.data import ShardedSampler
from nanodist.model import GPT, GPTConfig
from nanodist.testing import spawn


def small_model() -> GPT:
    torch.manual_seed(0)  # the same weights on every rank
    return GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8))


def failure(fn, *args, **kwargs):
    """The AssertionError message fn raised, or None if it passed."""
    try:
        fn(*args, **kwargs)
    except AssertionError as e:
        return str(e)
    return None


def _battery(rank, world, store_path=None):
    """Every distributed check, on one set of processes; returns {case: this rank's outcome}."""
    if store_path is not None:  # a default group nanodist did not create
        import nanodist
        nanodist.shutdown()
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    last = world - 1
    out = {}
    model = small_model()
    names = [n for n, _ in model.named_parameters()]

    # --- no false positives: identical params, grads and optimizer state, incl. bf16, NaN, -0.0
    x = torch.arange(16).reshape(2, 8) % 11
    _, loss = model(x, x)
    loss.backward()
    opt = torch.optim.AdamW(model.configure_param_groups(0.1), lr=1e-2)
    opt.step()
    loss = model(x, x)[1]
    loss.backward()
    out["clean"] = [failure(assert_params_in_sync, model), failure(assert_grads_in_sync, model),
                    failure(assert_optimizer_state_in_sync, opt)]
    odd = small_model().to(torch.bfloat16)
    with torch.no_grad():
        odd.wte.weight[0, 0] = float("nan")
        odd.wte.weight[0, 1] = float("-inf")
        odd.blocks[0].ln1.bias[0] = -0.0 if rank == last else 0.0  # equal values, different bits
    out["bf16_nan_negzero"] = failure(assert_params_in_sync, odd)

    # --- a one-element perturbation on one rank, anywhere, of any size, is caught and named
    caught = []
    g = torch.Generator().manual_seed(123)  # the same trial list on every rank
    for trial in range(8):
        m = small_model()
        name = names[int(torch.randint(len(names), (1,), generator=g))]
        p = dict(m.named_parameters())[name]
        i = int(torch.randint(p.numel(), (1,), generator=g))
        if rank == last:
            with torch.no_grad():
                flat = p.view(-1)
                flat[i] = torch.nextafter(flat[i], torch.tensor(math.inf)) if trial % 2 else flat[i] + 0.5
        caught.append((name, failure(assert_params_in_sync, m)))
    out["perturbed"] = caught

    m = small_model()
    if rank == last:
        with torch.no_grad():
            m.lm_head.weight[3, 4] += 1e-7
    out["atol"] = [failure(assert_params_in_sync, m, atol=1e-6), failure(assert_params_in_sync, m)]
    m = small_model()
    if rank == 0:
        with torch.no_grad():
            m.ln_f.weight[2] = float("nan")
    out["nan_one_rank"] = failure(assert_params_in_sync, m)

    # --- gradients: a value drift, and a grad that is None on one rank only
    m = small_model()
    m(x, x)[1].backward()
    if rank == last:
        m.blocks[0].mlp.fc.bias.grad[1] += 1.0
    out["grad_value"] = failure(assert_grads_in_sync, m)
    if rank == last:
        m.blocks[0].attn.proj.weight.grad = None
    out["grad_none"] = failure(assert_grads_in_sync, m)
    m.zero_grad(set_to_none=True)
    out["grads_all_none"] = failure(assert_grads_in_sync, m)

    # --- optimizer state: one moment drifts; a learning rate changed on one rank
    exp_avg = opt.state[model.wpe.weight]["exp_avg"]
    saved = exp_avg.clone()
    if rank == last:
        exp_avg[0, 0] += 1.0
    out["opt_state"] = failure(assert_optimizer_state_in_sync, opt)
    exp_avg.copy_(saved)
    assert failure(assert_optimizer_state_in_sync, opt) is None  # back in step
    if rank == 0:
        opt.param_groups[1]["lr"] = 5e-3
    out["opt_lr"] = failure(assert_optimizer_state_in_sync, opt)

    # --- ranks that do not even hold the same parameters must all fail, not hang
    bigger = small_model() if rank != last else GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2,
                                                               n_embd=8))
    out["structure"] = failure(assert_params_in_sync, bigger)

    # --- samplers, as a collective
    out["sampler_ok"] = check_sampler_exactly_once(ShardedSampler(range(10), seed=1, drop_last=True))
    out["sampler_bad"] = failure(check_sampler_exactly_once, range(0, 6), 10)  # every rank reads 0..5
    if store_path is not None:
        dist.destroy_process_group()
    return out


def _check_outcomes(outs, world):
    last = world - 1
    for o in outs:
        assert o["clean"] == [None, None, None]
        assert o["bf16_nan_negzero"] is None
        assert o["atol"][0] is None and o["atol"][1] is not None
        assert o["grads_all_none"] is None
    # Every failure is raised on every rank, with the same message.
    for case in ("atol", "nan_one_rank", "grad_value", "grad_none", "opt_state", "opt_lr", "structure", "sampler_bad",
                 "perturbed"):
        assert all(o[case] == outs[0][case] for o in outs), case
    for name, msg in outs[0]["perturbed"]:
        assert msg is not None, f"perturbation of {name} not caught"
        assert f"{name!r}" in msg and f"rank {last} vs rank 0: max abs diff" in msg
        agree = "rank 0" if world == 2 else "ranks 0, 1"
        assert f"ranks with identical copies: {agree}; rank {last}\n" in msg
    big = [m for (_, m), t in zip(outs[0]["perturbed"], range(8)) if t % 2 == 0]
    assert all("max abs diff 0.5 " in m for m in big)
    assert "max abs diff inf" in outs[0]["nan_one_rank"] and "'ln_f.weight'" in outs[0]["nan_one_rank"]
    assert "gradients out of sync" in outs[0]["grad_value"] and "'blocks.0.mlp.fc.bias'" in outs[0]["grad_value"]
    msg = outs[0]["grad_none"]
    assert "'blocks.0.attn.proj.weight'" in msg and f"rank {last}: is None" in msg
    assert "'wpe.weight.exp_avg'" in outs[0]["opt_state"] and "max abs diff 1 " in outs[0]["opt_state"]
    assert "'param_groups[1].lr'" in outs[0]["opt_lr"]
    assert "do not even hold the same tensors" in outs[0]["structure"] and "blocks.1" in outs[0]["structure"]
    assert all(o["sampler_ok"].per_rank == (10 // world,) * world for o in outs)
    assert "duplicated indices: 0 (ranks [0, 1" in outs[0]["sampler_bad"]
    assert "samples never seen by any rank: [6, 7, 8, 9]" in outs[0]["sampler_bad"]


@pytest.mark.dist
def test_checkers_at_world_size_2():
    _check_outcomes(spawn(_battery, world_size=2, timeout=120), 2)


@pytest.mark.dist
def test_checkers_at_world_size_3_with_a_plain_torch_process_group(tmp_path):
    _check_outcomes(spawn(_battery, world_size=3, args=(str(tmp_path / "store"),), timeout=120), 3)


def test_world_of_one_always_passes():
    assert not dist.is_initialized()
    m = small_model()
    with torch.no_grad():
        m.wte.weight.fill_(float("nan"))
    assert_params_in_sync(m)
    assert_grads_in_sync(m)
    assert_optimizer_state_in_sync(torch.optim.SGD(m.parameters(), lr=0.1))


def test_sampler_check_names_duplicates_missing_and_uneven_counts():
    cov = check_sampler_exactly_once([[0, 2, 4], [1, 3, 0]], 5)  # padding: 0 read twice, as expected
    assert (cov.distinct, cov.dropped, cov.padded, cov.per_rank) == (5, 0, 1, (3, 3))
    cov = check_sampler_exactly_once([[0, 2], [1, 3]], 5, drop_last=True)
    assert cov.dropped == 1
    with pytest.raises(AssertionError, match=r"duplicated indices: 2 \(ranks \[0, 1\]\).*\n.*never seen.*\[3, 4\]"):
        check_sampler_exactly_once([[0, 2], [1, 2]], 5, drop_last=True)
    with pytest.raises(AssertionError, match=r"never seen by any rank: \[4\]"):
        check_sampler_exactly_once([[0, 2], [1, 3]], 5, drop_last=False)
    with pytest.raises(AssertionError, match=r"never seen by any rank: \[4\]\n.*2 repeated reads where padding "
                                             r"6 read - 5 samples = 1 are expected; duplicated indices: 2 \(ranks "
                                             r"\[0, 1, 1\]\)"):
        check_sampler_exactly_once([[0, 1, 2], [2, 3, 2]], 5)
    with pytest.raises(AssertionError, match=r"different numbers of samples \[3, 2\]"):
        check_sampler_exactly_once([[0, 2, 4], [1, 3]], 5)
    with pytest.raises(AssertionError, match=r"indices outside 0\.\.4: \[7\]"):
        check_sampler_exactly_once([[0, 7], [1, 2]], 5, drop_last=True)
    with pytest.raises(ValueError, match="dataset_len is needed"):
        check_sampler_exactly_once(iter([1, 2]))


def test_sampler_check_rejects_every_rank_reading_everything():
    # The book prints this message (chapter 3): it must name the wrong counts, the share and the duplicates.
    with pytest.raises(AssertionError) as e:
        check_sampler_exactly_once([list(range(10))] * 3, 10)
    msg = str(e.value)
    assert msg.startswith("sampler does not read each of 10 samples once across 3 ranks (per-rank counts "
                          "[10, 10, 10]):\n")
    assert "ranks 0, 1, 2 read 10 samples each, but a rank's share of 10 samples is ceil(10 / 3) = 4" in msg
    assert "20 repeated reads where padding 12 read - 10 samples = 2 are expected" in msg
    assert "duplicated indices: 0 (ranks [0, 1, 2]), 1 (ranks [0, 1, 2])" in msg and "(10 in all)" in msg
    # The same, whatever the options say: an uneven split, drop_last, or a world size that divides n.
    with pytest.raises(AssertionError, match=r"share of 10 samples is 10 // 3 = 3 or ceil\(10 / 3\) = 4.*\n.*"
                                             r"duplicated indices: 0 \(ranks \[0, 1, 2\]\)"):
        check_sampler_exactly_once([list(range(10))] * 3, 10, equal_counts=False)
    with pytest.raises(AssertionError, match=r"10 // 3 = 3 \(drop_last.*\n.*no sample may repeat; duplicated "
                                             r"indices: 0 \(ranks \[0, 1, 2\]\)"):
        check_sampler_exactly_once([list(range(10))] * 3, 10, drop_last=True)
    with pytest.raises(AssertionError, match=r"ranks 0, 1 read 10 samples each, but a rank's share of 10 samples "
                                             r"is 10 / 2 = 5\n.*duplicated indices: 0 \(ranks \[0, 1\]\)"):
        check_sampler_exactly_once([range(10), range(10)], 10)
    # More padding than evening out the shares needs: rank 1 re-reads 0 and 1 where one pad would do.
    with pytest.raises(AssertionError, match=r"rank 1 reads 4 samples, but a rank's share of 5 samples is "
                                             r"5 // 2 = 2 or ceil\(5 / 2\) = 3 \(equal_counts=False.*\n.*2 repeated "
                                             r"reads where padding 6 read - 5 samples = 1 are expected; duplicated "
                                             r"indices: 0 \(ranks \[0, 1\]\), 1 \(ranks \[0, 1\]\)"):
        check_sampler_exactly_once([[0, 1, 2], [3, 4, 0, 1]], 5, equal_counts=False)
    with pytest.raises(AssertionError, match=r"ranks 0, 1 read 3 samples each, but a rank's share of 4 samples is "
                                             r"4 / 2 = 2\n.*2 repeated reads where padding 4 read - 4 samples = 0"):
        check_sampler_exactly_once([[0, 1, 2], [3, 0, 1]], 4)


def test_sampler_check_rejects_empty_input():
    with pytest.raises(ValueError, match=r"got an empty list: no ranks.*one list of indices per rank"):
        check_sampler_exactly_once([], 10)
    with pytest.raises(ValueError, match=r"dataset_len=0: an empty dataset"):
        check_sampler_exactly_once([[], []], 0)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sampler_check_passes_correct_padding_and_drop_last(world):
    """Shards built by hand as torch's DistributedSampler does: strided, padded from the front, or truncated."""
    for n in (world, world + 1, 2 * world - 1, 10, 11):
        ceil, floor = -(-n // world), n // world
        padded = list(range(n)) + list(range(world * ceil - n))
        shards = [padded[r::world] for r in range(world)]
        for drop_last in (None, False):
            cov = check_sampler_exactly_once(shards, n, drop_last=drop_last)
            assert (cov.per_rank, cov.distinct, cov.dropped, cov.padded) == ((ceil,) * world, n, 0, world * ceil - n)
        kept = list(range(world * floor))
        for drop_last in (None, True):
            cov = check_sampler_exactly_once([kept[r::world] for r in range(world)], n, drop_last=drop_last)
            assert (cov.per_rank, cov.dropped, cov.padded) == ((floor,) * world, n - world * floor, 0)
        # equal_counts=False: an uneven split without padding (evaluation), each rank n // W or ceil(n / W)
        uneven = [list(range(r, n, world)) for r in range(world)]
        cov = check_sampler_exactly_once(uneven, n, equal_counts=False)
        assert (cov.distinct, cov.dropped, cov.padded) == (n, 0, 0) and set(cov.per_rank) <= {floor, ceil}
        if ceil != floor:
            with pytest.raises(AssertionError, match="different numbers of samples"):
                check_sampler_exactly_once(uneven, n)
