"""The course's figures, drawn from what the labs measured. Each function returns the matplotlib Axes.

Every figure the book shows goes through `show()`, which first checks that the figure reads well in the built
page (`check_figure`): it fits the text column at full size, no text is smaller than MIN_FONT_PT, no plot has more
than MAX_SERIES named series, and no legend sits over the data. A figure that breaks a rule raises FigureError
naming the text, the plot or the width -- so a notebook that would draw an unreadable figure fails its test.
"""
from __future__ import annotations

import matplotlib
import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch, Rectangle

PALETTE = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]

# The book's text column is 688 CSS px wide (sphinx-book-theme, 1280 px window); figures are drawn at 100 dpi, so
# a figure up to COLUMN_IN inches wide shows at full size, where a 9 pt font renders at 9.4 pt.
DPI = 100
COLUMN_IN = 6.8
MIN_FONT_PT = 9.0
MAX_SERIES = 4
STYLE = {"figure.dpi": DPI, "savefig.dpi": DPI, "font.size": 10, "axes.titlesize": 10, "axes.labelsize": 10,
         "xtick.labelsize": 9, "ytick.labelsize": 9, "legend.fontsize": 9, "legend.title_fontsize": 9,
         "figure.titlesize": 10}
plt.rcParams.update(STYLE)


class FigureError(ValueError):
    """A figure would not read well in the book; the message says what to change."""


def figure_problems(fig) -> list[str]:
    """What makes `fig` hard to read in the book's column (empty if nothing): too wide, text too small, too many
    series in one plot, a legend over the data."""
    from matplotlib.text import Text
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    problems = []
    width = fig.get_tightbbox(renderer).width  # inches, as the inline backend crops it (bbox_inches="tight")
    if width > COLUMN_IN + 0.05:
        problems.append(f"the figure is {width:.1f} in wide and the book's column {COLUMN_IN} in: it would be "
                        f"shrunk to {100 * COLUMN_IN / width:.0f}%; make it narrower or stack its panels")
    for t in fig.findobj(Text):
        if t.get_visible() and t.get_text().strip() and t.get_fontsize() < MIN_FONT_PT - 1e-6:
            problems.append(f"text {t.get_text()!r:.50} is {t.get_fontsize():g} pt, under {MIN_FONT_PT:g} pt")
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        legend = ax.get_legend()
        named = len(legend.get_texts()) if legend else len(ax.get_legend_handles_labels()[1])
        if named > MAX_SERIES:
            problems.append(f"the plot {ax.get_title() or '(untitled)'!r} has {named} named series, more than "
                            f"{MAX_SERIES}: split it")
        if legend is not None and legend.get_visible() and ax.axison:
            box, area = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
            if box.overlaps(area):
                problems.append(f"the legend of {ax.get_title() or '(untitled)'!r} lies inside the plot: put it "
                                f"outside the data (beside or below the axes)")
    return problems


def check_figure(fig=None) -> None:
    """Raise FigureError if `fig` (default: the current figure) would not read well in the book."""
    problems = figure_problems(fig or plt.gcf())
    if problems:
        raise FigureError("this figure would not read well in the book:\n  " + "\n  ".join(problems))


def show(fig=None) -> None:
    """check_figure(), then plt.show(): how every figure of the book is shown."""
    check_figure(fig)
    plt.show()


def legend_below(ax, ncol: int = 2, **kw):
    """A legend under the plot, outside the data (under the x label)."""
    return ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=ncol, frameon=False, **kw)


def legend_right(ax, **kw):
    """A legend beside the plot, outside the data."""
    return ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, **kw)


def rank_layout(reports: list[dict], ax=None, title: str | None = None):
    """Nodes as boxes holding their ranks, from the per-rank reports of lab01 (rank, local_rank, node_rank)."""
    nodes = sorted({r["node_rank"] for r in reports})
    per_node = max(sum(1 for r in reports if r["node_rank"] == n) for n in nodes)
    if ax is None:
        _, ax = plt.subplots(figsize=(min(COLUMN_IN, 1.6 + 1.5 * per_node), 1.0 + 1.3 * len(nodes)))
    for row, node in enumerate(reversed(nodes)):
        y = row * 1.5
        ax.add_patch(FancyBboxPatch((0, y), 0.3 + 1.6 * per_node, 1.2, boxstyle="round,pad=0.05",
                                    fc="#F2F2F2", ec="#555555"))
        ax.text(0.1, y + 1.05, f"node {node}", va="center", fontsize=9, color="#333333")
        ranks = sorted((r for r in reports if r["node_rank"] == node), key=lambda r: r["local_rank"])
        for r in ranks:
            x = 0.2 + 1.6 * r["local_rank"]
            ax.add_patch(FancyBboxPatch((x, y + 0.1), 1.4, 0.75, boxstyle="round,pad=0.03",
                                        fc=PALETTE[r["rank"] % len(PALETTE)], ec="none", alpha=0.9))
            ax.text(x + 0.7, y + 0.6, f"rank {r['rank']}", ha="center", va="center", color="white",
                    fontweight="bold")
            ax.text(x + 0.7, y + 0.3, f"local rank {r['local_rank']}", ha="center", va="center",
                    color="white", fontsize=9)
    ax.set_xlim(-0.2, 0.5 + 1.6 * per_node)
    ax.set_ylim(-0.2, 1.5 * len(nodes))
    ax.set_aspect("equal")
    ax.axis("off")
    world = len(reports)
    ax.set_title(title or f"{len(nodes)} node(s) x {per_node} rank(s) = world size {world}")
    return ax


