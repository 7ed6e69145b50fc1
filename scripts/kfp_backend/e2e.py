"""The users' whole path on this machine: a real KFP 2.17.0 backend beside the local cluster, the chart, and the
pipelines submitted with ``python -m pipelines.submit --wait`` (``make e2e``).

    python scripts/kfp_backend/e2e.py [--pipelines recipe-comparison,fp8-rl,fp8-benchmark] [--keep]
    python scripts/kfp_backend/e2e.py --down      # stop what a --keep run left

Needs the cluster of ``make cluster-up`` (a real node that has the component image and scripts/kfp_backend/images.sh's
driver, launcher and argoexec images) and the backend build of scripts/kfp_backend/build.sh in the tools cache, with
the MLMD server's environment (``$TOOLS/mlmd-venv``): ``make e2e`` has prepare.py make them.  It starts, as host processes logging under a work directory: MariaDB, SeaweedFS's S3
gateway, the MLMD server (mlmd_server.py), KFP's API server (its driver and launcher images set), persistence agent
and ScheduledWorkflow controller, and Argo's workflow-controller (its executor image set).  Pods reach them through
tests/cluster/kfp_backend.py's Services in ``kubeflow``, a namespace that enforces Pod Security Standards
``restricted`` (Argo's executor containers locked down as KFP's own installation does).  It installs the chart (release ``rl``, namespace
``kubeflow``, ``ci/local-cluster-values.yaml``; hostPath volumes), then for each pipeline: submits it with CPU
settings, waits for SUCCEEDED, and checks in the release's MLflow that the run's parent run and every child run
are FINISHED.  For each it prints ``E2E OK <pipeline> kfp-run=<id> mlflow-parent=<id> (<s> s)``, and last
``E2E OK kfp-run=<id> mlflow-parent=<id>`` (recipe-comparison's).  Everything it started is stopped and the release
uninstalled at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "cluster"))
sys.path.insert(0, str(Path(__file__).parent))

from kfp_backend import KUBEFLOW_NAMESPACE, BackendSettings, HostPorts, backend_manifests  # noqa: E402
from real_node import CPU_RAY_RUN_CONFIG, host_ip  # noqa: E402
from smoke_apiserver import db_config, start_mariadb  # noqa: E402
from ui import missing_build, start_ui, ui_env  # noqa: E402

TOOLS = Path(os.environ.get("FP8RL_TOOLS_DIR") or Path.home() / ".cache" / "fp8rl" / "tools")
KFP_BIN = TOOLS / "kfp-2.17.0" / "bin"
CRDS = TOOLS / "kfp-2.17.0" / "crds"
MLMD_PYTHON = TOOLS / "mlmd-venv" / "bin" / "python"
CLUSTER_DIR = Path(os.environ.get("FP8RL_CLUSTER_DIR") or Path.home() / ".cache" / "fp8rl" / "cluster")
KUBECONFIG = CLUSTER_DIR / "kubeconfig.yaml"
KEPT = CLUSTER_DIR / "kfp-backend.json"  # what a --keep run left running: its work directory and process groups
CHART = ROOT / "charts" / "fp8rl"
RELEASE = "rl"
PIPELINE_SA = f"{RELEASE}-fp8rl-pipeline"  # the chart's; runs name it with --service-account
DRIVER_IMAGE = "localhost/fp8rl-kfp-driver:2.17.0"
LAUNCHER_IMAGE = "localhost/fp8rl-kfp-launcher:2.17.0"
EXECUTOR_IMAGE = "localhost/fp8rl-argoexec:v4.0.5"
S3_KEYS = ("kfp", "kfp-secret")
# SeaweedFS's own ports (their gRPC ports are these + 10000), away from the ones KFP's services use
WEED_PORTS = {"master": 19333, "volume": 18080, "filer": 18888}
PIPELINES = ("recipe-comparison", "fp8-rl", "fp8-benchmark")

# A tiny model on CPU, each RL step a RayJob of 2 trainer workers and 1 rollout worker on the 2-core node
RUN_CONFIG = CPU_RAY_RUN_CONFIG
COMMON = {"device": "cpu", "sft_steps": 2, "rl_steps": 2, "bench_steps": 1, "run_config": RUN_CONFIG}
STEP_REQUESTS = "250m,1Gi"  # the steps that hold a model: the default 2 CPUs would not fit the 2-core node
PARAMS: dict[str, dict[str, Any]] = {
    "recipe-comparison": {**COMMON, "recipes": ["bf16", "fp8-e2e"]},
    "fp8-rl": {**COMMON, "recipe": "fp8-e2e"},
    "fp8-benchmark": {k: v for k, v in COMMON.items() if k not in ("sft_steps", "rl_steps")}
    | {"recipes": ["bf16", "fp8-e2e"], "warmup_steps": 0},
}
# The run started from the UI's form: recipe-comparison's CPU settings, typed into the form, one RL step
UI_PARAMS = {**PARAMS["recipe-comparison"], "rl_steps": 1}


def say(msg: str) -> None:
    print(f"e2e: {msg}", flush=True)


def wait_for(what: str, ready: Callable[[], Any], timeout_s: float, proc: subprocess.Popen | None = None,
             log: Path | None = None) -> Any:  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log else ""
            raise SystemExit(f"e2e: {what}: the process exited ({proc.returncode}); its log {log}:\n{tail}")
        with contextlib.suppress(Exception):
            got = ready()
            if got:
                return got
        time.sleep(1)
    tail = log.read_text(errors="replace")[-3000:] if log else ""
    raise SystemExit(f"e2e: {what}: not ready after {timeout_s:.0f} s" + (f"; its log {log}:\n{tail}" if log else ""))


def listening(port: int, host: str = "127.0.0.1") -> bool:
    with socket.create_connection((host, port), timeout=1):
        return True


class Processes:
    """Host processes, each in its own session, logging to ``<work>/<name>.log``; stopped in reverse order."""

    def __init__(self, work: Path) -> None:
        self.work, self.procs = work, []

    def start(self, name: str, argv: list[Any], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path]:
        log = self.work / f"{name}.log"
        proc = subprocess.Popen([str(a) for a in argv], env={**os.environ, **(env or {})}, stdout=log.open("wb"),
                                stderr=subprocess.STDOUT, start_new_session=True, cwd=self.work)  # fmt: skip
        self.procs.append((name, proc))
        return proc, log

    def stop(self) -> None:
        stop_groups([proc.pid for _name, proc in reversed(self.procs)])


def stop_groups(pids: list[int]) -> None:
    """SIGTERM each process group, then SIGKILL what is left after 10 s (the API server outlives SIGTERM)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, 15)
    deadline = time.monotonic() + 10
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, 9)


