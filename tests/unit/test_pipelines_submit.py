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
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlparse

import pytest
import yaml

from pipelines import local as local_mod
from pipelines.params import parse_params, parse_value
from pipelines.remote import check_reachable
from pipelines.submit import main

RUN_ID = "5b0c2b7e-run"


class FakeKfpApi(BaseHTTPRequestHandler):
    """KFP v2beta1 REST as kfp.Client calls it: healthz, experiments, runs (create, get), pipelines (list, upload,
    upload_version, versions) and recurring runs; records every request. ``run_states`` scripts what successive GETs
    of the run say; ``pipelines`` holds the uploaded pipelines. Paths may come through the Kubernetes API server's
    service proxy (``--kube-context``), whose prefix is stripped."""

    calls: ClassVar[list[dict[str, Any]]] = []
    run_states: ClassVar[list[str]] = ["PENDING"]
    pipelines: ClassVar[dict[str, str]] = {}  # display name -> id
    failed_task: ClassVar[dict[str, Any]] = {}

    def _reply(self, body: dict[str, Any], status: int = 200) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        multipart = (self.headers.get("Content-Type") or "").startswith("multipart/")
        body = raw.decode(errors="replace") if multipart else json.loads(raw) if raw else None
        url = urlparse(self.path)
        path = url.path.split(PROXY_PREFIX, 1)[-1] if PROXY_PREFIX in url.path else url.path
        call = {"method": self.command, "path": "/" + path.lstrip("/"), "raw_path": url.path,
                "query": parse_qs(url.query), "body": body, "auth": self.headers.get("Authorization")}  # fmt: skip
        self.calls.append(call)
        return call

    def do_GET(self) -> None:
        call = self._record()
        path = call["path"]
        if path == "/apis/v2beta1/healthz":
            self._reply({"multi_user": False})
        elif path == "/apis/v2beta1/experiments":
            self._reply({"experiments": [], "total_size": 0})
        elif path == f"/apis/v2beta1/runs/{RUN_ID}":
            state = self.run_states.pop(0) if len(self.run_states) > 1 else self.run_states[0]
            tasks = [self.failed_task] if state == "FAILED" and self.failed_task else []
            self._reply({"run_id": RUN_ID, "state": state, "run_details": {"task_details": tasks}})
        elif path == "/apis/v2beta1/pipelines":
            predicate = json.loads(call["query"]["filter"][0])["predicates"][0]
            wanted = predicate.get("stringValue", predicate.get("string_value"))
            found = [{"pipeline_id": i, "display_name": n} for n, i in self.pipelines.items() if n == wanted]
            self._reply({"pipelines": found, "total_size": len(found)} if found else {})
        elif path.startswith("/apis/v2beta1/pipelines/") and path.endswith("/versions"):
            pid = path.split("/")[4]
            self._reply({"pipeline_versions": [{"pipeline_id": pid, "pipeline_version_id": "pv-default"}]})
        else:
            self._reply({"error": "not found"}, 404)

    def do_POST(self) -> None:
        call = self._record()
        path = call["path"]
        if path == "/apis/v2beta1/experiments":
            self._reply({"experiment_id": "exp-7", "display_name": call["body"]["display_name"]})
        elif path == "/apis/v2beta1/runs":
            self._reply({"run_id": RUN_ID, "display_name": call["body"]["display_name"], "state": "PENDING"})
        elif path == "/apis/v2beta1/pipelines/upload":
            name = call["query"]["name"][0]
            self.pipelines[name] = f"pl-{len(self.pipelines) + 1}"
            self._reply({"pipeline_id": self.pipelines[name], "display_name": name})
        elif path == "/apis/v2beta1/pipelines/upload_version":
            pid, name = call["query"]["pipelineid"][0], call["query"]["name"][0]
            self._reply({"pipeline_id": pid, "pipeline_version_id": "pv-new", "display_name": name})
        elif path == "/apis/v2beta1/recurringruns":
            self._reply({"recurring_run_id": "rr-1", "display_name": call["body"]["display_name"]})
        else:
            self._reply({"error": "not found"}, 404)

    def log_message(self, *args: object) -> None:
        pass


