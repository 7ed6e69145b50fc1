"""``fp8rl.kube.submit_rayjob`` and the RL-step component's ``rayjob`` backend against a real API server
and the real KubeRay operator.

The operator creates the RayCluster, its pods and the submitter Job for real; kwok marks scheduled pods
Running. What cannot happen here is a Ray job finishing: that needs a Ray head in a running container, and
the operator polls its dashboard through cluster DNS. So the paths tested here are creation, the watch,
the failure diagnoses (unschedulable, image pull, active deadline, deletion by someone else) and the
cleanup; a completed job stays covered by the in-memory fake of ``tests/unit/test_submit.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from control_plane import BAD_IMAGE

from fp8rl.kube import KubeApis, build_rayjob, parse_template, submit_rayjob
from fp8rl.kube.errors import RayJobFailed, RayJobTimeout

pytestmark = pytest.mark.cluster

ENTRYPOINT = ["python", "-c", "print('hello from the driver')"]
TEMPLATE = {
    "image": "ghcr.io/example/fp8rl-gpu:0.1.0",
    "head": {"resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"cpu": "1", "memory": "2Gi"}}},
    "workers": {
        "replicas": 1,
        "gpusPerWorker": 8,
        "resources": {"requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"cpu": "8", "memory": "64Gi"}},
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
    },
    "ttlSecondsAfterFinished": 0,
}


def _doc(namespace: str, name: str, **overrides: Any) -> dict[str, Any]:
    data = {**TEMPLATE, **overrides}
    return build_rayjob(parse_template(data), name, ENTRYPOINT, namespace, {"app.kubernetes.io/part-of": "fp8rl"})


def _apis(api_client: Any) -> KubeApis:
    from kubernetes import client

    return KubeApis(custom=client.CustomObjectsApi(api_client), core=client.CoreV1Api(api_client))


def _rayjob_gone(api: KubeApis, namespace: str, name: str) -> bool:
    from kubernetes.client.exceptions import ApiException

    try:
        api.custom.get_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", name)
    except ApiException as e:
        return e.status == 404
    return False


def _clusters(api: KubeApis, namespace: str) -> list[dict[str, Any]]:
    return list(api.custom.list_namespaced_custom_object("ray.io", "v1", namespace, "rayclusters")["items"])


def _submit(api: KubeApis, doc: dict[str, Any], lines: list[str], **kw: Any) -> Any:
    kw.setdefault("poll_s", 0.5)
    kw.setdefault("request_timeout_s", 10.0)
    return submit_rayjob(doc, api, log_sink=lines.append, **kw)


def test_operator_runs_the_rayjob_and_the_client_cleans_up(
    api_client: Any, namespace: str, wait: Callable[..., Any]
) -> None:
    """Created with strict validation and admitted; the operator makes the RayCluster, its head and GPU worker
    pods and the submitter; the client follows them until its deadline, then deletes the RayJob and the
    garbage collector takes the RayCluster and its pods with it."""
    api = _apis(api_client)
    lines: list[str] = []
    with pytest.raises(RayJobTimeout) as err:
        _submit(api, _doc(namespace, "ok-job"), lines, timeout_s=15)
    assert "not finished after 15 s" in str(err.value)
    # no kubelet serves the submitter's log here (kwok): said once, and the watch goes on
    assert sum("cannot read the driver's log" in line for line in lines) <= 1
    assert any("created in namespace" in line for line in lines)
    # the operator moved it through its states (New -> Initializing -> Running) as the client saw them
    states = [line for line in lines if "deployment " in line]
    assert any("Initializing" in line or "Running" in line for line in states), states
    assert any(line.endswith("deleted") for line in lines)
    wait(lambda: _rayjob_gone(api, namespace, "ok-job"), 30, "RayJob deleted")
    wait(lambda: not _clusters(api, namespace), 60, "its RayCluster garbage-collected")
    wait(lambda: not api.core.list_namespaced_pod(namespace).items, 60, "its pods garbage-collected")


def test_the_operator_sees_the_gpu_workers_scheduled(api_client: Any, namespace: str, wait: Callable[..., Any]) -> None:
    api = _apis(api_client)
    done: dict[str, BaseException] = {}

    def run() -> None:
        try:
            _submit(api, _doc(namespace, "gpu-job"), [], timeout_s=120)
        except BaseException as e:
            done["error"] = e

    t = threading.Thread(target=run)
    t.start()
    try:

        def ray_pods() -> dict[str, Any] | None:
            listed = api.core.list_namespaced_pod(namespace, label_selector="fp8rl/rayjob=gpu-job").items
            roles = {p.metadata.labels["fp8rl/role"]: p for p in listed}
            running = all(roles.get(r) is not None and roles[r].status.phase == "Running" for r in ("head", "worker"))
            return roles if running else None

        roles = wait(ray_pods, 40, "head and worker pods Running")
        worker = roles["worker"]
        assert worker.spec.containers[0].resources.limits["nvidia.com/gpu"] == "8"
        assert worker.spec.node_name.startswith("gpu-node-")
        cluster = _clusters(api, namespace)[0]
        assert cluster["metadata"]["ownerReferences"][0]["kind"] == "RayJob"
    finally:
        t.join(60)
    # kwok "completes" the submitter pod; with no Ray job behind it, the operator fails the RayJob after its
    # grace period, and the client reports the operator's reason (not a timeout of its own)
    err = done.get("error")
    assert isinstance(err, RayJobFailed) and not isinstance(err, RayJobTimeout), err
    assert "JobDeploymentStatusTransitionGracePeriodExceeded" in str(err) and "submitter finished" in str(err)


def test_unschedulable_gpu_request_is_reported_and_named_at_the_deadline(api_client: Any, namespace: str) -> None:
    api = _apis(api_client)
    workers = {**TEMPLATE["workers"], "gpusPerWorker": 16}  # the nodes have 8
    lines: list[str] = []
    with pytest.raises(RayJobTimeout) as err:
        _submit(api, _doc(namespace, "too-big", workers=workers), lines, timeout_s=30)
    waiting = [line for line in lines if "waiting:" in line]
    assert waiting and "nvidia.com/gpu" in waiting[0], lines
    assert "unschedulable" in str(err.value) and "nvidia.com/gpu" in str(err.value)


def test_bad_image_fails_after_the_grace_period(api_client: Any, namespace: str) -> None:
    api = _apis(api_client)
    with pytest.raises(RayJobFailed) as err:
        _submit(api, _doc(namespace, "bad-image", image=BAD_IMAGE), [], timeout_s=60, image_pull_grace_s=3)
    assert not isinstance(err.value, RayJobTimeout)
    assert "image pull error" in str(err.value) and BAD_IMAGE in str(err.value)


def test_active_deadline_fails_the_job_with_the_operators_reason(api_client: Any, namespace: str) -> None:
    api = _apis(api_client)
    with pytest.raises(RayJobFailed) as err:
        _submit(api, _doc(namespace, "deadline", activeDeadlineSeconds=8), [], timeout_s=90)
    assert not isinstance(err.value, RayJobTimeout)
    assert "DeadlineExceeded" in str(err.value) or "deadline" in str(err.value).lower(), str(err.value)


def test_deletion_by_someone_else_mid_run(api_client: Any, namespace: str, wait: Callable[..., Any]) -> None:
    api = _apis(api_client)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            _submit(api, _doc(namespace, "deleted-job"), [], timeout_s=60)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    wait(lambda: _clusters(api, namespace), 30, "RayCluster created")
    api.custom.delete_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", "deleted-job")
    t.join(60)
    assert len(errors) == 1 and isinstance(errors[0], RayJobFailed), errors
    assert "deleted while we waited" in str(errors[0])


def test_strict_validation_and_name_clash_are_clear_errors(api_client: Any, namespace: str) -> None:
    api = _apis(api_client)
    doc = _doc(namespace, "strict")
    doc["spec"]["notAField"] = 1
    with pytest.raises(RayJobFailed) as err:
        _submit(api, doc, [], timeout_s=5)
    assert "rejected the RayJob" in str(err.value) and 'unknown field "spec.notAField"' in str(err.value), str(
        err.value
    )
    ok = _doc(namespace, "clash")
    api.custom.create_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", ok)
    with pytest.raises(RayJobFailed) as err:
        _submit(api, ok, [], timeout_s=5)
    assert "already exists" in str(err.value)
    assert not _rayjob_gone(api, namespace, "clash")  # not ours: never deleted


# ------------------------------------------------------------------ the RL-step component, rayjob backend


def test_rl_step_rayjob_backend_from_the_charts_template(
    cluster_helm: Callable[..., Any], api_client: Any, namespace: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, tiny_models: dict[str, Path], capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """The chart installed; its rendered RayJob template (the ConfigMap the pipelines mount) read back from the
    API server; the backend stages the run, builds the RayJob and submits it as the component does, up to the
    point where the Ray pods would start the training (the deadline here)."""
    from fp8rl.config import RunConfig, load_recipe
    from fp8rl.kube.rl_step import run_rl_step_as_rayjob

    chart = Path(__file__).resolve().parents[2] / "charts" / "fp8rl"
    cluster_helm("install", "rl", str(chart), "-n", namespace, "--set", "ray.enabled=false")
    cm = _apis(api_client).core.read_namespaced_config_map("rl-fp8rl-rayjob-defaults", namespace)
    template_path = tmp_path / "rayjob.yaml"
    template_path.write_text(cm.data["rayjob.yaml"])
    monkeypatch.setenv("POD_NAMESPACE", namespace)
    cfg = RunConfig.model_validate({"recipe": load_recipe("fp8-e2e"), "work_dir": str(tmp_path / "work")})
    with pytest.raises(RayJobTimeout):
        run_rl_step_as_rayjob(
            cfg, tiny_models["tiny"], tmp_path / "out", "parent", {"kfp.run_id": "run-1"}, template_path, 15,
            api=_apis(api_client),
        )  # fmt: skip
    out = capsys.readouterr().out
    assert "[rl-step] RayJob " in out and "created in namespace " + namespace in out
    assert "deployment Running" in out or "deployment Initializing" in out, out
    assert (tmp_path / "work" / "kfp-runs" / "run-1").is_dir()  # staged where the Ray pods would read it


def test_deleting_the_step_pod_garbage_collects_its_rayjob(
    api_client: Any, namespace: str, wait: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancelled KFP run deletes the RL step's pod, possibly before the step could delete its RayJob (SIGKILL
    after the grace period): the RayJob names that pod as its owner (``owner_pod_reference``, from the downward
    API's name and uid), so the API server's garbage collector deletes it, and with it the RayCluster and its GPU
    pods, within 30 s of the pod."""
    import time

    from kubernetes import client

    from fp8rl.kube.rl_step import owner_pod_reference

    core = client.CoreV1Api(api_client)
    pod = core.create_namespaced_pod(
        namespace, {"metadata": {"name": "rl-step"}, "spec": {"containers": [{"name": "main", "image": "busybox"}]}}
    )
    monkeypatch.setenv("FP8RL_POD_NAME", pod.metadata.name)
    monkeypatch.setenv("FP8RL_POD_UID", pod.metadata.uid)
    api = _apis(api_client)
    doc = build_rayjob(
        parse_template(TEMPLATE), "owned-job", ENTRYPOINT, namespace, {"app.kubernetes.io/part-of": "fp8rl"},
        owner=owner_pod_reference(),
    )  # fmt: skip
    api.custom.create_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", doc)
    wait(lambda: _clusters(api, namespace), 30, "RayCluster created by the operator")
    core.delete_namespaced_pod("rl-step", namespace, grace_period_seconds=0)
    start = time.monotonic()
    wait(lambda: _rayjob_gone(api, namespace, "owned-job"), 30, "RayJob garbage-collected after its pod")
    wait(lambda: not _clusters(api, namespace), 30, "its RayCluster deleted too")
    print(f"RayJob and RayCluster gone {time.monotonic() - start:.1f} s after the step's pod was deleted")