def uninstall() -> None:
    subprocess.run([str(TOOLS / "bin" / "helm"), f"--kubeconfig={KUBECONFIG}", "uninstall", RELEASE, "-n",
                    KUBEFLOW_NAMESPACE, "--wait"], capture_output=True)  # fmt: skip
    kubectl("delete", "workflows.argoproj.io", "--all", "-n", KUBEFLOW_NAMESPACE, check=False)
    kubectl("delete", "pvc", "--all", "-n", KUBEFLOW_NAMESPACE, check=False)
    kubectl("delete", "pv", f"e2e-{RELEASE}-fp8rl-data", f"e2e-{RELEASE}-fp8rl-mlflow", check=False)


def down() -> int:
    if not KEPT.exists():
        say(f"nothing kept ({KEPT} absent)")
        return 0
    kept = json.loads(KEPT.read_text())
    uninstall()
    stop_groups(kept["pids"])
    KEPT.unlink()
    say(f"stopped what the --keep run left; its logs in {kept['work']}")
    return 0


def kubectl(*args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["kubectl", f"--kubeconfig={KUBECONFIG}", *args], input=stdin, capture_output=True,
                          text=True)  # fmt: skip
    if check and done.returncode:
        raise SystemExit(f"e2e: kubectl {' '.join(args)}: {done.stderr.strip()}")
    return done


