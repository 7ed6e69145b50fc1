"""submit_rayjob against a scripted, in-memory fake of the Kubernetes API.

This is a fake at the API boundary because no Kubernetes API server (nor KubeRay operator) exists
here. It implements only the CustomObjectsApi / CoreV1Api methods submit_rayjob calls, returns the
kubernetes client's own model classes (V1Pod, CoreV1Event, ...) so attribute access is the real
one, honours label selectors and ``since_seconds``, and runs on a fake clock so a day-long timeout
takes no time. Statuses follow KubeRay v1.5 (``jobDeploymentStatus`` Initializing -> Running ->
Complete|Failed; ``jobStatus`` PENDING/RUNNING/SUCCEEDED/FAILED). The diagnosis functions are also
tested directly on pod/event objects shaped like what the API server returns.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

import pytest
from kubernetes.client import (
    CoreV1Event,
    CoreV1EventList,
    V1Container,
    V1ContainerState,
    V1ContainerStateTerminated,
    V1ContainerStateWaiting,
    V1ContainerStatus,
    V1ObjectMeta,
    V1ObjectReference,
    V1Pod,
    V1PodCondition,
    V1PodList,
    V1PodSpec,
    V1PodStatus,
)
from kubernetes.client.exceptions import ApiException

from fp8rl.errors import UserError
from fp8rl.kube.errors import RayJobFailed, RayJobTimeout
from fp8rl.kube.job_failure import diagnose, extract_traceback
from fp8rl.kube.pod_log import PodLogFollower, split_timestamp
from fp8rl.kube.submit import KubeApis, submit_rayjob

NAME, NS, IMAGE = "fp8rl-step", "ml", "ghcr.io/example/fp8rl-gpu:0.1.0"
CLUSTER = "fp8rl-step-abcde"
T0 = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)
DOC = {
    "apiVersion": "ray.io/v1",
    "kind": "RayJob",
    "metadata": {"name": NAME, "namespace": NS},
    "spec": {"entrypoint": "x"},
}

TRACEBACK = [
    "step 3: reward 0.41",
    "Traceback (most recent call last):",
    '  File "/app/fp8rl/cluster/driver.py", line 88, in main',
    "    run_step(cfg)",
    '  File "/app/fp8rl/cluster/driver.py", line 51, in run_step',
    "    ray.get(trainer.train.remote(batch))",
    "ray.exceptions.RayTaskError(ValueError): ray::Trainer.train() (pid=77, ip=10.0.0.5)",
    '  File "/app/fp8rl/train/trainer.py", line 120, in train',
    '    raise ValueError("logprob shape mismatch: (8, 32) vs (8, 31)")',
    "ValueError: logprob shape mismatch: (8, 32) vs (8, 31)",
    "",
    "---------------------------------------",
    "Job 'raysubmit_1' failed",
]


# ---------------------------------------------------------------- the fake


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.interrupt_at: float | None = None

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds > 0, "a zero sleep would spin"
        self.now += seconds
        if self.interrupt_at is not None and self.now >= self.interrupt_at:
            raise KeyboardInterrupt


def _at(script: list[tuple[float, Any]], now: float) -> Any:
    """The scripted value in force at ``now`` (the last entry that started at or before it)."""
    current = script[0][1]
    for start, value in script:
        if start <= now:
            current = value
    return current


def _timestamp(t: float, i: int) -> str:
    # kubelet writes RFC3339Nano with trailing zeros trimmed: mix lengths to exercise the padding.
    stamp = T0 + dt.timedelta(seconds=t)
    nanos = f"{stamp.microsecond * 1000 + i:09d}".rstrip("0") or "0"
    return stamp.strftime("%Y-%m-%dT%H:%M:%S") + f".{nanos}Z"


@dataclass
class FakeCluster:
    """Scripted over fake time: statuses, pods and the submitter's log lines each carry a start time."""

    statuses: list[tuple[float, dict[str, Any]]]
    pods: list[tuple[float, list[V1Pod]]] = field(default_factory=lambda: [(0.0, [])])
    log: list[tuple[float, str]] = field(default_factory=list)
    events: list[CoreV1Event] = field(default_factory=list)
    clock: FakeClock = field(default_factory=FakeClock)
    create_error: Exception | None = None
    get_errors: dict[int, Exception] = field(default_factory=dict)  # n-th get call -> error
    delete_error: Exception | None = None
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    created: list[dict[str, Any]] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    patched: list[dict[str, Any]] = field(default_factory=list)

    def apis(self) -> KubeApis:
        return KubeApis(custom=_FakeCustom(self), core=_FakeCore(self))

    def record(self, method: str, kwargs: dict[str, Any]) -> None:
        assert kwargs.get("_request_timeout"), f"{method} without a request timeout could block forever"
        self.calls.append((method, kwargs))


