"""RayJob documents built from the chart's template, checked field by field (schema checks: tests/unit/kube)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from fp8rl.config import ConfigError
from fp8rl.kube.rayjob import RAYJOB_LABEL, ROLE_LABEL, build_rayjob, build_rayjob_for_cluster
from fp8rl.kube.rayjob_template import RayJobTemplate, load_template, parse_template

# What the chart renders into its ConfigMap key rayjob.yaml (camelCase, exactly these fields).
CHART_YAML = """
image: ghcr.io/example/fp8rl-gpu:0.1.0
imagePullPolicy: IfNotPresent
serviceAccountName: fp8rl-ray
head:
  resources:
    requests: {cpu: "4", memory: 16Gi}
    limits: {cpu: 4, memory: 16Gi}
workers:
  replicas: 2
  gpusPerWorker: 8
  resources:
    requests: {cpu: "32", memory: 256Gi}
    limits: {cpu: "32", memory: 256Gi}
  tolerations:
    - {key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}
  nodeSelector: {nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}
runtimeEnv:
  env_vars: {HF_HUB_OFFLINE: "1"}
shutdownAfterJobFinishes: true
ttlSecondsAfterFinished: 300
activeDeadlineSeconds: 86400
mlflowTrackingUri: http://fp8rl-mlflow:5000
rayTokenSecret: {name: ray-token, key: auth_token}
pvcName: fp8rl-data
rayVersion: "2.60.0"
"""

ENTRYPOINT = ["python", "-m", "fp8rl.cluster.driver", "--config", "/data/run.yaml"]


def chart_data(**overrides: Any) -> dict[str, Any]:
    data = yaml.safe_load(CHART_YAML)
    for key, value in overrides.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    return data


@pytest.fixture
def template() -> RayJobTemplate:
    return parse_template(chart_data())


@pytest.fixture
def doc(template: RayJobTemplate) -> dict[str, Any]:
    return build_rayjob(template, "fp8rl-step", ENTRYPOINT, "ml", {"app.kubernetes.io/name": "fp8rl"})


def pods(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every pod template in the document, by role."""
    spec = doc["spec"]
    found = {"submitter": spec["submitterPodTemplate"]}
    if "rayClusterSpec" in spec:
        found["head"] = spec["rayClusterSpec"]["headGroupSpec"]["template"]
        (group,) = spec["rayClusterSpec"]["workerGroupSpecs"]
        found["worker"] = group["template"]
    return found


def containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for pod in pods(doc).values() for c in pod["spec"]["containers"]]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_chart_yaml_loads_with_camel_case_fields(tmp_path: Path) -> None:
    path = tmp_path / "rayjob.yaml"
    path.write_text(CHART_YAML)
    t = load_template(path)
    assert t.image_pull_policy == "IfNotPresent"
    assert t.workers.gpus_per_worker == 8
    assert t.workers.node_selector == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert t.head.resources.limits == {"cpu": "4", "memory": "16Gi"}  # YAML number 4 became the quantity "4"
    assert t.runtime_env.env_vars == {"HF_HUB_OFFLINE": "1"}
    assert t.ray_token_secret is not None and t.ray_token_secret.key == "auth_token"


def test_top_level_fields(doc: dict[str, Any]) -> None:
    assert doc["apiVersion"] == "ray.io/v1"
    assert doc["kind"] == "RayJob"
    assert doc["metadata"] == {"name": "fp8rl-step", "namespace": "ml", "labels": {"app.kubernetes.io/name": "fp8rl"}}
    spec = doc["spec"]
    assert spec["entrypoint"] == "python -m fp8rl.cluster.driver --config /data/run.yaml"
    assert spec["submissionMode"] == "K8sJobMode"
    assert spec["shutdownAfterJobFinishes"] is True
    assert spec["ttlSecondsAfterFinished"] == 300
    assert spec["activeDeadlineSeconds"] == 86400
    assert yaml.safe_load(spec["runtimeEnvYAML"]) == {"env_vars": {"HF_HUB_OFFLINE": "1"}}
    assert "clusterSelector" not in spec