def bars(labels: list[str], values: list[float], ylabel: str, title: str = "", ax=None, fmt: str = "{:.3g}"):
    """A labelled bar chart (one bar per measured configuration)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(min(COLUMN_IN - 0.4, 1.5 + 1.2 * len(labels)), 3.2))
    bars_ = ax.bar(labels, values, color=PALETTE[: len(labels)])
    for b, v in zip(bars_, values):
        ax.annotate(fmt.format(v), (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                    fontsize=9, xytext=(0, 2), textcoords="offset points")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.spines[["top", "right"]].set_visible(False)
    return ax


def ddp_timeline(timeline: list[dict], step: int = -1, ax=None):
    """One training step of nanodist.DDP: when each bucket's all-reduce was launched and finished, against
    the backward pass (from DDP(record_timeline=True).timeline; times from the first ready gradient)."""
    n_buckets = 1 + max(t["bucket"] for t in timeline)
    steps = [timeline[i:i + n_buckets] for i in range(0, len(timeline), n_buckets)]
    rows = steps[step]
    if ax is None:
        _, ax = plt.subplots(figsize=(6.0, 1.3 + 0.45 * (n_buckets + 1)))
    ms = 1e3
    end, synced = rows[0]["autograd_end_s"] * ms, rows[0]["synced_s"] * ms
    ax.barh(n_buckets, end, left=0, color="#BBBBBB", height=0.6)
    ax.text(end / 2, n_buckets, "backward (gradients being computed)", ha="center", va="center", fontsize=9)
    for t in rows:
        b = t["bucket"]
        ax.barh(n_buckets - 1 - b, (t["done_s"] - t["launch_s"]) * ms, left=t["launch_s"] * ms,
                color=PALETTE[b % len(PALETTE)], height=0.6)
        # a tick at each launch: a small bucket's all-reduce can be over too fast for its bar to show
        ax.plot([t["launch_s"] * ms], [n_buckets - 1 - b], marker="|", markersize=12, color=PALETTE[b % len(PALETTE)])
    ax.set_yticks(range(n_buckets + 1),
                  [f"bucket {n_buckets - 1 - i}" for i in range(n_buckets)] + ["compute"])
    ax.axvline(end, color="#555555", lw=1, ls="--")
    ax.axvline(synced, color="#C44E52", lw=1, ls=":")
    ax.text(synced, -0.9, " all averaged", color="#C44E52", fontsize=9, va="center")
    ax.set_ylim(-1.3, n_buckets + 0.6)
    ax.set_xlabel("ms since the first gradient was ready")
    ax.set_title("all-reduce of each gradient bucket, overlapping the backward pass")
    ax.spines[["top", "right"]].set_visible(False)
    return ax


def trace_lanes(trace, ax=None, title: str = ""):
    """One profiled step (a nanodist.profile.Trace): the compute lane, the communication lane, and a tick where
    each collective was launched, one row per kind, in ms from the start of the step; the overlap in the title."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6.6, 2.4))
    ms = 1e3
    kinds = sorted({c.kind for c in trace.collectives})
    rows = ["compute", "communication"] + [f"{k} launched" for k in kinds]
    y = {r: len(rows) - 1 - i for i, r in enumerate(rows)}
    for lane, color in (("compute", "#8C8C8C"), ("communication", PALETTE[0])):
        spans = [(a * ms, (b - a) * ms) for a, b in getattr(trace, lane)]
        ax.broken_barh(spans, (y[lane] - 0.3, 0.6), color=color)
    for c in trace.collectives:
        ax.plot([c.start_s * ms], [y[f"{c.kind} launched"]], marker="|", markersize=10, color=PALETTE[1])
    ax.set_yticks(list(y.values()), list(y.keys()))
    ax.set_xlim(0, trace.step_s * ms)
    ax.set_ylim(-0.7, len(rows) - 0.3)
    ax.set_xlabel("ms from the start of the step")
    overlap = trace.overlap()
    note = "no communication" if overlap is None else f"{100 * overlap:.0f} % of communication under compute"
    ax.set_title(f"{title}: {note}" if title else note)
    ax.spines[["top", "right"]].set_visible(False)
    return ax


def scaling(panels: dict[str, dict], max_ranks: int = 8):
    """Speedup (left) and efficiency (right) against the number of ranks, one row per panel.

    panels: {title: {"measured": {label: [(ranks, speedup), ...]}, "predicted": {label: callable(ranks) ->
    speedup}}}, e.g. one panel for weak and one for strong scaling, so that no plot carries more than a few
    series. Measured points are lines with markers, predictions dashed, the ideal (speedup = ranks) dotted.
    Returns the Axes, shape (rows, 2).
    """
    import numpy as np
    rows = len(panels)
    fig, axes = plt.subplots(rows, 2, figsize=(6.6, 3.3 * rows), squeeze=False,
                             gridspec_kw={"hspace": 1.05, "wspace": 0.35})
    n = np.arange(1, max_ranks + 1)
    for (title, panel), (ax_s, ax_e) in zip(panels.items(), axes):
        ax_s.plot(n, n, color="#999999", ls=":", label="ideal")
        ax_e.plot(n, np.ones_like(n, dtype=float), color="#999999", ls=":")
        predicted, measured = panel.get("predicted") or {}, panel.get("measured") or {}
        for i, (label, fn) in enumerate(predicted.items()):
            sp = np.array([fn(k) for k in n])
            ax_s.plot(n, sp, color=PALETTE[i % len(PALETTE)], lw=1.2, ls="--", label=label)
            ax_e.plot(n, sp / n, color=PALETTE[i % len(PALETTE)], lw=1.2, ls="--")
        for i, (label, pts) in enumerate(measured.items()):
            ks, ss = zip(*sorted(pts))
            color = PALETTE[(i + len(predicted)) % len(PALETTE)]
            ax_s.plot(ks, ss, "o-", color=color, label=label)
            ax_e.plot(ks, [sp / k for sp, k in zip(ss, ks)], "o-", color=color)
        ax_s.set(xlabel="ranks", ylabel="speedup", title=f"{title}: speedup")
        ax_e.set(xlabel="ranks", ylabel="speedup / ranks", title="efficiency", ylim=(0, 1.1))
        for ax in (ax_s, ax_e):
            ax.spines[["top", "right"]].set_visible(False)
        ax_s.legend(loc="upper left", bbox_to_anchor=(0.0, -0.25), ncol=2, frameon=False)
    return axes