class _FakeCustom:
    def __init__(self, c: FakeCluster):
        self.c = c

    def _check(self, group: str, version: str, namespace: str, plural: str) -> None:
        assert (group, version, namespace, plural) == ("ray.io", "v1", NS, "rayjobs")

    def create_namespaced_custom_object(
        self, group: str, version: str, namespace: str, plural: str, body: dict[str, Any], **kw: Any
    ) -> Any:
        self._check(group, version, namespace, plural)
        self.c.record("create", kw)
        assert kw.get("field_validation") == "Strict"
        if self.c.create_error:
            raise self.c.create_error
        self.c.created.append(body)
        return body

    def get_namespaced_custom_object(
        self, group: str, version: str, namespace: str, plural: str, name: str, **kw: Any
    ) -> Any:
        self._check(group, version, namespace, plural)
        self.c.record("get", kw)
        n = sum(1 for m, _ in self.c.calls if m == "get")
        if n in self.c.get_errors:
            raise self.c.get_errors[n]
        return {**DOC, "status": _at(self.c.statuses, self.c.clock.now)}

    def patch_namespaced_custom_object(
        self, group: str, version: str, namespace: str, plural: str, name: str, body: dict[str, Any], **kw: Any
    ) -> Any:
        self._check(group, version, namespace, plural)
        self.c.record("patch", kw)
        self.c.patched.append(body)
        return body

    def delete_namespaced_custom_object(
        self, group: str, version: str, namespace: str, plural: str, name: str, **kw: Any
    ) -> Any:
        self._check(group, version, namespace, plural)
        self.c.record("delete", kw)
        assert kw.get("propagation_policy") == "Background"
        if self.c.delete_error:
            raise self.c.delete_error
        self.c.deleted.append(name)


class _FakeCore:
    def __init__(self, c: FakeCluster):
        self.c = c

    def list_namespaced_pod(self, namespace: str, label_selector: str = "", **kw: Any) -> Any:
        self.c.record("list_pods", kw)
        wanted = dict(part.split("=", 1) for part in label_selector.split(",") if part)
        pods = _at(self.c.pods, self.c.clock.now)
        return V1PodList(items=[p for p in pods if wanted.items() <= (p.metadata.labels or {}).items()])

    def read_namespaced_pod_log(
        self,
        name: str,
        namespace: str,
        container: str | None = None,
        timestamps: bool = False,
        since_seconds: int | None = None,
        **kw: Any,
    ) -> Any:
        self.c.record("read_log", {**kw, "since_seconds": since_seconds})
        assert container == "ray-job-submitter" and timestamps
        pod = next((p for p in _at(self.c.pods, self.c.clock.now) if p.metadata.name == name), None)
        if pod is None:
            raise ApiException(status=404, reason="Not Found")
        now = self.c.clock.now
        lines = [
            f"{_timestamp(t, i)} {text}"
            for i, (t, text) in enumerate(self.c.log)
            if t <= now and (since_seconds is None or t >= now - since_seconds)
        ]
        return "\n".join(lines) + ("\n" if lines else "")

    def list_namespaced_event(self, namespace: str, field_selector: str = "", **kw: Any) -> Any:
        self.c.record("list_events", kw)
        assert field_selector == "type=Warning"
        return CoreV1EventList(items=list(self.c.events))


