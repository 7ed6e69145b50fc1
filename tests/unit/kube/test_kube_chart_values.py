"""The chart's values that matter, asserted on real `helm template` output (parsed YAML)."""

from __future__ import annotations

import base64
import re
import tomllib
from pathlib import Path

import pytest
import yaml
from kube_chart import CHART, CI_VALUES, NAMESPACE, REPO, containers, pod_specs, stage_chart

from fp8rl.config import BUILTIN_RECIPES

DEFAULTS_CM = "rel-fp8rl-rayjob-defaults"
MLFLOW_URL = f"http://rel-fp8rl-mlflow.{NAMESPACE}.svc.cluster.local:5000"
GPU = "nvidia.com/gpu"


@pytest.fixture
def render(render):
    """The chart's renders with its standing RayCluster on (``ray.enabled``, off by default), unless a test sets
    ``ray__enabled`` or renders values files (which say what they want)."""

    def _render(*values_files, **set_values):
        return render(*values_files, **({} if values_files else {"ray__enabled": True}) | set_values)

    return _render


def worker_group(rendered) -> dict:
    (group,) = rendered.one("RayCluster")["spec"]["workerGroupSpecs"]
    return group


def ray_container(pod_template: dict) -> dict:
    return pod_template["spec"]["containers"][0]


def rayjob_defaults(rendered) -> dict:
    return yaml.safe_load(rendered.one("ConfigMap", "-rayjob-defaults")["data"]["rayjob.yaml"])


def mlflow_container(rendered) -> dict:
    return rendered.one("Deployment", "-mlflow")["spec"]["template"]["spec"]["containers"][0]


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def helm_fails(helm, staged_chart: Path, kube_version: str, *set_json: str) -> str:
    args = ["template", "rel", str(staged_chart), "--kube-version", kube_version]
    for s in set_json:
        args += ["--set-json", s]
    proc = helm(*args, check=False)
    assert proc.returncode != 0, f"helm template {set_json} should fail"
    return proc.stderr


# --------------------------------------------------------------------------------------- GPU workers


def test_workers_request_the_gpus_per_worker(render) -> None:
    for gpus in (1, 8):
        res = ray_container(worker_group(render(ray__worker__gpusPerWorker=gpus))["template"])["resources"]
        assert res["requests"][GPU] == gpus and res["limits"][GPU] == gpus
        assert res["limits"]["memory"] == "64Gi"  # the configured resources survive the merge


def test_rayjob_workers_may_be_cpu_only(render) -> None:
    """gpusPerWorker 0 (a cluster without GPUs, such as make cluster-up's node): CPU workers, no GPU anywhere."""
    from fp8rl.kube.rayjob import build_rayjob
    from fp8rl.kube.rayjob_template import parse_template

    workers = rayjob_defaults(render(ray__worker__gpusPerWorker=0))["workers"]
    assert workers["gpusPerWorker"] == 0 and GPU not in workers["resources"].get("limits", {})
    template = parse_template(rayjob_defaults(render(ray__worker__gpusPerWorker=0)))
    doc = build_rayjob(template, "cpu-job", ["true"])
    container = doc["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert GPU not in container["resources"]["limits"] and GPU not in container["resources"]["requests"]


def test_cpu_only_workers_and_the_head_request_no_gpu(render) -> None:
    rendered = render(ray__worker__gpusPerWorker=0, rayJob__workers__gpusPerWorker=1)
    res = ray_container(worker_group(rendered)["template"])["resources"]
    assert GPU not in res["requests"] and GPU not in res["limits"]
    head = ray_container(render().one("RayCluster")["spec"]["headGroupSpec"]["template"])
    assert GPU not in head["resources"]["limits"]


def test_workers_tolerate_gpu_taints_and_use_node_selectors(render) -> None:
    group = worker_group(render(ray__worker__nodeSelector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}))
    spec = group["template"]["spec"]
    assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (1, 1, 4)


def test_ray_pods_mount_shared_memory_tmp_and_the_data_pvc(render) -> None:
    cluster = render(ray__worker__sharedMemorySize="32Gi").one("RayCluster")["spec"]
    for template, shm in ((cluster["headGroupSpec"]["template"], "4Gi"), (worker_group_spec(cluster), "32Gi")):
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert volumes["shared-mem"]["emptyDir"] == {"medium": "Memory", "sizeLimit": shm}
        assert volumes["data"]["persistentVolumeClaim"]["claimName"] == "rel-fp8rl-data"
        mounts = {m["mountPath"]: m["name"] for m in ray_container(template)["volumeMounts"]}
        assert mounts == {"/dev/shm": "shared-mem", "/tmp": "tmp", "/data": "data"}


def worker_group_spec(cluster_spec: dict) -> dict:
    return cluster_spec["workerGroupSpecs"][0]["template"]


