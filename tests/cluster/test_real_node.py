"""The product path on a real node: the chart installed with MLflow basic auth and Ray token auth, a real MLflow
server pod, and the pipeline's steps run as pods of the component image through their compiled KFP command, the
RL step as a KubeRay RayJob on real Ray pods (tiny model, CPU: 2 trainer workers + 1 rollout worker).

What KFP's backend would do around a step is done here by the test, and only that: write the executor input (the
parameters and the artifacts' paths on the data volume) and give the pod what ``pipelines/cluster.py`` asks of
kfp-kubernetes (the data volume, the chart's ConfigMap and Secret as env and files, the pod's name and uid from
the downward API).  The step's own code, the image, the RayJob, the operator, Ray and MLflow are all real.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from real_node import CPU_RAY_RUN_CONFIG

pytestmark = [pytest.mark.cluster, pytest.mark.real_node]

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "fp8rl"
LOCAL_VALUES = CHART / "ci" / "local-cluster-values.yaml"
RELEASE = "rl"
DATA_PVC, MLFLOW_PVC = f"{RELEASE}-fp8rl-data", f"{RELEASE}-fp8rl-mlflow"
CONFIGMAP, MLFLOW_CLIENT_SECRET = f"{RELEASE}-fp8rl-rayjob-defaults", f"{RELEASE}-fp8rl-mlflow-client"
MLFLOW_AUTH_SECRET = f"{RELEASE}-fp8rl-mlflow-auth"
PIPELINE_SA = f"{RELEASE}-fp8rl-pipeline"
RUN_CONFIG: dict[str, Any] = CPU_RAY_RUN_CONFIG


def _core(cluster: Any) -> Any:
    from kubernetes import client

    return client.CoreV1Api(cluster.api)


def _custom(cluster: Any) -> Any:
    from kubernetes import client

    return client.CustomObjectsApi(cluster.api)


def _wait(ready: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 1.0) -> Any:
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            got = ready()
            if got:
                return got
        except Exception as e:  # not there yet: keep polling, report the last error
            last = e
        time.sleep(poll_s)
    raise AssertionError(f"{what}: not after {timeout_s:.0f}s" + (f" (last error: {last})" if last else ""))


# ------------------------------------------------------------------------------------------ the release


def _volumes(cluster: Any, namespace: str) -> Path:
    """hostPath PersistentVolumes bound to the chart's two claims (no storage provisioner on this node)."""
    root = cluster.data / namespace
    core = _core(cluster)
    for claim, size, mode in ((DATA_PVC, "5Gi", "ReadWriteMany"), (MLFLOW_PVC, "1Gi", "ReadWriteOnce")):
        path = root / claim
        path.mkdir(parents=True)
        path.chmod(0o777)  # hostPath is not chowned to the pods' fsGroup
        core.create_persistent_volume({
            "metadata": {"name": f"{namespace}-{claim}"},
            "spec": {
                "capacity": {"storage": size}, "accessModes": [mode], "persistentVolumeReclaimPolicy": "Delete",
                "hostPath": {"path": str(path), "type": "Directory"},
                "claimRef": {"namespace": namespace, "name": claim},
            },
        })  # fmt: skip
    return root / DATA_PVC


@pytest.fixture
def release(real_cluster: Any, real_namespace: str) -> Iterator[Path]:
    """The chart installed with ``ci/local-cluster-values.yaml`` (auth on) and its MLflow pod serving; yields the
    host directory behind the data volume."""
    data = _volumes(real_cluster, real_namespace)
    t0 = time.monotonic()
    real_cluster.helm("install", RELEASE, str(CHART), "-n", real_namespace, "-f", str(LOCAL_VALUES),
                      "--wait", "--timeout", "5m", timeout=360)  # fmt: skip
    print(f"\n[real node] chart installed, MLflow serving, in {time.monotonic() - t0:.0f} s", flush=True)
    yield data
    real_cluster.helm("uninstall", RELEASE, "-n", real_namespace, "--wait", check=False)
    core = _core(real_cluster)
    for claim in (DATA_PVC, MLFLOW_PVC):
        core.delete_persistent_volume(f"{real_namespace}-{claim}")