# ----------------------------------------------------------------------------- chapter 2: collectives

REDUCED = "#3A3A3A"  # a cell holding a sum over ranks


def _cell(ax, x, y, text, fc, tc="white", ec="white", lw=1.5, w=1.0, hatch=None, fontsize=9):
    ax.add_patch(Rectangle((x, y), w, 1, fc=fc, ec=ec, lw=lw, hatch=hatch))
    ax.text(x + w / 2, y + 0.5, text, ha="center", va="center", color=tc, fontsize=fontsize)


def collective_buffers(entry: dict, ax=None, title: str | None = None):
    """Every rank's buffer before and after one collective (an entry of lab02 --demo's metrics["demo"]["collectives"]).

    A cell is coloured by the rank its value started on; a sum over ranks is dark grey; the buffers a collective
    leaves undefined (dist.reduce's non-root ranks) are hatched, showing whatever scratch they hold.
    """
    before, after = entry["before"], entry["after"]
    n, defined = len(before), entry.get("defined") or [True] * len(before)
    wb, wa, gap = max(map(len, before)), max(map(len, after)), 2.2
    if ax is None:
        _, ax = plt.subplots(figsize=(0.42 * (wb + wa + gap + 1.6), 0.42 * (n + 1.2)))
    origin: dict = {}  # value -> the ranks it started on
    for r, buf in enumerate(before):
        for v in buf:
            origin.setdefault(v, set()).add(r)
    x0 = wb + gap
    for r in range(n):
        y = n - 1 - r
        ax.text(-0.25, y + 0.5, f"rank {r}", ha="right", va="center", fontsize=9)
        for i, v in enumerate(before[r]):
            _cell(ax, i, y, v, PALETTE[r % len(PALETTE)])
        for i, v in enumerate(after[r]):
            if not defined[r]:
                _cell(ax, x0 + i, y, v, "white", tc="#888888", ec="#BBBBBB", lw=0.8, hatch="////")
            elif entry.get("reduces"):
                _cell(ax, x0 + i, y, v, REDUCED)
            else:
                src = origin.get(v, set())
                _cell(ax, x0 + i, y, v, PALETTE[min(src) % len(PALETTE)] if len(src) == 1 else "#AAAAAA")
    ax.annotate("", xy=(x0 - 0.35, n / 2), xytext=(wb + 0.35, n / 2), arrowprops=dict(arrowstyle="-|>", lw=1.5))
    ax.text(wb / 2, n + 0.15, "before", ha="center", va="bottom", fontsize=9, color="#555555")
    ax.text(x0 + wa / 2, n + 0.15, "after", ha="center", va="bottom", fontsize=9, color="#555555")
    ax.set_title(title or entry["call"], fontsize=10, family="monospace")
    ax.set_xlim(-1.7, x0 + max(wa, 1) + 0.1)
    ax.set_ylim(-0.1, n + 0.8)
    ax.set_aspect("equal")
    ax.axis("off")
    return ax


