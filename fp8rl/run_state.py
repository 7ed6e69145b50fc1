"""Checkpoints of a running RL loop, so a killed worker or driver resumes with no lost or repeated step.

A checkpoint is a directory ``step-NNNNNN/`` under the run's checkpoint directory, holding
``state.pt``: the trainer state (fp32 masters, AdamW moments, schedule position), the
loop's RNG states (prompt sampling and torch), the evaluation results and every step's
metrics so far.  It is written to a temporary directory and renamed, then ``LATEST`` is
replaced atomically, so a reader sees the previous checkpoint or the new one, never half
of one.  The ``keep`` newest checkpoints are kept (``checkpoint_keep``, ``KEEP`` by default).

Metrics reach the tracking sink only after the checkpoint that covers their step is
saved (``MetricsBuffer``): a step that ran after the last checkpoint and was lost with a
worker is computed again on resume, and logged once.  A kill between saving a checkpoint
and flushing its metrics is repaired on resume: the loop reads back which steps the sink
holds and logs the checkpointed ones it lacks (``fp8rl.loop``).
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fp8rl.atomic import atomic_directory, atomic_write_text
from fp8rl.config.run import RunConfig
from fp8rl.errors import UserError
from fp8rl.tracking import MetricsSink

LATEST = "LATEST"
KEEP: int = RunConfig.model_fields["checkpoint_keep"].default  # one default: the run config's


@dataclass
class LoopState:
    """Where the loop stands after ``step`` completed steps."""

    step: int
    trainer: dict[str, Any]
    python_rng: Any
    torch_rng: torch.Tensor
    initial: dict[str, float]
    final: dict[str, float]
    history: list[dict[str, float]] = field(default_factory=list)


class CheckpointWriteError(UserError):
    """A loop checkpoint could not be written (most often: its disk is full)."""


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def save_loop_state(root: str | os.PathLike[str], state: LoopState, keep: int = KEEP) -> Path:
    """Write ``state`` as checkpoint ``step-NNNNNN`` and point ``LATEST`` at it; keep the ``keep`` newest."""
    if keep < 1:
        raise ValueError(f"keep: at least the newest checkpoint is kept, got {keep}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    target = _step_dir(root, state.step)
    try:
        with atomic_directory(target, overwrite=True) as tmp:
            torch.save(state.__dict__, Path(tmp) / "state.pt")
    except (RuntimeError, OSError) as e:  # torch reports a full disk as "[enforce fail ...] unexpected pos N vs M"
        free_gib = shutil.disk_usage(root).free / 2**30
        raise CheckpointWriteError(
            f"{target}: writing the checkpoint failed ({str(e).strip()}); {free_gib:.1f} GiB free on its disk: "
            "free space, or checkpoint less often (checkpoint_every)"
        ) from e
    atomic_write_text(root / LATEST, target.name + "\n")
    for old in sorted(root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def load_latest(root: str | os.PathLike[str]) -> LoopState | None:
    """The newest complete checkpoint under ``root``, or None when there is none."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    path = Path(root) / pointer.read_text().strip() / "state.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{pointer} names {path.parent.name}, which has no state.pt")
    data = torch.load(path, map_location="cpu", weights_only=True)
    return LoopState(**data)


def restore_python_rng(rng: random.Random, state: Any) -> None:
    # torch.load gives the nested tuples back as lists
    version, internal, gauss = state
    rng.setstate((version, tuple(internal), gauss))


class MetricsBuffer:
    """Holds step metrics until the checkpoint covering them is saved, then logs them in step order."""

    def __init__(self, sink: MetricsSink, buffered: bool) -> None:
        self.sink = sink
        self.buffered = buffered
        self.pending: list[tuple[int, Mapping[str, float]]] = []

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self.buffered:
            self.pending.append((step, metrics))
        else:
            self.sink.log_metrics(metrics, step=step)

    def flush(self) -> None:
        for step, metrics in self.pending:
            self.sink.log_metrics(metrics, step=step)
        self.pending.clear()