class Mlflow:
    """The release's MLflow server from this host (its Service's cluster IP, through kube-proxy), as admin."""

    def __init__(self, cluster: Any, namespace: str) -> None:
        import base64

        from mlflow.tracking import MlflowClient

        core = _core(cluster)
        svc = core.read_namespaced_service(f"{RELEASE}-fp8rl-mlflow", namespace)
        self.uri = f"http://{svc.spec.cluster_ip}:{svc.spec.ports[0].port}"
        secret = core.read_namespaced_secret(MLFLOW_AUTH_SECRET, namespace)
        self.password = base64.b64decode(secret.data["admin-password"]).decode()
        self._env = {"MLFLOW_TRACKING_USERNAME": "admin", "MLFLOW_TRACKING_PASSWORD": self.password}
        self.client_cls = MlflowClient

    def client(self, monkeypatch: pytest.MonkeyPatch) -> Any:
        for k, v in self._env.items():
            monkeypatch.setenv(k, v)
        return self.client_cls(tracking_uri=self.uri)


# --------------------------------------------------------------------------------- a component as a pod


def _compiled(component: Any) -> dict[str, Any]:
    """The component's container (image, command, args) as KFP compiles it."""
    import tempfile

    from kfp import compiler

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "component.yaml"
        compiler.Compiler().compile(component, str(path))
        spec = yaml.safe_load(path.read_text())
    (executor,) = spec["deploymentSpec"]["executors"].values()
    return dict(executor["container"])


def _artifact(uri: str, schema: str) -> dict[str, Any]:
    return {"artifacts": [{"name": Path(uri).name, "uri": uri, "type": {"schemaTitle": schema}, "metadata": {}}]}


def _executor_input(params: dict[str, Any], inputs: dict[str, tuple[str, str]], outputs: dict[str, tuple[str, str]],
                    out_dir: str) -> dict[str, Any]:  # fmt: skip
    """What KFP's driver hands the executor: parameter values, and each artifact's local path as its URI."""
    return {
        "inputs": {
            "parameterValues": params,
            "artifacts": {name: _artifact(uri, schema) for name, (uri, schema) in inputs.items()},
        },
        "outputs": {
            "artifacts": {name: _artifact(uri, schema) for name, (uri, schema) in outputs.items()},
            "parameters": {"Output": {"outputFile": f"{out_dir}/Output"}},
            "outputFile": f"{out_dir}/executor_output.json",
        },
    }


def _component_pod(name: str, image: str, container: dict[str, Any], executor_input: dict[str, Any],
                   rayjob: bool) -> dict[str, Any]:  # fmt: skip
    """The step's pod as KFP + kfp-kubernetes make it for ``pipelines.cluster.on_cluster(tracked=True, rayjob=...)``
    (fp8rl.kube's OWNER_POD_FIELDS and the chart's names, at their defaults for release ``rl``)."""
    from pipelines.cluster import MLFLOW_SECRET_ENV, OWNER_POD_FIELDS, RAYJOB_DEFAULTS_MOUNT

    args = [json.dumps(executor_input) if a == "{{$}}" else a for a in container["args"]]
    env: list[dict[str, Any]] = [
        {"name": "MLFLOW_TRACKING_URI",
         "valueFrom": {"configMapKeyRef": {"name": CONFIGMAP, "key": "mlflowTrackingUri", "optional": True}}},
        {"name": "HOME", "value": "/tmp"},
    ]  # fmt: skip
    env += [{"name": var, "valueFrom": {"secretKeyRef": {"name": MLFLOW_CLIENT_SECRET, "key": key, "optional": True}}}
            for key, var in MLFLOW_SECRET_ENV.items()]  # fmt: skip
    mounts = [{"name": "data", "mountPath": "/data"}, {"name": "tmp", "mountPath": "/tmp"}]
    volumes: list[dict[str, Any]] = [
        {"name": "data", "persistentVolumeClaim": {"claimName": DATA_PVC}},
        {"name": "tmp", "emptyDir": {}},
    ]
    if rayjob:
        env += [{"name": var, "valueFrom": {"fieldRef": {"fieldPath": path}}} for var, path in OWNER_POD_FIELDS.items()]
        mounts.append({"name": "rayjob-defaults", "mountPath": RAYJOB_DEFAULTS_MOUNT})
        volumes.append({"name": "rayjob-defaults", "configMap": {"name": CONFIGMAP}})
    return {
        "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "fp8rl", "fp8rl/test-step": name}},
        "spec": {
            "restartPolicy": "Never",
            "serviceAccountName": PIPELINE_SA,
            "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "main", "image": image, "imagePullPolicy": "Never", "securityContext": KFP_CONTAINER_SECURITY,
                "command": container["command"], "args": args, "env": env, "volumeMounts": mounts,
                "resources": {"requests": {"cpu": "100m", "memory": "512Mi"}, "limits": {"cpu": "1", "memory": "3Gi"}},
            }],
            "volumes": volumes,
        },
    }  # fmt: skip


