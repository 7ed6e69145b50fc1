"""A pipeline step against a real ``mlflow server`` with basic auth on, logging as the chart's non-admin client
user: the user is made by the chart's own init script (charts/fp8rl/files/mlflow/client_user.py) in the server's
auth database, as the MLflow pod's init container does; the step works, the same calls without credentials get 401,
and the user cannot administer the server."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from kfp.dsl import Artifact
from mlflow import MlflowClient
from mlflow_serving import serve_mlflow

from components.runtime import read_run_ref
from components.tracking import start_tracking
from fp8rl.tracking import MlflowSink, recipe_tags

REPO = Path(__file__).resolve().parents[2]
CLIENT_USER_SCRIPT = REPO / "charts" / "fp8rl" / "files" / "mlflow" / "client_user.py"
ADMIN, ADMIN_PASSWORD = "admin", "admin-password-for-the-test-0123456789"
CLIENT, CLIENT_PASSWORD = "fp8rl-pipeline", "client-password-for-the-test-0123456789"
# the chart's basic_auth.ini (templates/mlflow/auth.yaml), with the database in the test's directory
AUTH_INI = """[mlflow]
default_permission = READ
database_uri = sqlite:///{db}
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
"""


def _auth_env(ini: Path) -> dict[str, str]:
    return {"MLFLOW_AUTH_CONFIG_PATH": str(ini), "MLFLOW_AUTH_ADMIN_USERNAME": ADMIN}


def _client_user(ini: Path, password: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", **_auth_env(ini), "FP8RL_MLFLOW_CLIENT_USERNAME": CLIENT}
    env["FP8RL_MLFLOW_CLIENT_PASSWORD"] = password
    return subprocess.run(
        [sys.executable, str(CLIENT_USER_SCRIPT)], env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture
def auth_server(tmp_path: Path) -> Iterator[str]:
    auth = tmp_path / "auth"
    auth.mkdir()
    ini = auth / "basic_auth.ini"
    ini.write_text(AUTH_INI.format(db=auth / "basic_auth.db"))
    made = _client_user(ini, "a-first-password-to-be-rotated-0123")
    assert made.returncode == 0 and "created (not an admin)" in made.stdout, made.stderr
    rotated = _client_user(ini, CLIENT_PASSWORD)  # a second start (helm upgrade, pod restart): same user
    assert rotated.returncode == 0 and "password set" in rotated.stdout, rotated.stderr
    env = {**_auth_env(ini), "MLFLOW_AUTH_ADMIN_PASSWORD": ADMIN_PASSWORD}
    env["MLFLOW_FLASK_SERVER_SECRET_KEY"] = "flask-secret-for-the-test"
    with serve_mlflow(tmp_path / "server", ["--app-name", "basic-auth"], env) as url:
        yield url


def _post(url: str, path: str, body: dict, user: str | None, password: str | None) -> int:
    request = urllib.request.Request(f"{url}{path}", json.dumps(body).encode(), method="POST")
    request.add_header("Content-Type", "application/json")
    if user is not None:
        request.add_header("Authorization", "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def test_a_step_logs_as_the_non_admin_client_user(
    auth_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, work = auth_server, tmp_path / "work"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    experiment = {"name": "fp8rl-auth"}
    assert _post(url, "/api/2.0/mlflow/experiments/create", experiment, None, None) == 401  # no credentials
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", CLIENT)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", CLIENT_PASSWORD)
    run = Artifact(uri=str(tmp_path / "mlflow_run"))  # the pipeline's first tracked step, as KFP runs its body
    start_tracking.python_func(
        experiment="fp8rl-auth", work_dir=str(work), pipeline_name="auth", kfp_run_id="0" * 32, kfp_run_name="r",
        mlflow_run=run,
    )  # fmt: skip
    parent = read_run_ref(run).run_id
    with MlflowSink("fp8rl-auth", "bf16", work, parent_run_id=parent, tags=recipe_tags("bf16")) as sink:
        sink.log_params(recipe_tags("bf16"))
        for step in range(3):
            sink.log_metrics({"reward": 0.1 * step}, step)
    client = MlflowClient(tracking_uri=url)
    child = client.search_runs([client.get_experiment_by_name("fp8rl-auth").experiment_id], "tags.recipe = 'bf16'")
    assert [r.info.status for r in child] == ["FINISHED"]
    assert [m.step for m in client.get_metric_history(child[0].info.run_id, "reward")] == [0, 1, 2]
    # not an admin: it cannot create users or make itself one; the admin can
    new_user = {"username": "someone", "password": "someone-password-0123456789"}
    assert _post(url, "/api/2.0/mlflow/users/create", new_user, CLIENT, CLIENT_PASSWORD) == 403
    promote = {"username": CLIENT, "is_admin": True}
    request = urllib.request.Request(
        f"{url}/api/2.0/mlflow/users/update-admin", json.dumps(promote).encode(), method="PATCH"
    )
    request.add_header("Content-Type", "application/json")
    request.add_header("Authorization", "Basic " + base64.b64encode(f"{CLIENT}:{CLIENT_PASSWORD}".encode()).decode())
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 403
    assert _post(url, "/api/2.0/mlflow/users/create", new_user, ADMIN, ADMIN_PASSWORD) == 200