# ---------------------------------------------------------------- pods and events like the API server returns


def make_pod(
    name: str,
    role: str,
    phase: str = "Running",
    *,
    waiting: tuple[str, str] | None = None,
    terminated: str | None = None,
    unschedulable: str | None = None,
    image: str = IMAGE,
    created: int = 0,
) -> V1Pod:
    container = {"head": "ray-head", "worker": "ray-worker", "submitter": "ray-job-submitter"}[role]
    labels = {"fp8rl/rayjob": NAME, "fp8rl/role": role}
    if role != "submitter":
        labels["ray.io/cluster"] = CLUSTER
    state = V1ContainerState(running=None)
    if waiting:
        state = V1ContainerState(waiting=V1ContainerStateWaiting(reason=waiting[0], message=waiting[1]))
    if terminated:
        state = V1ContainerState(terminated=V1ContainerStateTerminated(reason=terminated, exit_code=137))
    statuses: list[V1ContainerStatus] | None = [
        V1ContainerStatus(
            name=container, image=image, image_id="", ready=phase == "Running", restart_count=0, state=state
        )
    ]
    conditions = None
    if unschedulable:
        conditions = [
            V1PodCondition(type="PodScheduled", status="False", reason="Unschedulable", message=unschedulable)
        ]
        statuses = None  # a pod that never got a node has no container statuses
    return V1Pod(
        metadata=V1ObjectMeta(name=name, labels=labels, creation_timestamp=T0 + dt.timedelta(seconds=created)),
        spec=V1PodSpec(containers=[V1Container(name=container, image=image)]),
        status=V1PodStatus(phase=phase, container_statuses=statuses, conditions=conditions),
    )


def make_event(obj: str, reason: str, message: str, kind: str = "Pod") -> CoreV1Event:
    return CoreV1Event(
        metadata=V1ObjectMeta(name=f"{obj}.1"),
        involved_object=V1ObjectReference(kind=kind, name=obj),
        reason=reason,
        message=message,
        type="Warning",
    )


def status(deployment: str, job: str = "", **extra: Any) -> dict[str, Any]:
    s: dict[str, Any] = {"jobDeploymentStatus": deployment, "rayClusterName": CLUSTER, "jobId": "raysubmit_1"}
    if job:
        s["jobStatus"] = job
    return {**s, **extra}


HEAD = make_pod(f"{CLUSTER}-head-x", "head")
WORKER = make_pod(f"{CLUSTER}-gpu-worker-y", "worker")


def run(cluster: FakeCluster, **kwargs: Any) -> tuple[Any, list[str]]:
    lines: list[str] = []
    options = {"timeout_s": 3600.0, "poll_s": 5.0, "clock": cluster.clock, "sleep": cluster.clock.sleep, **kwargs}
    result = submit_rayjob(DOC, cluster.apis(), log_sink=lines.append, **options)
    return result, lines


def run_failing(cluster: FakeCluster, exc: type[BaseException] = RayJobFailed, **kwargs: Any) -> tuple[Any, list[str]]:
    lines: list[str] = []
    options = {"timeout_s": 3600.0, "poll_s": 5.0, "clock": cluster.clock, "sleep": cluster.clock.sleep, **kwargs}
    with pytest.raises(exc) as e:
        submit_rayjob(DOC, cluster.apis(), log_sink=lines.append, **options)
    return e.value, lines


def driver_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if not line.startswith("[rayjob")]


# ---------------------------------------------------------------- the happy path