def test_replicas_outside_min_max_fail(helm, staged_chart: Path, kube_version: str) -> None:
    err = helm_fails(helm, staged_chart, kube_version, "ray.enabled=true", "ray.worker.replicas=9")
    assert "minReplicas (1) <= replicas (9) <= maxReplicas (4)" in err


def test_ray_version_matches_constraints(render) -> None:
    pinned = re.search(r"^ray==(\S+)$", (REPO / "constraints.txt").read_text(), re.M)
    assert pinned, "ray is not pinned in constraints.txt"
    assert render().one("RayCluster")["spec"]["rayVersion"] == pinned.group(1)


def test_app_version_is_the_project_version() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"] == project


# --------------------------------------------------------------------------------------- autoscaling


def test_autoscaling_off_by_default(render) -> None:
    spec = render().one("RayCluster")["spec"]
    assert spec["enableInTreeAutoscaling"] is False and "autoscalerOptions" not in spec
    assert spec["headGroupSpec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_autoscaling_on(render) -> None:
    spec = render(ray__autoscaling__enabled=True, ray__autoscaling__idleTimeoutSeconds=120).one("RayCluster")["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    options = spec["autoscalerOptions"]
    assert options["version"] == "v2" and options["idleTimeoutSeconds"] == 120
    assert options["securityContext"]["allowPrivilegeEscalation"] is False
    assert options["resources"]["limits"] and options["resources"]["requests"]
    assert options["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]  # a volume of the head pod
    assert {"name": "HOME", "value": "/tmp"} in options["env"]
    # the sidecar needs an API token in the head pod; workers never get one
    assert spec["headGroupSpec"]["template"]["spec"]["automountServiceAccountToken"] is True
    assert worker_group_spec(spec)["spec"]["automountServiceAccountToken"] is False


# --------------------------------------------------------------------------------------- Ray auth


def test_ray_token_auth_on_by_default(render) -> None:
    rendered = render()
    assert rendered.one("RayCluster")["spec"]["authOptions"] == {"mode": "token", "secretName": "rel-fp8rl-ray-token"}
    secret = rendered.one("Secret", "-ray-token")
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert len(base64.b64decode(secret["data"]["auth_token"])) == 48
    assert rayjob_defaults(rendered)["rayTokenSecret"] == {"name": "rel-fp8rl-ray-token", "key": "auth_token"}
    probe = rendered.one("Pod", "-test-ray-head")["spec"]["containers"][0]
    assert env_of(probe)["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "rel-fp8rl-ray-token",
        "key": "auth_token",
    }


def test_ray_token_from_an_existing_secret(render) -> None:
    rendered = render(ray__auth__existingSecret="my-token")
    assert rendered.one("RayCluster")["spec"]["authOptions"]["secretName"] == "my-token"
    assert rendered.names("Secret") == set()
    assert rayjob_defaults(rendered)["rayTokenSecret"] == {"name": "my-token", "key": "auth_token"}


def test_ray_auth_off(render) -> None:
    rendered = render(ray__auth__enabled=False)
    assert "authOptions" not in rendered.one("RayCluster")["spec"]
    assert rendered.names("Secret") == set()
    assert "rayTokenSecret" not in rayjob_defaults(rendered)
    assert "env" not in rendered.one("Pod", "-test-ray-head")["spec"]["containers"][0]


# --------------------------------------------------------------------------------------- MLflow


def test_mlflow_defaults_sqlite_and_artifacts_on_a_pvc(render) -> None:
    rendered = render()
    container = mlflow_container(rendered)
    args = container["args"]
    assert "--backend-store-uri=sqlite:////mlflow/mlflow.db" in args
    assert "--serve-artifacts" in args and "--artifacts-destination=/mlflow/artifacts" in args
    assert "--workers=2" in args and not any(a.startswith("--app-name") for a in args)
    assert env_of(container)["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"]["value"] == "false"
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/tmp", "/mlflow"}
    pvc = rendered.one("PersistentVolumeClaim", "-mlflow")
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
    deployment = rendered.one("Deployment", "-mlflow")
    assert deployment["spec"]["strategy"] == {"type": "Recreate"} and deployment["spec"]["replicas"] == 1


def test_mlflow_probes_use_health(render) -> None:
    container = mlflow_container(render())
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe


def test_mlflow_accepts_its_service_names_as_host(render) -> None:
    (hosts,) = [
        a.split("=", 1)[1].split(",") for a in mlflow_container(render())["args"] if a.startswith("--allowed-hosts")
    ]
    host = MLFLOW_URL.removeprefix("http://").split(":")[0]
    assert {host, f"{host}:*", "rel-fp8rl-mlflow:*", "localhost:*", "10.*"} <= set(hosts)


def test_mlflow_postgresql_and_s3(render) -> None:
    rendered = render(
        mlflow__backend__type="postgresql",
        mlflow__backend__postgresql__existingSecret="pg",
        mlflow__artifacts__type="s3",
        mlflow__artifacts__s3={
            "bucket": "b",
            "prefix": "p",
            "endpointUrl": "https://minio:9000",
            "existingSecret": "s3",
        },
    )
    container = mlflow_container(rendered)
    assert not any(a.startswith("--backend-store-uri") for a in container["args"])
    assert "--artifacts-destination=s3://b/p" in container["args"]
    env = env_of(container)
    assert env["MLFLOW_BACKEND_STORE_URI"]["valueFrom"]["secretKeyRef"] == {"name": "pg", "key": "uri"}
    assert env["MLFLOW_S3_ENDPOINT_URL"]["value"] == "https://minio:9000"
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "s3", "key": "AWS_SECRET_ACCESS_KEY"}
    # nothing left on a volume: no PVC, no /mlflow mount
    assert "rel-fp8rl-mlflow" not in rendered.names("PersistentVolumeClaim")
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/tmp"}


@pytest.mark.parametrize(
    ("backend", "artifacts", "pvc"),
    [("sqlite", "s3", True), ("postgresql", "pvc", True), ("postgresql", "s3", False)],
)
def test_mlflow_pvc_exists_exactly_when_something_lives_on_it(render, backend, artifacts, pvc) -> None:
    rendered = render(
        mlflow__backend__type=backend,
        mlflow__backend__postgresql__existingSecret="pg",
        mlflow__artifacts__type=artifacts,
        mlflow__artifacts__s3__bucket="b",
    )
    assert ("rel-fp8rl-mlflow" in rendered.names("PersistentVolumeClaim")) is pvc


def test_mlflow_storage_without_its_settings_fails(helm, staged_chart: Path, kube_version: str) -> None:
    err = helm_fails(helm, staged_chart, kube_version, 'mlflow.backend.type="postgresql"')
    assert "mlflow.backend.postgresql.existingSecret is required" in err
    err = helm_fails(helm, staged_chart, kube_version, 'mlflow.artifacts.type="s3"')
    assert "mlflow.artifacts.s3.bucket is required" in err


def test_mlflow_basic_auth_on(render) -> None:
    rendered = render(
        mlflow__auth__enabled=True,
        mlflow__backend__type="postgresql",
        mlflow__backend__postgresql__existingSecret="pg",
        mlflow__artifacts__type="s3",
        mlflow__artifacts__s3__bucket="b",
    )
    container = mlflow_container(rendered)
    assert "--app-name=basic-auth" in container["args"]
    env = env_of(container)
    assert env["MLFLOW_AUTH_ADMIN_USERNAME"]["value"] == "admin"
    for name, key in (
        ("MLFLOW_AUTH_ADMIN_PASSWORD", "admin-password"),
        ("MLFLOW_FLASK_SERVER_SECRET_KEY", "flask-secret-key"),
    ):
        assert env[name]["valueFrom"]["secretKeyRef"] == {"name": "rel-fp8rl-mlflow-auth", "key": key}
    secret = rendered.one("Secret", "-mlflow-auth")
    assert set(secret["data"]) == {"admin-password", "flask-secret-key"}
    assert all(len(base64.b64decode(v)) == 48 for v in secret["data"].values())
    # the pipeline steps' credentials (pipelines/cluster.py mlflow_secret): a user of their own, not the admin
    client = rendered.one("Secret", "-mlflow-client")
    assert client["metadata"]["name"] == "rel-fp8rl-mlflow-client"
    assert base64.b64decode(client["data"]["username"]) == b"fp8rl-pipeline"
    assert len(base64.b64decode(client["data"]["password"])) == 48
    assert client["data"]["password"] != secret["data"]["admin-password"]
    ini = rendered.one("ConfigMap", "-mlflow-auth")["data"]["basic_auth.ini"]
    assert "database_uri = sqlite:////mlflow/basic_auth.db" in ini and "admin_password" not in ini
    assert env["MLFLOW_AUTH_CONFIG_PATH"]["value"] == "/etc/mlflow-auth/basic_auth.ini"
    # the auth database needs the volume even with PostgreSQL + S3
    assert "rel-fp8rl-mlflow" in rendered.names("PersistentVolumeClaim")
    # Ray pods get credentials to log runs
    head = ray_container(rendered.one("RayCluster")["spec"]["headGroupSpec"]["template"])
    assert env_of(head)["MLFLOW_TRACKING_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "rel-fp8rl-mlflow-client",
        "key": "password",
    }


def test_mlflow_basic_auth_off_and_existing_secret(render) -> None:
    off = render()
    assert off.names("Secret") == {"rel-fp8rl-ray-token"}
    assert "rel-fp8rl-mlflow-auth" not in off.names("ConfigMap")
    assert "MLFLOW_TRACKING_PASSWORD" not in env_of(
        ray_container(off.one("RayCluster")["spec"]["headGroupSpec"]["template"])
    )
    existing = render(mlflow__auth__enabled=True, mlflow__auth__existingSecret="mine")
    assert "rel-fp8rl-mlflow-auth" not in existing.names("Secret")
    env = env_of(mlflow_container(existing))
    assert env["MLFLOW_AUTH_ADMIN_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "mine"


def test_mlflow_disabled(render) -> None:
    rendered = render(mlflow__enabled=False)
    assert not rendered.kinds("Deployment") and not rendered.kinds("Service")
    assert "mlflowTrackingUri" not in rayjob_defaults(rendered)
    assert "MLFLOW_TRACKING_URI" not in env_of(
        ray_container(rendered.one("RayCluster")["spec"]["headGroupSpec"]["template"])
    )
    external = render(mlflow__enabled=False, mlflow__externalTrackingUri="https://mlflow.example.com")
    assert rayjob_defaults(external)["mlflowTrackingUri"] == "https://mlflow.example.com"


# --------------------------------------------------------------------------------------- RBAC, accounts


def test_rbac_rules_are_exactly_what_the_pipeline_step_needs(render) -> None:
    rendered = render()
    role = rendered.one("Role")
    rules = {
        (tuple(r["apiGroups"]), tuple(r["resources"]), tuple(r.get("resourceNames", ()))): sorted(r["verbs"])
        for r in role["rules"]
    }
    assert rules == {
        (("ray.io",), ("rayjobs",), ()): ["create", "delete", "get", "watch"],
        (("ray.io",), ("rayclusters",), ()): ["get", "list", "watch"],
        (("",), ("pods",), ()): ["get", "list"],
        (("",), ("pods/log",), ()): ["get"],
        (("",), ("events",), ()): ["list"],
        (("",), ("configmaps",), (DEFAULTS_CM,)): ["get"],
    }
    assert len(role["rules"]) == len(rules)
    assert not rendered.kinds("ClusterRole") and not rendered.kinds("ClusterRoleBinding")
    binding = rendered.one("RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rel-fp8rl-pipeline", "namespace": NAMESPACE}]


def test_service_accounts(render) -> None:
    rendered = render()
    assert rendered.names("ServiceAccount") == {"rel-fp8rl-pipeline", "rel-fp8rl-ray"}
    assert rendered.one("ServiceAccount", "-ray")["automountServiceAccountToken"] is False
    for _, spec in pod_specs(rendered.one("RayCluster")):
        assert spec["serviceAccountName"] == "rel-fp8rl-ray"
    external = render(next(f for f in CI_VALUES if f.name == "external-mlflow-values.yaml"))
    assert not external.kinds("ServiceAccount") and not external.kinds("Role")
    assert rayjob_defaults(external)["serviceAccountName"] == "ray-workloads"


# --------------------------------------------------------------------------------------- pod security


def all_renders(render) -> dict[str, object]:
    cases = {"defaults": render(), "autoscaling": render(ray__autoscaling__enabled=True)}
    cases |= {f.stem: render(f) for f in CI_VALUES}
    return cases


def test_every_pod_runs_as_non_root_with_seccomp(render) -> None:
    checked = 0
    for case, rendered in all_renders(render).items():
        for doc in rendered.docs:
            for where, spec in pod_specs(doc):
                sc = spec["securityContext"]
                assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0, f"{case}: {where}"
                assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, f"{case}: {where}"
                checked += 1
    assert checked >= 12


def test_every_container_is_locked_down(render) -> None:
    checked = 0
    for case, rendered in all_renders(render).items():
        for doc in rendered.docs:
            for where, container in containers(doc):
                sc = container.get("securityContext") or {}
                assert sc.get("allowPrivilegeEscalation") is False, f"{case}: {where}"
                assert sc.get("privileged") is False and sc.get("runAsNonRoot") is True, f"{case}: {where}"
                assert sc.get("capabilities") == {"drop": ["ALL"]}, f"{case}: {where}"
                assert sc.get("readOnlyRootFilesystem") is True, f"{case}: {where}"
                checked += 1
    assert checked >= 20  # head, workers, MLflow, two test pods, autoscaler, across the renders


def test_every_container_has_requests_and_limits(render) -> None:
    for case, rendered in all_renders(render).items():
        for doc in rendered.docs:
            for where, container in containers(doc):
                res = container.get("resources") or {}
                for part in ("requests", "limits"):
                    assert {"cpu", "memory"} <= set(res.get(part) or {}), f"{case}: {where} lacks {part}"


def test_ray_security_context_override_merges(render) -> None:
    spec = render(ray__containerSecurityContext={"readOnlyRootFilesystem": False}).one("RayCluster")["spec"]
    sc = ray_container(spec["headGroupSpec"]["template"])["securityContext"]
    assert sc["readOnlyRootFilesystem"] is False and sc["allowPrivilegeEscalation"] is False
    assert mlflow_container(render())["securityContext"]["readOnlyRootFilesystem"] is True


# --------------------------------------------------------------------------------------- storage


def test_data_pvc(render) -> None:
    pvc = render().one("PersistentVolumeClaim", "-data")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"]["resources"]["requests"]["storage"] == "500Gi"
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    existing = render(storage__existingClaim="models")
    assert "rel-fp8rl-data" not in existing.names("PersistentVolumeClaim")
    assert rayjob_defaults(existing)["pvcName"] == "models"
    volumes = {v["name"]: v for v in worker_group_spec(existing.one("RayCluster")["spec"])["spec"]["volumes"]}
    assert volumes["data"]["persistentVolumeClaim"]["claimName"] == "models"


@pytest.mark.parametrize(
    ("set_json", "complaint"),
    [
        (("ray.worker.replicas=0", "ray.worker.minReplicas=0"), "RayJob clusters need workers"),
        (("rayJob.shutdownAfterJobFinishes=false",), "needs rayJob.shutdownAfterJobFinishes: true"),
        (('rayJob.runtimeEnv={"pip": ["x"]}',), "'/rayJob/runtimeEnv'"),
    ],
)
def test_rayjob_defaults_the_component_would_refuse_fail_at_install(
    helm, staged_chart: Path, kube_version: str, set_json: tuple[str, ...], complaint: str
) -> None:
    assert complaint in helm_fails(helm, staged_chart, kube_version, *set_json)


def test_no_models_pvc_at_all_fails(helm, staged_chart: Path, kube_version: str) -> None:
    err = helm_fails(helm, staged_chart, kube_version, "storage.create=false")
    assert "storage.existingClaim is required when storage.create is false" in err


def test_pods_get_no_service_links(render) -> None:
    for doc in render(ray__autoscaling__enabled=True).docs:
        for where, spec in pod_specs(doc):
            assert spec["enableServiceLinks"] is False, where  # a Service named mlflow would set MLFLOW_PORT


# --------------------------------------------------------------------------------------- RayJob defaults


def test_rayjob_defaults_contract(render) -> None:
    rendered = render(ray__enabled=False)  # the default: each RayJob brings its own cluster
    cm = rendered.one("ConfigMap", "-rayjob-defaults")
    assert cm["metadata"]["name"] == DEFAULTS_CM
    assert set(cm["data"]) == {"mlflowTrackingUri", "rayjob.yaml", *(f"recipe-{r}.yaml" for r in BUILTIN_RECIPES)}
    d = rayjob_defaults(rendered)
    # the pipeline steps' $MLFLOW_TRACKING_URI (pipelines/cluster.py) is the RayJob's tracking URI
    assert cm["data"]["mlflowTrackingUri"] == d["mlflowTrackingUri"]
    assert set(d) == {
        "image", "imagePullPolicy", "serviceAccountName", "head", "workers", "runtimeEnv",
        "shutdownAfterJobFinishes", "ttlSecondsAfterFinished", "activeDeadlineSeconds",
        "mlflowTrackingUri", "rayTokenSecret", "pvcName", "rayVersion", "pod",
    }  # fmt: skip
    ray_pin = re.search(r"^ray==(\S+)$", (REPO / "constraints.txt").read_text(), re.M)
    assert ray_pin and d["rayVersion"] == ray_pin.group(1)  # KubeRay refuses token auth without rayVersion
    assert d["image"] == "fp8rl-runtime:0.1.0" and d["imagePullPolicy"] == "IfNotPresent"
    assert d["serviceAccountName"] == "rel-fp8rl-ray"
    assert d["head"] == {
        "resources": {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"cpu": "4", "memory": "16Gi"}},
        "tolerations": [],
        "nodeSelector": {},
    }
    workers = d["workers"]
    assert set(workers) == {"replicas", "gpusPerWorker", "resources", "tolerations", "nodeSelector"}
    assert workers["replicas"] == 1 and workers["gpusPerWorker"] == 1
    assert workers["resources"]["limits"][GPU] == 1 and workers["resources"]["requests"][GPU] == 1
    assert workers["tolerations"] == [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}]
    assert d["runtimeEnv"] == {"env_vars": {"HF_HOME": "/data/huggingface", "PYTHONUNBUFFERED": "1"}}
    assert d["shutdownAfterJobFinishes"] is True
    assert d["ttlSecondsAfterFinished"] == 3600 and d["activeDeadlineSeconds"] == 86400
    assert d["mlflowTrackingUri"] == MLFLOW_URL
    assert d["pvcName"] == "rel-fp8rl-data"
    # the URL is the Service the chart renders
    assert rendered.one("Service")["metadata"]["name"] == "rel-fp8rl-mlflow"
    assert not rendered.kinds("RayCluster")  # nothing idle by default