def collectives_panels(collectives: dict, names: list[str], ncols: int | None = None):
    """collective_buffers() for several collectives, as many side by side as the book's column holds; returns the
    Axes."""
    n = len(collectives[names[0]]["before"])
    width = max(max(map(len, collectives[k]["before"])) + max(map(len, collectives[k]["after"])) for k in names)
    panel_in = 0.42 * (width + 4)
    ncols = ncols or max(1, min(len(names), int(COLUMN_IN // panel_in)))
    nrows = -(-len(names) // ncols)
    _, axes = plt.subplots(nrows, ncols, figsize=(ncols * panel_in, nrows * 0.42 * (n + 2.2)), squeeze=False)
    for ax, name in zip(axes.flat, names):
        collective_buffers(collectives[name], ax=ax)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    return axes


def barrier_timeline(entry: dict, ax=None):
    """lab02 --demo's barrier: each rank works for a while, then waits in dist.barrier() until the last arrives."""
    arrive, leave = entry["arrive_ms"], entry["leave_ms"]
    start = entry.get("start_ms") or [0.0] * len(arrive)
    n = len(arrive)
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 0.7 + 0.45 * n))
    for r in range(n):
        y = n - 1 - r
        ax.barh(y, arrive[r] - start[r], left=start[r], color=PALETTE[r % len(PALETTE)], height=0.6)
        if arrive[r] - start[r] > 0.15 * max(leave):
            ax.text((start[r] + arrive[r]) / 2, y, "working", ha="center", va="center", color="white", fontsize=9)
        ax.barh(y, leave[r] - arrive[r], left=arrive[r], color="#EEEEEE", edgecolor="#999999", hatch="...",
                height=0.6, label="waiting in dist.barrier()" if r == 0 else None)
    ax.axvline(max(arrive), color="#555555", lw=1, ls="--")
    ax.text(max(arrive), n - 0.45, "the last rank arrives ", ha="right", fontsize=9, va="bottom", color="#555555")
    ax.set_yticks(range(n), [f"rank {n - 1 - i}" for i in range(n)])
    ax.set_ylim(-0.5, n + 0.2)
    ax.set_xlabel("ms since the first rank left the previous barrier")
    ax.set_title(entry.get("call", "dist.barrier()"), fontsize=10, family="monospace")
    ax.legend(loc="upper left", bbox_to_anchor=(0.0, -0.3 - 0.6 / n), frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    return ax


def async_reads(entry: dict, axes=None):
    """lab02 --demo's async all-reduce read before wait(): at each read, the share of each rank's tensor already
    holding the final sum (top) and still holding the rank's original value (bottom); the rest are partial sums."""
    from matplotlib.ticker import MaxNLocator
    if axes is None:
        _, axes = plt.subplots(2, 1, figsize=(6.4, 4.8), sharex=True, gridspec_kw={"hspace": 0.35})
    top, bottom = axes
    for r, reads in enumerate(entry["reads"]):
        x = range(1, len(reads) + 1)
        color = PALETTE[r % len(PALETTE)]
        top.plot(x, [100 * f for _, f in reads], "o-", color=color, ms=5, label=f"rank {r}")
        bottom.plot(x, [100 * o for o, _ in reads], "s-", color=color, ms=4)
    top.set_title(f"reads before wait(): {entry.get('call', 'an async all-reduce')}", fontsize=10)
    top.set(ylabel="% final sum", ylim=(-5, 105))
    bottom.set(ylabel="% original value", ylim=(-5, 105),
               xlabel="read number (read 1: right after the call returned)")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in axes:
        ax.spines[["top", "right"]].set_visible(False)
    top.legend(loc="upper center", bbox_to_anchor=(0.5, -1.62), ncol=4, frameon=False)
    return axes


def ring_steps(frames: list[dict], ax=None, fmt: str = "{:g}"):
    """Ring all-reduce step by step, from collectives.simulate() or collectives.frames_from_traces() frames.

    One row per frame, one group of cells per rank (a cell per element, chunks side by side). A chunk's shade
    says how many ranks' contributions it holds (dark: all of them); the chunk each rank has just received
    from its left neighbour is outlined in red. Rows are labelled RS k (reduce-scatter step k) and AG k
    (all-gather step k).
    """
    import textwrap
    n, m = len(frames[0]["buffers"]), frames[0]["buffers"][0].numel()
    bounds = frames[0]["bounds"]
    texts = [[fmt.format(v) for v in b.tolist()] for f in frames for b in f["buffers"]]
    unit = 0.35  # inches per cell height; a digit at 9 pt is 0.08 in wide
    w = max(1.0, (0.08 * max(len(t) for row in texts for t in row) + 0.03) / unit)  # room for the longest number
    group = m * w + 0.4
    rows = len(frames)
    left = 1.3
    width_in = unit * (n * group + left)
    if ax is None:
        ax = plt.figure(figsize=(width_in, unit * (1.25 * rows + 1.6))).add_axes((0, 0, 1, 1))
    cmap = plt.get_cmap("Blues")
    count = [[1] * n for _ in range(n)]  # count[r][c]: how many ranks' contributions rank r's chunk c holds
    short = {"reduce-scatter": "RS", "all-gather": "AG"}
    for k, f in enumerate(frames):
        new = [row[:] for row in count]
        for src, dst, c in f["sends"]:
            new[dst][c] = count[dst][c] + count[src][c] if f["phase"] == "reduce-scatter" else count[src][c]
        count = new
        received = {(dst, c) for _, dst, c in f["sends"]}
        y = 1.25 * (rows - 1 - k)
        label = "start" if f["phase"] == "start" else f"{short.get(f['phase'], f['phase'])} {f['step'] + 1}"
        ax.text(-0.15, y + 0.5, label, ha="right", va="center", fontsize=9)
        for r in range(n):
            x0 = r * group
            for c, (a, b) in enumerate(bounds):
                share = count[r][c] / n
                for i in range(a, b):
                    _cell(ax, x0 + i * w, y, fmt.format(frames[k]["buffers"][r][i].item()), cmap(0.15 + 0.75 * share),
                          tc="white" if share > 0.5 else "#222222", w=w, fontsize=9)
                if (r, c) in received and b > a:
                    ax.add_patch(Rectangle((x0 + a * w, y), (b - a) * w, 1, fc="none", ec=PALETTE[3], lw=2.5,
                                           zorder=3))
    top = 1.25 * (rows - 1) + 1
    for r in range(n):
        ax.text(r * group + m * w / 2, top + 0.75, f"rank {r}", ha="center", va="bottom", fontsize=10)
        for c, (a, b) in enumerate(bounds):
            room = unit * w * (b - a)
            ax.text(r * group + (a + b) / 2 * w, top + 0.1, f"chunk {c}" if room >= 0.6 else f"c{c}",
                    ha="center", va="bottom", fontsize=9, color="#777777")
    ax.set_xlim(-left, n * group)
    ax.set_ylim(-0.2, top + 1.6)
    ax.set_aspect("equal")
    ax.axis("off")
    title = ("every step, every rank r sends one chunk to rank r+1 (the last to rank 0); red: the chunk just "
             "received. RS: reduce-scatter step, AG: all-gather step")
    ax.set_title("\n".join(textwrap.wrap(title, max(30, int(width_in / 0.075)))), fontsize=9)
    return ax


def _size_label(size: float) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if size >= scale:
            return f"{size / scale:g}{unit}"
    return f"{size:g}"


def bandwidth(rows: list[dict], ops: list[str] | None = None, memcpy_GBps: float | None = None,
              models: dict | None = None, ax=None, title: str = ""):
    """Bus bandwidth against message size from lab02's metrics["sweep"] rows, one line per op (at most
    MAX_SERIES of them: draw more in another plot).

    models (op -> costmodel.CostModel): dashed lines, the busbw the fitted alpha-beta model predicts;
    memcpy_GBps: a dotted line, this machine's memory-copy bandwidth (the ceiling for moving bytes).
    """
    import numpy as np
    from matplotlib.ticker import FuncFormatter
    ops = ops or list(dict.fromkeys(r["op"] for r in rows))
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 3.6))
    for i, op in enumerate(ops):
        pts = sorted((r["size_bytes"], r["busbw_GBps"], r["busbw_GBps"] / r["algbw_GBps"])
                     for r in rows if r["op"] == op)
        if not pts:
            continue
        color = PALETTE[i % len(PALETTE)]
        size, busbw, factor = zip(*pts)
        ax.plot(size, busbw, marker="o" if op.startswith("dist.") else "s", ms=4, color=color, label=op)
        if models and op in models:
            s = np.geomspace(size[0], size[-1], 100)
            ax.plot(s, factor[0] * s / models[op].predict(s) / 1e9, ls="--", lw=1, color=color)
    if memcpy_GBps:
        ax.axhline(memcpy_GBps, color="#555555", ls=":", lw=1.5)
        ax.text(0.01, memcpy_GBps, f"memcpy {memcpy_GBps:.1f} GB/s", transform=ax.get_yaxis_transform(),
                va="bottom", ha="left", fontsize=9, color="#555555")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _size_label(v)))
    ax.set(xlabel="message size (bytes)", ylabel="bus bandwidth (GB/s)", title=title)
    ax.grid(True, which="major", color="#EEEEEE")
    legend_below(ax, ncol=2)
    ax.spines[["top", "right"]].set_visible(False)
    return ax