def test_head_and_one_gpu_worker_group(doc: dict[str, Any]) -> None:
    cluster = doc["spec"]["rayClusterSpec"]
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["name"] == "ray-head"
    assert head["image"] == "ghcr.io/example/fp8rl-gpu:0.1.0"
    assert head["resources"] == {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"cpu": "4", "memory": "16Gi"}}
    assert "nvidia.com/gpu" not in head["resources"]["limits"]
    assert {p["name"]: p["containerPort"] for p in head["ports"]} == {
        "gcs-server": 6379,
        "dashboard": 8265,
        "client": 10001,
    }
    (group,) = cluster["workerGroupSpecs"]
    assert group["groupName"] == "gpu"
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 2


def test_gpu_limits_tolerations_node_selector(doc: dict[str, Any]) -> None:
    worker_pod = pods(doc)["worker"]["spec"]
    (worker,) = worker_pod["containers"]
    assert worker["resources"]["limits"] == {"cpu": "32", "memory": "256Gi", "nvidia.com/gpu": "8"}
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == "8"
    assert worker_pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert worker_pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}


def test_shm_and_pvc_on_ray_pods(doc: dict[str, Any]) -> None:
    for role in ("head", "worker"):
        spec = pods(doc)[role]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["dshm"] == {"name": "dshm", "emptyDir": {"medium": "Memory"}}
        assert volumes["tmp"] == {"name": "tmp", "emptyDir": {}}  # the root filesystem is read-only
        assert volumes["data"] == {"name": "data", "persistentVolumeClaim": {"claimName": "fp8rl-data"}}
        mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
        assert mounts == {"/dev/shm": "dshm", "/tmp": "tmp", "/data": "data"}


def test_no_pvc_means_only_shm_and_tmp() -> None:
    doc = build_rayjob(parse_template(chart_data(pvcName=None)), "fp8rl-step", "python x.py")
    spec = pods(doc)["worker"]["spec"]
    assert [v["name"] for v in spec["volumes"]] == ["dshm", "tmp"]
    assert [m["mountPath"] for m in spec["containers"][0]["volumeMounts"]] == ["/dev/shm", "/tmp"]


def test_env_mlflow_and_token_on_ray_containers(doc: dict[str, Any]) -> None:
    token = {"secretKeyRef": {"name": "ray-token", "key": "auth_token"}}
    for role in ("head", "worker"):
        env = env_of(pods(doc)[role]["spec"]["containers"][0])
        assert env == {
            "HOME": "/tmp",
            "MLFLOW_TRACKING_URI": "http://fp8rl-mlflow:5000",
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": token,
        }
    # The submitter talks to the dashboard, so it needs the token but not MLflow.
    assert env_of(pods(doc)["submitter"]["spec"]["containers"][0]) == {
        "HOME": "/tmp",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": token,
    }


def test_auth_off_sets_no_auth_env() -> None:
    doc = build_rayjob(
        parse_template(chart_data(rayTokenSecret=None, mlflowTrackingUri=None)), "fp8rl-step", "python x.py"
    )
    for c in containers(doc):
        assert env_of(c) == {"HOME": "/tmp"}, c["name"]
    assert "authOptions" not in doc["spec"]["rayClusterSpec"]


def test_the_operator_reads_the_same_token_secret() -> None:
    """authOptions names the chart's Secret: the operator's status requests to the dashboard carry the token (else
    they are refused and the RayJob fails after its submitter ends, as a real node showed), and KubeRay generates
    no Secret of its own; the token must be under KubeRay's key."""
    doc = build_rayjob(parse_template(chart_data()), "fp8rl-step", "python x.py")
    assert doc["spec"]["rayClusterSpec"]["authOptions"] == {"mode": "token", "secretName": "ray-token"}
    assert doc["spec"]["rayClusterSpec"]["rayVersion"] == "2.60.0"  # KubeRay refuses token auth without it
    with pytest.raises(ConfigError, match="rayTokenSecret needs rayVersion"):
        parse_template(chart_data(rayVersion=None))
    with pytest.raises(ConfigError, match="rayTokenSecret.key is 'token'"):
        parse_template(chart_data(rayTokenSecret={"name": "tok", "key": "token"}))