def with_token(script_argv: list[Any], token: str, path: str) -> list[str]:
    """``script_argv`` in a mount namespace of its own whose ``/run`` (``/var/run``) holds ``token`` at ``path``:
    where KFP's persistence agent and ScheduledWorkflow controller read their service-account token in a pod."""
    target = Path(path)
    setup = (f"mount -t tmpfs none /run && mkdir -p {target.parent} && printf %s \"$FP8RL_SA_TOKEN\" > {target} "
             '&& exec "$@"')  # fmt: skip
    return ["env", f"FP8RL_SA_TOKEN={token}", "unshare", "-m", "sh", "-c", setup, "backend",
            *map(str, script_argv)]  # fmt: skip


def start_backend(procs: Processes, work: Path, node_ip: str) -> str:
    """Everything KFP needs beside the cluster; returns the API server's URL."""
    settings = BackendSettings(node_ip=node_ip, run_namespace=KUBEFLOW_NAMESPACE, s3_access_key=S3_KEYS[0],
                               s3_secret_key=S3_KEYS[1], service_account=PIPELINE_SA)  # fmt: skip
    ports = settings.ports
    for port in (ports.api_http, ports.api_grpc, ports.mlmd_grpc, ports.s3, *WEED_PORTS.values()):
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            raise SystemExit(f"e2e: port {port} is in use: stop what listens there (an earlier --keep run?)")
    db_port = start_stores(procs, work, settings)
    url, env = start_apiserver(procs, work, settings, db_port)
    start_controllers(procs, settings, env)
    return url


