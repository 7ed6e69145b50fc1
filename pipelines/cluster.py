"""Kubernetes settings of pipeline steps (kfp-kubernetes): GPUs, tolerations, volumes, ConfigMaps, Secrets.

Applied per task in the pipeline definitions; they go into the IR's ``platforms.kubernetes``
section, which Kubeflow Pipelines applies and kfp.local ignores, so the same pipelines run
both ways. The names of the chart's objects are pipeline parameters (defaults for a Helm
release named ``rl``), so one compiled IR serves any release:

| parameter | default | used for |
|---|---|---|
| ``pvc_name`` | ``rl-fp8rl-data`` | mounted at ``/data`` in every step (models, staging for RayJobs, work dir) |
| ``rayjob_defaults`` | ``rl-fp8rl-rayjob-defaults`` | key ``mlflowTrackingUri`` -> ``$MLFLOW_TRACKING_URI`` (optional); mounted at ``/etc/fp8rl`` in the RL step (``rayjob.yaml``) |
| ``mlflow_secret`` | ``rl-fp8rl-mlflow-client`` | keys ``username``/``password`` -> ``$MLFLOW_TRACKING_USERNAME``/``PASSWORD`` (optional) |
| ``hf_secret`` | ``hf-token`` | key ``token`` -> ``$HF_TOKEN`` in the prepare-model step (optional) |

Secrets reach the steps only as environment variables from Kubernetes Secrets, never as parameters.

KFP, not the chart, creates the steps' pods: the chart's ``pipelineSteps`` section (extra env, pod annotations and
labels, tolerations, node selector) and ``images.pullSecrets`` are compiled into every step from the values file
given to helm (``python -m pipelines.compile --values FILE``, ``python -m pipelines.submit --values FILE``:
``StepPods``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kfp import kubernetes
from kfp.dsl import PipelineTask

DEFAULT_RELEASE = "rl"
DEFAULT_PVC = f"{DEFAULT_RELEASE}-fp8rl-data"
DEFAULT_RAYJOB_DEFAULTS = f"{DEFAULT_RELEASE}-fp8rl-rayjob-defaults"
DEFAULT_MLFLOW_SECRET = f"{DEFAULT_RELEASE}-fp8rl-mlflow-client"
DEFAULT_HF_SECRET = "hf-token"
DATA_MOUNT = "/data"
CLUSTER_WORK_DIR = f"{DATA_MOUNT}/fp8rl"
RAYJOB_DEFAULTS_MOUNT = "/etc/fp8rl"
GPU_RESOURCE = "nvidia.com/gpu"
MLFLOW_URI_KEY = "mlflowTrackingUri"
MLFLOW_SECRET_ENV = {"username": "MLFLOW_TRACKING_USERNAME", "password": "MLFLOW_TRACKING_PASSWORD"}
HF_SECRET_ENV = {"token": "HF_TOKEN"}
IMAGE_UID = IMAGE_GID = 1000  # the component and runtime images' user (images/Dockerfile.*)


# A step whose pod fails (evicted, its node lost, an image pull that timed out) is retried this many times by
# default, after RETRY_BACKOFF, doubling up to RETRY_BACKOFF_MAX. The RL step resumes from its checkpoint and MLflow
# run; local runs (kfp.local honours retries too) use none, so that a step's error shows at once.
DEFAULT_RETRIES = 1
RETRY_BACKOFF, RETRY_BACKOFF_MAX = "60s", "600s"


@dataclass(frozen=True)
class StepSize:
    """CPU and memory requests of a step's pod: what the scheduler reserves (no limits: a step may use a node's
    idle CPU; the GPU steps' nodes are sized by their GPUs)."""

    cpu: str
    memory: str


def parse_step_size(text: str) -> StepSize:
    """``"CPU,MEMORY"`` (Kubernetes quantities, e.g. ``"500m,2Gi"``) -> ``StepSize``; ``ValueError`` naming the part."""
    cpu, sep, memory = (part.strip() for part in text.partition(","))
    if not sep:
        raise ValueError(f"{text!r}: expected CPU,MEMORY (e.g. 500m,2Gi)")
    if not re.fullmatch(r"\d+(\.\d+)?m?", cpu):
        raise ValueError(f"{text!r}: CPU {cpu!r} is not a Kubernetes CPU quantity (e.g. 2, 0.5, 500m)")
    if not re.fullmatch(r"\d+(\.\d+)?([KMGTPE]i?|[kmgtpe])?", memory):
        raise ValueError(f"{text!r}: memory {memory!r} is not a Kubernetes memory quantity (e.g. 8Gi, 512Mi)")
    return StepSize(cpu, memory)


