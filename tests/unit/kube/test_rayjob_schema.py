"""Both RayJob variants validate against the KubeRay v1 CRD schema, strictly (an unknown field is an error).

``kube_schemas.validate_manifest`` (tests/kube_schemas.py) checks ``ray.io/v1`` documents against the
KubeRay CRD schemas installed by scripts/k8s_tools.sh, and skips when they are not installed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from kube_schemas import validate_manifest

from fp8rl.kube.rayjob import build_rayjob, build_rayjob_for_cluster
from fp8rl.kube.rayjob_template import parse_template

CHART_YAML = """
image: ghcr.io/example/fp8rl-gpu:0.1.0
imagePullPolicy: IfNotPresent
serviceAccountName: fp8rl-ray
head: {resources: {requests: {cpu: "4", memory: 16Gi}, limits: {cpu: 4, memory: 16Gi}}}
workers:
  replicas: 2
  gpusPerWorker: 8
  resources: {requests: {cpu: "32", memory: 256Gi}, limits: {cpu: "32", memory: 256Gi}}
  tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]
  nodeSelector: {nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}
runtimeEnv: {env_vars: {HF_HUB_OFFLINE: "1"}}
shutdownAfterJobFinishes: true
ttlSecondsAfterFinished: 300
activeDeadlineSeconds: 86400
mlflowTrackingUri: http://fp8rl-mlflow:5000
rayTokenSecret: {name: ray-token, key: auth_token}
rayVersion: "2.60.0"
pvcName: fp8rl-data
"""


TEMPLATE = parse_template(yaml.safe_load(CHART_YAML))


def test_rayjob_with_its_own_cluster_is_valid() -> None:
    validate_manifest(build_rayjob(TEMPLATE, "fp8rl-step", "python -m fp8rl.cluster.driver", "ml", {"app": "fp8rl"}))


def test_rayjob_without_auth_pvc_or_optionals_is_valid() -> None:
    data = yaml.safe_load(CHART_YAML)
    for key in (
        "rayTokenSecret",
        "pvcName",
        "mlflowTrackingUri",
        "activeDeadlineSeconds",
        "runtimeEnv",
        "serviceAccountName",
    ):
        data.pop(key)
    validate_manifest(build_rayjob(parse_template(data), "fp8rl-step", "python x.py"))


def test_rayjob_for_existing_cluster_is_valid() -> None:
    validate_manifest(build_rayjob_for_cluster(TEMPLATE, "fp8rl-step", "python x.py", "shared-ray", "ml"))


def test_validator_rejects_an_unknown_field() -> None:
    """Guards the tests above: a validator that accepts anything would make them pass too."""
    doc = copy.deepcopy(build_rayjob(TEMPLATE, "fp8rl-step", "python x.py"))
    doc["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["gpusPerWorker"] = 8
    with pytest.raises(AssertionError, match="gpusPerWorker"):
        validate_manifest(doc)


CI_VALUES = sorted((Path(__file__).resolve().parents[3] / "charts" / "fp8rl" / "ci").glob("*.yaml"))


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda v: "defaults" if v is None else v.stem)
def test_chart_rendered_template_builds_valid_rayjobs(render: Callable[..., Any], values: Path | None) -> None:
    """The chart's ConfigMap key rayjob.yaml loads as a template, and both RayJobs built from it are valid."""
    rendered = render(*([values] if values else []))
    text = rendered.one("ConfigMap", "-rayjob-defaults")["data"]["rayjob.yaml"]
    template = parse_template(yaml.safe_load(text), "rendered rayjob.yaml")
    validate_manifest(build_rayjob(template, "fp8rl-step", "python -m fp8rl.cluster.driver", "fp8rl"))
    validate_manifest(build_rayjob_for_cluster(template, "fp8rl-step", "python x.py", "shared-ray", "fp8rl"))