PROXY_PREFIX = "/api/v1/namespaces/kubeflow/services/ml-pipeline:http/proxy"


def serve(tls: ssl.SSLContext | None = None) -> tuple[ThreadingHTTPServer, threading.Thread]:
    FakeKfpApi.calls, FakeKfpApi.run_states, FakeKfpApi.pipelines, FakeKfpApi.failed_task = [], ["PENDING"], {}, {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeKfpApi)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread


@pytest.fixture
def kfp_api() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    server, _ = serve()
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
        (["fp8-rl", "--param", "backend=slurm"], "--param backend: expected local or process or rayjob, got 'slurm'"),
        (["fp8-rl", "--param", 'run_config={"ray": null}'], "--param run_config.ray: null; a KFP parameter cannot"),
        (["recipe-comparison", "--param", "recipes=[bf16, null]"], "--param recipes[1]: null"),
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

    tasks = pipeline_ir(seen["pipeline"])[0]["components"]["comp-exit-handler-1"]["dag"]["tasks"]
    (loop,) = [t for name, t in tasks.items() if name.startswith("for-loop-")]
    assert loop["iteratorPolicy"]["parallelismLimit"] == 1


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


# ---------------------------------------------------------------- what KFP users expect of a submit tool


def _runs(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c["body"] for c in calls if c["method"] == "POST" and c["path"] == "/apis/v2beta1/runs"]


@pytest.mark.parametrize(
    ("states", "code", "said"),
    [
        (["PENDING", "RUNNING", "SUCCEEDED"], 0, "run 5b0c2b7e-run SUCCEEDED"),
        (["RUNNING", "FAILED"], 1, "run 5b0c2b7e-run FAILED: RL step: the RayJob failed"),
        (["RUNNING", "CANCELED"], 1, "run 5b0c2b7e-run CANCELED"),
    ],
)
def test_wait_follows_the_run_to_its_end(
    kfp_api: tuple[str, list[dict[str, Any]]], capsys: pytest.CaptureFixture[str], states: list[str], code: int,
    said: str,
) -> None:  # fmt: skip
    """``--wait``: each change of state is printed; 0 on SUCCEEDED, otherwise 1 naming the failed step (not the
    DAGs around it) with its error."""
    host, calls = kfp_api
    FakeKfpApi.run_states = list(states)
    FakeKfpApi.failed_task = {"display_name": "RL step", "state": "FAILED", "error": {"message": "the RayJob failed"}}
    assert main(["fp8-rl", "--host", host, "--wait", "--poll", "0.01"]) == code
    captured = capsys.readouterr()
    assert said in captured.out + captured.err
    for state in dict.fromkeys(states):
        assert f"run {RUN_ID}: {state}" in captured.out
    assert [c["path"] for c in calls].count(f"/apis/v2beta1/runs/{RUN_ID}") == len(states)


def test_wait_gives_up_after_the_timeout(
    kfp_api: tuple[str, list[dict[str, Any]]], capsys: pytest.CaptureFixture[str]
) -> None:
    host, _ = kfp_api
    FakeKfpApi.run_states = ["RUNNING"]
    assert main(["fp8-rl", "--host", host, "--wait", "--timeout", "0.05", "--poll", "0.01"]) == 124
    assert f"run {RUN_ID} is still RUNNING after 0 s" in capsys.readouterr().err