def test_a_standing_raycluster_is_the_one_the_rl_steps_use(render) -> None:
    """ray.enabled: the RayCluster, and the RayJob defaults name it, so the RL step runs its RayJob on it
    (fp8rl.kube.rl_step: clusterSelector) instead of bringing a cluster of its own."""
    from fp8rl.kube.rayjob import build_rayjob_for_cluster
    from fp8rl.kube.rayjob_template import parse_template

    rendered = render(ray__enabled=True)
    cluster = rendered.one("RayCluster")["metadata"]["name"]
    template = parse_template(rayjob_defaults(rendered))
    assert template.ray_cluster_name == cluster == "rel-fp8rl-ray"
    doc = build_rayjob_for_cluster(template, "job", ["true"], template.ray_cluster_name, NAMESPACE)
    assert doc["spec"]["clusterSelector"] == {"ray.io/cluster": cluster} and "rayClusterSpec" not in doc["spec"]
    assert rendered.one("Service")["spec"]["ports"][0]["port"] == 5000


def test_rayjob_defaults_follow_the_cluster_unless_overridden(render) -> None:
    inherited = rayjob_defaults(render(ray__worker__gpusPerWorker=4, ray__worker__replicas=2))["workers"]
    assert inherited["gpusPerWorker"] == 4 and inherited["replicas"] == 2
    assert inherited["resources"]["limits"][GPU] == 4
    own = rayjob_defaults(
        render(
            rayJob__workers={"replicas": 3, "gpusPerWorker": 8, "tolerations": [], "nodeSelector": {"pool": "h200"}},
            images__registry="reg.example.com/ml",
        )
    )
    assert own["workers"]["replicas"] == 3 and own["workers"]["gpusPerWorker"] == 8
    assert own["workers"]["resources"]["requests"][GPU] == 8
    assert own["workers"]["tolerations"] == [] and own["workers"]["nodeSelector"] == {"pool": "h200"}
    assert own["image"] == "reg.example.com/ml/fp8rl-runtime:0.1.0"


