"""The MLflow identity of the pipeline steps and the Ray pods, on real `helm template` renders: with basic auth on
(whether the admin Secret is the chart's or an existing one, as in ci/production-values.yaml) the Secret the steps
read exists, and it names a user of its own, not the admin; only the MLflow pod sees the admin password."""

from __future__ import annotations

import base64

import pytest
import yaml
from kube_chart import CI_VALUES, containers

from pipelines.cluster import DEFAULT_MLFLOW_SECRET, MLFLOW_SECRET_ENV

PRODUCTION = next(f for f in CI_VALUES if f.name == "production-values.yaml")


def _secret_refs(container: dict) -> dict[str, dict]:
    return {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}  # fmt: skip


def test_production_values_render_the_client_secret_the_steps_read(render) -> None:
    rendered = render(PRODUCTION)
    # the steps' default mlflow_secret is "<release>-fp8rl-mlflow-client" for release "rl"; this render's is "rel"
    name = DEFAULT_MLFLOW_SECRET.replace("rl-", "rel-", 1)
    client = rendered.one("Secret", "-mlflow-client")
    assert client["metadata"]["name"] == name
    assert set(client["data"]) == set(MLFLOW_SECRET_ENV)  # the keys the steps map to MLFLOW_TRACKING_*
    admin = yaml.safe_load(PRODUCTION.read_text())["mlflow"]["auth"].get("adminUsername", "admin")
    user = base64.b64decode(client["data"]["username"]).decode()
    assert user and user != admin
    assert len(base64.b64decode(client["data"]["password"])) == 48
    # the admin Secret is the user's (existingSecret): the chart renders none of its own
    assert "rel-fp8rl-mlflow-auth" not in rendered.names("Secret")


def test_the_mlflow_pod_creates_the_client_user_before_the_server_starts(render) -> None:
    rendered = render(PRODUCTION)
    pod = rendered.one("Deployment", "-mlflow")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["command"] == ["python", "/etc/mlflow-auth/client_user.py"]
    refs = _secret_refs(init)
    assert refs["FP8RL_MLFLOW_CLIENT_USERNAME"] == {"name": "rel-fp8rl-mlflow-client", "key": "username"}
    assert refs["FP8RL_MLFLOW_CLIENT_PASSWORD"] == {"name": "rel-fp8rl-mlflow-client", "key": "password"}
    assert "MLFLOW_AUTH_ADMIN_PASSWORD" not in refs  # it needs the database, not the admin's password
    mounts = {m["mountPath"] for m in init["volumeMounts"]}
    assert {"/mlflow", "/etc/mlflow-auth", "/tmp"} <= mounts
    script = rendered.one("ConfigMap", "-mlflow-auth")["data"]["client_user.py"]
    assert "is_admin=False" in script


def test_only_the_mlflow_server_sees_the_admin_password(render) -> None:
    rendered = render(PRODUCTION)
    holders = [
        where
        for doc in rendered.docs
        for where, c in containers(doc)
        if any(ref["name"] == "fp8rl-mlflow-auth" for ref in _secret_refs(c).values())
    ]
    assert holders == ["Deployment/rel-fp8rl-mlflow/mlflow"]
    head = rendered.one("RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert _secret_refs(head)["MLFLOW_TRACKING_PASSWORD"] == {"name": "rel-fp8rl-mlflow-client", "key": "password"}
    rayjob = yaml.safe_load(rendered.one("ConfigMap", "-rayjob-defaults")["data"]["rayjob.yaml"])
    assert rayjob["mlflowAuth"]["passwordSecret"] == {"name": "rel-fp8rl-mlflow-client", "key": "password"}


def test_the_client_user_cannot_be_the_admin(helm, staged_chart, kube_version: str) -> None:
    args = ["template", "rel", str(staged_chart), "--kube-version", kube_version]
    args += ["--set", "mlflow.auth.enabled=true", "--set", "mlflow.auth.clientUsername=admin"]
    proc = helm(*args, check=False)
    assert proc.returncode != 0 and "mlflow.auth.clientUsername must differ" in proc.stderr


@pytest.mark.parametrize("existing", ["", "mine"])
def test_the_client_secret_exists_whoever_owns_the_admin_secret(render, existing: str) -> None:
    rendered = render(ray__enabled=False, mlflow__auth__enabled=True, mlflow__auth__existingSecret=existing)
    assert "rel-fp8rl-mlflow-client" in rendered.names("Secret")