def test_initializing_running_complete_streams_each_log_line_once() -> None:
    submitter_running = make_pod(f"{NAME}-sub", "submitter", "Running")
    submitter_done = make_pod(f"{NAME}-sub", "submitter", "Succeeded")
    cluster = FakeCluster(
        statuses=[
            (0, {}),
            (5, status("Initializing")),
            (20, status("Running", "PENDING")),
            (25, status("Running", "RUNNING")),
            (60, status("Complete", "SUCCEEDED")),
        ],
        pods=[
            (0, []),
            (5, [HEAD, WORKER]),
            (20, [HEAD, WORKER, submitter_running]),
            (60, [HEAD, WORKER, submitter_done]),
        ],
        log=[
            (21, "submitted raysubmit_1"),
            (30, "step 1: reward 0.12"),
            (30, "step 1: reward 0.12"),
            (45, "step 2: reward 0.30"),
            (59, "done"),
        ],
    )
    result, lines = run(cluster)
    assert result.name == NAME and result.namespace == NS
    assert (result.job_status, result.deployment_status) == ("SUCCEEDED", "Complete")
    assert result.job_id == "raysubmit_1" and result.ray_cluster_name == CLUSTER
    assert result.elapsed_s == pytest.approx(60, abs=6)
    # Two identical lines with different timestamps are two lines; overlapping read windows are not.
    assert driver_lines(lines) == [
        "submitted raysubmit_1",
        "step 1: reward 0.12",
        "step 1: reward 0.12",
        "step 2: reward 0.30",
        "done",
    ]
    assert f"[rayjob {NAME}] deployment Initializing, ray job -" in lines
    assert f"[rayjob {NAME}] deployment Complete, ray job SUCCEEDED" in lines
    assert cluster.created == [DOC]
    assert cluster.deleted == [NAME]
    # Log reads after the first one only ask for a recent window, not the whole log again.
    reads = [kw for m, kw in cluster.calls if m == "read_log"]
    assert reads[0]["since_seconds"] is None
    assert all(kw["since_seconds"] is not None and kw["since_seconds"] <= 20 for kw in reads[1:])


def test_keep_leaves_the_rayjob() -> None:
    cluster = FakeCluster(statuses=[(0, status("Complete", "SUCCEEDED"))])
    _, lines = run(cluster, keep=True)
    assert cluster.deleted == []
    assert any("kubectl delete rayjob" in line for line in lines)


def test_transient_api_error_is_retried() -> None:
    cluster = FakeCluster(
        statuses=[(0, status("Running", "RUNNING")), (10, status("Complete", "SUCCEEDED"))],
        get_errors={1: ApiException(status=503, reason="Service Unavailable")},
    )
    result, lines = run(cluster)
    assert result.job_status == "SUCCEEDED"
    assert any("Kubernetes API error, retrying" in line for line in lines)


def test_submitter_restart_follows_the_new_pod() -> None:
    first = make_pod(f"{NAME}-a", "submitter", "Failed", created=0)
    second = make_pod(f"{NAME}-b", "submitter", "Succeeded", created=30)
    cluster = FakeCluster(
        statuses=[(0, status("Running", "RUNNING")), (40, status("Complete", "SUCCEEDED"))],
        pods=[(0, [first]), (30, [first, second])],
        log=[(1, "hello")],
    )
    _, lines = run(cluster)
    assert any(f"submitter pod restarted: {NAME}-b" in line for line in lines)


# ---------------------------------------------------------------- failures name their cause


def test_image_pull_error_fails_after_the_grace_period() -> None:
    bad = "ghcr.io/example/fp8rl-gpu:nope"
    pulling = make_pod(
        f"{CLUSTER}-gpu-worker-y",
        "worker",
        "Pending",
        waiting=("ImagePullBackOff", f'Back-off pulling image "{bad}"'),
        image=bad,
    )
    cluster = FakeCluster(statuses=[(0, status("Initializing"))], pods=[(0, [HEAD, pulling])])
    err, _ = run_failing(cluster, image_pull_grace_s=60)
    assert err.reason.startswith(f"image pull error: {bad} (ImagePullBackOff")
    assert isinstance(err, UserError)
    assert 60 <= cluster.clock.now <= 70
    assert cluster.deleted == [NAME]