# what KFP's compiler puts on every step's container (its platform defaults: no escalation, no capabilities, the
# runtime's seccomp profile), so a step pod is admitted where Pod Security Standards "restricted" are enforced
KFP_CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"},
}  # fmt: skip


def _run_pod(cluster: Any, namespace: str, pod: dict[str, Any], timeout_s: float) -> tuple[str, str]:
    """Create the pod, wait until it ends; returns (phase, log)."""
    core = _core(cluster)
    name = pod["metadata"]["name"]
    core.create_namespaced_pod(namespace, pod)
    phase = _wait(lambda: (p := core.read_namespaced_pod(name, namespace).status.phase) in ("Succeeded", "Failed")
                  and p, timeout_s, f"pod {name} finished", poll_s=2)  # fmt: skip
    return phase, core.read_namespaced_pod_log(name, namespace)


class RayJobWatch:
    """Records every RayJob of the namespace and the statuses it goes through, until stopped."""

    def __init__(self, cluster: Any, namespace: str) -> None:
        self.custom, self.namespace = _custom(cluster), namespace
        self.seen: dict[str, list[str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                items = self.custom.list_namespaced_custom_object("ray.io", "v1", self.namespace, "rayjobs")["items"]
            except Exception:  # the API server is busy: look again
                items = []
            for job in items:
                st = job.get("status") or {}
                state = f"{st.get('jobDeploymentStatus', '')}/{st.get('jobStatus', '')}"
                states = self.seen.setdefault(job["metadata"]["name"], [])
                if not states or states[-1] != state:
                    states.append(state)
            self._stop.wait(1.0)

    def stop(self) -> dict[str, list[str]]:
        self._stop.set()
        self._thread.join()
        return self.seen


# --------------------------------------------------------------------------------------------- the tests


def _start_tracking(cluster: Any, namespace: str, data: Path, kfp_run: str) -> tuple[str, str]:
    """The start-tracking step as a pod; returns (MLflow parent run id, the run-ref artifact's path in pods)."""
    from components.tracking import start_tracking

    out = f"/data/kfp/{kfp_run}/start-tracking"
    ref = f"{out}/mlflow_run"
    executor = _executor_input(
        {"experiment": "real-node", "work_dir": "/data/fp8rl", "pipeline_name": "fp8-rl", "kfp_run_id": kfp_run,
         "kfp_run_name": "real-node"},
        {}, {"mlflow_run": (ref, "system.Artifact")}, out,
    )  # fmt: skip
    pod = _component_pod("start-tracking", cluster.image, _compiled(start_tracking), executor, rayjob=False)
    phase, log = _run_pod(cluster, namespace, pod, 300)
    assert phase == "Succeeded", log[-4000:]
    run_id = json.loads((data / ref.removeprefix("/data/")).read_text())["run_id"]
    return run_id, ref


def _stage_model(data: Path, tiny: Path) -> str:
    import shutil

    target = data / "models" / "tiny"
    shutil.copytree(tiny, target)
    for p in [target, *target.rglob("*")]:
        p.chmod(0o777 if p.is_dir() else 0o666)
    return "/data/models/tiny"


def _rl_step_pod(cluster: Any, kfp_run: str, model: str, ref: str, recipe: str, steps: int,
                 run_config: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    from components.rl_step import rl_step

    out = f"/data/kfp/{kfp_run}/rl-step"
    executor = _executor_input(
        {"recipe": recipe, "steps": steps, "seed": 0, "run_config": run_config, "pipeline_name": "fp8-rl",
         "kfp_run_id": kfp_run, "backend": "rayjob", "rayjob_template": "/etc/fp8rl/rayjob.yaml",
         "timeout_s": 1200.0},
        {"model": (model, "system.Model"), "mlflow_run": (ref, "system.Artifact")},
        {"trained": (f"{out}/trained", "system.Model"), "metrics": (f"{out}/metrics", "system.Metrics")}, out,
    )  # fmt: skip
    return _component_pod("rl-step", cluster.image, _compiled(rl_step), executor, rayjob=True)


def test_rl_step_runs_as_a_rayjob_to_completion(
    real_cluster: Any, real_namespace: str, release: Path, tiny_models: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """start-tracking, then the RL step with backend ``rayjob``: the RayJob reaches SUCCEEDED on real Ray pods, the
    recipe's MLflow run is FINISHED with the step metrics and the resolved config under the parent, the trained
    checkpoint comes back to the step's output, and the RayJob and its pods are gone afterwards."""
    cluster, ns = real_cluster, real_namespace
    kfp_run = uuid.uuid4().hex
    parent, ref = _start_tracking(cluster, ns, release, kfp_run)
    model = _stage_model(release, tiny_models["tiny"])
    watch = RayJobWatch(cluster, ns)
    t0 = time.monotonic()
    pod = _rl_step_pod(cluster, kfp_run, model, ref, "fp8-e2e", 2, RUN_CONFIG)
    try:
        phase, log = _run_pod(cluster, ns, pod, 1200)
    finally:
        seen = watch.stop()
    took = time.monotonic() - t0
    assert phase == "Succeeded", log[-6000:]
    (rayjob,) = seen
    # the step returns only once Ray reports SUCCEEDED (fp8rl.kube.submit_rayjob); the watch saw it run
    assert any(s.endswith("/RUNNING") for s in seen[rayjob]), seen
    assert f"[rayjob {rayjob}] created" in log and "Traceback" not in log, log[-6000:]

    client = Mlflow(cluster, ns).client(monkeypatch)
    parent_run = client.get_run(parent)
    children = client.search_runs([parent_run.info.experiment_id], f"tags.mlflow.parentRunId = '{parent}'")
    (child,) = children
    assert child.info.status == "FINISHED", child.info
    history = client.get_metric_history(child.info.run_id, "train/loss")
    assert len({m.step for m in history}) == len(history) == 2, history  # every step once: none missing or twice
    assert child.data.params["recipe"] == "fp8-e2e", child.data.params
    assert child.data.tags.get("kfp.run_id") == kfp_run
    assert "config/resolved.yaml" in [a.path for a in client.list_artifacts(child.info.run_id, "config")]
    assert (release / "kfp" / kfp_run / "rl-step" / "trained" / "config.json").is_file()

    core = _core(cluster)
    _wait(lambda: not _custom(cluster).list_namespaced_custom_object("ray.io", "v1", ns, "rayjobs")["items"], 60,
          "the RayJob deleted")  # fmt: skip
    _wait(lambda: not core.list_namespaced_pod(ns, label_selector=f"fp8rl/rayjob={rayjob}").items, 120,
          "the Ray pods gone")  # fmt: skip
    print(f"\n[real node] rl-step pod + RayJob in {took:.0f} s; statuses {seen[rayjob]}")
    print(f"RAYJOB SUCCEEDED {rayjob} mlflow={child.info.run_id} {child.info.status}")


# ------------------------------------------------------------------------------------------------ faults


def _rayjob_running(cluster: Any, namespace: str) -> str:
    """The namespace's one RayJob once Ray reports its job RUNNING; its name."""
    jobs = _custom(cluster).list_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs")["items"]
    running = [j for j in jobs if (j.get("status") or {}).get("jobStatus") == "RUNNING"]
    return str(running[0]["metadata"]["name"]) if running else ""


def _no_rayjobs_or_ray_pods(cluster: Any, namespace: str) -> bool:
    jobs = _custom(cluster).list_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs")["items"]
    pods = _core(cluster).list_namespaced_pod(namespace, label_selector="fp8rl/rayjob").items
    return not jobs and not pods


def test_deleting_the_step_pod_mid_run_deletes_its_rayjob(
    real_cluster: Any, real_namespace: str, release: Path, tiny_models: dict[str, Path]
) -> None:
    """A cancelled KFP run deletes the step's pod (SIGTERM, then SIGKILL after the grace period): its RayJob, the
    RayCluster and the Ray pods are gone within 30 s, not left running until the deadline."""
    cluster, ns = real_cluster, real_namespace
    kfp_run = uuid.uuid4().hex
    _, ref = _start_tracking(cluster, ns, release, kfp_run)
    model = _stage_model(release, tiny_models["tiny"])
    pod = _rl_step_pod(cluster, kfp_run, model, ref, "bf16", 100_000, RUN_CONFIG)  # hours: it is deleted long before
    # In a KFP pod the launcher, not `sh`, is PID 1, and it exits on SIGTERM; with `sh` as PID 1 the signal would be
    # ignored for the whole grace period.  A shared PID namespace gives the step the same fate here.
    pod["spec"]["shareProcessNamespace"] = True
    core = _core(cluster)
    core.create_namespaced_pod(ns, pod)
    rayjob = _wait(lambda: _rayjob_running(cluster, ns), 600, "the RayJob's job RUNNING", poll_s=2)
    t0 = time.monotonic()
    core.delete_namespaced_pod("rl-step", ns)
    _wait(lambda: _no_rayjobs_or_ray_pods(cluster, ns), 60, f"RayJob {rayjob} and its Ray pods gone", poll_s=0.5)
    gone_s = time.monotonic() - t0
    print(f"\n[real node] RayJob {rayjob} and its pods gone {gone_s:.1f} s after the step's pod was deleted")
    assert gone_s <= 30, gone_s


def test_a_failing_step_ends_the_mlflow_runs_failed(
    real_cluster: Any, real_namespace: str, release: Path, tiny_models: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The RL step's RayJob fails (its checkpoint's weights are not readable): the step fails naming the cause, and
    the comparison run and the recipe's run end FAILED, not RUNNING."""
    cluster, ns = real_cluster, real_namespace
    kfp_run = uuid.uuid4().hex
    parent, ref = _start_tracking(cluster, ns, release, kfp_run)
    model = _stage_model(release, tiny_models["tiny"])
    for weights in (release / "models" / "tiny").glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    phase, log = _run_pod(cluster, ns, _rl_step_pod(cluster, kfp_run, model, ref, "bf16", 2, RUN_CONFIG), 900)
    assert phase == "Failed", log[-4000:]
    assert "RayJobFailed" in log and "safetensors" in log.lower(), log[-4000:]
    client = Mlflow(cluster, ns).client(monkeypatch)
    runs = [client.get_run(parent)]
    runs += client.search_runs([runs[0].info.experiment_id], f"tags.mlflow.parentRunId = '{parent}'")
    assert [r.info.status for r in runs] == ["FAILED"] * len(runs) and len(runs) >= 1, [r.info for r in runs]
    assert runs[0].data.tags["fp8rl.failed_step"] == "rl-step"
    _wait(lambda: _no_rayjobs_or_ray_pods(cluster, ns), 120, "the failed RayJob cleaned up")


def test_mlflow_restarted_then_a_ray_worker_killed_mid_run_lose_no_step(
    real_cluster: Any, real_namespace: str, release: Path, tiny_models: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Two faults in one RL step, one after the other (one RayCluster to start, not two):

    - the MLflow server's pod is deleted once the first checkpoint's metrics are logged: its Deployment brings it
      back on the same volume and the client's retries carry the step's logging over the gap (the next
      checkpoint's metrics arrive);
    - then the Ray worker pod is killed (its actors die with it): KubeRay starts a new worker pod, the driver
      replaces the actors and resumes from the last checkpoint (``ray.max_restarts``).

    The run ends FINISHED holding every step once."""
    cluster, ns = real_cluster, real_namespace
    kfp_run = uuid.uuid4().hex
    parent, ref = _start_tracking(cluster, ns, release, kfp_run)
    model = _stage_model(release, tiny_models["tiny"])
    # metrics reach MLflow at each checkpoint; steps take 0.1-0.4 s, so both faults fall well inside the run
    steps, every = 60, 10
    config = {**RUN_CONFIG, "checkpoint_every": every, "ray": {**RUN_CONFIG["ray"], "max_restarts": 2}}
    core = _core(cluster)
    core.create_namespaced_pod(ns, _rl_step_pod(cluster, kfp_run, model, ref, "bf16", steps, config))
    client = Mlflow(cluster, ns).client(monkeypatch)
    experiment = client.get_run(parent).info.experiment_id

    def steps_logged() -> int:
        (child,) = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent}'")
        return len(client.get_metric_history(child.info.run_id, "train/loss"))

    def finished() -> str | None:
        phase = core.read_namespaced_pod("rl-step", ns).status.phase
        return phase if phase in ("Succeeded", "Failed") else None

    _wait(lambda: steps_logged() >= every, 600, "the first checkpoint's steps in MLflow", poll_s=0.5)
    (server,) = core.list_namespaced_pod(ns, label_selector="app.kubernetes.io/component=mlflow").items
    core.delete_namespaced_pod(server.metadata.name, ns)
    assert core.read_namespaced_pod("rl-step", ns).status.phase == "Running"  # the restart falls inside the run
    t0 = time.monotonic()
    _wait(lambda: steps_logged() >= 2 * every, 600, "the next checkpoint's steps in the restarted MLflow", poll_s=1)
    print(
        f"\n[real node] MLflow pod {server.metadata.name} deleted; logging went on {time.monotonic() - t0:.0f} s later"
    )
    (worker,) = core.list_namespaced_pod(ns, label_selector="fp8rl/role=worker").items
    core.delete_namespaced_pod(worker.metadata.name, ns, grace_period_seconds=0)
    assert core.read_namespaced_pod("rl-step", ns).status.phase == "Running"  # killed inside the run
    phase = _wait(finished, 900, "the RL step finished", poll_s=2)
    log = core.read_namespaced_pod_log("rl-step", ns)
    if phase == "Failed":  # the other promise: a failure that names the pod
        assert worker.metadata.name in log, log[-4000:]
        return
    assert "resuming from the last checkpoint" in log, log[-4000:]
    (child,) = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent}'")
    history = client.get_metric_history(child.info.run_id, "train/loss")
    assert child.info.status == "FINISHED", child.info
    assert sorted(m.step for m in history) == sorted({m.step for m in history}) and len(history) == steps, history
    print(f"[real node] worker pod {worker.metadata.name} killed; resumed, all {steps} steps logged once")


def test_helm_upgrade_with_a_new_image_tag_replaces_the_ray_pods(
    real_cluster: Any, real_namespace: str, release: Path
) -> None:
    """With the standing RayCluster on (ray.enabled, CPU workers here), ``helm upgrade`` to a new image tag replaces
    its running head and worker pods with pods of the new image (``ray.upgradeStrategy: Recreate``)."""
    cluster, ns = real_cluster, real_namespace
    repo, tag = cluster.image.rsplit(":", 1)
    new = f"{repo}:{tag}-upgrade"
    cluster.node.ctr("images", "tag", "--force", cluster.image, new)
    standing = ["--set", "ray.enabled=true", "--set", "ray.worker.gpusPerWorker=0", "--set-json",
                'ray.worker.tolerations=[]', "--set-json",
                'ray.head.resources={"requests":{"cpu":"100m","memory":"1Gi"},"limits":{"cpu":"1","memory":"3Gi"}}',
                "--set-json",
                'ray.worker.resources={"requests":{"cpu":"100m","memory":"1Gi"},"limits":{"cpu":"1","memory":"3Gi"}}',
                "--set-json", 'ray.head.sharedMemorySize="256Mi"', "--set-json", 'ray.worker.sharedMemorySize="256Mi"']  # fmt: skip
    common = ["-n", ns, "-f", str(LOCAL_VALUES), *standing]
    core = _core(cluster)

    def ray_pods(image: str) -> dict[str, str]:
        pods = core.list_namespaced_pod(ns, label_selector="ray.io/cluster").items
        ready = {p.metadata.uid: p.spec.containers[0].image for p in pods if p.status.phase == "Running"
                 and all(c.ready for c in p.status.container_statuses or [])}  # fmt: skip
        return ready if len(ready) == len(pods) == 2 and set(ready.values()) == {image} else {}

    real_cluster.helm("upgrade", RELEASE, str(CHART), *common, timeout=120)
    before = _wait(lambda: ray_pods(cluster.image), 300, "the standing cluster's head and worker Ready", poll_s=2)
    t0 = time.monotonic()
    real_cluster.helm("upgrade", RELEASE, str(CHART), *common, "--set", f"images.runtime.tag={tag}-upgrade",
                      timeout=120)  # fmt: skip
    after = _wait(lambda: ray_pods(new), 300, f"Ray pods of {new} Ready", poll_s=2)
    assert not set(before) & set(after), (before, after)
    print(f"\n[real node] helm upgrade to {new}: both Ray pods replaced in {time.monotonic() - t0:.0f} s")