def test_upload_makes_the_pipeline_then_new_versions_and_runs_them(
    kfp_api: tuple[str, list[dict[str, Any]]], capsys: pytest.CaptureFixture[str]
) -> None:
    host, calls = kfp_api
    assert main(["fp8-rl", "--host", host, "--upload", "--param", "rl_steps=4"]) == 0
    assert "uploaded pipeline 'fp8-rl' (pl-1)" in capsys.readouterr().out
    (upload,) = [c for c in calls if c["path"] == "/apis/v2beta1/pipelines/upload"]
    assert "pipelineInfo" in upload["body"] and "fp8-rl" in upload["body"]  # the compiled package, multipart
    (first,) = _runs(calls)
    assert first["pipeline_version_reference"] == {"pipeline_id": "pl-1", "pipeline_version_id": "pv-default"}
    assert first["runtime_config"]["parameters"] == {"rl_steps": 4} and "pipeline_spec" not in first

    calls.clear()
    argv = ["fp8-rl", "--host", host, "--upload", "--version-name", "v2", "--pipeline-name", "fp8-rl"]
    assert main(argv) == 0
    assert "uploaded version 'v2' (pv-new) of pipeline 'fp8-rl' (pl-1)" in capsys.readouterr().out
    (version,) = [c for c in calls if c["path"] == "/apis/v2beta1/pipelines/upload_version"]
    assert version["query"]["name"] == ["v2"] and version["query"]["pipelineid"] == ["pl-1"]
    assert _runs(calls)[0]["pipeline_version_reference"]["pipeline_version_id"] == "pv-new"


def test_schedule_makes_a_recurring_run(
    kfp_api: tuple[str, list[dict[str, Any]]], capsys: pytest.CaptureFixture[str]
) -> None:
    host, calls = kfp_api
    argv = ["recipe-comparison", "--host", host, "--schedule", "0 3 * * *", "--max-concurrency", "2", "--no-catchup",
            "--run-name", "nightly", "--param", "rl_steps=5"]  # fmt: skip
    assert main(argv) == 0
    assert "recurring run rr-1" in capsys.readouterr().out
    (rec,) = [c["body"] for c in calls if c["path"] == "/apis/v2beta1/recurringruns"]
    assert rec["trigger"]["cron_schedule"]["cron"] == "0 0 3 * * *"  # KFP's cron: seconds first
    assert int(rec["max_concurrency"]) == 2 and rec["no_catchup"] is True and rec["display_name"] == "nightly"
    assert rec["runtime_config"]["parameters"] == {"rl_steps": 5} and "pipeline_spec" in rec
    assert not _runs(calls)


def test_a_bad_schedule_is_named(kfp_api: tuple[str, list[dict[str, Any]]], capsys: pytest.CaptureFixture[str]) -> None:
    host, calls = kfp_api
    assert main(["fp8-rl", "--host", host, "--schedule", "every day"]) == 2
    assert "--schedule 'every day': expected a cron expression" in capsys.readouterr().err
    assert not [c for c in calls if c["method"] == "POST"]


