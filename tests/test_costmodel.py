"""The alpha-beta model: step and byte counts, fits that recover known parameters, predictions, crossover."""
import math

import numpy as np
import pytest

from nanodist import costmodel as cm

ALPHA, BETA = 50e-6, 1 / 2e9  # 50 us per step, 2 GB/s
SIZES = [2**k for k in range(12, 27)]  # 4 KB .. 64 MB, like lab02


def synthetic(algorithm, n, noise=0.0, seed=0, sizes=SIZES):
    rng = np.random.default_rng(seed)
    t = [ALPHA * cm.cost(algorithm, s, n)[0] + BETA * cm.cost(algorithm, s, n)[1] for s in sizes]
    return np.array(t) * (1 + noise * rng.standard_normal(len(sizes)))


def test_counts_match_the_textbook():
    s = 1200.0
    assert cm.cost("ring_all_reduce", s, 4) == (6, 2 * 3 / 4 * s)
    assert cm.cost("ring_reduce_scatter", s, 4) == (3, 3 / 4 * s)
    assert cm.cost("ring_all_gather", s, 3) == (2, 2 / 3 * s)
    assert cm.cost("naive_all_reduce", s, 4) == (6, 6 * s)
    assert cm.cost("recursive_doubling_all_reduce", s, 8) == (3, 3 * s)
    assert cm.cost("recursive_doubling_all_reduce", s, 3) == (3, 3 * s)  # fold, 1 doubling, unfold
    assert cm.cost("recursive_doubling_all_reduce", s, 6) == (4, 4 * s)
    assert cm.cost("dist.all_reduce", s, 4) == cm.cost("ring_all_reduce", s, 4)
    for algorithm in cm.ALGORITHMS:
        assert cm.cost(algorithm, s, 1) == (0, 0)  # a world of one moves nothing
    with pytest.raises(ValueError, match="unknown algorithm 'butterfly'"):
        cm.cost("butterfly", s, 4)
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        cm.cost("ring_all_reduce", s, 0)


@pytest.mark.parametrize("algorithm,n", [("ring_all_reduce", 2), ("ring_all_reduce", 8), ("naive_all_reduce", 4),
                                         ("recursive_doubling_all_reduce", 3), ("ring_reduce_scatter", 4)])
def test_fit_recovers_alpha_and_beta(algorithm, n):
    model = cm.fit(SIZES, synthetic(algorithm, n, noise=0.03), algorithm, n, backend="gloo", device="cpu")
    assert model.alpha_s == pytest.approx(ALPHA, rel=0.15)
    assert model.beta_s_per_byte == pytest.approx(BETA, rel=0.05)
    assert model.bandwidth_GBps == pytest.approx(2.0, rel=0.05)
    assert (model.algorithm, model.world_size, model.backend, model.device, model.n_points) == \
        (algorithm, n, "gloo", "cpu", len(SIZES))
    assert 0 < model.rel_rmse < 0.1
    exact = cm.fit(SIZES, synthetic(algorithm, n), algorithm, n)
    assert exact.alpha_s == pytest.approx(ALPHA, rel=1e-6) and exact.beta_s_per_byte == pytest.approx(BETA, rel=1e-6)


def test_fit_across_world_sizes_and_prediction():
    sizes = SIZES * 3
    worlds = [2] * len(SIZES) + [4] * len(SIZES) + [8] * len(SIZES)
    times = np.concatenate([synthetic("ring_all_reduce", n) for n in (2, 4, 8)])
    model = cm.fit(sizes, times, "ring_all_reduce", worlds)
    assert model.world_size is None
    assert model.alpha_s == pytest.approx(ALPHA, rel=1e-6)
    # predict = alpha * 2(N-1) + beta * 2(N-1)/N * S, for a world size never measured
    want = ALPHA * 2 * 63 + BETA * 2 * 63 / 64 * 1e8
    assert cm.predict(model, 1e8, world_size=64) == pytest.approx(want)
    assert model.predict(1e8, 64) == pytest.approx(want)
    arr = model.predict(np.array([0, 1e8]), 64)
    assert arr.shape == (2,) and arr[0] == pytest.approx(ALPHA * 126)
    with pytest.raises(ValueError, match="pass world_size="):
        model.predict(1e8)


