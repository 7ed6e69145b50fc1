"""KubeRay ``RayJob`` documents for the RL step, built as plain data from a typed template.

The chart renders a ConfigMap key ``rayjob.yaml`` with the camelCase fields of
:class:`fp8rl.kube.rayjob_template.RayJobTemplate` (which :func:`~fp8rl.kube.rayjob_template.load_template`
reads, naming the file and field on any error), and the builders turn it into a complete ``ray.io/v1``
``RayJob`` (KubeRay v1.5 schema, ``config/crd/bases/ray.io_rayjobs.yaml``):

- :func:`build_rayjob`: KubeRay creates a RayCluster (one head, one GPU worker
  group) for the job and tears it down after it finishes
  (``shutdownAfterJobFinishes`` + ``ttlSecondsAfterFinished``).
- :func:`build_rayjob_for_cluster`: the job runs on an existing RayCluster picked
  by ``clusterSelector: {ray.io/cluster: <name>}``; nothing is created or deleted
  but the submitter pod.

Both use ``submissionMode: K8sJobMode``: a submitter pod runs ``ray job submit``
and then ``ray job logs --follow``, so its log *is* the driver's log, which is what
:mod:`fp8rl.kube.submit` streams. We supply the submitter pod template
ourselves so that it, too, has resources, a restricted securityContext, our
labels and the Ray token.

Ray token auth (Ray >= 2.52): ``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN`` from a
Secret on every Ray container and on the submitter, and ``rayClusterSpec.authOptions``
naming that same Secret (``secretName``, KubeRay >= 1.6): the operator reads the token from
it to ask the dashboard for the job's status. Without ``authOptions`` the operator's
requests are refused ("Missing authentication token"), it never sees the job end, and
the RayJob fails 30 s after its submitter finished (``JobDeploymentStatusTransitionGracePeriodExceeded``:
found on a real node). With ``secretName`` the operator generates no Secret of its own,
so the token stays the one clients outside the cluster know. KubeRay reads the token
under the key ``auth_token`` only, so that is the key the Secret must use.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from fp8rl.config import ConfigError
from fp8rl.kube.rayjob_template import GPU_RESOURCE, RayJobTemplate, Toleration

API_VERSION = "ray.io/v1"
KIND = "RayJob"
DATA_MOUNT = "/data"
SHM_MOUNT = "/dev/shm"
# the root filesystem is read-only (the chart's containerSecurityContext): Ray's session files, HOME and caches go
# to this emptyDir, as in the chart's RayCluster
TMP_MOUNT = "/tmp"
HEAD_CONTAINER = "ray-head"
WORKER_CONTAINER = "ray-worker"
SUBMITTER_CONTAINER = "ray-job-submitter"
WORKER_GROUP = "gpu"
CLUSTER_SELECTOR_KEY = "ray.io/cluster"  # KubeRay utils.RayJobClusterSelectorKey
# Labels we put on every pod we template, so submit.py can find them (and only them).
RAYJOB_LABEL = "fp8rl/rayjob"
ROLE_LABEL = "fp8rl/role"
# the KFP run a RayJob belongs to (fp8rl.kube.rl_step): how a retried step knows its earlier attempt's RayJob
KFP_RUN_LABEL = "fp8rl/kfp-run-id"
# KubeRay caps RayJob names at 47 characters (MaxRayJobNameLength = 53 - 6) and wants DNS-1035.
MAX_NAME_LENGTH = 47
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# The submitter only runs `ray job submit` and `ray job logs`: KubeRay's default size for it.
SUBMITTER_RESOURCES = {"requests": {"cpu": "500m", "memory": "256Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}}
HEAD_PORTS = [
    {"name": "gcs-server", "containerPort": 6379},
    {"name": "dashboard", "containerPort": 8265},
    {"name": "client", "containerPort": 10001},
]


def _check_name(name: str) -> None:
    if len(name) > MAX_NAME_LENGTH or not _DNS1035.match(name):
        raise ConfigError(
            f"RayJob name {name!r}: must be a DNS-1035 label (lowercase letters, digits, '-', starting with a "
            f"letter) of at most {MAX_NAME_LENGTH} characters (KubeRay's limit)"
        )


def _entrypoint(entrypoint: str | Sequence[str]) -> str:
    text = entrypoint if isinstance(entrypoint, str) else shlex.join(entrypoint)
    if not text.strip():
        raise ConfigError("RayJob entrypoint: empty command")
    return text


def _security_context(template: RayJobTemplate) -> dict[str, Any]:
    """Every container: the chart's containerSecurityContext (PSS 'restricted' and a read-only root filesystem by
    default, ``rayjob_template.PodSettings``)."""
    return dict(template.pod.container_security_context)


def _pod_security_context(template: RayJobTemplate) -> dict[str, Any]:
    """Every pod: the chart's podSecurityContext (the image's uid/gid; fsGroup makes the PVC writable by it)."""
    return dict(template.pod.security_context)


def _token_env(template: RayJobTemplate) -> list[dict[str, Any]]:
    secret = template.ray_token_secret
    if secret is None:
        return []
    return [
        {"name": "RAY_AUTH_MODE", "value": "token"},
        {"name": "RAY_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret.name, "key": secret.key}}},
    ]


def _ray_env(template: RayJobTemplate) -> list[dict[str, Any]]:
    """Env of the Ray containers; the driver and every actor inherit it from the raylet.  The chart's ``ray.env``
    comes last (a name it sets twice takes its value: Kubernetes keeps the last)."""
    env: list[dict[str, Any]] = [{"name": "HOME", "value": TMP_MOUNT}]
    if template.mlflow_tracking_uri:
        env.append({"name": "MLFLOW_TRACKING_URI", "value": template.mlflow_tracking_uri})
    if template.mlflow_auth is not None:
        secret = template.mlflow_auth.password_secret
        env += [
            {"name": "MLFLOW_TRACKING_USERNAME", "value": template.mlflow_auth.username},
            {
                "name": "MLFLOW_TRACKING_PASSWORD",
                "valueFrom": {"secretKeyRef": {"name": secret.name, "key": secret.key}},
            },
        ]
    return env + _token_env(template) + [dict(e) for e in template.pod.env]


def _volumes(template: RayJobTemplate) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts): a memory-backed /dev/shm (Ray object store, NCCL), /tmp and the data PVC at /data."""
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": SHM_MOUNT}, dict(_TMP_VOLUME_MOUNT)]
    if template.pvc_name:
        volumes.append({"name": "data", "persistentVolumeClaim": {"claimName": template.pvc_name}})
        mounts.append({"name": "data", "mountPath": DATA_MOUNT})
    return volumes, mounts