STEP_SIZES = {
    "small": StepSize("500m", "1Gi"),  # MLflow bookkeeping and the report: start/end tracking, compare
    "medium": StepSize("2", "8Gi"),  # a checkpoint in host memory: prepare, SFT, convert, the RL step's driver
    "gpu": StepSize("8", "64Gi"),  # vLLM or the trainer on one GPU: loading a checkpoint takes ~2x its size
}


@dataclass(frozen=True)
class StepPods:
    """What every step's pod gets from the chart's values (``pipelineSteps`` and ``images.pullSecrets``), compiled
    into the IR: KFP applies it on the cluster, kfp.local ignores all but the env."""

    env: tuple[tuple[str, str], ...] = ()
    annotations: tuple[tuple[str, str], ...] = ()
    labels: tuple[tuple[str, str], ...] = ()
    tolerations: tuple[Mapping[str, Any], ...] = ()
    node_selector: Mapping[str, str] = field(default_factory=dict)
    pull_secrets: tuple[str, ...] = ()


NO_STEP_PODS = StepPods()
_TOLERATION_KEYS = {"key", "operator", "value", "effect", "tolerationSeconds"}


def _section(doc: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    value = doc.get(key) or {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _strings(value: Any, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, Mapping) or not all(isinstance(v, str) for v in value.values()):
        raise ValueError(f"{where}: expected a mapping of strings (quote numbers and booleans)")
    return tuple((str(k), v) for k, v in value.items())


def _env(value: Any, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise ValueError(f"{where}: expected a list of {{name, value}}")
    out = []
    for i, item in enumerate(value):
        if (
            not isinstance(item, Mapping)
            or set(item) != {"name", "value"}
            or not isinstance(item["value"], str)
            or not isinstance(item["name"], str)
            or not item["name"]
        ):
            raise ValueError(
                f"{where}[{i}]: expected {{name, value}}, both strings (a Secret's value reaches the steps "
                "through the chart's Secrets, not valueFrom)"
            )
        out.append((item["name"], item["value"]))
    return tuple(out)


def _tolerations(value: Any, where: str) -> tuple[Mapping[str, Any], ...]:
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise ValueError(f"{where}: expected a list of tolerations")
    for i, item in enumerate(value):
        if not isinstance(item, Mapping) or not set(item) <= _TOLERATION_KEYS:
            raise ValueError(f"{where}[{i}]: a toleration's fields are {', '.join(sorted(_TOLERATION_KEYS))}")
    return tuple(dict(t) for t in value)


def step_pods(doc: Mapping[str, Any], where: str = "values") -> StepPods:
    """``StepPods`` from a chart values document (its ``pipelineSteps`` and ``images.pullSecrets``); a ValueError
    names the field (prefixed with ``where``)."""
    steps = _section(doc, "pipelineSteps", f"{where}: pipelineSteps")
    w = f"{where}: pipelineSteps."
    secrets = _section(doc, "images", f"{where}: images").get("pullSecrets") or []
    if not isinstance(secrets, Sequence) or not all(isinstance(s, Mapping) and s.get("name") for s in secrets):
        raise ValueError(f"{where}: images.pullSecrets: expected a list of {{name}}")
    return StepPods(
        env=_env(steps.get("env") or [], w + "env"),
        annotations=_strings(steps.get("podAnnotations") or {}, w + "podAnnotations"),
        labels=_strings(steps.get("podLabels") or {}, w + "podLabels"),
        tolerations=_tolerations(steps.get("tolerations") or [], w + "tolerations"),
        node_selector=dict(_strings(steps.get("nodeSelector") or {}, w + "nodeSelector")),
        pull_secrets=tuple(str(s["name"]) for s in secrets),
    )


def _deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Helm's merge of values files: mappings merged key by key, anything else replaced by the later file's, a key
    set to null removed."""
    out = dict(base)
    for key, value in over.items():
        if value is None:
            out.pop(key, None)
            continue
        both = isinstance(value, Mapping) and isinstance(out.get(key), Mapping)
        out[key] = _deep_merge(out[key], value) if both else value
    return out


def read_step_pods(paths: Sequence[str | Path]) -> StepPods:
    """``StepPods`` from chart values files, merged as ``helm -f A -f B`` merges them (later wins); a ValueError
    names the file (all of them, for a field the merge made wrong) and the field."""
    import yaml

    merged: dict[str, Any] = {}
    for path in paths:
        try:
            doc = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as e:
            raise ValueError(f"{path}: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not YAML: {e}") from None
        if not isinstance(doc, Mapping):
            raise ValueError(f"{path}: expected a mapping of chart values")
        step_pods(doc, str(path))  # each file's own mistakes named with its own path
        merged = _deep_merge(merged, doc)
    return step_pods(merged, ", ".join(map(str, paths))) if paths else NO_STEP_PODS


@dataclass(frozen=True)
class ClusterRefs:
    """The chart objects' names, as the pipeline's parameter channels (or plain strings), and the steps' retries."""

    pvc_name: Any
    rayjob_defaults: Any
    mlflow_secret: Any
    hf_secret: Any
    retries: int = DEFAULT_RETRIES
    medium: StepSize = STEP_SIZES["medium"]  # the requests of the steps that hold a model (a compile option)
    gpus: bool = True  # False: a cluster without GPUs; the GPU steps run on CPU nodes at the medium size
    pods: StepPods = NO_STEP_PODS  # every step pod's env, metadata and placement from the chart's values


# the env the RL step reads its pod's identity from (fp8rl.kube.rl_step.owner_pod_reference)
OWNER_POD_FIELDS = {"FP8RL_POD_NAME": "metadata.name", "FP8RL_POD_UID": "metadata.uid"}


def on_cluster(
    task: PipelineTask,
    refs: ClusterRefs,
    *,
    tracked: bool = False,
    gpu: bool = False,
    rayjob: bool = False,
    hf_token: bool = False,
    size: str = "small",
) -> PipelineTask:
    """Give ``task`` its CPU and memory requests (``size``: ``STEP_SIZES``, medium's ``refs.medium``; ``gpu`` steps
    are ``gpu``), the retry
    policy and the data volume, plus: MLflow settings (``tracked``), one GPU and the GPU toleration (``gpu``), the
    RayJob template (``rayjob``), the Hugging Face token (``hf_token``).

    Tracked steps write to MLflow, so they are never served from KFP's cache (a cached step would
    hand out another run's MLflow ids).
    """
    if gpu and not refs.gpus:
        gpu, size = False, "medium"
    requests = STEP_SIZES["gpu"] if gpu else refs.medium if size == "medium" else STEP_SIZES[size]
    task.set_cpu_request(requests.cpu).set_memory_request(requests.memory)
    if refs.retries:
        task.set_retry(refs.retries, backoff_duration=RETRY_BACKOFF, backoff_max_duration=RETRY_BACKOFF_MAX)
    kubernetes.mount_pvc(task, pvc_name=refs.pvc_name, mount_path=DATA_MOUNT)
    # the images' user (the chart's podSecurityContext): what KFP lets a step set; KFP's compiler adds no privilege
    # escalation, no capabilities and the RuntimeDefault seccomp profile itself
    kubernetes.set_security_context(task, run_as_user=IMAGE_UID, run_as_group=IMAGE_GID, run_as_non_root=True)
    if tracked:
        kubernetes.use_config_map_as_env(
            task, refs.rayjob_defaults, {MLFLOW_URI_KEY: "MLFLOW_TRACKING_URI"}, optional=True
        )
        kubernetes.use_secret_as_env(task, refs.mlflow_secret, MLFLOW_SECRET_ENV, optional=True)
        task.set_caching_options(enable_caching=False)
    if rayjob:
        kubernetes.use_config_map_as_volume(task, refs.rayjob_defaults, RAYJOB_DEFAULTS_MOUNT)
        # the step's own pod, by the downward API: its RayJob is owned by it (deleted with it when a run is cancelled)
        for env, path in OWNER_POD_FIELDS.items():
            kubernetes.use_field_path_as_env(task, env, path)
    if hf_token:
        kubernetes.use_secret_as_env(task, refs.hf_secret, HF_SECRET_ENV, optional=True)
    if gpu:
        task.set_accelerator_type(GPU_RESOURCE).set_accelerator_limit(1)
        kubernetes.add_toleration(task, key=GPU_RESOURCE, operator="Exists", effect="NoSchedule")
    apply_step_pods(task, refs.pods)
    return task


def apply_step_pods(task: PipelineTask, pods: StepPods) -> PipelineTask:
    """The chart's ``pipelineSteps`` and pull secrets on ``task`` (see ``StepPods``)."""
    for name, value in pods.env:
        task.set_env_variable(name, value)
    for key, value in pods.annotations:
        kubernetes.add_pod_annotation(task, key, value)
    for key, value in pods.labels:
        kubernetes.add_pod_label(task, key, value)
    for t in pods.tolerations:
        kubernetes.add_toleration(
            task, key=t.get("key"), operator=t.get("operator"), value=t.get("value"),
            effect=t.get("effect"), toleration_seconds=t.get("tolerationSeconds"),
        )  # fmt: skip
    for key, value in pods.node_selector.items():
        kubernetes.add_node_selector(task, key, value)
    if pods.pull_secrets:
        kubernetes.set_image_pull_secrets(task, list(pods.pull_secrets))
    return task