def test_from_link_and_crossover():
    ring = cm.CostModel.from_link("ring_all_reduce", latency_s=ALPHA, bandwidth_GBps=2.0)
    rd = cm.CostModel.from_link("recursive_doubling", latency_s=ALPHA, bandwidth_GBps=2.0)
    assert rd.algorithm == "recursive_doubling_all_reduce" and ring.bandwidth_GBps == pytest.approx(2.0)
    n = 8
    s = cm.crossover_size(ring, rd, world_size=n)
    # ring: 14 alpha + 1.75 beta S; recursive doubling: 3 alpha + 3 beta S  =>  S = 11 alpha / (1.25 beta)
    assert s == pytest.approx(11 * ALPHA / (1.25 * BETA))
    assert ring.predict(s, n) == pytest.approx(rd.predict(s, n))
    assert ring.predict(s / 2, n) > rd.predict(s / 2, n) and ring.predict(2 * s, n) < rd.predict(2 * s, n)
    # the same algorithm on a faster link never crosses over
    fast = cm.CostModel.from_link("ring_all_reduce", latency_s=ALPHA / 2, bandwidth_GBps=4.0)
    assert cm.crossover_size(ring, fast, n) is None
    with pytest.raises(ValueError, match="pass world_size="):
        cm.crossover_size(ring, rd)


def test_fit_errors_say_what_to_do():
    with pytest.raises(ValueError, match="at least 2 measurements at different sizes"):
        cm.fit([4096], [1e-4], "ring_all_reduce", 2)
    with pytest.raises(ValueError, match="at least 2 measurements at different sizes"):
        cm.fit([4096, 4096, 4096], [1e-4, 1.1e-4, 0.9e-4], "ring_all_reduce", 2)
    with pytest.raises(ValueError, match="3 sizes, 2 times"):
        cm.fit([1, 2, 3], [1e-4, 2e-4], "ring_all_reduce", 2)
    with pytest.raises(ValueError, match="moves no bytes"):
        cm.fit([1, 2], [1e-4, 2e-4], "ring_all_reduce", 1)
    with pytest.raises(ValueError, match="positive seconds"):
        cm.fit([1, 2], [1e-4, 0.0], "ring_all_reduce", 2)


def test_fit_keeps_alpha_and_beta_non_negative():
    # pure bandwidth with noise that would push the intercept below zero
    times = np.array([BETA * s for s in SIZES]) * (1 + 0.02 * np.sin(np.arange(len(SIZES))))
    times[:3] *= 0.5
    model = cm.fit(SIZES, times, "ring_reduce_scatter", 2)
    assert model.alpha_s >= 0 and model.beta_s_per_byte > 0
    assert math.isfinite(model.bandwidth_GBps)


def test_fit_results_reads_a_lab02_record():
    rows = [{"op": op, "size_bytes": s, "time_s": float(t)}
            for op, alg in (("dist.all_reduce", "ring_all_reduce"), ("ring_reduce_scatter", "ring_reduce_scatter"))
            for s, t in zip(SIZES, synthetic(alg, 2))]
    rows.append({"op": "naive_all_reduce", "size_bytes": 4096, "time_s": 1e-3})  # one size: skipped, not fitted
    record = {"lab": "lab02_allreduce", "run_id": "x", "world_size": 2, "backend": "gloo", "device": "cpu",
              "metrics": {"sweep": rows}}
    models = cm.fit_results(record)
    assert set(models) == {"dist.all_reduce", "ring_reduce_scatter"}
    assert models["dist.all_reduce"].algorithm == "ring_all_reduce"
    assert models["dist.all_reduce"].beta_s_per_byte == pytest.approx(BETA, rel=1e-6)
    assert models["ring_reduce_scatter"].world_size == 2 and models["ring_reduce_scatter"].backend == "gloo"
    big_only = cm.fit_results(record, ops=["dist.all_reduce"], min_bytes=2**20)
    assert big_only["dist.all_reduce"].n_points == len([s for s in SIZES if s >= 2**20])
    with pytest.raises(ValueError, match="no metrics\\['sweep'\\] rows"):
        cm.fit_results({"lab": "lab03_ddp", "run_id": "y", "world_size": 2, "metrics": {}})
    with pytest.raises(ValueError, match="nproc >= 2"):
        cm.fit_results({**record, "world_size": 1})


def test_crossover_ignores_per_byte_costs_equal_up_to_rounding():
    from nanodist.costmodel import CostModel, crossover_size
    a = CostModel.from_link("ring_all_reduce", latency_s=1e-4, bandwidth_GBps=1.6)
    b = CostModel.from_link("ring_all_reduce", latency_s=2e-4, bandwidth_GBps=1.6 * (1 + 1e-15))
    assert crossover_size(a, b, world_size=2) is None  # not a crossover at ~1e15 bytes