def test_a_short_image_pull_hiccup_is_tolerated() -> None:
    pulling = make_pod(f"{CLUSTER}-gpu-worker-y", "worker", "Pending", waiting=("ErrImagePull", "i/o timeout"))
    cluster = FakeCluster(
        statuses=[(0, status("Initializing")), (30, status("Complete", "SUCCEEDED"))],
        pods=[(0, [HEAD, pulling]), (20, [HEAD, WORKER])],
    )
    result, _ = run(cluster, image_pull_grace_s=60)
    assert result.job_status == "SUCCEEDED"


def test_unschedulable_gpus_reported_once_then_timeout_names_them() -> None:
    message = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu. preemption: 0/4 nodes are available."
    pending = make_pod(f"{CLUSTER}-gpu-worker-y", "worker", "Pending", unschedulable=message)
    cluster = FakeCluster(statuses=[(0, status("Initializing"))], pods=[(0, [HEAD, pending])])
    err, lines = run_failing(cluster, RayJobTimeout, timeout_s=120)
    assert err.reason.startswith("not finished after 120 s (deployment Initializing); unschedulable: pod ")
    assert "Insufficient nvidia.com/gpu" in err.reason and "gpusPerWorker" in err.reason
    assert sum("waiting: unschedulable" in line for line in lines) == 1
    assert cluster.clock.now == pytest.approx(120)
    assert cluster.deleted == [NAME]


@pytest.mark.parametrize(
    "final",
    [
        status("Complete", "FAILED"),
        status(
            "Failed", "FAILED", reason="AppFailed", message="Job submission has failed. Reason: BackoffLimitExceeded"
        ),
    ],
)
def test_driver_traceback_surfaces_the_original_exception(final: dict[str, Any]) -> None:
    submitter = make_pod(f"{NAME}-sub", "submitter", "Running")
    done = make_pod(f"{NAME}-sub", "submitter", "Failed")
    cluster = FakeCluster(
        statuses=[(0, status("Running", "RUNNING")), (30, final)],
        pods=[(0, [HEAD, WORKER, submitter]), (30, [HEAD, WORKER, done])],
        log=[(5 + i, line) for i, line in enumerate(TRACEBACK)],
    )
    err, lines = run_failing(cluster)
    assert (
        err.reason
        == "driver raised ray.exceptions.RayTaskError(ValueError): ray::Trainer.train() (pid=77, ip=10.0.0.5)"
    )
    assert "ValueError: logprob shape mismatch: (8, 32) vs (8, 31)" in str(err)
    assert 'File "/app/fp8rl/train/trainer.py", line 120, in train' in err.details
    assert "Job 'raysubmit_1' failed" not in err.details  # the traceback block ends at the blank line
    assert "ValueError: logprob shape mismatch" in "\n".join(lines)  # and it was streamed as it happened
    assert cluster.deleted == [NAME]


def test_kuberay_reason_when_nothing_more_specific() -> None:
    final = status(
        "Failed", "RUNNING", reason="DeadlineExceeded", message="The RayJob has passed the activeDeadlineSeconds."
    )
    cluster = FakeCluster(statuses=[(0, status("Running", "RUNNING")), (10, final)], pods=[(0, [HEAD, WORKER])])
    err, _ = run_failing(cluster)
    assert err.reason == "DeadlineExceeded: The RayJob has passed the activeDeadlineSeconds."


def test_validation_failed_is_terminal() -> None:
    final = status("ValidationFailed", reason="ValidationFailed", message="The RayJob spec is invalid: ...")
    cluster = FakeCluster(statuses=[(0, final)])
    err, _ = run_failing(cluster)
    assert err.reason.startswith("ValidationFailed: The RayJob spec is invalid")


