"""Run the RL step as a KubeRay RayJob, or on an existing Ray cluster, and wait for it without ever hanging.

Two ways in, one contract: stream the driver's log lines to ``log_sink`` while waiting, return a
result on success, raise :class:`~fp8rl.kube.errors.RayJobFailed` (a :class:`~fp8rl.errors.UserError`)
whose message says *why* on failure, and :class:`~fp8rl.kube.errors.RayJobTimeout` when a deadline passes.

- :func:`submit_rayjob` (this module) creates a ``ray.io/v1`` RayJob through the Kubernetes API, polls
  ``status.jobDeploymentStatus`` / ``status.jobStatus``, follows the submitter pod's log (in
  K8sJobMode it runs ``ray job logs --follow``, so that log is the driver's; best effort: a log the API
  server cannot fetch from the kubelet is reported once and never hides the outcome), and on failure reads
  pod statuses and Warning events to name the cause (:func:`fp8rl.kube.job_failure.diagnose`):
  ``image pull error: <image>``, ``unschedulable: <scheduler message>``, ``out of memory: ...``, or
  the driver's traceback. The RayJob is deleted at the end (success, failure, timeout, Ctrl-C) unless
  ``keep=True``; deleting it makes KubeRay stop the Ray job (its ``ray.io/rayjob-finalizer``) and
  garbage-collect the RayCluster.
- :func:`fp8rl.kube.job_submission.submit_to_ray_cluster` talks to a Ray dashboard through
  ``ray.job_submission``; the job is stopped if we give up on it (timeout, Ctrl-C).

Timeouts (every blocking wait has one; the defaults shared by both paths live here):

| what | default |
|---|---|
| whole job (``timeout_s``) | ``DEFAULT_TIMEOUT_S`` = 24 h (the cluster-side bound is the template's ``activeDeadlineSeconds``) |
| one Kubernetes API call / one Ray dashboard request | ``DEFAULT_REQUEST_TIMEOUT_S`` = 30 s |
| status poll interval | ``DEFAULT_POLL_S`` = 5 s (RayJob), ``job_submission.DEFAULT_RAY_POLL_S`` = 1 s (dashboard) |
| an image that will not pull before we give up | ``DEFAULT_IMAGE_PULL_GRACE_S`` = 300 s |
| last log lines after the job ends | ``LOG_DRAIN_S`` = 10 s (RayJob), ``job_submission.TAIL_STOP_S`` = 2 s (dashboard) |

Unschedulable pods are reported as they happen but are not fatal before the deadline: a cluster
autoscaler may still be adding GPU nodes.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes.client.exceptions import ApiException

from fp8rl.kube.attempts import GROUP, PLURAL, VERSION, reclaim
from fp8rl.kube.errors import RayJobFailed, RayJobTimeout
from fp8rl.kube.job_failure import diagnose, image_pull_problems, unschedulable_problems
from fp8rl.kube.pod_log import PodLogFollower
from fp8rl.kube.rayjob import CLUSTER_SELECTOR_KEY, RAYJOB_LABEL, ROLE_LABEL

DEFAULT_TIMEOUT_S = 24 * 3600.0
DEFAULT_REQUEST_TIMEOUT_S = 30.0
DEFAULT_POLL_S = 5.0
DEFAULT_IMAGE_PULL_GRACE_S = 300.0
LOG_DRAIN_S = 10.0
LOG_TAIL_LINES = 400  # driver lines kept for the failure message
TERMINAL_DEPLOYMENT = frozenset({"Complete", "Failed", "ValidationFailed"})

LogSink = Callable[[str], None]


def print_line(line: str) -> None:
    """The default ``log_sink`` of both paths: stdout, flushed per line."""
    print(line, flush=True)


@dataclass(frozen=True)
class RayJobResult:
    """A finished RayJob. ``job_status`` is Ray's (``SUCCEEDED``); ``deployment_status`` KubeRay's (``Complete``)."""

    name: str
    namespace: str
    job_id: str | None
    job_status: str
    deployment_status: str
    ray_cluster_name: str | None
    elapsed_s: float


@dataclass(frozen=True)
class KubeApis:
    """The two Kubernetes API groups we call: ``custom`` (CustomObjectsApi) and ``core`` (CoreV1Api).

    Methods used: custom.{create,get,delete}_namespaced_custom_object; core.list_namespaced_pod,
    core.read_namespaced_pod_log, core.list_namespaced_event.
    """

    custom: Any
    core: Any

    @classmethod
    def from_environment(cls, context: str | None = None) -> KubeApis:
        """In-cluster service account when running in a pod (a KFP step), else the kubeconfig."""
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config(context=context)
        return cls(custom=client.CustomObjectsApi(), core=client.CoreV1Api())


# ---------------------------------------------------------------- Kubernetes: submit and wait


@dataclass
class _Watch:
    """What one RayJob submission has seen so far."""

    name: str
    namespace: str
    api: KubeApis
    request_timeout_s: float
    log_sink: LogSink
    clock: Callable[[], float]
    follower: PodLogFollower | None = None
    last_state: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        self.last_status: dict[str, Any] = {}
        self.log_tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        self.pull_first_seen: dict[str, float] = {}
        self.reported: set[str] = set()

    def status(self) -> dict[str, Any]:
        try:
            obj = self.api.custom.get_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, self.name, _request_timeout=self.request_timeout_s
            )
        except ApiException as e:
            if e.status == 404:
                raise RayJobFailed(self.name, "the RayJob was deleted while we waited for it") from None
            raise
        return dict(obj.get("status") or {})

    def pods(self, status: Mapping[str, Any]) -> list[Any]:
        """Our templated pods, plus the RayCluster's (an existing cluster's pods do not carry our label)."""
        selectors = [f"{RAYJOB_LABEL}={self.name}"]
        if status.get("rayClusterName"):
            selectors.append(f"{CLUSTER_SELECTOR_KEY}={status['rayClusterName']}")
        pods: dict[str, Any] = {}
        for selector in selectors:
            listed = self.api.core.list_namespaced_pod(
                self.namespace, label_selector=selector, _request_timeout=self.request_timeout_s
            )
            pods.update({p.metadata.name: p for p in listed.items})
        return list(pods.values())

    def events(self, pods: list[Any], status: Mapping[str, Any]) -> list[Any]:
        """Warning events about our pods, the RayJob, its submitter Job and its RayCluster."""
        names = {p.metadata.name for p in pods} | {self.name, status.get("rayClusterName") or ""}
        listed = self.api.core.list_namespaced_event(
            self.namespace, field_selector="type=Warning", _request_timeout=self.request_timeout_s
        )
        return [
            ev
            for ev in listed.items
            if ev.involved_object is not None
            and (
                (ev.involved_object.name or "") in names or (ev.involved_object.name or "").startswith(self.name + "-")
            )
        ]

    def stream_logs(self, pods: list[Any]) -> None:
        submitters = [p for p in pods if (p.metadata.labels or {}).get(ROLE_LABEL) == "submitter"]
        started = [p for p in submitters if p.status is not None and p.status.phase != "Pending"]
        if not started:
            return
        newest = max(started, key=lambda p: (str(p.metadata.creation_timestamp or ""), p.metadata.name))
        if self.follower is None or self.follower.pod != newest.metadata.name:
            if self.follower is not None:
                self.log_sink(f"[rayjob {self.name}] submitter pod restarted: {newest.metadata.name}")
            self.follower = PodLogFollower(
                self.api.core, self.namespace, newest.metadata.name, self.request_timeout_s, self.clock
            )
        try:
            lines = self.follower.poll()
        except Exception as e:
            # The log is best effort: a kubelet that cannot be reached (a 500 from the API server's proxy), or
            # RBAC without pods/log, must not hide the job's outcome. Said once per pod; retried every poll.
            if not (isinstance(e, ApiException) or _is_transient(e)):
                raise
            key = f"log:{newest.metadata.name}"
            if key not in self.reported:
                self.reported.add(key)
                reason = f"{e.status} {e.reason}: {_api_message(e)}" if isinstance(e, ApiException) else str(e)
                self.log_sink(
                    f"[rayjob {self.name}] cannot read the driver's log from {newest.metadata.name} ({reason})"
                )
            return
        for line in lines:
            self.log_tail.append(line)
            self.log_sink(line)

    def report_state(self, status: Mapping[str, Any]) -> None:
        state = (status.get("jobDeploymentStatus") or "New", status.get("jobStatus") or "-")
        if state != self.last_state:
            self.log_sink(f"[rayjob {self.name}] deployment {state[0]}, ray job {state[1]}")
            self.last_state = state

    def check_pending(self, pods: list[Any], grace_s: float) -> None:
        """Report unschedulable pods once; fail on an image that has not pulled for ``grace_s``."""
        for key, message in unschedulable_problems(pods):
            if key not in self.reported:
                self.reported.add(key)
                self.log_sink(f"[rayjob {self.name}] waiting: {message}")
        now = self.clock()
        current = dict(image_pull_problems(pods))
        self.pull_first_seen = {k: self.pull_first_seen.get(k, now) for k in current}
        for key, message in current.items():
            if now - self.pull_first_seen[key] >= grace_s:
                raise RayJobFailed(self.name, message, f"(still failing after {grace_s:.0f} s)")

    def failure(
        self, status: Mapping[str, Any], cls: type[RayJobFailed] = RayJobFailed, prefix: str = ""
    ) -> RayJobFailed:
        """The diagnosed error; an API error while diagnosing only makes the diagnosis poorer."""
        pods: list[Any] = []
        events: list[Any] = []
        try:
            pods = self.pods(status)
            events = self.events(pods, status)
        except Exception as e:
            self.log_sink(f"[rayjob {self.name}] could not read pods/events for the diagnosis: {e}")
        reason, details = diagnose(status, pods, events, list(self.log_tail))
        return cls(self.name, prefix + reason, details)


def _is_transient(e: BaseException) -> bool:
    """API hiccups worth another poll: 5xx, 429, timeouts and broken connections."""
    if isinstance(e, ApiException):
        return e.status is None or e.status == 429 or e.status >= 500
    import urllib3

    return isinstance(e, urllib3.exceptions.HTTPError | OSError)


def _create(api: KubeApis, doc: Mapping[str, Any], request_timeout_s: float) -> bool:
    """Strict field validation: the API server refuses an unknown field instead of silently dropping it.  True when
    the name exists (``409``): the caller asks ``fp8rl.kube.attempts.reclaim`` what it is."""
    name, namespace = doc["metadata"]["name"], doc["metadata"].get("namespace", "default")
    try:
        api.custom.create_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, dict(doc), field_validation="Strict", _request_timeout=request_timeout_s
        )
    except ApiException as e:
        if e.status == 409:
            return True
        hints = {
            404: f"the {PLURAL}.{GROUP}/{VERSION} resource does not exist: is the KubeRay operator (v1.x) installed?",
            403: f"forbidden: the service account may not create {PLURAL}.{GROUP} in namespace {namespace} (RBAC)",
            422: f"the API server rejected the RayJob: {_api_message(e)}",
            # strict field validation: an unknown or duplicate field (e.g. a KubeRay version without that field)
            400: f"the API server rejected the RayJob: {_api_message(e)}",
        }
        raise RayJobFailed(
            name, hints.get(e.status or 0, f"could not create the RayJob: {e.status} {e.reason}")
        ) from None
    except Exception as e:
        if not _is_transient(e):
            raise
        raise RayJobFailed(
            name, f"cannot reach the Kubernetes API server ({e}); check with: kubectl get rayjob {name} -n {namespace}"
        ) from e
    return False


def _delete(api: KubeApis, name: str, namespace: str, request_timeout_s: float, log_sink: LogSink) -> None:
    """Best effort: a failed delete is reported, never raised over the job's own outcome."""
    try:
        api.custom.delete_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name, propagation_policy="Background", _request_timeout=request_timeout_s
        )
        log_sink(f"[rayjob {name}] deleted")
    except ApiException as e:
        if e.status != 404:
            log_sink(
                f"[rayjob {name}] could not delete it ({e.status} {e.reason}): kubectl delete rayjob {name} -n {namespace}"
            )
    except Exception as e:  # a broken connection must not hide the job's result
        log_sink(f"[rayjob {name}] could not delete it ({e}): kubectl delete rayjob {name} -n {namespace}")


