"""The RL step's RayJob template: what the cluster operator decides about it, as the chart renders it.

The chart renders a ConfigMap key ``rayjob.yaml`` with the camelCase fields of :class:`RayJobTemplate`;
:func:`load_template` reads it and names the file and field on any error.  The builders of the ``ray.io/v1``
``RayJob`` documents (:mod:`fp8rl.kube.rayjob`) take it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from fp8rl.config import ConfigError, format_validation_errors, read_yaml

GPU_RESOURCE = "nvidia.com/gpu"

# Kubernetes resource.Quantity, as the CRD's pattern for resources.
_QUANTITY = re.compile(
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)


class _Template(BaseModel):
    """camelCase in YAML (as the chart renders it), snake_case in Python; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)


class Resources(_Template):
    """Container requests/limits as Kubernetes quantities (``"8"``, ``"500m"``, ``"64Gi"``)."""

    requests: dict[str, str] = Field(default_factory=dict)
    limits: dict[str, str] = Field(default_factory=dict)

    @field_validator("requests", "limits", mode="before")
    @classmethod
    def _quantities(cls, value: Any) -> Any:
        # YAML gives numbers for "cpu: 8"; Kubernetes wants strings, so normalise here.
        if isinstance(value, Mapping):
            return {
                k: str(v) if isinstance(v, int | float) and not isinstance(v, bool) else v for k, v in value.items()
            }
        return value

    @field_validator("requests", "limits")
    @classmethod
    def _valid_quantities(cls, value: dict[str, str]) -> dict[str, str]:
        bad = [f"{k}={v!r}" for k, v in value.items() if not _QUANTITY.match(v)]
        if bad:
            raise ValueError(f"not Kubernetes quantities: {', '.join(bad)}")
        return value

    @model_validator(mode="after")
    def _cpu_and_memory(self) -> Resources:
        # A Ray node sizes its CPU count and object store from these: an unbounded pod is a surprise later.
        missing = [r for r in ("cpu", "memory") if r not in self.requests and r not in self.limits]
        if missing:
            raise ValueError(f"set {' and '.join(missing)} in requests or limits")
        return self

    def to_k8s(self, extra_limits: Mapping[str, str] | None = None) -> dict[str, dict[str, str]]:
        limits = {**self.limits, **(extra_limits or {})}
        requests = {**self.requests, **(extra_limits or {})}
        return {"requests": requests, "limits": limits}


class Toleration(_Template):
    """A Kubernetes toleration (e.g. ``{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}``)."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None

    def to_k8s(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class HeadSpec(_Template):
    resources: Resources
    tolerations: list[Toleration] = Field(default_factory=list)
    node_selector: dict[str, str] = Field(default_factory=dict)


class WorkersSpec(_Template):
    """One worker group: ``replicas`` pods with ``gpusPerWorker`` GPUs each (0: CPU-only workers, for a cluster
    without GPUs such as ``make cluster-up``'s node; the RL step then runs its CPU path)."""

    replicas: int = Field(1, ge=1)
    gpus_per_worker: int = Field(1, ge=0)
    resources: Resources
    tolerations: list[Toleration] = Field(default_factory=list)
    node_selector: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _gpus_from_one_place(self) -> WorkersSpec:
        for kind, values in (("requests", self.resources.requests), ("limits", self.resources.limits)):
            if GPU_RESOURCE in values and values[GPU_RESOURCE] != str(self.gpus_per_worker):
                raise ValueError(
                    f"resources.{kind}.{GPU_RESOURCE}={values[GPU_RESOURCE]} disagrees with "
                    f"gpusPerWorker={self.gpus_per_worker}; set GPUs only through gpusPerWorker"
                )
        return self


class RuntimeEnv(BaseModel):
    """The Ray runtime env of the job. Only ``env_vars``: code and packages belong in the image, not pip-at-start."""

    # Ray's own snake_case keys, so no camelCase alias here.
    model_config = ConfigDict(extra="forbid", frozen=True)

    env_vars: dict[str, str] = Field(default_factory=dict)


class SecretKeyRef(_Template):
    """A key of a Kubernetes Secret (KubeRay's convention for the Ray token key is ``auth_token``)."""

    name: str = Field(min_length=1)
    key: str = Field("auth_token", min_length=1)


class MlflowAuth(_Template):
    """MLflow basic-auth credentials of the Ray pods (``MLFLOW_TRACKING_USERNAME`` / ``_PASSWORD``): the chart's
    client user (not an admin) and the Secret key that holds its password."""

    username: str = Field(min_length=1)
    password_secret: SecretKeyRef


# The images run as uid/gid 1000 (images/Dockerfile.*); what a pod gets where the chart says nothing.
IMAGE_UID = IMAGE_GID = 1000


def _default_pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True, "runAsUser": IMAGE_UID, "runAsGroup": IMAGE_GID, "fsGroup": IMAGE_GID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }  # fmt: skip