# ----------------------------------------------------------------------------- chapter 4: ZeRO

def zero_pipeline(toy: dict, fmt: str = "{:.2f}"):
    """One DistAdamW step, every rank's buffers, from lab04 --record-pipeline's metrics["pipeline"]["toy"].

    Four panels, top to bottom: each rank's local gradient; after the reduce-scatter, the averaged gradient of
    the slice it owns; after AdamW, its copy of the parameters with that slice updated (the rest, greyed, still
    old); after the all-gather, the whole updated parameters. A cell's colour is the rank that computed it;
    dark grey is an average over all ranks. Returns the Axes.
    """
    ranks, names = toy["ranks"], toy["names"]
    W, sizes = len(ranks), [len(b) for b in toy["before"]]

    def show(v: float) -> str:
        text = fmt.format(v)
        return text.lstrip("-") if text.strip("-0.") == "" else text  # no "-0.00"

    w, gap, rows_gap = 1.45, 0.7, 1.9
    x0 = [sum(sizes[:k]) * w + k * gap for k in range(len(sizes))]
    width = x0[-1] + sizes[-1] * w
    owner = [[None] * n for n in sizes]  # owner[k][i]: the rank that updates element i of parameter k
    for r, entries in enumerate(ranks):
        for k, e in enumerate(entries):
            if e["piece"] is not None:
                a, n = e["piece"]
                for i in range(a, a + n):
                    owner[k][i] = r
    titles = ["1. backward: each rank's local gradient, from its own batch",
              "2. reduce-scatter: each rank receives the average over ranks of its slice only",
              "3. AdamW on the slice: exp_avg and exp_avg_sq exist for these elements only (grey: not yet updated)",
              "4. all-gather: every rank receives every updated slice"]
    panel_h = W + rows_gap
    height = 4 * panel_h + 1.2
    import textwrap
    fig_w = 0.36 * (width + 2.6)
    titles = ["\n".join(textwrap.wrap(t, max(30, int(fig_w / 0.075)))) for t in titles]
    _, ax = plt.subplots(figsize=(fig_w, 0.36 * height))
    blank = dict(fc="white", ec="#CCCCCC", lw=0.8)
    for p in range(4):
        top = height - 1.2 - p * panel_h - rows_gap + 0.6  # y of the panel's top edge
        ax.text(-2.2, top + 0.35, titles[p], ha="left", va="bottom", fontsize=9, color="#333333")
        for r in range(W):
            y = top - 1 - r
            ax.text(-0.25, y + 0.5, f"rank {r}", ha="right", va="center", fontsize=9)
            for k, e in enumerate(ranks[r]):
                a, n = e["piece"] if e["piece"] is not None else (0, 0)
                for i in range(sizes[k]):
                    x, mine = x0[k] + i * w, a <= i < a + n
                    if p == 0:
                        _cell(ax, x, y, show(e["grad"][i]), PALETTE[r % len(PALETTE)], w=w, fontsize=9)
                    elif p == 1:
                        if mine:
                            _cell(ax, x, y, show(e["grad_shard"][i - a]), REDUCED, w=w, fontsize=9)
                        else:
                            _cell(ax, x, y, "", w=w, **blank)
                    elif p == 2:
                        if mine:
                            _cell(ax, x, y, show(e["updated_shard"][i - a]), PALETTE[r % len(PALETTE)], w=w,
                                  fontsize=9)
                        else:
                            _cell(ax, x, y, show(toy["before"][k][i]), tc="#AAAAAA", w=w, fontsize=9, **blank)
                    else:
                        o = owner[k][i]
                        _cell(ax, x, y, show(e["param"][i]), PALETTE[o % len(PALETTE)] if o is not None
                              else "#AAAAAA", w=w, fontsize=9)
    head = height - 0.55
    for k, name in enumerate(names):
        shape = "×".join(map(str, ranks[0][k]["shape"])) or "scalar"
        ax.text(x0[k] + sizes[k] * w / 2, head, f"{name} ({shape})", ha="center", va="bottom", fontsize=9)
    ax.set_xlim(-2.3, width + 0.2)
    ax.set_ylim(-0.2, height + 0.2)
    ax.set_aspect("equal")
    ax.axis("off")
    return ax