def test_param_file_yaml_or_json_and_param_wins(
    kfp_api: tuple[str, list[dict[str, Any]]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host, calls = kfp_api
    params = {"rl_steps": 9, "recipes": ["bf16", "fp8-e2e"], "run_config": {"grpo": {"group_size": 4}},
              "diagnose": True, "model_source": "tiny"}  # fmt: skip
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(params))
    (tmp_path / "p.json").write_text(json.dumps(params))
    for name in ("p.yaml", "p.json"):
        calls.clear()
        argv = ["recipe-comparison", "--host", host, "--param-file", str(tmp_path / name), "--param", "rl_steps=2"]
        assert main(argv) == 0
        (run,) = _runs(calls)
        assert run["runtime_config"]["parameters"] == {**params, "rl_steps": 2}, name
    (tmp_path / "bad.yaml").write_text("- a list\n")
    assert main(["fp8-rl", "--host", host, "--param-file", str(tmp_path / "bad.yaml")]) == 2
    assert f"--param-file {tmp_path / 'bad.yaml'}: expected a mapping" in capsys.readouterr().err
    assert main(["fp8-rl", "--local", "--param-file", str(tmp_path / "missing.yaml")]) == 2
    assert "--param-file" in capsys.readouterr().err and "No such file" in capsys.readouterr().err + "No such file"
    (tmp_path / "typo.yaml").write_text("rl_step: 3\n")
    assert main(["fp8-rl", "--host", host, "--param-file", str(tmp_path / "typo.yaml")]) == 2
    assert "has no parameter 'rl_step'" in capsys.readouterr().err


def _task_caching(run: dict[str, Any]) -> dict[str, bool]:
    spec = run["pipeline_spec"]["pipeline_spec"]
    tasks = {}
    for comp in [spec["root"], *spec["components"].values()]:
        for name, task in comp.get("dag", {}).get("tasks", {}).items():
            if "componentRef" in task and not name.startswith(("exit-handler", "for-loop", "condition")):
                tasks[name] = bool(task.get("cachingOptions", {}).get("enableCache", False))
    return tasks


def test_caching_and_pipeline_root(kfp_api: tuple[str, list[dict[str, Any]]]) -> None:
    """By default each step keeps its own setting (model preparation and conversion cached, steps that write to
    MLflow never); --disable-caching turns every step's off; --pipeline-root goes with the run."""
    host, calls = kfp_api
    assert main(["fp8-rl", "--host", host, "--pipeline-root", "s3://bucket/fp8rl"]) == 0
    (run,) = _runs(calls)
    assert run["runtime_config"]["pipeline_root"] == "s3://bucket/fp8rl"
    cached = _task_caching(run)
    assert cached["prepare-model"] and cached["convert-to-fp8"] and not cached["rl-step"] and not cached["sft-warmup"]
    calls.clear()
    assert main(["fp8-rl", "--host", host, "--disable-caching"]) == 0
    assert not any(_task_caching(_runs(calls)[0]).values())


def _kubeconfig(path: Path, server: str, context: str = "kfp-dev") -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": context,
        "clusters": [{"name": "c", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": {"token": "kube-token"}}],
        "contexts": [{"name": context, "context": {"cluster": "c", "user": "u"}}],
    }))  # fmt: skip
    return path