def test_rayjob_defaults_without_a_standing_cluster(render) -> None:
    rendered = render(next(f for f in CI_VALUES if f.name == "rayjob-only-values.yaml"))
    assert not rendered.kinds("RayCluster")
    assert "rel-fp8rl-test-ray-head" not in rendered.names("Pod")
    d = rayjob_defaults(rendered)
    assert d["workers"]["replicas"] == 4 and d["workers"]["gpusPerWorker"] == 8
    assert d["pvcName"] == "shared-models" and "rayTokenSecret" not in d


@pytest.mark.parametrize("recipe", BUILTIN_RECIPES)
def test_recipe_copies_are_byte_identical(render, recipe: str) -> None:
    source = (REPO / "fp8rl" / "recipes" / f"{recipe}.yaml").read_bytes()
    copy = CHART / "files" / "recipes" / f"{recipe}.yaml"
    assert copy.is_file() and copy.read_bytes() == source, (
        f"charts/fp8rl/files/recipes/{recipe}.yaml is not a copy of fp8rl/recipes/{recipe}.yaml: make chart-recipes"
    )
    assert render().one("ConfigMap", "-rayjob-defaults")["data"][f"recipe-{recipe}.yaml"].encode() == source


def test_the_chart_holds_no_recipe_but_the_built_in_ones() -> None:
    # a copy left behind by a removed recipe would still be rendered (the ConfigMap globs files/recipes/)
    assert {p.stem for p in (CHART / "files" / "recipes").glob("*.yaml")} == set(BUILTIN_RECIPES), "make chart-recipes"