def newton_schulz_steps(result: dict, ax=None):
    """Singular values after each Newton-Schulz iteration, from nanodist.optim.newton_schulz_singular_values."""
    import numpy as np
    steps = np.array([[float(v) for v in s] for s in result["per_step"]])  # (iterations + 1, k)
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 3.6))
    ax.axhspan(0.5, 1.5, color="#EEEEEE", zorder=0, label="where Muon wants them: about 1")
    cmap = plt.get_cmap("viridis")
    k = steps.shape[1]
    for j in range(k):
        ax.plot(range(len(steps)), steps[:, j], "o-", ms=3, color=cmap(j / max(k - 1, 1)),
                label="singular values (dark: largest, light: smallest)" if j == 0 else None)
    ax.set_yscale("log")
    ax.set(xlabel="Newton-Schulz iterations", ylabel="singular value", xticks=range(len(steps)),
           title="orthogonalising a matrix: every direction pushed towards size 1")
    legend_below(ax, ncol=1)
    ax.spines[["top", "right"]].set_visible(False)
    return ax


def muon_deal(owned: list[list[dict]], ax=None):
    """Which matrices each rank's DistMuon updates, as stacked bars of their sizes (lab04 --record-pipeline's
    metrics["pipeline"]["muon"]["owned"]: per rank, dicts with name and numel). Colour: the kind of matrix."""
    kinds = list(dict.fromkeys(m["name"].split(".", 2)[-1].rsplit(".", 1)[0] for ms in owned for m in ms))
    if ax is None:
        _, ax = plt.subplots(figsize=(6.6, 0.9 + 0.55 * len(owned)))
    seen = set()
    widest = max(sum(m["numel"] for m in ms) for ms in owned)
    for r, ms in enumerate(owned):
        left = 0
        for m in sorted(ms, key=lambda m: -m["numel"]):
            kind = m["name"].split(".", 2)[-1].rsplit(".", 1)[0]
            color = PALETTE[kinds.index(kind) % len(PALETTE)]
            ax.barh(r, m["numel"], left=left, color=color, edgecolor="white", height=0.7,
                    label=kind if kind not in seen else None)
            seen.add(kind)
            block = m["name"].split(".")[1] if m["name"].startswith("blocks.") else ""
            if m["numel"] >= widest / 12:  # room for the label at 9 pt
                ax.text(left + m["numel"] / 2, r, block, ha="center", va="center", color="white", fontsize=9)
            left += m["numel"]
    ax.set_yticks(range(len(owned)), [f"rank {r}" for r in range(len(owned))])
    ax.invert_yaxis()
    ax.set_xlabel("elements of the matrices this rank orthogonalises and updates\n(numbers: the block)")
    legend_below(ax, ncol=2)
    ax.spines[["top", "right"]].set_visible(False)
    return ax


