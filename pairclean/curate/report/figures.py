"""The report's figures: matplotlib SVGs (embedded as data URIs), in the page's colours."""

from __future__ import annotations

import base64
import io
import math
import os

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from pairclean.core.mixture import FittedMixture
from pairclean.scorefile.rules import RuleRecord

CLEAN, NOISY, NEUTRAL, INK, MUTED = "#1b9e77", "#d95f02", "#5b6c8f", "#1f2430", "#6b7280"
BETA_COLOUR, GMM_COLOUR = "#7570b3", "#e7298a"
RULE_COLOURS = (BETA_COLOUR, GMM_COLOUR, "#66a61e", "#e6ab02", "#a6761d")  # per rule, in the file's rule order


def _svg_uri(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="svg", metadata={"Date": None})
    return "data:image/svg+xml;base64," + base64.b64encode(buf.getvalue()).decode()


def _style(ax) -> None:
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    for side in ("left", "bottom"):
        ax.spines[side].set_color("#c8ccd4")
    ax.tick_params(colors=MUTED, labelsize=9)
    ax.grid(axis="y", color="#eceef2", linewidth=0.8)
    ax.set_axisbelow(True)


def gmm_boundaries(mixture: FittedMixture, lo: float, hi: float) -> list[float]:
    """Similarities where p_clean crosses 0.5 inside [lo, hi] (two when the variances differ a lot)."""
    grid = np.linspace(lo, hi, 4001)
    d = mixture.p_clean(grid) - 0.5
    idx = np.nonzero(np.sign(d[:-1]) * np.sign(d[1:]) < 0)[0]
    return [float(grid[i] - d[i] * (grid[i + 1] - grid[i]) / (d[i + 1] - d[i])) for i in idx]


def similarity_figure(edges: np.ndarray, counts: dict, beta: float | None, mixture: FittedMixture | None,
                      n_scored: int) -> str:
    """Histogram of cosine similarity with the beta and GMM boundaries (clean/noisy split with truth)."""
    fig = Figure(figsize=(11, 4.2), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    _style(ax)
    lo, hi = float(edges[0]), float(edges[-1])
    if "all" in counts:
        ax.stairs(counts["all"], edges, fill=True, color=NEUTRAL, alpha=0.55, label=f"pairs ({n_scored:,})")
        ax.stairs(counts["all"], edges, color=NEUTRAL, linewidth=1.0)
    else:
        for name, colour in (("clean", CLEAN), ("noisy", NOISY), ("unlabelled", "#9ca3af")):
            if name in counts:
                ax.stairs(counts[name], edges, fill=True, color=colour, alpha=0.45,
                          label=f"truly {name} ({int(counts[name].sum()):,})" if name != "unlabelled"
                          else f"unlabelled ({int(counts[name].sum()):,})")
                ax.stairs(counts[name], edges, color=colour, linewidth=1.2)
    if mixture is not None:
        x = np.linspace(lo, hi, 400)
        width = (hi - lo) / (len(edges) - 1)
        for k in range(len(mixture.means)):
            pdf = (mixture.weights[k] * np.exp(-0.5 * (x - mixture.means[k]) ** 2 / mixture.variances[k])
                   / math.sqrt(2 * math.pi * mixture.variances[k]))
            clean = k == mixture.clean_component
            ax.plot(x, pdf * n_scored * width, color=CLEAN if clean else NOISY, linewidth=1.4,
                    linestyle="-" if clean else "--",
                    label=f"GMM {'clean' if clean else 'noisy'} component (μ={mixture.means[k]:.3f})")
        for j, b in enumerate(gmm_boundaries(mixture, lo, hi)):
            ax.axvline(b, color=GMM_COLOUR, linestyle=":", linewidth=2,
                       label=f"GMM boundary p_clean = 0.5 (s = {b:.3f})" if j == 0 else None)
    if beta is not None and lo <= beta <= hi:
        ax.axvline(beta, color=BETA_COLOUR, linestyle="--", linewidth=2,
                   label=f"β = {beta:.3f}: OSA boundary (s − β ≤ 0 is noisy)")
    elif beta is not None:
        ax.annotate(f"β = {beta:.3f} (outside the plotted range)", xy=(0.01, 0.95), xycoords="axes fraction",
                    color=BETA_COLOUR, fontsize=9, va="top")
    ax.set_xlim(lo, hi)
    ax.set_xlabel("cosine similarity s", color=INK)
    ax.set_ylabel("pairs", color=INK)
    fig.legend(frameon=False, fontsize=9, loc="outside right upper")
    return _svg_uri(fig)


def shard_figure(shards: list[dict], truth: bool, rules: list[RuleRecord]) -> str:
    """Share of pairs flagged per shard and rule (in shard order), to spot a bad source at a glance."""
    n = len(shards)
    fig = Figure(figsize=(11, 2.9), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    _style(ax)
    x = np.arange(n)
    width = 0.8 / max(len(rules), 1)
    for i, rule in enumerate(rules):
        share = np.array([s["share"][rule.name] if s["share"][rule.name] is not None else np.nan for s in shards],
                         float)
        colour, label = RULE_COLOURS[i % len(RULE_COLOURS)], f"flagged by {rule.label} rule"
        if n <= 80:
            ax.bar(x + (i - (len(rules) - 1) / 2) * width, share, width=width, color=colour, alpha=0.8, label=label)
        else:
            ax.plot(x, share, color=colour, linewidth=1, label=label)
    if truth:
        true = np.array([s["share_true"] if s["share_true"] is not None else np.nan for s in shards], float)
        ax.plot(x, true, color=INK, marker="o" if n <= 80 else None, markersize=4, linewidth=1.2,
                label="truly noisy")
    ax.set_ylim(0, 1)
    ax.yaxis.set_major_formatter(lambda v, _pos: f"{v:.0%}")
    ax.set_xlabel(f"shard (in order, {n:,} shards)", color=INK)
    ax.set_ylabel("share of pairs", color=INK)
    if n <= 12:
        # Shard names are user text: `$...$` in one is a file name, not mathtext to typeset.
        ax.set_xticks(x, [os.path.basename(s["shard"]) for s in shards], fontsize=8, parse_math=False)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.legend(frameon=False, fontsize=9, loc="outside right upper")
    return _svg_uri(fig)
