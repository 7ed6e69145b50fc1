"""The RL step on Ray: ``driver`` (``run_rl_on_ray``, ``RayParts``: layouts, weight sync, resume after a fault)
over ``placement`` (the placement group and the actors started in it), ``groups`` (the actors seen from the
driver: bounded calls, the rollout and trainer groups, how an actor fails) and the actors in ``workers``.

Running it on Kubernetes (KubeRay RayJobs, the Ray Job Submission API) is ``fp8rl.kube``. Names are
loaded on first use, so importing the package does not import torch or ray.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "run_rl_on_ray": "driver",
    "WorkerDied": "groups",
    "WorkerError": "groups",
    "WorkerTimeout": "groups",
}

__all__ = ["WorkerDied", "WorkerError", "WorkerTimeout", "run_rl_on_ray"]

if TYPE_CHECKING:
    from fp8rl.cluster.driver import run_rl_on_ray
    from fp8rl.cluster.groups import WorkerDied, WorkerError, WorkerTimeout


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