# --------------------------------------------------------------------------------------- schema, tests, notes


@pytest.mark.parametrize(
    ("set_json", "complaint"),
    [
        ('ray.worker.gpusPerWorker="eight"', "'/ray/worker/gpusPerWorker'"),
        ('mlflow.backend.type="mysql"', "'/mlflow/backend/type'"),
        ('ray.upgradeStrategy="Rolling"', "'/ray/upgradeStrategy'"),
        ('mlfow={"enabled": false}', "'mlfow'"),
        ("ray.head.resources.requests=null", "'/ray/head/resources'"),
        ("mlflow.resources=null", "'/mlflow'"),
        ('images.pullPolicy="Sometimes"', "'/images/pullPolicy'"),
    ],
)
def test_values_schema_rejects_bad_values(helm, staged_chart: Path, kube_version: str, set_json, complaint) -> None:
    err = helm_fails(helm, staged_chart, kube_version, set_json)
    assert "values don't meet the specifications of the schema" in err and complaint in err, err


def test_helm_test_hooks(render) -> None:
    rendered = render()
    pods = {p["metadata"]["name"]: p for p in rendered.kinds("Pod")}
    assert set(pods) == {"rel-fp8rl-test-mlflow", "rel-fp8rl-test-ray-head"}
    for pod in pods.values():
        assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
        assert pod["spec"]["restartPolicy"] == "Never"
    assert "http://rel-fp8rl-mlflow:5000/health" in pods["rel-fp8rl-test-mlflow"]["spec"]["containers"][0]["args"][0]
    # KubeRay names the head Service <raycluster>-head-svc
    cluster = rendered.one("RayCluster")["metadata"]["name"]
    assert (
        f"http://{cluster}-head-svc:8265/api/version"
        in pods["rel-fp8rl-test-ray-head"]["spec"]["containers"][0]["args"][0]
    )
    assert not render(mlflow__enabled=False, ray__enabled=False).kinds("Pod")