def test_timeout_while_running_keeps_last_log_lines_and_deletes() -> None:
    submitter = make_pod(f"{NAME}-sub", "submitter", "Running")
    cluster = FakeCluster(
        statuses=[(0, status("Running", "RUNNING"))],
        pods=[(0, [HEAD, WORKER, submitter])],
        log=[(1, "step 1"), (50, "step 2")],
    )
    err, _ = run_failing(cluster, RayJobTimeout, timeout_s=100, poll_s=7)
    assert err.reason.startswith("not finished after 100 s (deployment Running)")
    assert "step 2" in err.details
    assert cluster.clock.now == pytest.approx(100)  # the last sleep is cut to the deadline
    assert cluster.deleted == [NAME]


# ---------------------------------------------------------------- cleanup on every way out


def test_ctrl_c_deletes_the_rayjob() -> None:
    cluster = FakeCluster(statuses=[(0, status("Running", "RUNNING"))])
    cluster.clock.interrupt_at = 12
    with pytest.raises(KeyboardInterrupt):
        run(cluster)
    assert cluster.deleted == [NAME]


def test_rbac_refusal_is_a_clear_error_and_still_cleans_up() -> None:
    cluster = FakeCluster(statuses=[(0, {})], get_errors={2: ApiException(status=403, reason="Forbidden")})
    err, _ = run_failing(cluster)
    assert "RBAC" in err.reason
    assert cluster.deleted == [NAME]


def test_unexpected_exception_still_cleans_up() -> None:
    cluster = FakeCluster(statuses=[(0, {})], get_errors={2: RuntimeError("bug")})
    with pytest.raises(RuntimeError, match="bug"):
        run(cluster)
    assert cluster.deleted == [NAME]


def test_rayjob_deleted_behind_our_back() -> None:
    cluster = FakeCluster(statuses=[(0, {})], get_errors={2: ApiException(status=404, reason="Not Found")})
    err, _ = run_failing(cluster)
    assert "deleted while we waited" in err.reason


@pytest.mark.parametrize(
    ("code", "text"), [(409, "already exists"), (404, "KubeRay operator"), (403, "RBAC"), (422, "rejected")]
)
def test_create_errors_are_explained_and_nothing_is_deleted(code: int, text: str) -> None:
    cluster = FakeCluster(statuses=[(0, {})], create_error=ApiException(status=code, reason="x"))
    err, _ = run_failing(cluster)
    assert text in err.reason
    assert cluster.deleted == []  # a RayJob we did not create (a name clash) is not ours to delete


def test_unreachable_api_server_on_create() -> None:
    cluster = FakeCluster(statuses=[(0, {})], create_error=ConnectionRefusedError(111, "Connection refused"))
    err, _ = run_failing(cluster)
    assert err.reason.startswith("cannot reach the Kubernetes API server")
    assert cluster.deleted == []


def test_a_failed_delete_does_not_hide_the_result() -> None:
    cluster = FakeCluster(
        statuses=[(0, status("Complete", "SUCCEEDED"))], delete_error=ApiException(status=500, reason="boom")
    )
    result, lines = run(cluster)
    assert result.job_status == "SUCCEEDED"
    assert any(f"kubectl delete rayjob {NAME} -n {NS}" in line for line in lines)


# ---------------------------------------------------------------- diagnosis and log parsing, directly


def test_diagnose_prefers_the_pod_cause_over_kuberay_deadline() -> None:
    pulling = make_pod("w", "worker", "Pending", waiting=("ErrImagePull", "manifest unknown"), image="repo/img:bad")
    reason, _ = diagnose({"reason": "DeadlineExceeded", "message": "..."}, [HEAD, pulling], [], [])
    assert reason == "image pull error: repo/img:bad (ErrImagePull: manifest unknown)"


def test_diagnose_failed_scheduling_event() -> None:
    ev = make_event("w-pod", "FailedScheduling", "0/2 nodes are available: 2 Insufficient nvidia.com/gpu.")
    reason, _ = diagnose({}, [], [ev], [])
    assert reason.startswith("unschedulable: pod w-pod: 0/2 nodes are available: 2 Insufficient nvidia.com/gpu.")