def _api_message(e: ApiException) -> str:
    """The ``message`` of the API server's Status body (what kubectl prints), else the raw body."""
    import json

    try:
        return str(json.loads(e.body)["message"])
    except (TypeError, ValueError, KeyError):
        return str(e.body or e.reason)


def _api_error(name: str, e: ApiException) -> RayJobFailed:
    if e.status in (401, 403):
        return RayJobFailed(
            name, f"Kubernetes API refused access ({e.status} {e.reason}): check the service account's RBAC"
        )
    return RayJobFailed(name, f"Kubernetes API error {e.status} {e.reason}", str(e.body or ""))


def _poll_once(watch: _Watch, image_pull_grace_s: float) -> dict[str, Any] | None:
    """One poll; the status when the RayJob reached a terminal state, else None."""
    status = watch.last_status = watch.status()
    watch.report_state(status)
    pods = watch.pods(status)
    watch.stream_logs(pods)
    if status.get("jobDeploymentStatus") in TERMINAL_DEPLOYMENT:
        return status
    watch.check_pending(pods, image_pull_grace_s)
    return None


def _wait(
    watch: _Watch, timeout_s: float, poll_s: float, image_pull_grace_s: float, sleep: Callable[[float], None]
) -> dict[str, Any]:
    deadline = watch.clock() + timeout_s
    while True:
        try:
            terminal = _poll_once(watch, image_pull_grace_s)
        except RayJobFailed:
            raise
        except Exception as e:
            if isinstance(e, ApiException) and not _is_transient(e):
                raise _api_error(watch.name, e) from e
            if not _is_transient(e):
                raise
            watch.log_sink(f"[rayjob {watch.name}] Kubernetes API error, retrying: {e}")
            terminal = None
        if terminal is not None:
            return terminal
        remaining = deadline - watch.clock()
        if remaining <= 0:
            state = f"deployment {watch.last_status.get('jobDeploymentStatus') or 'New'}"
            raise watch.failure(watch.last_status, RayJobTimeout, f"not finished after {timeout_s:.0f} s ({state}); ")
        sleep(min(poll_s, remaining))


