"""A retried RL step meets the RayJob of its earlier attempt: adopt it or replace it, never fail on the name.

The RayJob's name is a hash of (KFP run, recipe, seed) (``fp8rl.kube.rl_step.rayjob_name``), so a KFP retry of the
step asks for the same name.  An attempt that ended cleanly deleted its RayJob; one whose pod was killed outright
(SIGKILL: node loss, an OOM kill) left it, and until the garbage collector follows the dead pod's ownerReference
the create answers ``409 already exists``.  Then, if the existing RayJob is this step's (same ``fp8rl/kfp-run-id``
label, same entrypoint: the same staged run):

- still going or succeeded: *adopt* it: its ownerReference becomes the new pod (deleted with it, not with the dead
  one) and the step watches it as if it had created it; no second driver is started;
- failed or stopped: *replace* it: delete it, wait until it is gone, create it anew.  The new driver resumes from
  the run's last checkpoint on the shared volume into the same MLflow run (``fp8rl.loop``).

Any other RayJob of that name is not ours: the step fails naming it, and leaves it alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kubernetes.client.exceptions import ApiException

from fp8rl.kube.errors import RayJobFailed
from fp8rl.kube.rayjob import KFP_RUN_LABEL

GROUP, VERSION, PLURAL = "ray.io", "v1", "rayjobs"
# KubeRay's jobDeploymentStatus / jobStatus values after which no driver runs (Suspended: stopped by a user)
DEAD_DEPLOYMENT = frozenset({"Failed", "ValidationFailed", "Suspended"})
DEAD_JOB = frozenset({"FAILED", "STOPPED"})
DELETE_WAIT_S = 300.0


def same_attempt(existing: Mapping[str, Any], doc: Mapping[str, Any]) -> bool:
    """Whether ``existing`` is an earlier attempt of the step that built ``doc``: same KFP run label, same
    entrypoint (a RayJob without the label, made outside a KFP run, is never taken for one)."""
    run = (doc["metadata"].get("labels") or {}).get(KFP_RUN_LABEL)
    theirs = (existing.get("metadata", {}).get("labels") or {}).get(KFP_RUN_LABEL)
    return bool(run) and run == theirs and existing.get("spec", {}).get("entrypoint") == doc["spec"]["entrypoint"]


def is_dead(existing: Mapping[str, Any]) -> bool:
    status = existing.get("status") or {}
    return status.get("jobDeploymentStatus") in DEAD_DEPLOYMENT or status.get("jobStatus") in DEAD_JOB


def reclaim(
    api: Any,
    doc: Mapping[str, Any],
    request_timeout_s: float,
    log_sink: Callable[[str], None],
    clock: Callable[[], float],
    sleep: Callable[[float], None],
) -> bool:
    """After a ``409`` on creating ``doc``: adopt the earlier attempt's RayJob of that name (True), or replace it
    by ``doc`` (False) (module docstring); ``RayJobFailed`` when it is not one."""
    name, namespace = doc["metadata"]["name"], doc["metadata"].get("namespace", "default")
    try:
        existing = api.custom.get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name, _request_timeout=request_timeout_s
        )
    except ApiException as e:
        if e.status != 404:
            raise
        existing = None  # the garbage collector took it since the 409 (its dead pod was deleted)
    if existing is None:
        _create(api, doc, request_timeout_s)
        return False
    if not same_attempt(existing, doc):
        raise RayJobFailed(
            name, f"a RayJob named {name} already exists in namespace {namespace} and is not an earlier attempt of "
            f"this step (another KFP run or entrypoint): delete it (kubectl delete rayjob {name} -n {namespace})",
        )  # fmt: skip
    status = existing.get("status") or {}
    state = f"{status.get('jobDeploymentStatus') or 'New'}/{status.get('jobStatus') or '-'}"
    if not is_dead(existing):
        owners = doc["metadata"].get("ownerReferences")
        if owners:
            patch = {"metadata": {"ownerReferences": [dict(o) for o in owners]}}
            api.custom.patch_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, patch, _request_timeout=request_timeout_s
            )
        log_sink(f"[rayjob {name}] an earlier attempt's RayJob is {state}: adopted (no second driver)")
        return True  # the caller watches it as its own
    log_sink(f"[rayjob {name}] an earlier attempt's RayJob is {state}: deleting it and starting again")
    api.custom.delete_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, name, propagation_policy="Foreground", _request_timeout=request_timeout_s
    )
    _wait_gone(api, name, namespace, request_timeout_s, clock, sleep)
    _create(api, doc, request_timeout_s)
    return False


def _create(api: Any, doc: Mapping[str, Any], request_timeout_s: float) -> None:
    namespace = doc["metadata"].get("namespace", "default")
    api.custom.create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, dict(doc), field_validation="Strict", _request_timeout=request_timeout_s
    )


def _wait_gone(
    api: Any,
    name: str,
    namespace: str,
    request_timeout_s: float,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
) -> None:
    """Until the deleted RayJob (and, with Foreground deletion, its RayCluster first) no longer exists."""
    deadline = clock() + DELETE_WAIT_S
    while clock() < deadline:
        try:
            api.custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, _request_timeout=request_timeout_s
            )
        except ApiException as e:
            if e.status == 404:
                return
            raise
        sleep(2.0)
    raise RayJobFailed(
        name, f"the earlier attempt's RayJob {name} was not gone {DELETE_WAIT_S:.0f} s after its deletion"
    )
