"""The Kubernetes objects of the host-process KFP backend (tests/cluster/kfp_backend.py): CPU only."""

from __future__ import annotations

import pytest
import yaml

from tests.cluster.kfp_backend import BackendSettings, HostPorts, backend_manifests


def _settings(**kw: object) -> BackendSettings:
    base: dict[str, object] = {"node_ip": "10.0.0.5", "run_namespace": "fp8rl", "s3_access_key": "a",
                               "s3_secret_key": "b"}  # fmt: skip
    base.update(kw)
    return BackendSettings(**base)  # type: ignore[arg-type]


def test_services_point_at_the_node_on_kfp_ports() -> None:
    objs = backend_manifests(_settings())
    eps = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Endpoints"}
    # seaweedfs: where KFP 2.17.0's launcher sends minio:// artifacts by default
    assert set(eps) == {"ml-pipeline", "metadata-grpc-service", "minio-service", "seaweedfs"}
    for ep in eps.values():
        assert ep["metadata"]["namespace"] == "kubeflow"
        assert ep["subsets"][0]["addresses"] == [{"ip": "10.0.0.5"}]
    assert {p["port"] for p in eps["ml-pipeline"]["subsets"][0]["ports"]} == {8887, 8888}
    svcs = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Service"}
    assert all("selector" not in s["spec"] for s in svcs.values())
    assert objs[0]["kind"] == "Namespace" and objs[0]["metadata"]["name"] == "kubeflow"


def test_the_kubeflow_namespace_is_restricted_and_argos_executor_fits_it() -> None:
    """Pod Security Standards ``restricted`` on the namespace a run's pods go to in ``make e2e``, and Argo's executor
    containers (init, wait) locked down as that level requires: Argo gives them no securityContext of its own."""
    objs = backend_manifests(_settings())
    labels = objs[0]["metadata"]["labels"]
    assert {labels[f"pod-security.kubernetes.io/{m}"] for m in ("enforce", "warn", "audit")} == {"restricted"}
    (argo,) = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "workflow-controller-configmap"]
    sc = yaml.safe_load(argo["data"]["executor"])["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0 and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["seccompProfile"] == {"type": "RuntimeDefault"}


def test_run_namespace_gets_secret_launcher_config_and_executor_rights() -> None:
    objs = backend_manifests(_settings(ports=HostPorts(s3=9333)))
    in_ns = {(o["kind"], o["metadata"]["name"]): o for o in objs if o["metadata"].get("namespace") == "fp8rl"}
    assert in_ns[("Secret", "mlpipeline-minio-artifact")]["stringData"] == {"accesskey": "a", "secretkey": "b"}
    assert in_ns[("ConfigMap", "kfp-launcher")]["data"] == {"defaultPipelineRoot": "minio://mlpipeline/v2/artifacts"}
    binding = in_ns[("RoleBinding", "fp8rl-kfp-executor")]
    assert binding["subjects"][0]["name"] == "pipeline-runner"
    chart_sa = backend_manifests(_settings(service_account="rl-fp8rl-pipeline"))
    assert next(o for o in chart_sa if o["kind"] == "RoleBinding")["subjects"][0]["name"] == "rl-fp8rl-pipeline"
    ports = next(o for o in objs if o["kind"] == "Endpoints" and o["metadata"]["name"] == "minio-service")
    assert ports["subsets"][0]["ports"][0]["port"] == 9333


@pytest.mark.parametrize(("kw", "field"), [({"node_ip": "node"}, "node_ip"), ({"run_namespace": ""}, "run_namespace"),
                                           ({"ports": HostPorts(s3=0)}, "ports.s3"),
                                           ({"service_account": ""}, "service_account")])  # fmt: skip
def test_bad_settings_name_the_field(kw: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        _settings(**kw)
