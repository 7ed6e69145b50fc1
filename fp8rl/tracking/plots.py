"""Metric-over-steps plots comparing recipes (reward, accuracy, token_mult_prob_error)."""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from fp8rl.atomic import atomic_write_bytes


def plot_metric_history(
    histories: Mapping[str, Sequence[tuple[int, float]]], metric: str, path: str | os.PathLike[str]
) -> Path:
    """Draw ``metric`` against step, one line per run (keyed by recipe), into the PNG ``path``.

    ``histories`` maps a label to ``[(step, value), ...]`` (any order; NaN breaks the line).
    Uses matplotlib's Agg canvas on a ``Figure`` of its own (no pyplot global state), and
    writes through a temporary file and a rename, so a reader never sees half a PNG.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not histories:
        raise ValueError(f"no runs to plot for {metric!r}")
    fig = Figure(figsize=(7, 4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for label, points in histories.items():
        steps, values = zip(*sorted(points), strict=True) if points else ((), ())
        ax.plot(steps, values, marker="." if len(steps) < 50 else None, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(metric)
    ax.grid(True, alpha=0.3)
    ax.legend()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    path = Path(path)
    atomic_write_bytes(path, buf.getvalue())
    return path
