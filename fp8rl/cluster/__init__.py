"""Ray on Kubernetes: RayJob documents for the RL step, and submitting them (or to an existing Ray cluster)."""

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
    "submit_rayjob",
    "submit_to_ray_cluster",
]
