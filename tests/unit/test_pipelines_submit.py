"""``python -m pipelines.submit``: parameters, errors, and the request it makes to a KFP endpoint.

No Kubeflow Pipelines API server can run here. The submission is therefore tested at the kfp
client boundary from the other side: the real ``kfp.Client`` talks HTTP to a stand-in KFP API on
loopback that implements the four calls a submission makes (health check, find/create the
experiment, create the run) and records them. What is checked is the request the real client
sends: the compiled pipeline spec with its platform spec, the typed run parameters, the
experiment, run name, service account and bearer token. Whether a real KFP backend then runs it
is outside what this machine can test.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlparse

import pytest

from pipelines import local as local_mod
from pipelines.params import parse_params, parse_value
from pipelines.submit import check_reachable, main

RUN_ID = "5b0c2b7e-run"


class FakeKfpApi(BaseHTTPRequestHandler):
    """KFP v2beta1 REST: GET healthz, GET experiments, POST experiments, POST runs; records every request."""

    calls: ClassVar[list[dict[str, Any]]] = []

    def _reply(self, body: dict[str, Any], status: int = 200) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        url = urlparse(self.path)
        call = {"method": self.command, "path": url.path, "query": parse_qs(url.query), "body": body,
                "auth": self.headers.get("Authorization")}  # fmt: skip
        self.calls.append(call)
        return call

    def do_GET(self) -> None:
        call = self._record()
        if call["path"] == "/apis/v2beta1/healthz":
            self._reply({"multi_user": False})
        elif call["path"] == "/apis/v2beta1/experiments":
            self._reply({"experiments": [], "total_size": 0})
        else:
            self._reply({"error": "not found"}, 404)

    def do_POST(self) -> None:
        call = self._record()
        if call["path"] == "/apis/v2beta1/experiments":
            self._reply({"experiment_id": "exp-7", "display_name": call["body"]["display_name"]})
        elif call["path"] == "/apis/v2beta1/runs":
            self._reply({"run_id": RUN_ID, "display_name": call["body"]["display_name"], "state": "PENDING"})
        else:
            self._reply({"error": "not found"}, 404)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def kfp_api() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    FakeKfpApi.calls = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeKfpApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", FakeKfpApi.calls
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(autouse=True)
def no_endpoint_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("KF_PIPELINES_ENDPOINT", "KF_PIPELINES_TOKEN", "KF_PIPELINES_UI_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)


def test_submission_request(kfp_api: tuple[str, list[dict[str, Any]]], capsys: pytest.CaptureFixture[str]) -> None:
    host, calls = kfp_api
    code = main([
        "recipe-comparison", "--host", host, "--token", "s3cret", "--experiment", "fp8-exp", "--run-name", "nightly",
        "--service-account", "rl-fp8rl-pipeline", "--registry", "registry.example.com/ml",
        "--param", "rl_steps=3", "--param", "recipes=bf16,fp8-e2e", "--param", "run_config={grpo: {group_size: 4}}",
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert out.strip().endswith(f"{host}/#/runs/details/{RUN_ID}")
    assert all(c["auth"] == "Bearer s3cret" for c in calls)
    (create_exp,) = [c for c in calls if c["method"] == "POST" and c["path"].endswith("/experiments")]
    assert create_exp["body"]["display_name"] == "fp8-exp"
    (run,) = [c["body"] for c in calls if c["method"] == "POST" and c["path"].endswith("/runs")]
    assert run["display_name"] == "nightly" and run["experiment_id"] == "exp-7"
    assert run["service_account"] == "rl-fp8rl-pipeline"
    assert run["runtime_config"]["parameters"] == {
        "rl_steps": 3, "recipes": ["bf16", "fp8-e2e"], "run_config": {"grpo": {"group_size": 4}}
    }  # fmt: skip
    spec = run["pipeline_spec"]
    assert spec["pipeline_spec"]["pipelineInfo"]["name"] == "recipe-comparison"
    images = {e["container"]["image"] for e in spec["pipeline_spec"]["deploymentSpec"]["executors"].values()}
    assert all(i.startswith("registry.example.com/ml/fp8rl-") for i in images)
    kube = spec["platform_spec"]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert kube["exec-evaluate"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert "s3cret" not in json.dumps(run)  # the token authenticates the request; it is not part of the run


def test_host_from_environment(
    kfp_api: tuple[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    host, calls = kfp_api
    monkeypatch.setenv("KF_PIPELINES_ENDPOINT", host)
    monkeypatch.setenv("KF_PIPELINES_TOKEN", "from-env")
    assert main(["fp8-benchmark"]) == 0
    assert RUN_ID in capsys.readouterr().out
    (run,) = [c for c in calls if c["path"].endswith("/runs")]
    assert run["auth"] == "Bearer from-env" and run["body"]["runtime_config"].get("parameters", {}) == {}


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when the socket is: nothing listens there


def test_unreachable_host_fails_fast(capsys: pytest.CaptureFixture[str]) -> None:
    host = f"http://127.0.0.1:{closed_port()}"
    start = time.monotonic()
    assert main(["fp8-rl", "--host", host]) == 2
    assert time.monotonic() - start < 10  # not kfp.Client's five health-check retries
    err = capsys.readouterr().err
    assert f"cannot reach Kubeflow Pipelines at {host}" in err and "Traceback" not in err


def test_http_errors_count_as_reachable(kfp_api: tuple[str, list[dict[str, Any]]]) -> None:
    host, _ = kfp_api
    check_reachable(host + "/no-such-prefix", None)  # a 404 is an answer; auth and paths are kfp.Client's to report


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["nope"], "unknown pipeline 'nope'; available: fp8-rl, recipe-comparison, fp8-benchmark"),
        (["fp8-rl", "--param", "rl_steps"], "--param 'rl_steps': expected key=value"),
        (["fp8-rl", "--param", "=3"], "--param '=3': expected key=value"),
        (["fp8-rl", "--param", "steps=3"], "pipeline 'fp8-rl' has no parameter 'steps'; its parameters: backend"),
        (["fp8-rl", "--param", "rl_steps=many"], "--param rl_steps=many: expected integer (e.g. rl_steps=20)"),
        (["fp8-rl", "--param", "rl_steps=2.5"], "expected integer"),
        (["fp8-rl", "--param", "run_config=[1, 2]"], "--param run_config=[1, 2]: expected dict"),
        (["fp8-rl", "--param", "run_config={a: [}"], "expected dict"),
        (["recipe-comparison", "--param", "recipes=[bf16"], "expected list"),
        (["recipe-comparison", "--param", "recipes=bf16,fp9"], "--param recipes: unknown recipe 'fp9'"),
        (["fp8-rl", "--param", "recipe=fp8"], "--param recipe: unknown recipe 'fp8'"),
        (["fp8-rl", "--param", "backend=slurm"], "--param backend: expected local or rayjob, got 'slurm'"),
    ],
)
def test_bad_input_is_named_and_exits_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, "--local"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipelines.submit: error: ") and message in err and "Traceback" not in err


def test_parse_value_types() -> None:
    assert parse_value("x", "Boolean", "Yes") is True and parse_value("x", "Boolean", "off") is False
    assert parse_value("x", "Float", "1e-3") == 1e-3
    assert parse_value("x", "List", '["a", "b"]') == ["a", "b"] == parse_value("x", "List", "a, b")
    assert parse_value("x", "Dict", '{"a": {"b": 1}}') == {"a": {"b": 1}}
    with pytest.raises(Exception, match="expected boolean"):
        parse_value("x", "Boolean", "maybe")


def test_params_follow_the_pipeline_declaration() -> None:
    from pipelines import get_pipelines

    p = get_pipelines()["fp8-benchmark"]
    assert parse_params("fp8-benchmark", p, ["bench_steps=7", "device=cpu"]) == {"bench_steps": 7, "device": "cpu"}


def test_no_host_means_local(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    seen: dict[str, Any] = {}

    def fake_run(name: str, pipeline: Any, arguments: dict[str, Any], work_dir: Path, verbose: bool) -> Any:
        seen.update(name=name, arguments=arguments, work_dir=work_dir, pipeline=pipeline)
        return local_mod.LocalRun(
            name, tmp_path / "report", "| table |\n", "sqlite:////w/mlflow.db", tmp_path / "l", 1.0
        )

    monkeypatch.setattr(local_mod, "run_locally", fake_run)
    assert main(["recipe-comparison", "--work-dir", str(tmp_path), "--param", "rl_steps=2"]) == 0
    out = capsys.readouterr().out
    assert "no KFP endpoint configured" in out
    assert seen["name"] == "recipe-comparison" and seen["arguments"] == {"rl_steps": 2}
    assert out.rstrip().endswith(
        "| table |\n\nopen the runs: mlflow ui --backend-store-uri sqlite:////w/mlflow.db".strip()
    )
    # the local build runs one recipe at a time
    from pipelines.compile import pipeline_ir

    assert (
        pipeline_ir(seen["pipeline"])[0]["root"]["dag"]["tasks"]["for-loop-1"]["iteratorPolicy"]["parallelismLimit"]
        == 1
    )


def test_console_filter_drops_the_executor_dump_and_keeps_step_output() -> None:
    import io

    from pipelines.local import _ConsoleFilter

    console, log = io.StringIO(), io.StringIO()
    stream = _ConsoleFilter(console, log, verbose=False)
    lines = [
        "08:00:00.000 - INFO - Executing task 'sft-warmup'",
        "    [KFP Executor 2026 INFO]: Looking for component `sft_warmup`",
        "    [KFP Executor 2026 INFO]: Got executor_input:",
        "    {",
        '        "inputs": {',
        "        }",
        "    }",
        "    sft step 50/600 loss 1.2 (5s)",
        "    [KFP Executor 2026 INFO]: Wrote executor output file to /x.",
        "08:00:09.000 - INFO - Task 'sft-warmup' finished with status SUCCESS",
    ]
    for line in lines:
        stream.write(line + "\n")
    assert console.getvalue().splitlines() == [lines[0], lines[7], lines[9]]
    assert log.getvalue().splitlines() == lines