def _default_container_security_context() -> dict[str, Any]:
    """Pod Security Standards 'restricted', and a read-only root filesystem (the pods write /tmp, /dev/shm, /data:
    volumes of their own)."""
    return {
        "runAsNonRoot": True, "privileged": False, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"},
    }  # fmt: skip


class PodSettings(_Template):
    """What every pod of the RayJob (head, workers, submitter) takes from the chart, as its own pods do: the pod and
    container securityContext (Kubernetes' own fields, as the chart's ``podSecurityContext`` and
    ``containerSecurityContext``), extra env of the containers (``ray.env``: Kubernetes EnvVars), annotations and
    image pull secrets."""

    security_context: dict[str, Any] = Field(default_factory=_default_pod_security_context)
    container_security_context: dict[str, Any] = Field(default_factory=_default_container_security_context)
    env: list[dict[str, Any]] = Field(default_factory=list)
    annotations: dict[str, str] = Field(default_factory=dict)
    # the chart's images.pullSecrets ([{name: ...}]): the registry the runtime image comes from
    image_pull_secrets: list[dict[str, str]] = Field(default_factory=list)

    @field_validator("env")
    @classmethod
    def _named(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        unnamed = [i for i, e in enumerate(value) if not isinstance(e.get("name"), str) or not e["name"]]
        if unnamed:
            raise ValueError(f"entries {unnamed} have no name (Kubernetes EnvVars: {{name, value}} or valueFrom)")
        return value


class RayJobTemplate(_Template):
    """Everything about the RL step's RayJob that the cluster operator decides (rendered by the chart)."""

    image: str = Field(min_length=1)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    service_account_name: str | None = None
    head: HeadSpec
    workers: WorkersSpec
    pod: PodSettings = PodSettings()
    runtime_env: RuntimeEnv = RuntimeEnv()
    shutdown_after_job_finishes: bool = True
    ttl_seconds_after_finished: int = Field(300, ge=0)
    active_deadline_seconds: int | None = Field(None, gt=0)
    mlflow_tracking_uri: str | None = None
    # set by the chart when MLflow's basic auth is on: without it the RL step's logging would be refused (401)
    mlflow_auth: MlflowAuth | None = None
    ray_token_secret: SecretKeyRef | None = None
    pvc_name: str | None = None
    # the chart's standing RayCluster (ray.enabled): jobs run on it (build_rayjob_for_cluster) instead of their own
    ray_cluster_name: str | None = None
    # the image's Ray (rayClusterSpec.rayVersion): KubeRay picks probes and commands by it, and refuses token auth
    # (authOptions) without it
    ray_version: str | None = Field(None, pattern=r"^\d+\.\d+\.\d+")

    @model_validator(mode="after")
    def _ttl_needs_shutdown(self) -> RayJobTemplate:
        # KubeRay rejects this combination at admission (validateDeletionConfiguration); say it before submitting.
        if self.ttl_seconds_after_finished > 0 and not self.shutdown_after_job_finishes:
            raise ValueError("ttlSecondsAfterFinished > 0 requires shutdownAfterJobFinishes: true")
        return self

    @model_validator(mode="after")
    def _token_under_kuberays_key(self) -> RayJobTemplate:
        # authOptions.secretName: the operator reads the token under this key only (module docstring)
        if self.ray_token_secret is not None and not self.ray_version:
            raise ValueError("rayTokenSecret needs rayVersion (KubeRay refuses token auth without it; Ray >= 2.52)")
        if self.ray_token_secret is not None and self.ray_token_secret.key != "auth_token":
            raise ValueError(
                f"rayTokenSecret.key is {self.ray_token_secret.key!r}: KubeRay reads the Ray token from the key "
                "'auth_token' only; store it under that key"
            )
        return self


def parse_template(data: Any, source: str = "rayjob template") -> RayJobTemplate:
    """Validate already-loaded YAML; errors name ``source`` and the camelCase field."""
    try:
        # by_name=False: files are camelCase only, so a snake_case key is reported as unknown (pydantic >= 2.11).
        return RayJobTemplate.model_validate(data, by_alias=True, by_name=False)
    except ValidationError as e:
        raise ConfigError(format_validation_errors(e, source, "RayJob template")) from None


def load_template(path: str | Path) -> RayJobTemplate:
    """Read the chart's ``rayjob.yaml``; a missing file, bad YAML or bad field is a ``ConfigError``."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: RayJob template not found (the chart mounts it from its ConfigMap key rayjob.yaml)")
    return parse_template(read_yaml(path, mapping_of="expected a mapping of template fields"), str(path))
