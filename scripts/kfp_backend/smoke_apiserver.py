"""Bring the KFP API server that ``build.sh`` built up against a real Kubernetes API server, and call it.

    python scripts/kfp_backend/smoke_apiserver.py --s3-endpoint 127.0.0.1:PORT [--kubeconfig FILE] [--db mariadb|postgres]
        [--pipeline FILE [--driver BINARY --mlmd-python PYTHON]] [--apiserver BINARY] [--keep]

It starts, each in a temporary directory, each logging there:
- a Kubernetes control plane (tests/cluster/control_plane.py, kwok nodes only, on free loopback ports), unless
  ``--kubeconfig`` names a running cluster (``python scripts/local_cluster.py up`` prints one);
- the database, from Debian's packages (KFP 2.17.0 speaks ``mysql`` or ``pgx``, not SQLite): MariaDB by default;
  ``--db postgres`` for PostgreSQL, which 2.17.0's API server fails on at start (its default-experiment store
  queries the mixed-case column ``DefaultExperimentId`` unquoted: ``column "defaultexperimentid" does not exist``);
- the API server (``$TOOLS/kfp-2.17.0/bin/apiserver``) out of cluster, its kubeconfig as ``$HOME/.kube/config``
  of a scratch HOME (the ScheduledWorkflow client reads only that path out of cluster);
then calls ``kfp.Client(host=...).list_experiments()``, creates an experiment and lists it again, and prints
``KFP APISERVER OK host=... experiments=[...]``.  With ``--pipeline FILE`` (e.g. ``python -m pipelines.compile``'s
recipe-comparison.yaml) it also installs Argo's CRDs, uploads the pipeline, starts a run and prints
``KFP RUN CREATED run=... state=PENDING workflows=[...]``: the API server compiled the run into an Argo Workflow
on the Kubernetes API server (no workflow controller runs here, so it goes no further).  With ``--driver BINARY``
too, it runs KFP's driver for that run's root DAG as the Workflow's first pod would, against ``mlmd_server.py`` and
the API server, and prints ``KFP DRIVER OK root-dag execution=N``.  The object store is an S3 endpoint given with ``--s3-endpoint``
(SeaweedFS's S3 gateway, or for this smoke alone any S3 test server).  Everything it started is stopped at the
end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "cluster"))

from control_plane import ControlPlane, free_port  # noqa: E402

KFP_VERSION = "2.17.0"
TOOLS = Path(os.environ.get("FP8RL_TOOLS_DIR") or Path.home() / ".cache" / "fp8rl" / "tools")
PG_BIN = Path("/usr/lib/postgresql/15/bin")


RPC_PORT: list[int] = []  # the API server's gRPC port, for the driver


def _say(msg: str) -> None:
    print(f"kfp-smoke: {msg}", flush=True)


def _wait(what: str, ready, timeout_s: float, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-4000:] if log else ""
            raise SystemExit(f"kfp-smoke: {what}: the process exited ({proc.returncode}):\n{tail}")
        with contextlib.suppress(Exception):
            if ready():
                return
        time.sleep(0.5)
    tail = log.read_text(errors="replace")[-4000:] if log else ""
    raise SystemExit(f"kfp-smoke: {what} not ready after {timeout_s:.0f} s:\n{tail}")


def start_postgres(work: Path, procs: list) -> int:
    """A PostgreSQL cluster in ``work/pg`` (trust auth on loopback), database ``mlpipeline``; returns its port."""
    if not (PG_BIN / "initdb").exists():
        raise SystemExit(f"kfp-smoke: no {PG_BIN / 'initdb'}: apt-get install postgresql-15")
    data, port = work / "pg", free_port()
    data.mkdir()
    shutil.chown(data, "postgres", "postgres")
    data.chmod(0o700)
    as_pg = ["runuser", "-u", "postgres", "--"]
    subprocess.run([*as_pg, PG_BIN / "initdb", "-D", data, "-U", "kfp", "--auth=trust", "-E", "UTF8"],
                   check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    log = work / "postgres.log"
    proc = subprocess.Popen([*as_pg, PG_BIN / "postgres", "-D", data, "-p", str(port), "-h", "127.0.0.1",
                             "-k", data], stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    procs.append(("postgres", proc))
    _wait("postgres", lambda: subprocess.run([PG_BIN / "pg_isready", "-h", "127.0.0.1", "-p", str(port)],
                                             capture_output=True).returncode == 0, 30, proc, log)  # fmt: skip
    subprocess.run([PG_BIN / "createdb", "-h", "127.0.0.1", "-p", str(port), "-U", "kfp", "mlpipeline"], check=True)
    return port


def start_mariadb(work: Path, procs: list) -> int:
    """A MariaDB server in ``work/mysql``, root without a password on loopback; returns its port."""
    if not Path("/usr/sbin/mariadbd").exists():
        raise SystemExit("kfp-smoke: no /usr/sbin/mariadbd: apt-get install mariadb-server")
    data, port = work / "mysql", free_port()
    subprocess.run(["mariadb-install-db", f"--datadir={data}", "--user=root", "--auth-root-authentication-method=normal",
                    "--skip-test-db"], check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    log = work / "mariadb.log"
    proc = subprocess.Popen(["/usr/sbin/mariadbd", "--no-defaults", f"--datadir={data}", "--user=root",
                             f"--port={port}", "--bind-address=127.0.0.1", f"--socket={work / 'mysql.sock'}",
                             f"--pid-file={work / 'mysql.pid'}", "--skip-log-bin"],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    procs.append(("mariadb", proc))
    _wait("mariadb", lambda: socket.create_connection(("127.0.0.1", port), timeout=1).close() is None, 60, proc, log)
    return port


def db_config(db: str, port: int) -> dict:
    if db == "postgres":
        pg = {"Host": "127.0.0.1", "Port": port, "User": "kfp", "Password": "", "DBName": "mlpipeline"}
        return {"DBDriverName": "pgx", "DBConfig": {"PostgreSQLConfig": pg, "ConMaxLifeTime": "120s"}}
    my = {"Host": "127.0.0.1", "Port": str(port), "User": "root", "Password": "", "DBName": "mlpipeline",
          "GroupConcatMaxLen": "4194304"}  # fmt: skip
    return {"DBDriverName": "mysql", "DBConfig": {"MySQLConfig": my, "ConMaxLifeTime": "120s"}}


def start_apiserver(work: Path, binary: Path, kubeconfig: Path, db: dict, s3: str, procs: list) -> str:
    if not binary.exists():
        raise SystemExit(f"kfp-smoke: no {binary}: run scripts/kfp_backend/build.sh (KFP_SRC=...) first")
    host, _, port = s3.rpartition(":")
    config = {
        **db,
        "ObjectStoreConfig": {
            "Host": host,
            "Port": port,
            "Secure": False,
            "AccessKey": "kfp",
            "SecretAccessKey": "kfp-secret",
            "BucketName": "mlpipeline",
            "PipelinePath": "pipelines",
        },
        "InitConnectionTimeout": "60s",
        "DEFAULTPIPELINERUNNERSERVICEACCOUNT": "pipeline-runner",
        "CacheEnabled": "true",
        "CRON_SCHEDULE_TIMEZONE": "UTC",
    }
    cfg_dir = work / "apiserver-config"
    cfg_dir.mkdir()
    (cfg_dir / "config.json").write_text(json.dumps(config, indent=2))
    home = work / "home"
    (home / ".kube").mkdir(parents=True)
    shutil.copy(kubeconfig, home / ".kube" / "config")
    # the RPC flag must be ":PORT": the HTTP gateway dials "localhost" + the flag
    rpc, http = free_port(), free_port()
    RPC_PORT[:] = [rpc]
    env = {**os.environ, "HOME": str(home), "KUBECONFIG": str(kubeconfig), "POD_NAMESPACE": "kubeflow",
           # required at start even though nothing here serves visualizations (no server listens there)
           "ML_PIPELINE_VISUALIZATIONSERVER_SERVICE_HOST": "127.0.0.1",
           "ML_PIPELINE_VISUALIZATIONSERVER_SERVICE_PORT": str(free_port())}  # fmt: skip
    log = work / "apiserver.log"
    argv = [binary, f"--config={cfg_dir}", f"--rpcPortFlag=:{rpc}", f"--httpPortFlag=127.0.0.1:{http}",
            f"--webhookPortFlag=127.0.0.1:{free_port()}", "--logtostderr=true", "--v=2"]  # fmt: skip
    _say(f"apiserver: {' '.join(map(str, argv))} (log {log})")
    proc = subprocess.Popen(argv, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    procs.append(("apiserver", proc))
    url = f"http://127.0.0.1:{http}"
    _wait("the KFP API server", lambda: urllib.request.urlopen(f"{url}/apis/v2beta1/healthz", timeout=2).status == 200,
          180, proc, log)  # fmt: skip
    return url


def submit_run(client, kubeconfig: Path, pipeline: Path, crds: Path) -> str:
    """Upload ``pipeline``, start a run of it, and show the Argo Workflow the API server created for it.  No
    workflow controller runs here, so the run goes no further than the Workflow object."""
    kubectl = ["kubectl", f"--kubeconfig={kubeconfig}"]
    subprocess.run([*kubectl, "create", "namespace", "kubeflow"], check=True, capture_output=True)
    for crd in sorted(crds.glob("*.yaml")):
        if crd.name != "kustomization.yaml":
            done = subprocess.run([*kubectl, "create", "-f", crd], capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"kfp-smoke: kubectl create -f {crd}: {done.stderr.strip()}")
    uploaded = client.upload_pipeline(str(pipeline), pipeline_name=f"{pipeline.stem}-smoke")
    _say(f"uploaded {pipeline.name}: pipeline id {uploaded.pipeline_id}")
    run = client.create_run_from_pipeline_package(str(pipeline), arguments={}, run_name=f"{pipeline.stem}-smoke",
                                                  experiment_name="fp8rl-smoke", enable_caching=False)  # fmt: skip
    _say(f"run {run.run_id} created")
    time.sleep(3)
    wfs = subprocess.run([*kubectl, "get", "workflows.argoproj.io", "-n", "kubeflow", "-o", "name"],
                         check=True, capture_output=True, text=True).stdout.split()  # fmt: skip
    state = client.get_run(run.run_id).state
    print(f"KFP RUN CREATED run={run.run_id} state={state} workflows={wfs}", flush=True)
    return run.run_id


def run_root_driver(work: Path, kubeconfig: Path, driver: Path, mlmd_python: Path, rpc_port: int, procs: list) -> None:
    """Run KFP's driver for the run's root DAG, as the Workflow's first pod would, against ``mlmd_server.py`` and the
    API server: out of a pod, in a mount namespace of its own whose /run holds the service-account files the driver
    reads (namespace, token, CA) for the account ``kubeflow/pipeline-runner``."""
    kubectl = ["kubectl", f"--kubeconfig={kubeconfig}"]
    wf = json.loads(subprocess.run([*kubectl, "get", "workflows.argoproj.io", "-n", "kubeflow", "-o", "json"],
                                   check=True, capture_output=True, text=True).stdout)["items"][0]  # fmt: skip
    params = {p["name"]: p.get("value") for p in wf["spec"]["arguments"]["parameters"]}
    root = next(t for tpl in wf["spec"]["templates"] for t in (tpl.get("dag") or {}).get("tasks", [])
                if t["name"] == "root-driver")  # fmt: skip
    driver_args = next(t["container"]["args"] for t in wf["spec"]["templates"]
                       if (t.get("container") or {}).get("command") == ["driver"])  # fmt: skip
    pipeline_name = driver_args[driver_args.index("--pipeline_name") + 1]
    runtime_config = next(a["value"] for a in root["arguments"]["parameters"] if a["name"] == "runtime-config")
    mlmd_port, log = free_port(), work / "mlmd.log"
    mlmd = subprocess.Popen([mlmd_python, Path(__file__).with_name("mlmd_server.py"), "--host", "127.0.0.1",
                             "--port", str(mlmd_port), "--sqlite", str(work / "mlmd.sqlite")],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    procs.append(("mlmd", mlmd))
    _wait("mlmd_server.py", lambda: socket.create_connection(("127.0.0.1", mlmd_port), timeout=1).close() is None,
          60, mlmd, log)  # fmt: skip
    sa = work / "serviceaccount"
    sa.mkdir()
    subprocess.run([*kubectl, "-n", "kubeflow", "create", "serviceaccount", "pipeline-runner"], capture_output=True)
    subprocess.run([*kubectl, "create", "clusterrolebinding", "kfp-smoke-runner", "--clusterrole=cluster-admin",
                    "--serviceaccount=kubeflow:pipeline-runner"], check=True, capture_output=True)  # fmt: skip
    token = subprocess.run([*kubectl, "-n", "kubeflow", "create", "token", "pipeline-runner"], check=True,
                           capture_output=True, text=True).stdout.strip()  # fmt: skip
    (sa / "token").write_text(token)
    (sa / "namespace").write_text("kubeflow")
    shutil.copy(kubeconfig.parent / "pki" / "ca.crt", sa / "ca.crt")
    server = next(ln.split()[-1] for ln in kubeconfig.read_text().splitlines() if "server:" in ln)
    host, port = server.removeprefix("https://").rsplit(":", 1)
    out = work / "driver-out"
    out.mkdir()
    argv = [driver, "--type", "ROOT_DAG", "--pipeline_name", pipeline_name, "--run_id", wf["metadata"]["labels"]["pipeline/runid"],
        "--run_name", wf["metadata"]["name"], "--run_display_name", "smoke", "--pipeline_job_create_time_utc",
        wf["metadata"]["creationTimestamp"], "--dag_execution_id", "0", "--component", params["components-root"],
        "--task", "", "--task_name", "", "--runtime_config", runtime_config, "--iteration_index", "-1",
        "--execution_id_path", out / "execution-id", "--iteration_count_path", out / "iteration-count",
        "--condition_path", out / "condition", "--http_proxy", "", "--https_proxy", "", "--no_proxy", "",
        "--ml_pipeline_server_address", "127.0.0.1",
        "--ml_pipeline_server_port", str(rpc_port), "--mlmd_server_address", "127.0.0.1",
        "--mlmd_server_port", str(mlmd_port)]  # fmt: skip
    script = ('mount -t tmpfs none /run && d=/run/secrets/kubernetes.io/serviceaccount && mkdir -p "$d" && '
              f'cp {sa}/* "$d"/ && exec "$@"')  # fmt: skip
    env = {**os.environ, "KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port}
    log = work / "driver.log"
    with log.open("wb") as f:
        done = subprocess.run(["unshare", "-m", "sh", "-c", script, "driver", *map(str, argv)], env=env, stdout=f,
                              stderr=subprocess.STDOUT, timeout=180)  # fmt: skip
    if done.returncode:
        raise SystemExit(f"kfp-smoke: the root-DAG driver failed ({done.returncode}):\n{log.read_text()[-3000:]}")
    print(f"KFP DRIVER OK root-dag execution={(out / 'execution-id').read_text().strip()} (MLMD: mlmd_server.py)",
          flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kubeconfig", type=Path, help="a running cluster's kubeconfig (default: start a control plane)")
    p.add_argument("--s3-endpoint", required=True, help="HOST:PORT of an S3 endpoint with bucket 'mlpipeline'")
    p.add_argument(
        "--apiserver",
        type=Path,
        default=TOOLS / f"kfp-{KFP_VERSION}" / "bin" / "apiserver",
        help="the API server binary (default: build.sh's, in the tools cache)",
    )
    p.add_argument("--db", choices=("mariadb", "postgres"), default="mariadb", help="the database (default mariadb)")
    p.add_argument("--pipeline", type=Path, help="a compiled pipeline YAML: upload it and start a run of it")
    p.add_argument("--argo-crds", type=Path, default=TOOLS / f"kfp-{KFP_VERSION}" / "crds",
                   help="Argo's CRDs, installed before the run (default: build.sh's)")  # fmt: skip
    p.add_argument("--driver", type=Path, help="with --pipeline: run this KFP driver binary for the run's root DAG")
    p.add_argument("--mlmd-python", type=Path, default=Path(sys.executable),
                   help="a python with ml-metadata==1.17.1, for mlmd_server.py (default: this one)")  # fmt: skip
    p.add_argument("--keep", action="store_true", help="leave everything running (prints the work directory)")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kfp-smoke."))
    work.chmod(0o755)
    procs: list = []
    cp = None
    try:
        kubeconfig = args.kubeconfig
        if kubeconfig is None:
            t0 = time.monotonic()
            cp = ControlPlane(tools=TOOLS, workdir=work / "control-plane").start()
            kubeconfig = cp.kubeconfig
            _say(f"control plane up in {time.monotonic() - t0:.0f} s ({kubeconfig})")
        port = start_postgres(work, procs) if args.db == "postgres" else start_mariadb(work, procs)
        _say(f"{args.db} on 127.0.0.1:{port}")
        t0 = time.monotonic()
        url = start_apiserver(work, args.apiserver, kubeconfig, db_config(args.db, port), args.s3_endpoint, procs)
        _say(f"KFP API server healthy at {url} in {time.monotonic() - t0:.0f} s")
        import kfp

        client = kfp.Client(host=url)
        before = client.list_experiments()
        client.create_experiment("fp8rl-smoke")
        names = [e.display_name for e in client.list_experiments().experiments or []]
        _say(f"experiments before: {before.total_size}; after create: {names}")
        print(f"KFP APISERVER OK host={url} experiments={names}", flush=True)
        if args.pipeline:
            submit_run(client, kubeconfig, args.pipeline, args.argo_crds)
            if args.driver:
                run_root_driver(work, kubeconfig, args.driver, args.mlmd_python, RPC_PORT[0], procs)
        return 0
    finally:
        if args.keep:
            _say(f"--keep: left running; work dir {work}")
        else:
            for _name, proc in reversed(procs):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 15)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:  # the API server outlives SIGTERM
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, 9)
                    proc.wait()
            if cp is not None:
                cp.stop()
            _say(f"stopped; logs in {work}")


if __name__ == "__main__":
    sys.exit(main())
