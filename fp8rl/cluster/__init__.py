"""The RL step on Ray, and on Kubernetes through KubeRay.

- Ray: ``driver`` (``run_rl_on_ray``: placement, layouts, sync, faults) over the actors in ``workers``.
- Kubernetes: ``rayjob`` (typed RayJob templates and builders), ``submit`` (Kubernetes API),
  ``ray_jobs`` (Ray Job Submission API), ``diagnose``, ``errors``.

Names are loaded on first use, so importing one part (the Ray driver on a GPU node, say) does
not import the client libraries of the others (kubernetes, ray).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "RayJobFailed": "errors",
    "RayJobTimeout": "errors",
    "RayClusterJobResult": "ray_jobs",
    "submit_to_ray_cluster": "ray_jobs",
    "RayJobTemplate": "rayjob",
    "build_rayjob": "rayjob",
    "build_rayjob_for_cluster": "rayjob",
    "load_template": "rayjob",
    "parse_template": "rayjob",
    "KubeApis": "submit",
    "RayJobResult": "submit",
    "submit_rayjob": "submit",
    "run_rl_on_ray": "driver",
    "WorkerDied": "driver",
    "WorkerError": "driver",
    "WorkerTimeout": "driver",
}

__all__ = [
    "KubeApis",
    "RayClusterJobResult",
    "RayJobFailed",
    "RayJobResult",
    "RayJobTemplate",
    "RayJobTimeout",
    "WorkerDied",
    "WorkerError",
    "WorkerTimeout",
    "build_rayjob",
    "build_rayjob_for_cluster",
    "load_template",
    "parse_template",
    "run_rl_on_ray",
    "submit_rayjob",
    "submit_to_ray_cluster",
]

if TYPE_CHECKING:
    from fp8rl.cluster.driver import WorkerDied, WorkerError, WorkerTimeout, run_rl_on_ray
    from fp8rl.cluster.errors import RayJobFailed, RayJobTimeout
    from fp8rl.cluster.ray_jobs import RayClusterJobResult, submit_to_ray_cluster
    from fp8rl.cluster.rayjob import (
        RayJobTemplate,
        build_rayjob,
        build_rayjob_for_cluster,
        load_template,
        parse_template,
    )
    from fp8rl.cluster.submit import KubeApis, RayJobResult, submit_rayjob


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
