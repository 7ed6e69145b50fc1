"""The Helm chart on a real API server: install, upgrade and uninstall, RBAC as the server decides it, and
the real KubeRay operator reconciling the chart's RayCluster onto kwok GPU nodes.

What is not real here (control_plane.py): pods run no containers (kwok marks them Running), and no storage
provisioner exists, so each test pre-binds a hostPath PersistentVolume to every claim the release makes.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from control_plane import ControlPlane

pytestmark = pytest.mark.cluster

CHART = Path(__file__).resolve().parents[2] / "charts" / "fp8rl"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
RELEASE = "rl"
FULL = f"{RELEASE}-fp8rl"
# what uninstall leaves on purpose (helm.sh/resource-policy: keep): the data and MLflow PVCs and generated Secrets
KEPT_KINDS = {"PersistentVolumeClaim", "Secret"}

# Objects of other kinds that a chart value refers to but the chart does not create (production-values.yaml).
PREREQUISITE_SECRETS = ["fp8rl-ray-token", "fp8rl-mlflow-postgres", "fp8rl-mlflow-s3", "fp8rl-mlflow-auth", "regcred"]


def _apis(api_client: Any) -> tuple[Any, Any]:
    from kubernetes import client

    return client.CoreV1Api(api_client), client.CustomObjectsApi(api_client)


def _manifest_objects(helm: Callable[..., Any], namespace: str) -> list[dict[str, Any]]:
    text = helm("get", "manifest", RELEASE, "-n", namespace).stdout
    return [d for d in yaml.safe_load_all(text) if d]


def _get(api_client: Any, doc: dict[str, Any], namespace: str) -> Any:
    """The live object of a manifest document (dynamic client: any kind the API server serves)."""
    from kubernetes import dynamic

    dyn = dynamic.DynamicClient(api_client)
    res = dyn.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
    return res.get(name=doc["metadata"]["name"], namespace=namespace if res.namespaced else None)


def _bind_volumes(api_client: Any, namespace: str, claims: list[dict[str, Any]]) -> None:
    """A hostPath PersistentVolume pre-bound to each claim of the release (no provisioner here)."""
    core, _ = _apis(api_client)
    for claim in claims:
        spec = claim["spec"]
        name = f"pv-{namespace}-{claim['metadata']['name']}"[:63]
        core.create_persistent_volume(
            {
                "metadata": {"name": name},
                "spec": {
                    "capacity": {"storage": spec["resources"]["requests"]["storage"]},
                    "accessModes": spec["accessModes"],
                    "storageClassName": spec.get("storageClassName", ""),
                    "persistentVolumeReclaimPolicy": "Delete",
                    "hostPath": {"path": f"/tmp/{name}"},
                    "claimRef": {"namespace": namespace, "name": claim["metadata"]["name"]},
                },
            }
        )


def _prerequisites(api_client: Any, namespace: str, values: Path | None) -> None:
    core, _ = _apis(api_client)
    if values is not None and values.name == "production-values.yaml":
        for name in PREREQUISITE_SECRETS:
            core.create_namespaced_secret(namespace, {"metadata": {"name": name}, "stringData": {"x": "y"}})
    if values is not None and values.name == "rayjob-only-values.yaml":
        claim = {"metadata": {"name": "shared-models"},
                 "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}}  # fmt: skip
        core.create_namespaced_persistent_volume_claim(namespace, claim)


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda v: v.name if v else "default-values")
def test_install_upgrade_uninstall(
    cluster_helm: Callable[..., Any], api_client: Any, namespace: str, values: Path | None, wait: Callable[..., Any]
) -> None:
    _prerequisites(api_client, namespace, values)
    args = ["-n", namespace, *(["-f", str(values)] if values else [])]
    rendered = [d for d in yaml.safe_load_all(cluster_helm("template", RELEASE, str(CHART), *args).stdout) if d]
    _bind_volumes(api_client, namespace, [d for d in rendered if d["kind"] == "PersistentVolumeClaim"])

    cluster_helm("install", RELEASE, str(CHART), *args)
    objects = _manifest_objects(cluster_helm, namespace)
    assert objects, "the release has no objects"
    for doc in objects:  # every object admitted, as rendered (and with the chart's labels)
        live = _get(api_client, doc, namespace)
        labels = live.metadata.labels or {}
        assert labels.get("app.kubernetes.io/instance") == RELEASE, (doc["kind"], doc["metadata"]["name"])
        assert labels.get("app.kubernetes.io/managed-by") == "Helm"
        assert labels.get("helm.sh/chart", "").startswith("fp8rl-")

    # an upgrade that changes values rolls the change out and keeps every object
    cluster_helm("upgrade", RELEASE, str(CHART), *args, "--set", "ray.worker.replicas=2",
                 "--set-string", "serviceAccount.annotations.team=rl-research")  # fmt: skip
    status = json.loads(cluster_helm("status", RELEASE, *args[:2], "-o", "json").stdout)
    assert status["version"] == 2 and status["info"]["status"] == "deployed"
    upgraded = _manifest_objects(cluster_helm, namespace)
    assert {(d["kind"], d["metadata"]["name"]) for d in upgraded} == {
        (d["kind"], d["metadata"]["name"]) for d in objects
    }
    for doc in upgraded:
        live = _get(api_client, doc, namespace)
        if doc["kind"] == "ServiceAccount":
            assert (live.metadata.annotations or {}).get("team") == "rl-research"
        if doc["kind"] == "RayCluster":
            assert live.spec.workerGroupSpecs[0].replicas == 2

    cluster_helm("uninstall", RELEASE, *args[:2], "--wait", "--timeout", "60s")
    left = []
    for doc in objects:
        try:
            live = _get(api_client, doc, namespace)
        except Exception as e:  # NotFoundError: gone, as it should be
            assert "Not Found" in str(e) or "404" in str(e), e
            continue
        if live.metadata.deletion_timestamp is None:
            left.append((doc["kind"], doc["metadata"]["name"]))
    kept = {(d["kind"], d["metadata"]["name"]) for d in objects if d["kind"] in KEPT_KINDS}
    assert set(left) == kept, f"left after uninstall: {sorted(set(left) - kept)}; kept on purpose: {sorted(kept)}"
    # and the pods the operator made for the RayCluster are garbage-collected with it
    core, _ = _apis(api_client)
    wait(lambda: not core.list_namespaced_pod(namespace, label_selector="ray.io/cluster").items, 60, "Ray pods gone")


def test_schema_rejects_bad_values_on_install(cluster_helm: Callable[..., Any], namespace: str) -> None:
    bad = cluster_helm("install", RELEASE, str(CHART), "-n", namespace, "--set", "rayJob.workers.replicas=0",
                       check=False)  # fmt: skip
    assert bad.returncode != 0 and "replicas" in bad.stderr and "minimum" in bad.stderr.lower(), bad.stderr
    assert "rl" not in cluster_helm("list", "-n", namespace, "-q").stdout.split()


# ---------------------------------------------------------------------------------------------- RBAC

PIPELINE_ALLOWED = [
    ("create", "ray.io", "rayjobs", None, None),
    ("get", "ray.io", "rayjobs", None, None),
    ("watch", "ray.io", "rayjobs", None, None),
    ("delete", "ray.io", "rayjobs", None, None),
    ("get", "ray.io", "rayclusters", None, None),
    ("list", "", "pods", None, None),
    ("get", "", "pods", "log", None),
    ("list", "", "events", None, None),
    ("get", "", "configmaps", None, f"{RELEASE}-fp8rl-rayjob-defaults"),
]
DANGEROUS = [
    ("list", "", "secrets", None, None),
    ("get", "", "secrets", None, f"{FULL}-ray-token"),
    ("create", "", "pods", "exec", None),
    ("create", "", "pods", None, None),
    ("delete", "", "pods", None, None),
    ("get", "", "configmaps", None, "some-other-config"),
    ("update", "ray.io", "rayjobs", None, None),
    ("create", "ray.io", "rayclusters", None, None),
    ("create", "rbac.authorization.k8s.io", "rolebindings", None, None),
    ("create", "rbac.authorization.k8s.io", "clusterroles", None, None),
    ("create", "", "serviceaccounts", "token", None),
]


def _can(api_client: Any, user: str, namespace: str, verb: str, group: str, resource: str, sub: str | None,
         name: str | None) -> bool:  # fmt: skip
    from kubernetes import client

    attrs = {"namespace": namespace, "verb": verb, "group": group, "resource": resource}
    if sub:
        attrs["subresource"] = sub
    if name:
        attrs["name"] = name
    review = client.AuthorizationV1Api(api_client).create_subject_access_review(
        {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
         "spec": {"user": user, "groups": ["system:serviceaccounts", f"system:serviceaccounts:{namespace}",
                                           "system:authenticated"], "resourceAttributes": attrs}}
    )  # fmt: skip
    return bool(review.status.allowed)


def test_rbac_as_the_api_server_decides(
    cluster_helm: Callable[..., Any], api_client: Any, namespace: str, control_plane: ControlPlane
) -> None:
    cluster_helm("install", RELEASE, str(CHART), "-n", namespace)
    pipeline = f"system:serviceaccount:{namespace}:{FULL}-pipeline"
    ray = f"system:serviceaccount:{namespace}:{FULL}-ray"
    for check in PIPELINE_ALLOWED:
        assert _can(api_client, pipeline, namespace, *check), f"pipeline SA should be allowed: {check}"
    for check in DANGEROUS:
        assert not _can(api_client, pipeline, namespace, *check), f"pipeline SA must be denied: {check}"
    # nothing in any other namespace, nothing cluster-wide
    for verb, group, resource, sub, name in PIPELINE_ALLOWED[:2]:
        assert not _can(api_client, pipeline, "default", verb, group, resource, sub, name)
    # the Ray pods' account can do nothing at all with the API
    for check in PIPELINE_ALLOWED + DANGEROUS:
        assert not _can(api_client, ray, namespace, *check), f"ray SA must be denied: {check}"


# ---------------------------------------------------------------------------------- the KubeRay operator


def test_operator_reconciles_the_charts_raycluster_onto_gpu_nodes(
    cluster_helm: Callable[..., Any], api_client: Any, namespace: str, wait: Callable[..., Any]
) -> None:
    standing = ["-n", namespace, "--set", "ray.enabled=true"]  # the standing RayCluster (off by default)
    rendered = [d for d in yaml.safe_load_all(cluster_helm("template", RELEASE, str(CHART), *standing).stdout) if d]
    _bind_volumes(api_client, namespace, [d for d in rendered if d["kind"] == "PersistentVolumeClaim"])
    (rc_doc,) = [d for d in rendered if d["kind"] == "RayCluster"]
    want_workers = sum(g.get("replicas", 1) for g in rc_doc["spec"]["workerGroupSpecs"])
    cluster_helm("install", RELEASE, str(CHART), *standing)
    core, custom = _apis(api_client)
    name = rc_doc["metadata"]["name"]

    def running_pods() -> list[Any] | None:
        pods = core.list_namespaced_pod(namespace, label_selector=f"ray.io/cluster={name}").items
        running = [p for p in pods if p.status.phase == "Running"]
        return pods if len(running) == 1 + want_workers else None

    pods = wait(running_pods, 90, f"head + {want_workers} worker pod(s) of {name} Running")
    by_type = {p.metadata.labels["ray.io/node-type"]: p for p in pods}
    assert set(by_type) == {"head", "worker"}
    worker = by_type["worker"]
    gpus = worker.spec.containers[0].resources.limits["nvidia.com/gpu"]
    assert int(gpus) >= 1 and worker.spec.node_name.startswith("gpu-node-")
    assert worker.spec.service_account_name == f"{FULL}-ray"
    # the operator's own view: state ready, and the conditions it sets
    status = wait(
        lambda: (s := custom.get_namespaced_custom_object("ray.io", "v1", namespace, "rayclusters", name)
                 .get("status", {})).get("state") == "ready" and s,
        60, "RayCluster state ready",
    )  # fmt: skip
    conds = {c["type"]: c["status"] for c in status.get("conditions", [])}
    assert conds.get("HeadPodReady") == "True", conds
    assert status.get("availableWorkerReplicas", status.get("readyWorkerReplicas")) == want_workers
    # the head Service the chart's NOTES and the pipeline use
    assert core.read_namespaced_service(f"{name}-head-svc", namespace).spec.ports


def test_control_plane_versions(control_plane: ControlPlane, cluster_tools: Path) -> None:
    """The control plane is the one the build script pinned (and says so in its /version)."""
    from control_plane import versions

    served = json.loads(control_plane.get("/version"))
    assert served["gitVersion"] == versions(cluster_tools)["kubernetes"]
    out = subprocess.run([str(cluster_tools / "bin" / "helm"), "version", "--short"], capture_output=True, text=True)
    assert out.returncode == 0
