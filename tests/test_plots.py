"""The book's figures read well at the size the page shows them (nanodist.plots.check_figure), and every
notebook shows its figures through plots.show(), which checks them."""
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from nanodist import collectives, plots  # noqa: E402

BOOK = Path(__file__).resolve().parents[1] / "book"


@pytest.fixture(autouse=True)
def _close():
    yield
    plt.close("all")


def problems(fig=None):
    return plots.figure_problems(fig or plt.gcf())


def test_a_plain_figure_passes():
    _, ax = plt.subplots(figsize=(6, 3))
    ax.plot([1, 2, 3], label="a")
    plots.legend_below(ax)
    assert problems() == []
    plots.check_figure()


def test_small_text_too_wide_too_many_series_and_a_legend_on_the_data_are_caught():
    _, ax = plt.subplots(figsize=(9, 3))
    for k in range(5):
        ax.plot([k, k + 1], label=f"series {k}")
    ax.legend(loc="lower right")
    ax.text(0.5, 0.5, "tiny", fontsize=7)
    found = "\n".join(problems())
    assert "in wide" in found and "'tiny' is 7 pt" in found and "5 named series" in found and "lies inside" in found
    with pytest.raises(plots.FigureError, match="would not read well"):
        plots.show()


def test_the_course_figures_pass_their_own_check():
    n = 4
    plots.ring_steps(collectives.simulate([torch.full((n,), 10 ** r) for r in range(n)]))
    assert problems() == []
    plt.close("all")
    pts = {"this machine": [(1, 1.0), (2, 1.7)], "reference": [(1, 1.0), (2, 1.6)]}
    plots.scaling({"weak scaling": {"predicted": {"model": lambda k: 0.9 * k}, "measured": pts},
                   "strong scaling": {"predicted": {"model": lambda k: k ** 0.5}, "measured": pts}})
    assert problems() == []
    plt.close("all")
    rows = [{"op": op, "size_bytes": 2 ** k, "busbw_GBps": k / 10, "algbw_GBps": k / 10}
            for op in ("a", "b", "c", "d") for k in range(10, 20)]
    plots.bandwidth(rows, memcpy_GBps=5.0, title="four ops")
    assert problems() == []
    plt.close("all")
    mem = [{"world_size": w, "stage": s, "params_measured": 2**20, "grads_measured": 2**20,
            "optimizer_state_measured": 2**21, "total_formula": 2**22} for w in (1, 2, 4) for s in range(4)]
    plots.zero_memory(mem)
    assert problems() == []
    plt.close("all")
    plots.async_reads({"reads": [[(1.0, 0.0), (0.5, 0.25), (0.0, 1.0)] for _ in range(4)], "call": "x"})
    assert problems() == []


def test_every_notebook_shows_its_figures_through_the_check():
    for nb in sorted(BOOK.glob("*.ipynb")):
        cells = [c for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code"]
        for c in cells:
            src = "".join(c["source"])
            assert "plt.show()" not in src, f"{nb.name}: a figure shown with plt.show(), unchecked: use plots.show()"
            if "plt.subplots(" in src or "plots." in src and any(
                    f"plots.{f}(" in src for f in ("bars", "scaling", "bandwidth", "ring_steps", "zero_memory",
                                                   "memory_over_step", "fsdp_timeline", "async_reads")):
                assert "plots.show(" in src, f"{nb.name}: a cell draws a figure without plots.show():\n{src[:200]}"


def test_trace_lanes_draws_a_profiled_step_and_its_overlap():
    """Chapter 7's lanes: compute, communication, a row of launch ticks per kind of collective; the title reads the
    overlap off the trace (here 1 ms of the 3 ms of communication runs beside compute: 33 %)."""
    from nanodist.profile import Collective, Trace
    trace = Trace(step_s=0.010, collectives=[Collective("all_reduce", 10, 0.005, "process group"),
                                             Collective("broadcast", 4, 0.001, "process group")],
                  compute=[(0.0, 0.006)], communication=[(0.005, 0.008)])
    _, ax = plt.subplots(figsize=(6.6, 2.4))
    plots.trace_lanes(trace, ax, "a step")
    assert ax.get_title() == "a step: 33 % of communication under compute"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["compute", "communication", "all_reduce launched",
                                                            "broadcast launched"]
    assert not problems()
    _, ax = plt.subplots(figsize=(6.6, 2.4))
    plots.trace_lanes(Trace(step_s=0.01, collectives=[], compute=[(0.0, 0.01)]), ax)
    assert ax.get_title() == "no communication"