_TMP_VOLUME_MOUNT: dict[str, Any] = {"name": "tmp", "mountPath": TMP_MOUNT}


def _pod_metadata(template: RayJobTemplate, labels: Mapping[str, str], name: str, role: str) -> dict[str, Any]:
    metadata: dict[str, Any] = {"labels": _pod_labels(labels, name, role)}
    if template.pod.annotations:
        metadata["annotations"] = dict(template.pod.annotations)
    return metadata


def _pod_labels(labels: Mapping[str, str], name: str, role: str) -> dict[str, str]:
    return {**labels, RAYJOB_LABEL: name, ROLE_LABEL: role}


def _pod_spec(template: RayJobTemplate, container: dict[str, Any], volumes: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = {"securityContext": _pod_security_context(template), "containers": [container]}
    if volumes:
        spec["volumes"] = volumes
    if template.service_account_name:
        spec["serviceAccountName"] = template.service_account_name
    if template.pod.image_pull_secrets:
        spec["imagePullSecrets"] = [dict(s) for s in template.pod.image_pull_secrets]
    return spec


def _ray_container(template: RayJobTemplate, name: str, resources: dict[str, Any]) -> dict[str, Any]:
    _, mounts = _volumes(template)
    container: dict[str, Any] = {
        "name": name,
        "image": template.image,
        "imagePullPolicy": template.image_pull_policy,
        "resources": resources,
        "securityContext": _security_context(template),
        "volumeMounts": mounts,
    }
    env = _ray_env(template)
    if env:
        container["env"] = env
    return container


def _head_group(template: RayJobTemplate, name: str, labels: Mapping[str, str]) -> dict[str, Any]:
    container = _ray_container(template, HEAD_CONTAINER, template.head.resources.to_k8s())
    container["ports"] = [dict(p) for p in HEAD_PORTS]
    volumes, _ = _volumes(template)
    spec = _pod_spec(template, container, volumes)
    _place(spec, template.head.tolerations, template.head.node_selector)
    return {"rayStartParams": {}, "template": {"metadata": _pod_metadata(template, labels, name, "head"), "spec": spec}}


def _place(spec: dict[str, Any], tolerations: list[Toleration], node_selector: Mapping[str, str]) -> None:
    if tolerations:
        spec["tolerations"] = [t.to_k8s() for t in tolerations]
    if node_selector:
        spec["nodeSelector"] = dict(node_selector)


def _worker_group(template: RayJobTemplate, name: str, labels: Mapping[str, str]) -> dict[str, Any]:
    workers = template.workers
    gpus = {GPU_RESOURCE: str(workers.gpus_per_worker)} if workers.gpus_per_worker else {}
    container = _ray_container(template, WORKER_CONTAINER, workers.resources.to_k8s(extra_limits=gpus))
    volumes, _ = _volumes(template)
    spec = _pod_spec(template, container, volumes)
    _place(spec, workers.tolerations, workers.node_selector)
    return {
        "groupName": WORKER_GROUP,
        # A fixed-size group: the RL step places its actors once, so autoscaling has nothing to do.
        "replicas": workers.replicas,
        "minReplicas": workers.replicas,
        "maxReplicas": workers.replicas,
        "rayStartParams": {},
        "template": {"metadata": _pod_metadata(template, labels, name, "worker"), "spec": spec},
    }


def _submitter_template(template: RayJobTemplate, name: str, labels: Mapping[str, str]) -> dict[str, Any]:
    """KubeRay fills in the command (``ray job submit ... ; ray job logs --follow``) when we leave it empty."""
    container: dict[str, Any] = {
        "name": SUBMITTER_CONTAINER,
        "image": template.image,
        "imagePullPolicy": template.image_pull_policy,
        "resources": {k: dict(v) for k, v in SUBMITTER_RESOURCES.items()},
        "securityContext": _security_context(template),
        "env": [{"name": "HOME", "value": TMP_MOUNT}, *_token_env(template), *(dict(e) for e in template.pod.env)],
        "volumeMounts": [dict(_TMP_VOLUME_MOUNT)],
    }
    spec = _pod_spec(template, container, [{"name": "tmp", "emptyDir": {}}])
    spec["restartPolicy"] = "Never"  # a Job's pod template must say Never or OnFailure
    return {"metadata": _pod_metadata(template, labels, name, "submitter"), "spec": spec}


def _runtime_env_yaml(env_vars: Mapping[str, str]) -> str | None:
    return yaml.safe_dump({"env_vars": dict(env_vars)}, sort_keys=True) if env_vars else None


def _rayjob(
    name: str, namespace: str, labels: Mapping[str, str], spec: dict[str, Any], owner: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": namespace}
    if labels:
        metadata["labels"] = dict(labels)
    if owner is not None:
        metadata["ownerReferences"] = [dict(owner)]
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": spec}


def _common_spec(template: RayJobTemplate, name: str, entrypoint: str, labels: Mapping[str, str]) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "entrypoint": entrypoint,
        "submissionMode": "K8sJobMode",
        "submitterPodTemplate": _submitter_template(template, name, labels),
    }
    if template.active_deadline_seconds is not None:
        spec["activeDeadlineSeconds"] = template.active_deadline_seconds
    return spec


def build_rayjob(
    template: RayJobTemplate,
    name: str,
    entrypoint: str | Sequence[str],
    namespace: str = "default",
    labels: Mapping[str, str] | None = None,
    owner: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A RayJob that brings its own RayCluster: one head (no GPUs) and one fixed-size GPU worker group.

    ``labels`` go on the RayJob and on every pod; each pod also gets ``fp8rl/rayjob: <name>`` and
    ``fp8rl/role: head|worker|submitter``.  ``owner``: an ownerReference in ``namespace`` (the submitting pod):
    the RayJob is garbage-collected with it.
    """
    _check_name(name)
    labels = dict(labels or {})
    spec = _common_spec(template, name, _entrypoint(entrypoint), labels)
    spec["shutdownAfterJobFinishes"] = template.shutdown_after_job_finishes
    spec["ttlSecondsAfterFinished"] = template.ttl_seconds_after_finished
    runtime_env = _runtime_env_yaml(template.runtime_env.env_vars)
    if runtime_env:
        spec["runtimeEnvYAML"] = runtime_env
    spec["rayClusterSpec"] = {
        "headGroupSpec": _head_group(template, name, labels),
        "workerGroupSpecs": [_worker_group(template, name, labels)],
    }
    if template.ray_version:
        spec["rayClusterSpec"]["rayVersion"] = template.ray_version
    if template.ray_token_secret is not None:  # the operator's own dashboard requests carry the same token
        spec["rayClusterSpec"]["authOptions"] = {"mode": "token", "secretName": template.ray_token_secret.name}
    return _rayjob(name, namespace, labels, spec, owner)


def build_rayjob_for_cluster(
    template: RayJobTemplate,
    name: str,
    entrypoint: str | Sequence[str],
    cluster_name: str,
    namespace: str = "default",
    labels: Mapping[str, str] | None = None,
    owner: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A RayJob that runs on the existing RayCluster ``cluster_name`` (``clusterSelector``); ``owner`` as in
    :func:`build_rayjob` (the job, not the cluster, goes with it).

    The cluster is not ours: no ``shutdownAfterJobFinishes``/TTL, and its pods' env is what it is, so
    ``MLFLOW_TRACKING_URI`` travels in the runtime env instead (a runtime-env value set by the template wins).
    """
    _check_name(name)
    if not cluster_name:
        raise ConfigError("RayJob clusterSelector: the RayCluster name is empty")
    labels = dict(labels or {})
    spec = _common_spec(template, name, _entrypoint(entrypoint), labels)
    spec["clusterSelector"] = {CLUSTER_SELECTOR_KEY: cluster_name}
    env_vars = dict(template.runtime_env.env_vars)
    if template.mlflow_tracking_uri:
        env_vars.setdefault("MLFLOW_TRACKING_URI", template.mlflow_tracking_uri)
    runtime_env = _runtime_env_yaml(env_vars)
    if runtime_env:
        spec["runtimeEnvYAML"] = runtime_env
    return _rayjob(name, namespace, labels, spec, owner)
