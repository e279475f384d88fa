"""Small matplotlib helpers shared by the run plots and the benchmarks (headless, Agg)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

Series = dict[str, tuple[Sequence[float], Sequence[float]]]


def plot_panels(path: str | Path, title: str, panels: list[tuple[str, Series]], xlabel: str = "step",
                logx: bool = False, logy: bool = False) -> Path:
    """One row of line plots, one panel per `(ylabel, {label: (x, y)})`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.8), squeeze=False)
    for ax, (ylabel, series) in zip(axes[0], panels):
        for label, (xs, ys) in series.items():
            ax.plot(list(xs), list(ys), marker="o", markersize=3, label=label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if logx:
            ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        if len(series) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def ema(values: Sequence[float], alpha: float) -> list[float]:
    """Exponential moving average, seeded with the first value: s_0 = v_0, s_t = alpha v_t + (1 - alpha) s_{t-1}.
    Causal (no look-ahead), so a late jump shows where it happened rather than smeared before it."""
    assert 0.0 < alpha <= 1.0, f"alpha must be in (0, 1], got {alpha}"
    smoothed: list[float] = []
    for v in values:
        smoothed.append(v if not smoothed else alpha * v + (1.0 - alpha) * smoothed[-1])
    return smoothed


def smoothing_alpha(n: int) -> float:
    """The EMA weight for `n` points: a window of about a tenth of the run (2 / (window + 1)); 1 (no smoothing)
    for runs under 20 steps, where a window of one step is all there is."""
    window = max(1, n // 10)
    return 2.0 / (window + 1)


@dataclass(frozen=True)
class Curve:
    """One curve of a panel. `style`: "line"; "smoothed" (the raw values thin, their EMA solid); "markers" (sparse
    points, e.g. held-out evaluations); "stacked" (bars stacked on the panel's earlier stacked series)."""

    label: str
    xs: Sequence[float]  # steps are ints
    ys: Sequence[float]
    style: str = "line"


@dataclass(frozen=True)
class Panel:
    """One cell of `plot_grid`: a title, its curves, and optional y limits and a dashed ceiling line."""

    title: str
    curves: list[Curve]
    ylabel: str = ""
    ceiling: float | None = None
    ymin: float | None = None
    ymax: float | None = None


def _draw_curve(ax, s: Curve, color: str, bottoms: dict[float, float]) -> None:
    alpha = smoothing_alpha(len(s.ys))
    if s.style == "smoothed" and alpha < 1.0:  # a run too short to smooth draws its values as a plain line
        ax.plot(s.xs, s.ys, color=color, linewidth=0.8, alpha=0.35, marker="o", markersize=2)
        ax.plot(s.xs, ema(s.ys, alpha), color=color, linewidth=1.8, label=f"{s.label} (smoothed)")
    elif s.style == "markers":
        ax.plot(s.xs, s.ys, color=color, linestyle="none", marker="o", markersize=5, label=s.label)
    elif s.style == "stacked":
        _draw_stacked(ax, s, color, bottoms)
    else:
        ax.plot(s.xs, s.ys, color=color, linewidth=1.5, marker="o" if len(s.xs) <= 50 else None, markersize=3,
                label=s.label)


def _draw_stacked(ax, s: Curve, color: str, bottoms: dict[float, float]) -> None:
    """Bars while each step can have its own; past 50 steps a (step-wise) area, where bars would leave gaps."""
    below = [bottoms.get(x, 0.0) for x in s.xs]
    top = [b + y for b, y in zip(below, s.ys)]
    if len(s.xs) <= 50:
        ax.bar(s.xs, s.ys, bottom=below, width=0.85, color=color, alpha=0.7, linewidth=0, label=s.label)
    else:
        ax.fill_between(s.xs, below, top, step="mid", color=color, alpha=0.7, linewidth=0, label=s.label)
    bottoms.update(zip(s.xs, top))


def _draw_panel(ax, panel: Panel, xlabel: str) -> None:
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    bottoms: dict[float, float] = {}
    for i, s in enumerate(panel.curves):
        _draw_curve(ax, s, colors[i % len(colors)], bottoms)
    if panel.ceiling is not None:
        ax.axhline(panel.ceiling, color="grey", linestyle="--", linewidth=1, label=f"ceiling {panel.ceiling:g}")
    if panel.ymin is not None or panel.ymax is not None:
        ax.set_ylim(bottom=panel.ymin, top=panel.ymax)
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(panel.ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if len(ax.get_legend_handles_labels()[0]) > 1:
        ax.legend(fontsize=7)


def plot_grid(path: str | Path, title: str, panels: list[Panel], columns: int = 4, xlabel: str = "step") -> Path:
    """The panels in rows of `columns` (the last row's spare cells blank), one shared x meaning (`xlabel`)."""
    assert panels, "plot_grid needs at least one panel"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = min(columns, len(panels))
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 3.6 * rows), squeeze=False)
    cells = list(axes.flat)
    for ax, panel in zip(cells, panels):
        _draw_panel(ax, panel, xlabel)
    for ax in cells[len(panels):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
