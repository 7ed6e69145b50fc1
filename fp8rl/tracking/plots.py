"""Plots comparing recipes: metrics over steps (reward, accuracy, token_mult_prob_error) and the RL step
benchmark's time breakdown and speedups.

Each draws on a matplotlib ``Figure`` of its own with the Agg canvas (no pyplot global state) and writes
through a temporary file and a rename, so a reader never sees half a PNG."""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from fp8rl.atomic import atomic_write_bytes

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _figure(width: float, height: float) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _write_png(fig: Figure, path: str | os.PathLike[str]) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write_bytes(path, buf.getvalue())
    return Path(path)


def plot_metric_history(
    histories: Mapping[str, Sequence[tuple[int, float]]], metric: str, path: str | os.PathLike[str]
) -> Path:
    """Draw ``metric`` against step, one line per run (keyed by recipe), into the PNG ``path``.

    ``histories`` maps a label to ``[(step, value), ...]`` (any order; NaN breaks the line).
    """
    if not histories:
        raise ValueError(f"no runs to plot for {metric!r}")
    fig = _figure(7, 4)
    ax = fig.add_subplot()
    for label, points in histories.items():
        steps, values = zip(*sorted(points), strict=True) if points else ((), ())
        ax.plot(steps, values, marker="." if len(steps) < 50 else None, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(metric)
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _write_png(fig, path)


def plot_step_breakdown(
    breakdown: Mapping[str, Mapping[str, float]],
    speedups: Mapping[str, Mapping[str, float]],
    path: str | os.PathLike[str],
    title: str = "",
) -> Path:
    """The RL step benchmark as one PNG: per recipe, a stacked bar of its step's seconds by phase
    (``breakdown[recipe][phase]``, in the order given) and, beside it, grouped bars of its speedups over bf16
    (``speedups[recipe][what]``, a dashed line at 1.0; left empty without a bf16 baseline)."""
    if not breakdown:
        raise ValueError("no recipes to plot")
    recipes = list(breakdown)
    fig = _figure(11, 4.2)
    ax, ax_up = fig.subplots(1, 2, width_ratios=(3, 2))
    bottoms = [0.0] * len(recipes)
    for phase in next(iter(breakdown.values())):
        values = [breakdown[r].get(phase, 0.0) for r in recipes]
        ax.bar(recipes, values, bottom=bottoms, label=phase)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    ax.set_ylabel("seconds per RL step")
    ax.set_title("step time by phase")
    ax.legend(fontsize="small")
    ax.grid(True, axis="y", alpha=0.3)
    kinds = sorted({k for up in speedups.values() for k in up})
    width = 0.8 / max(len(kinds), 1)
    for i, kind in enumerate(kinds):
        xs = [j + (i - (len(kinds) - 1) / 2) * width for j in range(len(recipes))]
        ax_up.bar(xs, [speedups.get(r, {}).get(kind, 0.0) for r in recipes], width, label=kind)
    ax_up.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ax_up.set_xticks(range(len(recipes)), recipes)
    ax_up.set_ylabel("x bf16 (higher is faster)")
    ax_up.set_title("speedup vs bf16, same run")
    tallest = max((v for up in speedups.values() for v in up.values() if v == v), default=1.0)
    ax_up.set_ylim(0, max(1.0, tallest) * 1.2)  # room for the legend above the bars
    if kinds:
        ax_up.legend(fontsize="small", loc="upper center", ncols=len(kinds))
    ax_up.grid(True, axis="y", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize="medium")
    return _write_png(fig, path)