def zero_memory(rows: list[dict], ax=None, unit: float = 2**20, unit_name: str = "MiB"):
    """Measured bytes per rank (parameters, gradients, optimizer state stacked), grouped by world size and ZeRO
    stage, with the formula's total as a black tick. Rows as nanodist.memory.memory_table makes them."""
    sizes = sorted({r["world_size"] for r in rows})
    stages = sorted({r["stage"] for r in rows})
    if ax is None:
        _, ax = plt.subplots(figsize=(min(COLUMN_IN - 0.3, 1.4 + 0.42 * (len(sizes) * (len(stages) + 1))), 3.8))
    kinds = [("params", "parameters"), ("grads", "gradients"), ("optimizer_state", "optimizer state")]
    ticks, labels = [], []
    for g, n in enumerate(sizes):
        for j, s in enumerate(stages):
            row = next((r for r in rows if r["world_size"] == n and r["stage"] == s), None)
            if row is None:
                continue
            x = g * (len(stages) + 1) + j
            bottom = 0.0
            for c, (key, label) in enumerate(kinds):
                v = row[f"{key}_measured"] / unit
                ax.bar(x, v, bottom=bottom, color=PALETTE[c], width=0.8, label=label if (g, j) == (0, 0) else None)
                bottom += v
            ax.plot([x - 0.4, x + 0.4], [row["total_formula"] / unit] * 2, color="black", lw=2,
                    label="formula (total)" if (g, j) == (0, 0) else None)
            ticks.append(x)
            labels.append(str(s))
        ax.text(g * (len(stages) + 1) + (len(stages) - 1) / 2, -0.1, f"{n} rank{'s' if n > 1 else ''}",
                ha="center", va="top", transform=ax.get_xaxis_transform(), fontsize=9)
    ax.set_xticks(ticks, labels)
    ax.set_xlabel("ZeRO stage", labelpad=18)
    ax.set_ylabel(f"{unit_name} per rank")
    ax.set_title("model states per rank: measured (bars), ZeRO's formula (ticks)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.24), ncol=2, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    return ax


def fsdp_layouts(flat: list[list[tuple]], dim0: list[list[tuple]], names: list[str], numels: list[int],
                 axes=None):
    """Who holds what of one unit's parameters, two ways (from nanodist.fsdp.flat_layout / dim0_layout): nanodist's
    flat buffer cut into N equal pieces (a parameter may straddle ranks; the last piece padded) and FSDP2's cut of
    every parameter along dim 0 (each parameter on every rank, unequal when rows do not divide)."""
    W = len(flat)
    total = sum(numels)
    if axes is None:
        _, axes = plt.subplots(2, 1, figsize=(6.6, 1.4 + 0.9 * W), sharex=True)
    starts = [sum(numels[:i]) for i in range(len(numels))]
    for ax, layout, title in ((axes[0], flat, "nanodist FSDP: one flat buffer, N equal pieces"),
                              (axes[1], dim0, "torch FSDP2: every parameter cut along dim 0 (DTensor Shard(0))")):
        for r, pieces in enumerate(layout):
            for k, a, b in pieces:
                if b <= a:
                    continue
                x0 = starts[k] + a if k is not None else a
                ax.add_patch(Rectangle((x0, W - 1 - r), b - a, 0.8, fc=PALETTE[k % len(PALETTE)] if k is not None
                                       else "#DDDDDD", ec="white", lw=1, hatch=None if k is not None else "//"))
        for k, (s, n) in enumerate(zip(starts, numels)):
            ax.axvline(s, color="#999999", lw=0.6)
        ax.set_yticks([W - 1 - r + 0.4 for r in range(W)], [f"rank {r}" for r in range(W)])
        ax.set_title(title, fontsize=10, loc="left")
        ax.set_ylim(-0.2, W)
        ax.spines[["top", "right", "left"]].set_visible(False)
        ax.tick_params(left=False)
    pad = max(b for pieces in flat for k, a, b in pieces if k is None) if any(
        k is None for pieces in flat for k, _, _ in pieces) else total
    axes[-1].set_xlim(0, max(total, pad))
    axes[-1].set_xticks([s + n / 2 for s, n in zip(starts, numels)], names, fontsize=9)
    axes[-1].set_xlabel("the unit's parameters, end to end (element index)")
    return axes


def fsdp_timeline(runs: dict[str, list[dict]], axes=None):
    """FSDP's step, unit by unit, from FSDPTimeline events: when each unit's all-gather was in flight (light),
    when its parameters were gathered (dark), and its reduce-scatter (red); one panel per run (e.g. prefetch on
    and off), on one time axis in milliseconds."""
    names = list(runs)
    if axes is None:
        _, axes = plt.subplots(len(names), 1, figsize=(6.6, 0.9 + 1.9 * len(names)), sharex=True, squeeze=False)
        axes = axes[:, 0]
    for ax, name in zip(axes, names):
        events = runs[name]
        t0 = events[0]["t"]
        units = []
        for e in events:
            if e["unit"] not in units:
                units.append(e["unit"])
        rows = {u: len(units) - 1 - i for i, u in enumerate(units)}
        open_at: dict = {}
        for e in events:
            u, t, kind = e["unit"], 1e3 * (e["t"] - t0), e["event"]
            y = rows[u]
            if kind in ("gather_started", "reduce_started"):
                open_at[(u, kind)] = t
            elif kind == "gathered" and (u, "gather_started") in open_at:
                s = open_at.pop((u, "gather_started"))
                ax.broken_barh([(s, max(t - s, 0.05))], (y + 0.1, 0.8), fc="#A6C8E8")
                open_at[(u, "held")] = t
            elif kind == "freed" and (u, "held") in open_at:
                s = open_at.pop((u, "held"))
                ax.broken_barh([(s, max(t - s, 0.05))], (y + 0.1, 0.8), fc=PALETTE[0])
            elif kind == "reduced" and (u, "reduce_started") in open_at:
                s = open_at.pop((u, "reduce_started"))
                ax.broken_barh([(s, max(t - s, 0.05))], (y + 0.35, 0.3), fc=PALETTE[3])
        end = 1e3 * (events[-1]["t"] - t0)
        for (u, kind), s in open_at.items():  # still held at the end of the step
            if kind == "held":
                ax.broken_barh([(s, max(end - s, 0.05))], (rows[u] + 0.1, 0.8), fc=PALETTE[0])
        ax.set_yticks([rows[u] + 0.5 for u in units], units, fontsize=9)
        ax.set_title(name, fontsize=10, loc="left")
        ax.spines[["top", "right"]].set_visible(False)
    axes[-1].set_xlabel("time in the step (ms)")
    from matplotlib.patches import Patch
    axes[0].legend(handles=[Patch(fc="#A6C8E8", label="all-gather in flight"), Patch(fc=PALETTE[0], label="gathered"),
                            Patch(fc=PALETTE[3], label="reduce-scatter")],
                   loc="lower left", bbox_to_anchor=(0, 1.12), ncol=3, frameon=False)
    return axes


def memory_over_step(trace: dict, ax=None, unit: float = 2**20, unit_name: str = "MiB"):
    """Bytes allocated during one training step, above what the rank holds throughout (nanodist.memory's
    accounting: trace from experiment.measure_peak_step(run, trace=True)), with the saved activations and the
    gathered FSDP units drawn under it, and the forward / backward / optimizer phases marked."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6.6, 3.2))
    x = trace["index"]
    ax.plot(x, [v / unit for v in trace["total"]], color="#333333", lw=1.4, label="all allocations")
    layers, colors, labels = [trace["activations"]], [PALETTE[1]], ["saved activations"]
    if any(trace["gathered"]):  # DDP gathers nothing: no legend entry for a series that is not drawn
        layers, colors, labels = layers + [trace["gathered"]], colors + [PALETTE[0]], labels + ["gathered units"]
    ax.stackplot(x, *[[v / unit for v in layer] for layer in layers], colors=colors, alpha=0.6, labels=labels)
    marks = sorted(trace["phases"].items(), key=lambda kv: kv[1])
    ends = [at for _, at in marks[1:]] + [max(x[-1], marks[-1][1] + 1)]
    top = max(trace["total"]) / unit
    for (name, at), end in zip(marks, ends):
        ax.axvline(at, color="#999999", lw=0.8, ls="--")
        ax.text((at + end) / 2, top * 1.03, name, fontsize=9, ha="center", va="bottom", color="#555555")
    ax.set_ylim(0, top * 1.15)
    ax.set_xlabel("operations in the step, in order")
    ax.set_ylabel(f"{unit_name} above what is held")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    return ax


def tensor_parallel_block(sequence: bool = False, ranks: int = 2, ax=None):
    """Megatron's MLP (or attention) split over `ranks`, drawn left to right: the input, f, each rank's
    column-parallel layer, its element-wise function and its row-parallel layer, g, the output. With
    sequence=True, the sequence-parallel form: the input and output are each rank's positions, f an all-gather
    and g a reduce-scatter. What each operator does forward and backward is written under it."""
    if ax is None:
        _, ax = plt.subplots(figsize=(COLUMN_IN, 1.3 + 0.8 * ranks))
    f_fwd, f_bwd = ("all-gather", "reduce-scatter\n(and the shard gathered again)") if sequence else \
        ("identity", "all-reduce")
    g_fwd, g_bwd = ("reduce-scatter", "all-gather") if sequence else ("all-reduce", "identity")
    left, right = ("X: T/n each", "Y: T/n each") if sequence else ("X, whole", "Y, whole")
    top = ranks * 1.3
    low = top - 1.3 * ranks + 0.15  # the bottom of the last rank's row
    for r in range(ranks):
        y = top - 1.3 * (r + 1) + 0.15
        _cell(ax, 3.1, y, f"fc: rows {r}", PALETTE[0], w=1.9)
        _cell(ax, 5.3, y, "GELU", PALETTE[2], w=1.0)
        _cell(ax, 6.6, y, f"proj: cols {r}", PALETTE[0], w=1.9)
        for x0, x1 in ((2.6, 3.1), (5.0, 5.3), (6.3, 6.6), (8.5, 8.9)):
            ax.annotate("", (x1, y + 0.5), (x0, y + 0.5), arrowprops=dict(arrowstyle="->", color="#444444"))
    mid = top / 2 - 0.5
    _cell(ax, 0.0, mid, left, PALETTE[7], w=1.8)
    _cell(ax, 2.1, mid, "f", PALETTE[3], w=0.5)
    _cell(ax, 8.9, mid, "g", PALETTE[3], w=0.5)
    _cell(ax, 9.7, mid, right, PALETTE[7], w=1.8)
    for x0, x1 in ((1.8, 2.1), (9.4, 9.7)):
        ax.annotate("", (x1, mid + 0.5), (x0, mid + 0.5), arrowprops=dict(arrowstyle="->", color="#444444"))
    for x, fwd, bwd in ((2.35, f_fwd, f_bwd), (9.15, g_fwd, g_bwd)):
        ax.text(x, low - 0.15, f"forward: {fwd}\nbackward: {bwd}", ha="center", va="top", fontsize=9)
    ax.set_xlim(-0.1, 11.6)
    ax.set_ylim(low - 1.1, top + 0.1)
    ax.set_title("sequence parallelism: f and g move the sequence" if sequence else
                 "tensor parallelism, the MLP: one all-reduce forward (g), one backward (f)")
    ax.axis("off")
    return ax


def activation_memory(rows: list[dict], ax=None, unit: float = 2**20, unit_name: str = "MiB"):
    """One block's saved activations per rank, measured (bars) and the formula's (marks), for each TP size with
    and without SP: lab09's memory rows."""
    if ax is None:
        _, ax = plt.subplots(figsize=(COLUMN_IN * 0.8, 3.0))
    labels = [f"TP {r['tp']}" + (" + SP" if r["sequence_parallel"] else "") for r in rows]
    measured = [max(r["measured_per_rank"]) / unit for r in rows]
    formula = [r["formula"]["total"] / unit for r in rows]
    xs = range(len(rows))
    ax.bar(xs, measured, color=[PALETTE[1] if r["sequence_parallel"] else PALETTE[0] for r in rows],
           label="measured (saved-tensor hooks)")
    ax.plot(xs, formula, "k_", markersize=22, mew=2, label="formula")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel(f"{unit_name} per rank, one block")
    ax.spines[["top", "right"]].set_visible(False)
    legend_below(ax)
    return ax