def test_kube_context_goes_through_the_api_servers_service_proxy(
    kfp_api: tuple[str, list[dict[str, Any]]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """``--kube-context``: no host; kfp.Client reaches the ml-pipeline service through the context's API server
    (here the stand-in answers the proxied paths) with the context's credentials."""
    host, calls = kfp_api
    kubeconfig = str(_kubeconfig(tmp_path / "kubeconfig", host))
    monkeypatch.setenv("KUBECONFIG", kubeconfig)
    # the kubernetes client reads $KUBECONFIG when first imported, which an earlier test may have done
    monkeypatch.setattr("kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", kubeconfig)
    assert main(["fp8-rl", "--kube-context", "kfp-dev"]) == 0
    (run,) = [c for c in calls if c["path"] == "/apis/v2beta1/runs"]
    assert run["raw_path"].startswith(PROXY_PREFIX) and run["auth"] == "Bearer kube-token", run
    assert main(["fp8-rl", "--kube-context", "prod"]) == 2
    assert "--kube-context prod: not a context of the kubeconfig; its contexts: kfp-dev" in capsys.readouterr().err


def test_in_cluster_uses_the_pods_service_account_token(
    kfp_api: tuple[str, list[dict[str, Any]]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    host, calls = kfp_api
    token = tmp_path / "token"
    monkeypatch.setenv("KF_PIPELINES_SA_TOKEN_PATH", str(token))
    assert main(["fp8-rl", "--in-cluster", "--host", host]) == 2
    assert f"--in-cluster: no ServiceAccount token at {token}" in capsys.readouterr().err
    token.write_text("projected-sa-token")
    assert main(["fp8-rl", "--in-cluster", "--host", host]) == 0
    (run,) = [c for c in calls if c["path"] == "/apis/v2beta1/runs"]
    assert run["auth"] == "Bearer projected-sa-token"


@pytest.fixture
def tls_kfp_api(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The stand-in behind TLS with a certificate from a private CA; yields (host without scheme, CA file)."""
    ca_key, ca, key, csr, cert = (tmp_path / n for n in ("ca.key", "ca.pem", "srv.key", "srv.csr", "srv.pem"))

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca), "-days", "1",
            "-subj", "/CN=fp8rl test CA")  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1")
    ext = tmp_path / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial", "-out",
            str(cert), "-days", "1", "-extfile", str(ext))  # fmt: skip
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server, _ = serve(context)
    try:
        yield f"127.0.0.1:{server.server_address[1]}", ca
    finally:
        server.shutdown()
        server.server_close()


def test_a_private_ca_endpoint_is_reached_with_its_ca(
    tls_kfp_api: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """A host without a scheme is https, as kfp.Client assumes; the reachability probe trusts --ssl-ca-cert as
    kfp.Client does, so a private-CA endpoint is submitted to, and without the CA the error says to give it."""
    host, ca = tls_kfp_api
    assert main(["fp8-rl", "--host", host]) == 2
    assert (
        f"Kubeflow Pipelines at https://{host}/apis/v2beta1/healthz: TLS certificate not trusted"
        in (err := capsys.readouterr().err)
        and "--ssl-ca-cert" in err
    )
    assert main(["fp8-rl", "--host", host, "--ssl-ca-cert", str(ca)]) == 0
    assert f"https://{host}/#/runs/details/{RUN_ID}" in capsys.readouterr().out
    assert _runs(FakeKfpApi.calls)


def test_a_failed_attempt_is_named_by_its_step() -> None:
    """A real KFP 2.17 backend reports the failed pod as ``executor(0)`` under the step's own task (seen on a real
    backend: ``FAILED: executor(0)``); the message names the step, the attempt in brackets."""
    from types import SimpleNamespace as NS

    from pipelines.remote import failed_tasks

    def task(tid: str, name: str, parent: str | None, children: bool, error: str | None = None) -> NS:
        return NS(task_id=tid, display_name=name, parent_task_id=parent, state="FAILED",
                  child_tasks=[1] if children else [], error=NS(message=error) if error else None)  # fmt: skip

    tasks = [task("root", "fp8-rl", None, True), task("dag", "exit-handler-1", "root", True),
             task("step", "prepare model", "dag", True), task("retry", "retry-system-container-impl", "step", True),
             task("pod", "executor(0)", "retry", False, "exit status 1")]  # fmt: skip
    assert failed_tasks(NS(run_details=NS(task_details=tasks))) == ["prepare model (executor(0)): exit status 1"]
    # as KFP 2.17.0 reports it: no parent ids, each task listing its children (seen on the real backend)
    linked = [NS(task_id=t.task_id, display_name=t.display_name, parent_task_id=None, state=t.state, error=t.error,
                 child_tasks=[NS(task_id=c.task_id) for c in tasks if c.parent_task_id == t.task_id])
              for t in tasks]  # fmt: skip
    assert failed_tasks(NS(run_details=NS(task_details=linked))) == ["prepare model (executor(0)): exit status 1"]
    # as KFP 2.17.0 reported a failed prepare-model step on the real backend: nothing links the tasks
    flat = [task("root", "root", None, True), task("rootd", "root-driver", None, False),
            task("dag", "exit-handler-1", None, True), task("dagd", "exit-handler-1-driver", None, False),
            task("step", "prepare-model", None, True), task("stepd", "prepare-model-driver", None, False),
            task("retry", "executor", None, True), task("pod", "executor(0)", None, False, "exit status 1")]  # fmt: skip
    for t in flat:
        t.state = "SUCCEEDED" if t.display_name.endswith("-driver") else "FAILED"
        t.child_tasks = [NS(pod_name="x")] if t.child_tasks else []
    assert failed_tasks(NS(run_details=NS(task_details=flat))) == ["prepare-model (executor(0)): exit status 1"]
    orphan = [task("pod", "executor(1)", "gone", False)]
    assert failed_tasks(NS(run_details=NS(task_details=orphan))) == ["executor(1)"]