def test_token_secret_key_defaults_to_kuberay_convention() -> None:
    t = parse_template(chart_data(rayTokenSecret={"name": "tok"}))
    doc = build_rayjob(t, "fp8rl-step", "python x.py")
    env = env_of(pods(doc)["head"]["spec"]["containers"][0])
    assert env["RAY_AUTH_TOKEN"] == {"secretKeyRef": {"name": "tok", "key": "auth_token"}}


def test_security_context_and_resources_on_every_container(doc: dict[str, Any]) -> None:
    assert len(containers(doc)) == 3
    for c in containers(doc):
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc["runAsNonRoot"] is True, c["name"]
        assert sc["capabilities"] == {"drop": ["ALL"]}, c["name"]
        assert c["resources"]["requests"] and c["resources"]["limits"], c["name"]
        assert c["imagePullPolicy"] == "IfNotPresent"
    for role, pod in pods(doc).items():
        psc = pod["spec"]["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0, role
        assert pod["spec"]["serviceAccountName"] == "fp8rl-ray", role


def test_pod_labels_let_submit_find_every_pod(doc: dict[str, Any]) -> None:
    for role, pod in pods(doc).items():
        labels = pod["metadata"]["labels"]
        assert labels[RAYJOB_LABEL] == "fp8rl-step"
        assert labels[ROLE_LABEL] == role
        assert labels["app.kubernetes.io/name"] == "fp8rl"


def test_submitter_pod_is_a_valid_job_template(doc: dict[str, Any]) -> None:
    spec = pods(doc)["submitter"]["spec"]
    assert spec["restartPolicy"] == "Never"
    (c,) = spec["containers"]
    assert c["name"] == "ray-job-submitter"
    assert "command" not in c  # KubeRay fills in `ray job submit ... ; ray job logs --follow`


def test_optional_fields_left_out_when_unset() -> None:
    data = chart_data(activeDeadlineSeconds=None, runtimeEnv=None, serviceAccountName=None)
    doc = build_rayjob(parse_template(data), "fp8rl-step", "python x.py")
    assert "activeDeadlineSeconds" not in doc["spec"]
    assert "runtimeEnvYAML" not in doc["spec"]
    assert "labels" not in doc["metadata"]
    assert all("serviceAccountName" not in p["spec"] for p in pods(doc).values())


def test_cluster_selector_variant(template: RayJobTemplate) -> None:
    doc = build_rayjob_for_cluster(template, "fp8rl-step", "python x.py", "shared-ray", "ml")
    spec = doc["spec"]
    assert spec["clusterSelector"] == {"ray.io/cluster": "shared-ray"}
    assert "rayClusterSpec" not in spec
    # The cluster is not ours: nothing asks KubeRay to shut it down.
    assert "shutdownAfterJobFinishes" not in spec and "ttlSecondsAfterFinished" not in spec
    assert spec["activeDeadlineSeconds"] == 86400
    # MLflow cannot go into the existing pods' env, so it travels in the runtime env.
    assert yaml.safe_load(spec["runtimeEnvYAML"]) == {
        "env_vars": {"HF_HUB_OFFLINE": "1", "MLFLOW_TRACKING_URI": "http://fp8rl-mlflow:5000"}
    }
    (c,) = spec["submitterPodTemplate"]["spec"]["containers"]
    assert env_of(c)["RAY_AUTH_MODE"] == "token"
    assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_runtime_env_value_wins_over_template_mlflow_in_cluster_variant() -> None:
    data = chart_data(runtimeEnv={"env_vars": {"MLFLOW_TRACKING_URI": "http://other:5000"}})
    doc = build_rayjob_for_cluster(parse_template(data), "fp8rl-step", "python x.py", "shared-ray")
    assert yaml.safe_load(doc["spec"]["runtimeEnvYAML"])["env_vars"]["MLFLOW_TRACKING_URI"] == "http://other:5000"


@pytest.mark.parametrize("name", ["Fp8rl", "1step", "step_1", "step-", "x" * 48, ""])
def test_bad_rayjob_names_are_refused(template: RayJobTemplate, name: str) -> None:
    with pytest.raises(ConfigError, match="DNS-1035"):
        build_rayjob(template, name, "python x.py")


def test_empty_entrypoint_or_cluster_name_refused(template: RayJobTemplate) -> None:
    with pytest.raises(ConfigError, match="entrypoint"):
        build_rayjob(template, "fp8rl-step", "  ")
    with pytest.raises(ConfigError, match="clusterSelector"):
        build_rayjob_for_cluster(template, "fp8rl-step", "python x.py", "")


# ---------------------------------------------------------------- load_template errors


def write(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "rayjob.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_missing_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml: RayJob template not found"):
        load_template(tmp_path / "nope.yaml")


def test_unknown_field_is_named(tmp_path: Path) -> None:
    data = chart_data()
    data["workers"]["gpuPerWorker"] = 8  # typo of gpusPerWorker
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as e:
        load_template(path)
    assert str(path) in str(e.value)
    assert "workers.gpuPerWorker: Extra inputs are not permitted" in str(e.value)


def test_snake_case_top_level_field_is_unknown(tmp_path: Path) -> None:
    # The chart renders camelCase; a snake_case key is someone's typo, not an alias.
    data = chart_data()
    data["image_pull_policy"] = data.pop("imagePullPolicy")
    with pytest.raises(ConfigError, match="image_pull_policy: Extra inputs are not permitted"):
        load_template(write(tmp_path, data))


@pytest.mark.parametrize(
    ("override", "field"),
    [
        (
            {"workers": {"replicas": "two", "gpusPerWorker": 1, "resources": {"limits": {"cpu": 1, "memory": "1Gi"}}}},
            "workers.replicas",
        ),
        (
            {"workers": {"replicas": 1, "gpusPerWorker": -1, "resources": {"limits": {"cpu": 1, "memory": "1Gi"}}}},
            "workers.gpusPerWorker",
        ),
        ({"imagePullPolicy": "Sometimes"}, "imagePullPolicy"),
        ({"ttlSecondsAfterFinished": -1}, "ttlSecondsAfterFinished"),
        ({"activeDeadlineSeconds": 0}, "activeDeadlineSeconds"),
        ({"head": {"resources": {"limits": {"cpu": "four", "memory": "1Gi"}}}}, "head.resources.limits"),
        ({"head": {"resources": {"limits": {"cpu": "1"}}}}, "head.resources"),
        ({"rayTokenSecret": {"key": "auth_token"}}, "rayTokenSecret.name"),
        ({"runtimeEnv": {"env_vars": {"A": "1"}, "pip": ["x"]}}, "runtimeEnv.pip"),
    ],
)
def test_bad_values_name_the_field(tmp_path: Path, override: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_template(write(tmp_path, chart_data(**override)))
    assert f"  {field}" in str(e.value), str(e.value)


def test_gpus_only_through_gpus_per_worker(tmp_path: Path) -> None:
    workers = {
        "replicas": 1,
        "gpusPerWorker": 8,
        "resources": {"limits": {"cpu": 1, "memory": "1Gi", "nvidia.com/gpu": 4}},
    }
    with pytest.raises(ConfigError, match="disagrees with gpusPerWorker=8"):
        load_template(write(tmp_path, chart_data(workers=workers)))


def test_ttl_without_shutdown_is_refused_before_kuberay_does(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="requires shutdownAfterJobFinishes"):
        load_template(write(tmp_path, chart_data(shutdownAfterJobFinishes=False)))


def test_bad_yaml_and_non_mapping(tmp_path: Path) -> None:
    path = tmp_path / "rayjob.yaml"
    path.write_text("image: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_template(path)
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_template(path)
