"""The RL step on Ray: ``driver`` (``run_rl_on_ray``: placement, layouts, sync, faults) over the actors in
``workers``.

Running it on Kubernetes (KubeRay RayJobs, the Ray Job Submission API) is ``fp8rl.kube``. Names are
loaded on first use, so importing the package does not import torch or ray.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "run_rl_on_ray": "driver",
    "WorkerDied": "driver",
    "WorkerError": "driver",
    "WorkerTimeout": "driver",
}

__all__ = ["WorkerDied", "WorkerError", "WorkerTimeout", "run_rl_on_ray"]

if TYPE_CHECKING:
    from fp8rl.cluster.driver import WorkerDied, WorkerError, WorkerTimeout, run_rl_on_ray


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