def test_diagnose_oom_and_other_warnings() -> None:
    oom = make_pod("w", "worker", "Failed", terminated="OOMKilled")
    assert diagnose({}, [oom], [], [])[0].startswith("out of memory: container w/ray-worker was OOMKilled")
    mount = make_event("h", "FailedMount", 'persistentvolumeclaim "fp8rl-data" not found')
    assert diagnose({}, [], [mount], [])[0] == 'FailedMount: Pod/h: persistentvolumeclaim "fp8rl-data" not found'


def test_diagnose_stopped_job() -> None:
    reason, _ = diagnose({"jobStatus": "STOPPED"}, [HEAD], [], ["step 1"])
    assert reason.startswith("the Ray job was stopped")


def test_extract_traceback_takes_the_last_one() -> None:
    lines = ["Traceback (most recent call last):", '  File "a.py", line 1', "KeyError: 'x'", "", *TRACEBACK]
    tb = extract_traceback(lines)
    assert tb is not None and tb.splitlines()[-1] == "ValueError: logprob shape mismatch: (8, 32) vs (8, 31)"
    assert "KeyError" not in tb
    assert extract_traceback(["all good", "done"]) is None


def test_log_follower_drops_overlap_and_pads_nanoseconds() -> None:
    # kubelet trims trailing zeros: .5 is later than .123456789, which a plain string compare gets wrong.
    later, earlier = (
        split_timestamp("2025-01-01T00:00:01.5Z a")[0],
        split_timestamp("2025-01-01T00:00:01.123456789Z b")[0],
    )
    assert later is not None and earlier is not None and later > earlier
    assert split_timestamp("2025-01-01T00:00:01Z a") == ("2025-01-01T00:00:01.000000000", "a")
    f = PodLogFollower(core=None, namespace=NS, pod="p", request_timeout_s=1, clock=lambda: 0.0)
    assert f._new_lines("2025-01-01T00:00:01.1Z a\n2025-01-01T00:00:01.1Z b\n") == ["a", "b"]
    assert f._new_lines("2025-01-01T00:00:01.1Z a\n2025-01-01T00:00:01.1Z b\n2025-01-01T00:00:02Z c\n") == ["c"]


# ---------------------------------------------------------------- the Ray dashboard path, with a flaky fake client
# (the real dashboard is exercised in tests/integration/test_ray_job_submission.py; a blip cannot be made on cue there)


class _FlakyJobClient:
    """Answers like JobSubmissionClient, but the first status request fails like a dashboard restart."""

    statuses = ("RUNNING", "SUCCEEDED")

    def __init__(self, address: str, headers: dict[str, str] | None = None) -> None:
        self.headers, self.status_calls = headers, 0

    def submit_job(self, **kw: Any) -> str:
        return "raysubmit_flaky"

    def get_job_status(self, job_id: str) -> str:
        import requests

        self.status_calls += 1
        if self.status_calls == 1:
            raise requests.exceptions.ConnectionError("connection reset by peer")
        return self.statuses[min(self.status_calls - 2, len(self.statuses) - 1)]

    async def tail_job_logs(self, job_id: str) -> Any:
        yield "hello\n"

    def get_job_logs(self, job_id: str) -> str:
        return "hello\nworld\n"