def _drain_logs(watch: _Watch, status: Mapping[str, Any], sleep: Callable[[float], None]) -> None:
    """The submitter may still be printing the last lines when the status flips: read until it stops."""
    deadline = watch.clock() + LOG_DRAIN_S
    while True:
        before = len(watch.log_tail)
        try:
            pods = watch.pods(status)
            watch.stream_logs(pods)
        except Exception as e:  # the outcome is known; missing the last lines must not change it
            watch.log_sink(f"[rayjob {watch.name}] could not read the last log lines: {e}")
            return
        submitters_done = all(
            p.status is not None and p.status.phase in ("Succeeded", "Failed")
            for p in pods
            if (p.metadata.labels or {}).get(ROLE_LABEL) == "submitter"
        )
        if (submitters_done and len(watch.log_tail) == before) or watch.clock() >= deadline:
            return
        sleep(1.0)


class Terminated(SystemExit):
    """SIGTERM while a RayJob was watched (a cancelled KFP run's step pod is terminated): exit 143 after cleanup."""


@contextlib.contextmanager
def terminated_by_sigterm() -> Iterator[None]:
    """In the main thread, SIGTERM raises :class:`Terminated` where the watch is, so the ``finally`` that deletes
    the RayJob runs before the process exits (Kubernetes sends SIGTERM, then SIGKILL after the grace period;
    the ownerReference of ``fp8rl.kube.rl_step`` covers a SIGKILL).  Elsewhere, or off the main thread, nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum: int, _frame: Any) -> None:
        raise Terminated(128 + signum)

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def submit_rayjob(
    doc: Mapping[str, Any],
    api: KubeApis,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    poll_s: float = DEFAULT_POLL_S,
    log_sink: LogSink = print_line,
    *,
    keep: bool = False,
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    image_pull_grace_s: float = DEFAULT_IMAGE_PULL_GRACE_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> RayJobResult:
    """Create the RayJob ``doc``, stream the driver's log, and return when Ray reports ``SUCCEEDED``.

    Raises :class:`RayJobFailed` with the diagnosed cause, or :class:`RayJobTimeout` after ``timeout_s``.
    The RayJob is deleted on every way out (also Ctrl-C) unless ``keep``; one we could not create
    (e.g. a name clash with a RayJob that is not an earlier attempt's, ``fp8rl.kube.attempts``) is never
    deleted, since it is not ours.
    """
    name, namespace = doc["metadata"]["name"], doc["metadata"].get("namespace", "default")
    start = clock()
    how = "created"
    if _create(api, doc, request_timeout_s):  # an earlier attempt's (a retried step): adopted or replaced
        try:
            how = "adopted" if reclaim(api, doc, request_timeout_s, log_sink, clock, sleep) else "created again"
        except ApiException as e:
            raise _api_error(name, e) from e
    log_sink(f"[rayjob {name}] {how} in namespace {namespace}")
    watch = _Watch(name, namespace, api, request_timeout_s, log_sink, clock)
    try:
        with terminated_by_sigterm():
            status = _wait(watch, timeout_s, poll_s, image_pull_grace_s, sleep)
            _drain_logs(watch, status, sleep)
        if status.get("jobDeploymentStatus") != "Complete" or status.get("jobStatus") != "SUCCEEDED":
            raise watch.failure(status)
        return RayJobResult(
            name=name,
            namespace=namespace,
            job_id=status.get("jobId"),
            job_status=status["jobStatus"],
            deployment_status=status["jobDeploymentStatus"],
            ray_cluster_name=status.get("rayClusterName"),
            elapsed_s=clock() - start,
        )
    finally:
        if keep:
            log_sink(f"[rayjob {name}] kept: kubectl delete rayjob {name} -n {namespace}")
        else:
            _delete(api, name, namespace, request_timeout_s, log_sink)
