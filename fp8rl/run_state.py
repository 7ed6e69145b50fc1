"""Checkpoints of a running RL loop, so a killed worker or driver resumes with no lost or repeated step.

A checkpoint is a directory ``step-NNNNNN/`` under the run's checkpoint directory, holding
``state.pt``: the trainer state (fp32 masters, AdamW moments, schedule position), the
loop's RNG states (prompt sampling and torch), the evaluation results and every step's
metrics so far.  It is written to a temporary directory and renamed, then ``LATEST`` is
replaced atomically, so a reader sees the previous checkpoint or the new one, never half
of one; the file and the directories are fsynced before each rename, so a power loss or a
node's crash leaves the same.  The ``keep`` newest checkpoints are kept (``checkpoint_keep``,
``KEEP`` by default), and what a killed write left (its temporary directory) is removed by the
next write.  A newest checkpoint that cannot be read (a corrupt or truncated file) is reported
and the one before it loaded: ``keep`` of 2 or more is what makes that possible.

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
import sys
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
    _remove_unfinished(root)
    target = _step_dir(root, state.step)
    try:
        with atomic_directory(target, overwrite=True) as tmp:
            torch.save(state.__dict__, Path(tmp) / "state.pt")
            _fsync(Path(tmp) / "state.pt")
            _fsync(Path(tmp))
    except (RuntimeError, OSError) as e:  # torch reports a full disk as "[enforce fail ...] unexpected pos N vs M"
        raise CheckpointWriteError(
            f"{target}: writing the checkpoint failed ({str(e).strip()}); {_size(shutil.disk_usage(root).free)} free "
            f"on its disk ({root}): free space, or checkpoint less often (checkpoint_every)"
        ) from e
    _fsync(root)  # the rename is on disk before LATEST names the new directory
    atomic_write_text(root / LATEST, target.name + "\n")
    _fsync(root)
    for old in sorted(root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def _fsync(path: Path) -> None:
    """Flush ``path`` (a file or a directory: its entries) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _remove_unfinished(root: Path) -> None:
    """The temporary directories of writes that were killed (``atomic_directory`` names them ``.step-*``): one
    writer owns a checkpoint directory, so none of them is being written now."""
    for stale in root.glob(".step-*"):
        shutil.rmtree(stale, ignore_errors=True)


class CheckpointReadError(UserError):
    """No checkpoint of a run could be read."""


def load_latest(root: str | os.PathLike[str]) -> LoopState | None:
    """The newest checkpoint under ``root`` that reads back, or None when there is none.  ``LATEST`` names the
    newest; where it cannot be read, the kept ones before it are tried, newest first, each failure reported."""
    root = Path(root)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    latest = pointer.read_text().strip()
    older = sorted((p.name for p in root.glob("step-*") if p.name < latest), reverse=True)
    failures = []
    for name in [latest, *older]:
        path = root / name / "state.pt"
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
            state = LoopState(**data)
        except Exception as e:  # a corrupt, truncated or missing file: the next older checkpoint may be whole
            failures.append(f"{path}: {type(e).__name__}: {str(e).strip()[:300]}")
            print(f"checkpoint {failures[-1]}; trying an older one", file=sys.stderr)
            continue
        if failures:
            print(f"resuming from {root / name}, older than {latest}", file=sys.stderr)
        return state
    raise CheckpointReadError(f"{root}: no checkpoint can be read: " + "; ".join(failures))


def restore_python_rng(rng: random.Random, state: Any) -> None:
    # torch.load gives the nested tuples back as lists
    version, internal, gauss = state
    rng.setstate((version, tuple(internal), gauss))


class MetricsBuffer:
    """Holds step metrics until the checkpoint covering them is saved, then logs them in step order; drops those
    of the steps in ``held``."""

    def __init__(self, sink: MetricsSink, buffered: bool) -> None:
        self.sink = sink
        self.buffered = buffered
        self.pending: list[tuple[int, Mapping[str, float]]] = []
        # steps the sink already holds from before a resume (from a checkpoint older than the newest, whose
        # steps were logged): computed again, not logged twice
        self.held: set[int] = set()

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if step in self.held:
            return
        if self.buffered:
            self.pending.append((step, metrics))
        else:
            self.sink.log_metrics(metrics, step=step)

    def flush(self) -> None:
        for step, metrics in self.pending:
            self.sink.log_metrics(metrics, step=step)
        self.pending.clear()
