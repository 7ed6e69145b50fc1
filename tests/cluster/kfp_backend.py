"""The Kubernetes side of a KFP backend whose services run as host processes beside the local control plane.

KFP 2.17.0's API server, persistence agent, ScheduledWorkflow controller, Argo's workflow-controller, the MLMD
server (scripts/kfp_backend/mlmd_server.py), MariaDB and SeaweedFS run on the host, as the KubeRay operator does.
The pods that a run creates (driver, launcher + component, argoexec) reach them by KFP's usual in-cluster names:
Services without selectors in the ``kubeflow`` namespace whose Endpoints point at the node's address.

``backend_manifests`` returns those objects, and what a run's namespace needs: the ``mlpipeline-minio-artifact``
Secret, the ``kfp-launcher`` ConfigMap, and the Argo executor's rights for the ``pipeline-runner`` service account
(the chart's pipeline Role gives the RayJob rights; its service account is named ``pipeline-runner`` in
charts/fp8rl/ci/local-cluster-values.yaml). All objects are our own; names and ports are KFP's conventions.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

import yaml

KUBEFLOW_NAMESPACE = "kubeflow"
RUNNER_SERVICE_ACCOUNT = "pipeline-runner"
MINIO_SECRET = "mlpipeline-minio-artifact"
LAUNCHER_CONFIGMAP = "kfp-launcher"
ARGO_CONFIGMAP = "workflow-controller-configmap"
# Pod Security Standards "restricted" on the kubeflow namespace, enforced (the API server refuses any pod that is
# not) and warned and audited at the same level: where `make e2e`'s runs go, as on a shared cluster. No pod of KFP's
# own runs there (its services are host processes); a run's pods do: Argo's, KFP's driver and launcher, the steps,
# the chart's and the RayJobs'.
RESTRICTED = {f"pod-security.kubernetes.io/{mode}": "restricted" for mode in ("enforce", "warn", "audit")}
# Argo's executor containers (init, wait) in every run's pod: Argo gives them no securityContext of its own, so
# without this a restricted namespace refuses the pods. The values are those of KFP's own installation manifests
# (its workflow-controller-configmap), the user their image runs as (scripts/kfp_backend/Dockerfile.kfp).
ARGO_EXECUTOR = {
    "imagePullPolicy": "IfNotPresent",
    "securityContext": {
        "runAsNonRoot": True, "runAsUser": 65532, "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"},
    },
}  # fmt: skip


@dataclass(frozen=True)
class HostPorts:
    """Where each host-process service listens on the node's address (pods reach it through its Service)."""

    api_http: int = 8888
    api_grpc: int = 8887
    mlmd_grpc: int = 8080
    s3: int = 9000

    def services(self) -> dict[str, list[tuple[str, int]]]:
        """Service name -> [(port name, port)]: the names and ports KFP's driver and launcher dial."""
        return {
            "ml-pipeline": [("http", self.api_http), ("grpc", self.api_grpc)],
            "metadata-grpc-service": [("grpc-api", self.mlmd_grpc)],
            "minio-service": [("http", self.s3)],
            "seaweedfs": [("s3", self.s3)],  # 2.17.0's launcher default for minio:// (KFP ships SeaweedFS)
        }


@dataclass(frozen=True)
class BackendSettings:
    node_ip: str
    run_namespace: str
    s3_access_key: str
    s3_secret_key: str
    bucket: str = "mlpipeline"
    service_account: str = RUNNER_SERVICE_ACCOUNT  # what the runs' pods run as (pipelines.submit --service-account)
    ports: HostPorts = field(default_factory=HostPorts)

    def __post_init__(self) -> None:
        try:
            ipaddress.IPv4Address(self.node_ip)
        except ValueError as exc:
            raise ValueError(f"node_ip: not an IPv4 address: {self.node_ip!r}") from exc
        for name in ("run_namespace", "s3_access_key", "s3_secret_key", "bucket", "service_account"):
            if not getattr(self, name):
                raise ValueError(f"{name}: empty")
        for name, value in vars(self.ports).items():
            if not 0 < value < 65536:
                raise ValueError(f"ports.{name}: {value} is not a TCP port")

    @property
    def pipeline_root(self) -> str:
        return f"minio://{self.bucket}/v2/artifacts"


def _meta(name: str, namespace: str) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/part-of": "fp8rl-kfp-backend"}}


def backend_manifests(s: BackendSettings) -> list[dict[str, Any]]:
    """The objects, in apply order (namespaces first)."""
    objs: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": KUBEFLOW_NAMESPACE, "labels": RESTRICTED}},
    ]
    for name, ports in s.ports.services().items():
        objs.append({
            "apiVersion": "v1", "kind": "Service", "metadata": _meta(name, KUBEFLOW_NAMESPACE),
            "spec": {"ports": [{"name": p, "port": port, "targetPort": port, "protocol": "TCP"} for p, port in ports]},
        })  # fmt: skip
        # A Service without a selector keeps the Endpoints written for it; kube-proxy routes to the host.
        objs.append({
            "apiVersion": "v1", "kind": "Endpoints", "metadata": _meta(name, KUBEFLOW_NAMESPACE),
            "subsets": [{"addresses": [{"ip": s.node_ip}],
                         "ports": [{"name": p, "port": port, "protocol": "TCP"} for p, port in ports]}],
        })  # fmt: skip
    # Argo's controller exits without its ConfigMap; the executor's image comes from its --executor-image flag.
    objs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(ARGO_CONFIGMAP, KUBEFLOW_NAMESPACE),
                 "data": {"executor": yaml.safe_dump(ARGO_EXECUTOR, sort_keys=False)}})  # fmt: skip
    ns = s.run_namespace
    objs.append({
        "apiVersion": "v1", "kind": "Secret", "metadata": _meta(MINIO_SECRET, ns), "type": "Opaque",
        "stringData": {"accesskey": s.s3_access_key, "secretkey": s.s3_secret_key},
    })  # fmt: skip
    objs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(LAUNCHER_CONFIGMAP, ns),
                 "data": {"defaultPipelineRoot": s.pipeline_root}})  # fmt: skip
    # What Argo's executor (init, wait, emissary) does in a run's pods, beside the chart's RayJob Role.
    objs.append({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta("fp8rl-kfp-executor", ns),
        "rules": [
            {"apiGroups": ["argoproj.io"], "resources": ["workflowtaskresults"], "verbs": ["create", "patch"]},
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "watch", "patch"]},
            {"apiGroups": [""], "resources": ["secrets"], "resourceNames": [MINIO_SECRET], "verbs": ["get"]},
            {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [LAUNCHER_CONFIGMAP], "verbs": ["get"]},
        ],
    })  # fmt: skip
    objs.append({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": _meta("fp8rl-kfp-executor", ns),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "fp8rl-kfp-executor"},
        "subjects": [{"kind": "ServiceAccount", "name": s.service_account, "namespace": ns}],
    })  # fmt: skip
    return objs