def test_dashboard_blip_is_retried_and_missed_log_lines_are_filled_in(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray.job_submission

    from fp8rl.kube.job_submission import submit_to_ray_cluster

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", _FlakyJobClient)
    lines: list[str] = []
    result = submit_to_ray_cluster("http://head:8265", "python x.py", timeout_s=30, poll_s=0.05, log_sink=lines.append)
    assert result.status == "SUCCEEDED"
    assert any("dashboard error, retrying" in line for line in lines)
    assert [line for line in lines if not line.startswith("[ray job")] == ["hello", "world"]


def test_sigterm_deletes_the_rayjob_and_exits_143() -> None:
    """A cancelled KFP run terminates the step's pod: SIGTERM (a real signal to this process) while the RayJob is
    watched deletes it before the process exits, and the previous SIGTERM handler is back afterwards."""
    import os
    import signal

    from fp8rl.kube.submit import Terminated

    cluster = FakeCluster(statuses=[(0, status("Running", "RUNNING"))])
    sent: list[float] = []

    def sleep_then_terminate(seconds: float) -> None:
        cluster.clock.sleep(seconds)
        if not sent:
            sent.append(seconds)
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    e, _lines = run_failing(cluster, Terminated, sleep=sleep_then_terminate)
    assert e.code == 128 + signal.SIGTERM and sent
    assert cluster.deleted == [NAME]
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_step_pod_owns_its_rayjob(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the downward API's pod name and uid (the pipelines set them), the RayJob is owned by the step's pod,
    so deleting the pod garbage-collects the RayJob; without them it has no owner."""
    from fp8rl.kube.rayjob import build_rayjob
    from fp8rl.kube.rl_step import owner_pod_reference

    monkeypatch.delenv("FP8RL_POD_NAME", raising=False)
    monkeypatch.delenv("FP8RL_POD_UID", raising=False)
    assert owner_pod_reference() is None
    monkeypatch.setenv("FP8RL_POD_NAME", "recipe-comparison-abc-rl-step-123")
    monkeypatch.setenv("FP8RL_POD_UID", "6f1e2d3c-0000-4000-8000-000000000001")
    owner = owner_pod_reference()
    assert owner == {
        "apiVersion": "v1", "kind": "Pod", "name": "recipe-comparison-abc-rl-step-123",
        "uid": "6f1e2d3c-0000-4000-8000-000000000001", "blockOwnerDeletion": False,
    }  # fmt: skip
    from fp8rl.kube.rayjob_template import parse_template

    res = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "1", "memory": "1Gi"}}
    template = parse_template({"image": "fp8rl-runtime:0.1.0", "head": {"resources": res},
                               "workers": {"replicas": 1, "gpusPerWorker": 1, "resources": res}})  # fmt: skip
    doc = build_rayjob(template, "fp8rl-step", "python x.py", "ml", owner=owner)
    assert doc["metadata"]["ownerReferences"] == [owner] and doc["metadata"]["namespace"] == "ml"


def test_a_retried_step_adopts_its_earlier_attempts_running_rayjob(monkeypatch: pytest.MonkeyPatch) -> None:
    """The create answers 409 with a RayJob of the same KFP run and entrypoint that still runs (its step's pod was
    killed outright): the retry takes it over (re-owned by its pod), follows it to the end and deletes it then."""
    owner = {"apiVersion": "v1", "kind": "Pod", "name": "rl-step-retry", "uid": "u2", "blockOwnerDeletion": False}
    attempt = {**DOC, "metadata": {**DOC["metadata"], "labels": {"fp8rl/kfp-run-id": "run-1"}, "ownerReferences": [owner]}}  # fmt: skip
    monkeypatch.setitem(globals(), "DOC", attempt)  # what the fake API holds, and what the retry submits
    cluster = FakeCluster(
        statuses=[(0, status("Running", "RUNNING")), (30, status("Complete", "SUCCEEDED"))],
        pods=[(0, [HEAD, WORKER, make_pod(f"{NAME}-sub", "submitter", "Succeeded")])],
        create_error=ApiException(status=409, reason="AlreadyExists"),
    )
    result, lines = run(cluster)
    assert result.job_status == "SUCCEEDED"
    assert cluster.patched == [{"metadata": {"ownerReferences": [owner]}}] and cluster.created == []
    assert any("adopted (no second driver)" in line for line in lines), lines
    assert f"[rayjob {NAME}] adopted in namespace {NS}" in lines
    assert cluster.deleted == [NAME]  # ours now: deleted at the end like one we created