def test_data_parallel_speedup_without_overlap():
    from nanodist.costmodel import data_parallel_speedup
    assert data_parallel_speedup(0.1, 0.05, 1, "weak") == 1.0 == data_parallel_speedup(0.1, 0.05, 1, "strong")
    assert data_parallel_speedup(0.1, 0.0, 4, "weak") == pytest.approx(4.0)  # free communication: linear
    assert data_parallel_speedup(0.1, 0.0, 4, "strong") == pytest.approx(4.0)
    assert data_parallel_speedup(0.1, 0.1, 2, "weak") == pytest.approx(1.0)  # 2 x work in 2 x time
    assert data_parallel_speedup(0.1, 0.05, 2, "strong") == pytest.approx(0.1 / 0.1)
    with pytest.raises(ValueError, match="scaling must be 'weak' or 'strong'"):
        data_parallel_speedup(0.1, 0.1, 2, "diagonal")


def test_young_interval_minimises_the_expected_loss():
    from nanodist.costmodel import checkpoint_overhead, young_daly_interval
    C, M = 30.0, 6 * 3600.0
    best = young_daly_interval(C, M)
    assert best == pytest.approx((2 * C * M) ** 0.5)
    # the optimum of C/tau + tau/(2M): both terms equal there, and any other interval loses more
    assert C / best == pytest.approx(best / (2 * M))
    for tau in (best / 3, best * 0.9, best * 1.1, best * 3):
        assert checkpoint_overhead(tau, C, M) > checkpoint_overhead(best, C, M)
    assert checkpoint_overhead(best, C, M, restart_s=60) == pytest.approx(2 * C / best + 60 / M)
    for bad in ((0, M), (C, -1)):
        with pytest.raises(ValueError, match="positive"):
            young_daly_interval(*bad)
    with pytest.raises(ValueError, match="interval_s > 0"):
        checkpoint_overhead(0, C, M)


def test_zero_stages_one_and_two_send_what_ddp_sends_and_the_all_reduce_variant_half_again():
    """ZeRO's P_os reduce-scatters and all-gathers (DDP's volume); DistAdamW(zero_stage=1) all-reduces, keeping
    every rank's whole averaged gradient, and pays half again; FSDP pays half again for its second gather."""
    for n in (2, 3, 8, 64):
        ddp = cm.bytes_per_step("ddp", 1.0, n)
        assert ddp == pytest.approx(2 * (n - 1) / n)
        assert cm.bytes_per_step("zero1", 1.0, n) == pytest.approx(ddp)
        assert cm.bytes_per_step("zero2", 1.0, n) == pytest.approx(ddp)
        assert cm.bytes_per_step("zero1-allreduce", 1.0, n) == pytest.approx(1.5 * ddp)
        assert cm.bytes_per_step("fsdp", 1.0, n) == pytest.approx(1.5 * ddp)
        assert cm.bytes_per_step("fsdp-keep", 1.0, n) == pytest.approx(ddp)
    with pytest.raises(ValueError, match="strategy must be one of"):
        cm.bytes_per_step("zero4", 1.0, 2)


def test_tensor_parallel_traffic_and_activations_follow_megatron():
    S = 2 * 16 * 64 * 4
    assert cm.tensor_parallel_traffic(2, 16, 64, 1) == {}
    tp = cm.tensor_parallel_traffic(2, 16, 64, 4)
    assert tp == {("forward", "all-reduce", S): 2, ("backward", "all-reduce", S): 2}
    sp = cm.tensor_parallel_traffic(2, 16, 64, 4, sequence=True)
    forward = {k: v for k, v in sp.items() if k[0] == "forward"}
    # a ring all-reduce is a reduce-scatter then an all-gather: SP's forward sends what TP's does
    assert cm.ring_bytes(forward, 4) == cm.ring_bytes({k: v for k, v in tp.items() if k[0] == "forward"}, 4)
    assert sp[("backward", "all-gather", S)] == 4 and sp[("backward", "all-reduce", 64 * 4)] == 6
    assert cm.ring_bytes(tp, 4) == 4 * 2 * 3 / 4 * S
    # 16 b s h values a block: 4 whole under TP, 12 split; everything split under SP (plus the per-row small terms)
    one, four, four_sp = (cm.activation_bytes(2, 16, 64, 4, t, s) for t, s in ((1, False), (4, False), (4, True)))
    bsh = 2 * 16 * 64
    assert (one["main"], four["main"], four_sp["main"]) == (16 * bsh * 4, (4 + 3) * bsh * 4, 4 * bsh * 4)
    assert four_sp["total"] == one["total"] / 4