@pytest.fixture(scope="module")
def notes(helm, kube_version: str, tmp_path_factory: pytest.TempPathFactory):
    """NOTES.txt as rendered for given values (helm template does not print NOTES: a probe template does)."""
    chart = stage_chart(tmp_path_factory.mktemp("notes"))
    (chart / "templates" / "zz-notes-probe.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes-probe\ndata:\n"
        '  NOTES.txt: {{ include "fp8rl/templates/NOTES.txt" . | quote }}\n'
    )

    def _notes(*set_json: str) -> str:
        args = ["template", "rel", str(chart), "-n", NAMESPACE, "--kube-version", kube_version]
        args += ["--show-only", "templates/zz-notes-probe.yaml"]
        for s in set_json:
            args += ["--set-json", s]
        return yaml.safe_load(helm(*args).stdout)["data"]["NOTES.txt"]

    return _notes


def test_notes_tell_how_to_submit_and_open_mlflow(notes) -> None:
    text = notes()
    assert DEFAULTS_CM in text and "rel-fp8rl-pipeline" in text
    assert "python -m pipelines.submit" in text
    assert f"kubectl -n {NAMESPACE} port-forward svc/rel-fp8rl-mlflow 5000:5000" in text
    assert MLFLOW_URL in text and "RayJob that brings its own Ray cluster" in text
    assert "rel-fp8rl-ray-token" in notes("ray.enabled=true")
    auth = notes("mlflow.auth.enabled=true")
    assert "admin-password" in auth and "rel-fp8rl-mlflow-auth" in auth
    assert "port-forward svc/rel-fp8rl-mlflow" not in notes("mlflow.enabled=false")