def start_stores(procs: Processes, work: Path, settings: BackendSettings) -> int:
    """MariaDB, SeaweedFS (the S3 gateway) and the MLMD server; returns MariaDB's port."""
    ports = settings.ports
    db_port = start_mariadb(work, procs.procs)
    say(f"MariaDB on 127.0.0.1:{db_port}")

    s3_config = work / "s3.json"
    s3_config.write_text(json.dumps({"identities": [{
        "name": "kfp", "credentials": [{"accessKey": S3_KEYS[0], "secretKey": S3_KEYS[1]}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))  # fmt: skip
    (work / "weed").mkdir()
    proc, log = procs.start("seaweedfs", [
        KFP_BIN / "weed", "server", f"-dir={work / 'weed'}", f"-ip={settings.node_ip}", "-ip.bind=0.0.0.0",
        f"-master.port={WEED_PORTS['master']}", f"-volume.port={WEED_PORTS['volume']}", "-filer",
        f"-filer.port={WEED_PORTS['filer']}", "-s3", f"-s3.port={ports.s3}", f"-s3.config={s3_config}",
        "-master.volumeSizeLimitMB=256", "-volume.max=16",
    ])  # fmt: skip
    wait_for("SeaweedFS's S3 gateway", lambda: listening(ports.s3), 120, proc, log)
    say(f"SeaweedFS S3 on :{ports.s3}")

    proc, log = procs.start("mlmd", [MLMD_PYTHON, Path(__file__).with_name("mlmd_server.py"), "--host", "0.0.0.0",
                                     "--port", ports.mlmd_grpc, "--sqlite", work / "mlmd.sqlite"])  # fmt: skip
    wait_for("the MLMD server", lambda: listening(ports.mlmd_grpc), 60, proc, log)
    return db_port


def start_apiserver(
    procs: Processes, work: Path, settings: BackendSettings, db_port: int
) -> tuple[str, dict[str, str]]:
    """The KFP API server on the stores; returns its URL and the environment the controllers share with it."""
    ports = settings.ports
    config = {**db_config("mariadb", db_port),
              "ObjectStoreConfig": {"Host": "127.0.0.1", "Port": str(ports.s3), "Secure": False,
                                    "AccessKey": S3_KEYS[0], "SecretAccessKey": S3_KEYS[1],
                                    "BucketName": settings.bucket, "PipelinePath": "pipelines"},
              "InitConnectionTimeout": "60s", "DEFAULTPIPELINERUNNERSERVICEACCOUNT": "pipeline-runner",
              "CacheEnabled": "true", "CRON_SCHEDULE_TIMEZONE": "UTC"}  # fmt: skip
    (work / "apiserver-config").mkdir()
    (work / "apiserver-config" / "config.json").write_text(json.dumps(config, indent=2))
    home = work / "home"
    (home / ".kube").mkdir(parents=True)
    (home / ".kube" / "config").write_text(KUBECONFIG.read_text())
    env = {"HOME": str(home), "KUBECONFIG": str(KUBECONFIG), "POD_NAMESPACE": KUBEFLOW_NAMESPACE,
           "V2_DRIVER_IMAGE": DRIVER_IMAGE, "V2_LAUNCHER_IMAGE": LAUNCHER_IMAGE,
           # required at start; no visualization server runs
           "ML_PIPELINE_VISUALIZATIONSERVER_SERVICE_HOST": "127.0.0.1",
           "ML_PIPELINE_VISUALIZATIONSERVER_SERVICE_PORT": "18900"}  # fmt: skip
    proc, log = procs.start("apiserver", [
        KFP_BIN / "apiserver", f"--config={work / 'apiserver-config'}", f"--rpcPortFlag=:{ports.api_grpc}",
        f"--httpPortFlag=:{ports.api_http}", "--webhookPortFlag=127.0.0.1:18901", "--logtostderr=true", "--v=2",
    ], env)  # fmt: skip
    url = f"http://127.0.0.1:{ports.api_http}"
    wait_for("the KFP API server", lambda: urllib.request.urlopen(f"{url}/apis/v2beta1/healthz", timeout=2).status
             == 200, 180, proc, log)  # fmt: skip
    say(f"KFP API server at {url} (gRPC :{ports.api_grpc})")
    return url, env


def start_controllers(procs: Processes, settings: BackendSettings, env: dict[str, str]) -> None:
    """The Kubernetes side (Argo's and KFP's CRDs, the Services that lead pods to these processes, the run
    namespace's Secret, ConfigMap and executor rights), then the persistence agent, the ScheduledWorkflow controller
    and Argo's workflow-controller."""
    ports = settings.ports
    for crd in sorted(CRDS.glob("*.yaml")):
        kubectl("apply", "--server-side", "-f", str(crd))
    kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(backend_manifests(settings)))
    kubectl("create", "serviceaccount", "fp8rl-kfp-agent", "-n", KUBEFLOW_NAMESPACE, check=False)
    token = kubectl("create", "token", "fp8rl-kfp-agent", "-n", KUBEFLOW_NAMESPACE, "--duration=24h").stdout.strip()

    agent_token = "/var/run/secrets/kubeflow/tokens/persistenceagent-sa-token"
    proc, log = procs.start("persistence-agent", with_token([
        KFP_BIN / "persistence_agent", f"--kubeconfig={KUBECONFIG}", f"--namespace={KUBEFLOW_NAMESPACE}",
        "--mlPipelineAPIServerName=127.0.0.1", f"--mlPipelineServiceHttpPort={ports.api_http}",
        f"--mlPipelineServiceGRPCPort={ports.api_grpc}", "--logLevel=info",
    ], token, agent_token), env)  # fmt: skip
    watched = [("the persistence agent", proc, log)]
    proc, log = procs.start("scheduledworkflow", [
        KFP_BIN / "scheduledworkflow", f"--kubeconfig={KUBECONFIG}", f"--namespace={KUBEFLOW_NAMESPACE}",
        "--mlPipelineAPIServerName=127.0.0.1", f"--mlPipelineServiceGRPCPort={ports.api_grpc}",
        "--metricsPort=18902",
    ], env)  # fmt: skip
    watched.append(("the ScheduledWorkflow controller", proc, log))
    proc, log = procs.start("workflow-controller", [
        KFP_BIN / "workflow-controller", f"--kubeconfig={KUBECONFIG}", "--namespaced",
        f"--managed-namespace={KUBEFLOW_NAMESPACE}", "-n", KUBEFLOW_NAMESPACE, f"--executor-image={EXECUTOR_IMAGE}",
        "--executor-image-pull-policy=IfNotPresent",
    ], {**env, "LEADER_ELECTION_IDENTITY": "fp8rl-e2e", "LEADER_ELECTION_DISABLE": "true"})  # fmt: skip
    watched.append(("Argo's workflow-controller", proc, log))
    # they log and exit when something is missing (the persistence agent builds parts of its client from
    # $KUBECONFIG, not its --kubeconfig): give them the time to, then check that each is still up
    time.sleep(10)
    for what, proc, log in watched:
        if proc.poll() is not None:
            raise SystemExit(f"e2e: {what} exited ({proc.returncode}); its log {log}:\n{log.read_text()[-3000:]}")
    say("persistence agent, ScheduledWorkflow controller and Argo's workflow-controller started")
    say(
        f"{KUBEFLOW_NAMESPACE} enforces Pod Security Standards 'restricted' (backend_manifests): every pod of the runs "
        "must pass it"
    )


def install_chart(work: Path) -> dict[str, str]:
    """The chart, release ``rl`` in ``kubeflow``, on hostPath volumes; returns MLflow's URI and admin credentials."""
    helm = [str(TOOLS / "bin" / "helm"), f"--kubeconfig={KUBECONFIG}"]
    for claim, size, mode in ((f"{RELEASE}-fp8rl-data", "5Gi", "ReadWriteMany"),
                              (f"{RELEASE}-fp8rl-mlflow", "1Gi", "ReadWriteOnce")):  # fmt: skip
        path = work / "volumes" / claim
        path.mkdir(parents=True)
        path.chmod(0o777)  # hostPath is not chowned to the pods' fsGroup
        pv = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"e2e-{claim}"},
              "spec": {"capacity": {"storage": size}, "accessModes": [mode], "persistentVolumeReclaimPolicy": "Delete",
                       "hostPath": {"path": str(path), "type": "Directory"},
                       "claimRef": {"namespace": KUBEFLOW_NAMESPACE, "name": claim}}}  # fmt: skip
        kubectl("apply", "-f", "-", stdin=json.dumps(pv))
    t0 = time.monotonic()
    done = subprocess.run([*helm, "install", RELEASE, str(CHART), "-n", KUBEFLOW_NAMESPACE, "-f",
                           str(CHART / "ci" / "local-cluster-values.yaml"), "--wait", "--timeout", "6m"],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode:
        raise SystemExit(f"e2e: helm install: {done.stderr.strip()}")
    say(f"chart installed, MLflow serving, in {time.monotonic() - t0:.0f} s")
    svc = json.loads(kubectl("get", "service", f"{RELEASE}-fp8rl-mlflow", "-n", KUBEFLOW_NAMESPACE, "-o",
                             "json").stdout)  # fmt: skip
    secret = json.loads(kubectl("get", "secret", f"{RELEASE}-fp8rl-mlflow-auth", "-n", KUBEFLOW_NAMESPACE, "-o",
                                "json").stdout)  # fmt: skip
    return {"MLFLOW_TRACKING_URI": f"http://{svc['spec']['clusterIP']}:{svc['spec']['ports'][0]['port']}",
            "MLFLOW_TRACKING_USERNAME": "admin",
            "MLFLOW_TRACKING_PASSWORD": base64.b64decode(secret["data"]["admin-password"]).decode()}  # fmt: skip


def run_submit(
    pipeline: str, url: str, work: Path, label: str, extra: list[str], params: dict[str, Any]
) -> tuple[int, str]:
    """``python -m pipelines.submit PIPELINE`` against the API server as a user of a GPU-less cluster runs it;
    returns (exit status, output), the output also in ``<work>/submit-<label>.log``."""
    param_file = work / f"{label}-params.yaml"
    param_file.write_text(yaml.safe_dump(params))
    argv = [sys.executable, "-m", "pipelines.submit", pipeline, "--host", url, "--param-file", str(param_file),
            "--registry", "localhost", "--step-requests", STEP_REQUESTS, "--cpu-only", "--service-account",
            PIPELINE_SA, "--experiment", "fp8rl-e2e", "--run-name", f"e2e {label}", *extra]  # fmt: skip
    say(" ".join(argv[1:]))
    done = subprocess.run(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    (work / f"submit-{label}.log").write_text(done.stdout)
    print(done.stdout, end="", flush=True)
    return done.returncode, done.stdout


def run_id_of(output: str) -> str | None:
    found = re.search(r"\(run ([0-9a-f-]{36})\)", output)
    return found.group(1) if found else None


def submit(pipeline: str, url: str, work: Path) -> str:
    """``pipelines.submit PIPELINE --wait``; returns the KFP run id of the SUCCEEDED run."""
    rc, out = run_submit(pipeline, url, work, pipeline, ["--wait", "--timeout", "3600"], PARAMS[pipeline])
    run_id = run_id_of(out)
    if rc or not run_id:
        raise SystemExit(f"e2e: {pipeline}: pipelines.submit exited {rc} (log {work}/submit-{pipeline}.log)")
    return run_id


def check_submit_tool(url: str, work: Path) -> None:
    """What a KFP user does beside a run, against the real API server: ``--upload`` of a pipeline and then of a new
    version, each with a recurring run (``--schedule``) that the ScheduledWorkflow controller takes up; ``--wait`` on
    a run whose step fails exits 1 naming the step; cancelling a run stops its RayJob."""
    import kfp

    client = kfp.Client(host=url)
    name = "fp8rl-e2e-upload"
    for version in ("v1", "v2"):
        rc, out = run_submit("fp8-rl", url, work, f"upload-{version}", ["--upload", "--pipeline-name", name,
                             "--version-name", version, "--schedule", "0 3 * * *"], PARAMS["fp8-rl"])  # fmt: skip
        if rc:
            raise SystemExit(f"e2e: --upload --schedule ({version}): pipelines.submit exited {rc}")
    pipeline_id = client.get_pipeline_id(name)
    versions = {v.display_name for v in client.list_pipeline_versions(pipeline_id).pipeline_versions or []}
    recurring = [r for r in client.list_recurring_runs(page_size=50).recurring_runs or []
                 if r.pipeline_version_reference and r.pipeline_version_reference.pipeline_id == pipeline_id]  # fmt: skip
    # KFP names a new pipeline's first version after the pipeline; --version-name names the later ones
    if versions != {name, "v2"} or len(recurring) != 2:
        raise SystemExit(f"e2e: --upload: versions {sorted(versions)}, {len(recurring)} recurring runs "
                         f"(want {name!r} and 'v2'; 2)")  # fmt: skip
    swfs = wait_for("the ScheduledWorkflows of the recurring runs", lambda: [
        w for w in json.loads(kubectl("get", "scheduledworkflows", "-n", KUBEFLOW_NAMESPACE, "-o", "json").stdout)["items"]
        if w.get("status", {}).get("conditions")], 60)  # fmt: skip
    for r in recurring:
        client.delete_recurring_run(r.recurring_run_id)
    say(f"OK --upload: pipeline {name!r} versions {name!r}, 'v2'; 2 recurring runs, {len(swfs)} ScheduledWorkflow(s) "
        "reconciled; deleted")  # fmt: skip

    rc, out = run_submit("fp8-rl", url, work, "failing", ["--wait", "--timeout", "900"],
                         {**PARAMS["fp8-rl"], "model_source": "no-such-model"})  # fmt: skip
    if rc != 1 or "prepare" not in out.split("pipelines.submit: run", 1)[-1]:
        failed = run_id_of(out)
        tree = [(t.display_name, t.task_id, t.parent_task_id, str(t.state)) for t in
                (client.get_run(failed).run_details.task_details or [])] if failed else []  # fmt: skip
        raise SystemExit(f"e2e: a failing run: want exit 1 naming the prepare-model step, got {rc}; tasks {tree}")
    say("OK --wait on a failing run: exit 1, the failed step named")

    rc, out = run_submit("fp8-rl", url, work, "cancelled", [], PARAMS["fp8-rl"])
    run_id = run_id_of(out)
    if rc or not run_id:
        raise SystemExit(f"e2e: a run to cancel: pipelines.submit exited {rc}")

    def rayjobs() -> list[str]:
        got = json.loads(kubectl("get", "rayjobs", "-n", KUBEFLOW_NAMESPACE, "-o", "json").stdout)["items"]
        return [j["metadata"]["name"] for j in got]

    jobs = wait_for("the run's RayJob", rayjobs, 900)
    client.terminate_run(run_id)
    t0 = time.monotonic()
    wait_for("no RayJob and no Ray pod after the cancel", lambda: not rayjobs() and not kubectl(
        "get", "pods", "-n", KUBEFLOW_NAMESPACE, "-l", "ray.io/cluster", "-o", "name").stdout.strip(), 180)  # fmt: skip
    say(f"OK cancelling run {run_id} deleted its RayJob {jobs} and Ray pods in {time.monotonic() - t0:.0f} s")


def check_mlflow(kfp_run: str, mlflow_env: dict[str, str]) -> tuple[str, int]:
    """The run's MLflow parent (tag ``kfp.run_id``) and every child run FINISHED; returns (parent id, children)."""
    os.environ.update(mlflow_env)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_env["MLFLOW_TRACKING_URI"])
    exps = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(exps, f"tags.`kfp.run_id` = '{kfp_run}'")
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    if len(parents) != 1:
        raise SystemExit(f"e2e: KFP run {kfp_run}: expected one MLflow parent run, found {len(parents)}")
    parent = parents[0]
    children = client.search_runs(exps, f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    bad = [f"{r.info.run_name}={r.info.status}" for r in [parent, *children] if r.info.status != "FINISHED"]
    if not children or bad:
        raise SystemExit(f"e2e: KFP run {kfp_run}: MLflow runs not FINISHED: {bad or 'no child runs'}")
    return parent.info.run_id, len(children)


def check_ui(procs: Processes, work: Path, api_url: str, mlflow_env: dict[str, str]) -> None:
    """The KFP UI (scripts/kfp_backend/ui.py) driven in headless Chromium by tests/cluster/test_kfp_ui.py: upload
    recipe-comparison compiled as ``pipelines.submit`` compiles it here, start a run from the form, see it succeed,
    open a step's logs; then that run's MLflow runs FINISHED."""
    ports = HostPorts()
    ui_url = start_ui(procs, ports.mlmd_grpc, ui_env(ports.api_http, (ports.s3, *S3_KEYS), KUBEFLOW_NAMESPACE,
                                                     KUBECONFIG), wait_for)  # fmt: skip
    say(f"KFP UI at {ui_url}")
    package_dir, shots = work / "ui-package", work / "ui-screenshots"
    subprocess.run([sys.executable, "-m", "pipelines.compile", "recipe-comparison", "--output-dir", str(package_dir),
                    "--registry", "localhost", "--step-requests", STEP_REQUESTS, "--cpu-only",
                    # every step runs: the earlier recipe-comparison run would serve its prepare step from KFP's cache
                    "--disable-caching"], cwd=ROOT,
                   check=True)  # fmt: skip
    env = {"FP8RL_KFP_UI_URL": ui_url, "FP8RL_KFP_API_URL": api_url,
           "FP8RL_KFP_UI_PACKAGE": str(package_dir / "recipe-comparison.yaml"),
           "FP8RL_KFP_UI_PARAMS": json.dumps(UI_PARAMS), "FP8RL_KFP_UI_SERVICE_ACCOUNT": PIPELINE_SA,
           "FP8RL_KFP_UI_OUT": str(shots)}  # fmt: skip
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs",
                           "tests/cluster/test_kfp_ui.py"], cwd=ROOT, env={**os.environ, **env},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    (work / "ui-test.log").write_text(done.stdout)
    print(done.stdout, end="", flush=True)
    if done.returncode or "1 passed" not in done.stdout:
        raise SystemExit(f"e2e: the KFP UI check did not pass (exit {done.returncode}); screenshots in {shots}")
    run_id = (shots / "run-id").read_text().strip()
    parent, children = check_mlflow(run_id, mlflow_env)
    say(f"OK the KFP UI: uploaded, run {run_id} started from the form SUCCEEDED, a step's logs shown "
        f"({time.monotonic() - t0:.0f} s); MLflow parent {parent} and {children} child runs FINISHED; "
        f"screenshots {', '.join(sorted(p.name for p in shots.glob('*.png')))} in {shots}")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pipelines", default=",".join(PIPELINES), help=f"which, in order (default {','.join(PIPELINES)})")
    p.add_argument("--keep", action="store_true", help="leave the backend and the release running")
    p.add_argument(
        "--no-checks",
        dest="checks",
        action="store_false",
        help="skip the submit tool's checks after the pipelines (upload, schedule, failing run, cancel)",
    )
    p.add_argument(
        "--no-ui",
        dest="ui",
        action="store_false",
        help="skip the KFP UI check (it needs scripts/kfp_backend/build_ui.sh's build, Chromium and playwright)",
    )
    p.add_argument("--down", action="store_true", help="stop what a --keep run left, and uninstall its release")
    return p


def preflight(args: argparse.Namespace) -> list[str]:
    """The pipelines to run, once everything they need is there (SystemExit naming what is not)."""
    if KEPT.exists():
        raise SystemExit(f"e2e: a --keep run is still up ({KEPT}): stop it with --down first")
    pipelines = [x for x in args.pipelines.split(",") if x]
    unknown = sorted(set(pipelines) - set(PIPELINES))
    if unknown:
        raise SystemExit(f"e2e: --pipelines: unknown {unknown}; choose from {list(PIPELINES)}")
    missing = [str(b) for b in [*(KFP_BIN / n for n in ("apiserver", "persistence_agent", "scheduledworkflow",
               "workflow-controller", "weed")), MLMD_PYTHON] if not Path(b).exists()]  # fmt: skip
    if missing:
        raise SystemExit(f"e2e: missing {', '.join(missing)}: `make e2e-prepare KFP_SRC=...` makes them")
    if args.ui and missing_build():
        raise SystemExit(f"e2e: missing {', '.join(missing_build())}: build the UI with scripts/kfp_backend/build_ui.sh "
                         "(KFP_SRC=...), or pass --no-ui")  # fmt: skip
    if not KUBECONFIG.exists() or kubectl("get", "--raw", "/readyz", check=False).returncode:
        raise SystemExit(f"e2e: no cluster answers at {KUBECONFIG}: make cluster-up first")
    return pipelines


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.down:
        return down()
    pipelines = preflight(args)
    t_all = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="fp8rl-e2e."))
    work.chmod(0o755)
    say(f"work directory (logs) {work}")
    procs = Processes(work)
    installed = False
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still stops what it started
    try:
        url = start_backend(procs, work, host_ip())
        mlflow_env = install_chart(work)
        installed = True
        lines = []
        for pipeline in pipelines:
            t0 = time.monotonic()
            run_id = submit(pipeline, url, work)
            parent, children = check_mlflow(run_id, mlflow_env)
            line = f"kfp-run={run_id} mlflow-parent={parent}"
            say(f"OK {pipeline} {line} ({children} child runs FINISHED, {time.monotonic() - t0:.0f} s)")
            lines.append((pipeline, line))
        if args.ui:
            check_ui(procs, work, url, mlflow_env)
        if args.checks:
            check_submit_tool(url, work)
        say(f"all in {time.monotonic() - t_all:.0f} s")
        if lines:
            print(f"E2E OK {dict(lines).get('recipe-comparison', lines[-1][1])}", flush=True)
        return 0
    finally:
        if args.keep:
            KEPT.write_text(json.dumps({"work": str(work), "pids": [proc.pid for _n, proc in procs.procs]}))
            say(f"--keep: left running (stop it with --down); logs in {work}")
        else:
            if installed:
                uninstall()
            procs.stop()
            say(f"stopped; logs in {work}")


if __name__ == "__main__":
    sys.exit(main())
