"""The metrics boundary: what a training or rollout process reports, and where it goes.

``MetricsSink`` is the one interface the RL loop sees. MLflow is one implementation
(``fp8rl.tracking.mlflow_sink``); ``MemorySink`` records in memory for tests and for runs
with tracking off; ``NullSink`` drops everything.

Every sink stores parameters the way MLflow does, so a fake and the real thing agree:
nested mappings are flattened with dots (``{"optim": {"lr": 1e-5}}`` -> ``optim.lr``),
values become strings, and a value longer than ``MAX_PARAM_VALUE_LENGTH`` (MLflow's
limit, ``mlflow.utils.validation.MAX_PARAM_VAL_LENGTH``) is cut to fit with a marker.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Protocol, Self, runtime_checkable

RunStatus = Literal["FINISHED", "FAILED", "KILLED"]

MAX_PARAM_VALUE_LENGTH = 6000
_TRUNCATED = "...[truncated]"

_log = logging.getLogger(__name__)


@runtime_checkable
class MetricsSink(Protocol):
    """Where a run's parameters, per-step metrics, artifacts and tags go."""

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Record parameters once per run; nested mappings are flattened with dots."""
        ...

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Record scalar metrics at ``step`` (the optimizer step of the policy)."""
        ...

    def log_artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        """Attach a file (or a directory's contents) under ``artifact_path`` in the run."""
        ...

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set searchable labels; unlike parameters they may be overwritten."""
        ...

    def history(self, metric: str) -> list[tuple[int, float]]:
        """``[(step, value), ...]`` the sink holds for ``metric`` (a resumed run reads back what it logged)."""
        ...

    def close(self, status: RunStatus = "FINISHED") -> None:
        """End the run with ``status``; further calls are no-ops."""
        ...


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Flatten nested mappings to ``{"a.b": "value"}`` with values as MLflow stores them.

    Raises ``ValueError`` when two paths flatten to the same key (``{"a.b": 1, "a": {"b": 2}}``).
    """
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        items = flatten_params(value, f"{name}.") if isinstance(value, Mapping) else {name: param_value(value)}
        for k, v in items.items():
            if k in flat:
                raise ValueError(f"parameter {k!r} appears twice after flattening")
            flat[k] = v
    return flat


def param_value(value: Any) -> str:
    """``str(value)``, cut to ``MAX_PARAM_VALUE_LENGTH`` with a visible marker when longer."""
    text = str(value)
    if len(text) <= MAX_PARAM_VALUE_LENGTH:
        return text
    return text[: MAX_PARAM_VALUE_LENGTH - len(_TRUNCATED)] + _TRUNCATED


def exit_status(exc_type: type[BaseException] | None) -> RunStatus:
    """The run status for leaving a ``with`` block: an interrupt is KILLED, any other error FAILED."""
    if exc_type is None:
        return "FINISHED"
    return "KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED"


class ClosesOnExit:
    """``with sink:`` closes the run FINISHED, or FAILED/KILLED when the body raises.

    The body's exception always propagates; if closing fails while handling it, that
    failure is logged rather than raised so it does not hide the original error.
    """

    def close(self, status: RunStatus = "FINISHED") -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        status = exit_status(exc_type)
        if exc_type is None:
            self.close(status)
            return
        try:
            self.close(status)
        except Exception:
            _log.exception("could not mark the run %s", status)


@dataclass
class MemorySink(ClosesOnExit):
    """Records everything in memory, with MLflow's rules for parameters (set once, flattened)."""

    params: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    artifacts: list[tuple[Path, str | None]] = field(default_factory=list)
    tags: dict[str, str] = field(default_factory=dict)
    status: RunStatus | None = None  # None while the run is open

    def log_params(self, params: Mapping[str, Any]) -> None:
        for key, value in flatten_params(params).items():
            if self.params.get(key, value) != value:
                raise ValueError(f"parameter {key!r} is already {self.params[key]!r}; parameters are set once")
            self.params[key] = value

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.metrics.setdefault(key, []).append((step, float(value)))

    def log_artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        self.artifacts.append((Path(path), artifact_path))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        self.tags.update({k: str(v) for k, v in tags.items()})

    def close(self, status: RunStatus = "FINISHED") -> None:
        if self.status is None:
            self.status = status

    def history(self, metric: str) -> list[tuple[int, float]]:
        """``[(step, value), ...]`` in logging order; empty if never logged."""
        return list(self.metrics.get(metric, []))


class NullSink(ClosesOnExit):
    """Accepts everything and keeps nothing."""

    def log_params(self, params: Mapping[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        pass

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        pass

    def history(self, metric: str) -> list[tuple[int, float]]:
        return []

    def close(self, status: RunStatus = "FINISHED") -> None:
        pass