# --------------------------------------------------------------------------------------- kuberay-operator


def test_chart_has_no_dependencies_and_installs_from_a_checkout_offline(helm, kube_version: str) -> None:
    """The committed chart itself (not a staged copy) renders and lints with no network and no charts/ dir:
    a declared dependency, even one switched off, makes Helm refuse it until `helm dependency update`."""
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert "dependencies" not in meta
    assert not (CHART / "charts").exists(), "vendor nothing"
    docs = [
        d for d in yaml.safe_load_all(helm("template", "rel", str(CHART), "--kube-version", kube_version).stdout) if d
    ]
    assert any(d["kind"] == "ConfigMap" for d in docs) and not any(d["kind"] == "RayCluster" for d in docs)
    lint = helm("lint", "--strict", "--kube-version", kube_version, str(CHART)).stdout
    assert "0 chart(s) failed" in lint and "[WARNING]" not in lint, lint


def test_a_leftover_kuberay_operator_block_is_refused(helm, staged_chart: Path, kube_version: str) -> None:
    err = helm_fails(helm, staged_chart, kube_version, 'kuberay-operator={"enabled": true}')
    assert "kuberay-operator" in err and "not allowed" in err, err


def test_chart_has_no_other_differences_from_the_staged_copy(staged_chart: Path) -> None:
    for path in CHART.rglob("*"):
        if path.is_file() and path.name != "Chart.yaml":
            assert (staged_chart / path.relative_to(CHART)).read_bytes() == path.read_bytes(), path


