"""Running the RL step on Kubernetes: KubeRay RayJobs and Ray clusters reached from outside.

- ``rayjob_template``: the typed RayJob template (the chart's ConfigMap); ``rayjob``: the builders of
  ``ray.io/v1`` RayJobs from it.
- ``submit``: create a RayJob through the Kubernetes API and wait for it (``submit_rayjob``).
- ``job_submission``: run on an existing Ray cluster through the Ray Job Submission API (``submit_to_ray_cluster``).
- ``rl_step``: the RL step of one recipe as a RayJob: stage, submit, find its MLflow run, copy the checkpoint back.
- ``job_failure``: why a job failed (pod statuses, events, the driver's traceback); ``errors``: how it fails.

The Ray RL step itself (driver and actors) is ``fp8rl.cluster``. Names are loaded on first use, so
importing one part (the RayJob builders in a chart test, say) does not import the client libraries of
the others (kubernetes, ray).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "RayJobFailed": "errors",
    "RayJobTimeout": "errors",
    "RayClusterJobResult": "job_submission",
    "submit_to_ray_cluster": "job_submission",
    "RayJobTemplate": "rayjob_template",
    "build_rayjob": "rayjob",
    "build_rayjob_for_cluster": "rayjob",
    "load_template": "rayjob_template",
    "parse_template": "rayjob_template",
    "run_rl_step_as_rayjob": "rl_step",
    "KubeApis": "submit",
    "RayJobResult": "submit",
    "submit_rayjob": "submit",
}

__all__ = [
    "KubeApis",
    "RayClusterJobResult",
    "RayJobFailed",
    "RayJobResult",
    "RayJobTemplate",
    "RayJobTimeout",
    "build_rayjob",
    "build_rayjob_for_cluster",
    "load_template",
    "parse_template",
    "run_rl_step_as_rayjob",
    "submit_rayjob",
    "submit_to_ray_cluster",
]

if TYPE_CHECKING:
    from fp8rl.kube.errors import RayJobFailed, RayJobTimeout
    from fp8rl.kube.job_submission import RayClusterJobResult, submit_to_ray_cluster
    from fp8rl.kube.rayjob import build_rayjob, build_rayjob_for_cluster
    from fp8rl.kube.rayjob_template import RayJobTemplate, load_template, parse_template
    from fp8rl.kube.rl_step import run_rl_step_as_rayjob
    from fp8rl.kube.submit import KubeApis, RayJobResult, submit_rayjob


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
