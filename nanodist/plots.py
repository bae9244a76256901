"""The course's figures, drawn from what the labs measured. Each function returns the matplotlib Axes."""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch

PALETTE = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]


def rank_layout(reports: list[dict], ax=None, title: str | None = None):
    """Nodes as boxes holding their ranks, from the per-rank reports of lab01 (rank, local_rank, node_rank)."""
    nodes = sorted({r["node_rank"] for r in reports})
    per_node = max(sum(1 for r in reports if r["node_rank"] == n) for n in nodes)
    if ax is None:
        _, ax = plt.subplots(figsize=(2.2 + 1.7 * per_node, 1.0 + 1.5 * len(nodes)))
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
                    color="white", fontsize=8)
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
        _, ax = plt.subplots(figsize=(1.5 + 1.2 * len(labels), 3.2))
    bars_ = ax.bar(labels, values, color=PALETTE[: len(labels)])
    for b, v in zip(bars_, values):
        ax.annotate(fmt.format(v), (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                    fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.spines[["top", "right"]].set_visible(False)
    return ax


def ddp_timeline(timeline: list[dict], step: int = -1, ax=None):
    """One training step of nanodist.DDP: when each bucket's all-reduce was launched and finished,
    against the backward pass (from DDP(record_timeline=True).timeline; times from the first ready gradient)."""
    n_buckets = 1 + max(t["bucket"] for t in timeline)
    steps = [timeline[i:i + n_buckets] for i in range(0, len(timeline), n_buckets)]
    rows = steps[step]
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 1.2 + 0.45 * (n_buckets + 1)))
    ms = 1e3
    end = rows[0]["backward_end_s"] * ms
    ax.barh(n_buckets, end, left=0, color="#BBBBBB", height=0.6)
    ax.text(end / 2, n_buckets, "backward (gradients being computed)", ha="center", va="center", fontsize=8)
    for t in rows:
        b = t["bucket"]
        ax.barh(n_buckets - 1 - b, (t["done_s"] - t["launch_s"]) * ms, left=t["launch_s"] * ms,
                color=PALETTE[b % len(PALETTE)], height=0.6)
    ax.set_yticks(range(n_buckets + 1),
                  [f"bucket {n_buckets - 1 - i}" for i in range(n_buckets)] + ["compute"])
    ax.axvline(end, color="#555555", lw=1, ls="--")
    ax.set_xlabel("ms since the first gradient was ready")
    ax.set_title("all-reduce of each gradient bucket, overlapping the backward pass")
    ax.spines[["top", "right"]].set_visible(False)
    return ax


def scaling(measured: dict, predicted: dict | None = None, max_ranks: int = 8, axes=None):
    """Speedup and efficiency against the number of ranks.

    measured: {label: [(ranks, speedup), ...]} points from lab runs; predicted: {label: callable(ranks) ->
    speedup} curves (e.g. a cost-model prediction). The ideal (speedup = ranks) is drawn for reference.
    """
    import numpy as np
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    ax_s, ax_e = axes
    n = np.arange(1, max_ranks + 1)
    ax_s.plot(n, n, color="#999999", ls=":", label="ideal")
    ax_e.plot(n, np.ones_like(n, dtype=float), color="#999999", ls=":", label="ideal")
    for i, (label, fn) in enumerate((predicted or {}).items()):
        s = np.array([fn(k) for k in n])
        ax_s.plot(n, s, color=PALETTE[i % len(PALETTE)], lw=1.2, ls="--", label=label)
        ax_e.plot(n, s / n, color=PALETTE[i % len(PALETTE)], lw=1.2, ls="--", label=label)
    for i, (label, pts) in enumerate(measured.items()):
        ks, ss = zip(*sorted(pts))
        color = PALETTE[(i + len(predicted or {})) % len(PALETTE)]
        ax_s.plot(ks, ss, "o-", color=color, label=label)
        ax_e.plot(ks, [s / k for s, k in zip(ss, ks)], "o-", color=color, label=label)
    ax_s.set(xlabel="ranks", ylabel="speedup", title="speedup")
    ax_e.set(xlabel="ranks", ylabel="efficiency = speedup / ranks", title="efficiency", ylim=(0, 1.1))
    for ax in axes:
        ax.spines[["top", "right"]].set_visible(False)
    ax_e.legend(fontsize=8, loc="lower left")
    return axes