def test_every_value_is_documented() -> None:
    """helm-docs style: each key has a `# --` comment above it, or sits in a block that has one."""
    undocumented, stack = [], []  # stack of (indent, documented)
    comment = False
    for number, line in enumerate((CHART / "values.yaml").read_text().splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("# --"):
            comment = True
            continue
        if not stripped or stripped.startswith("#"):
            continue
        key = re.match(r"^(\s*)([A-Za-z0-9_.-]+):(.*)$", line)
        if not key or stripped.startswith("-"):
            comment = False
            continue
        indent = len(key.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        inherited = any(documented for _, documented in stack)
        is_leaf = key.group(3).strip() != ""
        if is_leaf and not (comment or inherited):
            undocumented.append(f"values.yaml:{number}: {stripped}")
        stack.append((indent, comment or inherited))
        comment = False
    assert not undocumented, "\n".join(undocumented)


# --------------------------------------------------------------------------------------- digests, NetworkPolicy


def test_images_by_digest_everywhere(render) -> None:
    rendered = render(CHART / "ci" / "locked-down-values.yaml")
    runtime = "registry.example.com/ml/fp8rl-runtime@sha256:" + "1" * 64
    component = "registry.example.com/ml/fp8rl-component@sha256:" + "2" * 64
    images = {c["image"] for doc in rendered.docs for _where, c in containers(doc) if "image" in c}
    assert runtime in images and component in images
    assert all("@sha256:" in image for image in images), images  # no tag left anywhere
    assert rayjob_defaults(rendered)["image"] == runtime  # RayJobs the component creates get the digest too
    assert mlflow_container(rendered)["image"] == component


def test_a_malformed_digest_is_refused(helm, staged_chart: Path, kube_version: str) -> None:
    err = helm_fails(helm, staged_chart, kube_version, 'images.runtime.digest="sha256:abc"')
    assert "digest" in err and "sha256" in err, err


def test_network_policies_admit_the_namespace_and_extra_peers_only(render) -> None:
    assert not render().kinds("NetworkPolicy")  # off by default
    rendered = render(CHART / "ci" / "locked-down-values.yaml")
    mlflow = rendered.one("NetworkPolicy", "-mlflow")
    head = rendered.one("NetworkPolicy", "-ray-head")
    pod_labels = rendered.one("Deployment", "-mlflow")["spec"]["template"]["metadata"]["labels"]
    assert mlflow["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    cluster = rendered.one("RayCluster")["metadata"]["name"]
    assert head["spec"]["podSelector"]["matchLabels"] == {"ray.io/cluster": cluster, "ray.io/node-type": "head"}
    for policy in (mlflow, head):
        (rule,) = policy["spec"]["ingress"]
        assert rule["from"][0] == {"podSelector": {}}  # every pod of the release namespace
        assert rule["from"][1]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "ingress-nginx"}
        assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert mlflow["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP", "port": "http"}]


def test_every_value_is_documented_once_in_the_readme() -> None:
    """The README's values table is generated from values.yaml's ``# --`` comments and is up to date, and
    every leaf value sits under a documented key."""
    import importlib.util

    import yaml

    path = Path(__file__).resolve().parents[3] / "scripts" / "chart_values_doc.py"
    spec = importlib.util.spec_from_file_location("chart_values_doc", path)
    assert spec is not None and spec.loader is not None
    doc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(doc)
    assert doc.main(["--check"]) == 0, "charts/fp8rl/README.md: run python scripts/chart_values_doc.py"
    text = (doc.CHART / "values.yaml").read_text()
    documented = [key for key, _ in doc.documented_keys(text)]
    assert len(documented) == len(set(documented))

    def leaves(node: object, prefix: str) -> list[str]:
        if isinstance(node, dict) and node:
            return [leaf for k, v in node.items() for leaf in leaves(v, f"{prefix}.{k}" if prefix else str(k))]
        return [prefix]

    undocumented = [
        leaf for leaf in leaves(yaml.safe_load(text), "")
        if not any(leaf == d or leaf.startswith(d + ".") for d in documented)
    ]  # fmt: skip
    assert not undocumented, f"values without a # -- comment: {undocumented}"


# ----------------------------------------------------------------------------- MLflow credentials of the RayJob pods


@pytest.mark.parametrize("values", ["production-values.yaml", "rayjob-only-values.yaml"])
def test_rayjobs_get_the_mlflow_credentials_when_auth_is_on(render, values: str) -> None:
    """With MLflow's basic auth on, a RayJob's head and workers log as the chart's non-admin client user (as the
    standing RayCluster's pods do): the password from the client Secret, never in the ConfigMap."""
    from fp8rl.kube.rayjob import build_rayjob
    from fp8rl.kube.rayjob_template import parse_template

    rendered = render(next(f for f in CI_VALUES if f.name == values))
    d = rayjob_defaults(rendered)
    auth = d["mlflowAuth"]
    assert auth["passwordSecret"] == {"name": "rel-fp8rl-mlflow-client", "key": "password"}
    assert auth["username"] == "fp8rl-pipeline"
    job = build_rayjob(parse_template(d), "fp8rl-step", "python x.py")
    spec = job["spec"]["rayClusterSpec"]
    for pod in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        env = env_of(pod["template"]["spec"]["containers"][0])
        assert env["MLFLOW_TRACKING_USERNAME"]["value"] == auth["username"]
        assert env["MLFLOW_TRACKING_PASSWORD"]["valueFrom"]["secretKeyRef"] == auth["passwordSecret"]
    standing = rendered.kinds("RayCluster")
    if standing:  # the same user and Secret key as the standing cluster's pods
        head = standing[0]["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
        assert env_of(head)["MLFLOW_TRACKING_PASSWORD"] == env["MLFLOW_TRACKING_PASSWORD"]


def test_no_mlflow_credentials_without_auth(render) -> None:
    assert "mlflowAuth" not in rayjob_defaults(render())


def test_an_upgrade_replaces_the_ray_pods_by_default(render) -> None:
    """KubeRay's upgradeStrategy: Recreate (default) replaces the running Ray pods when their template changes
    (a `helm upgrade` with a new image tag), None keeps them; anything else is refused by the schema."""
    assert render().one("RayCluster")["spec"]["upgradeStrategy"] == {"type": "Recreate"}
    assert render(ray__upgradeStrategy="None").one("RayCluster")["spec"]["upgradeStrategy"] == {"type": "None"}
