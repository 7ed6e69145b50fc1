"""Why a Ray job failed, from what it left behind: the driver's log, pod statuses and Warning events.

Pure functions over plain lines and the kubernetes client's model objects (``V1Pod``, ``CoreV1Event``),
so they are tested on objects shaped like the API server's. :func:`extract_traceback` and
:func:`driver_failure` serve both ways of running a job (:mod:`fp8rl.kube.submit`,
:mod:`fp8rl.kube.job_submission`); :func:`diagnose` names the cause of a failed or timed-out RayJob,
the most specific first: ``image pull error: <image>``, ``unschedulable: <scheduler message>``,
``out of memory: ...``, the driver's traceback, KubeRay's own reason, other Warning events.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

TRACEBACK_MAX_LINES = 80
IMAGE_PULL_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})

# ---------------------------------------------------------------- driver log analysis (both paths)

_TRACEBACK_HEADER = "Traceback (most recent call last):"


def extract_traceback(lines: Iterable[str], max_lines: int = TRACEBACK_MAX_LINES) -> str | None:
    """The last Python traceback in ``lines``: header, frames, and the exception line(s) up to a blank line."""
    lines = list(lines)
    starts = [i for i, line in enumerate(lines) if line.strip() == _TRACEBACK_HEADER]
    if not starts:
        return None
    block, i = [lines[starts[-1]]], starts[-1] + 1
    while i < len(lines) and lines[i][:1].isspace() and lines[i].strip():
        block.append(lines[i])  # frames, source lines, carets
        i += 1
    while i < len(lines) and lines[i].strip() and len(block) < max_lines:
        block.append(lines[i])  # the exception line and what it carries (a Ray remote traceback, a message)
        i += 1
    return "\n".join(block[:max_lines])


def _exception_line(traceback: str) -> str:
    """The first non-indented line after the frames: ``ValueError: boom``."""
    for line in traceback.splitlines()[1:]:
        if line.strip() and not line[:1].isspace():
            return line.strip()
    return "driver raised an exception"


def driver_failure(log_lines: Iterable[str], what: str = "driver") -> tuple[str, str]:
    """(one-line reason, details) from the driver's last log lines."""
    lines = list(log_lines)
    tb = extract_traceback(lines)
    if tb:
        return f"{what} raised {_exception_line(tb)}", tb
    tail = "\n".join(lines[-30:])
    return f"{what} exited with an error (no Python traceback in its log)", tail


# ---------------------------------------------------------------- Kubernetes: diagnosis (pure)


def _container_statuses(pod: Any) -> list[Any]:
    status = pod.status
    if status is None:
        return []
    return list(status.init_container_statuses or []) + list(status.container_statuses or [])


def _image_of(pod: Any, container_name: str, fallback: str) -> str:
    for c in list(pod.spec.init_containers or []) + list(pod.spec.containers or []):
        if c.name == container_name:
            return str(c.image)
    return fallback


def image_pull_problems(pods: Iterable[Any]) -> list[tuple[str, str]]:
    """[(pod/container key, "image pull error: <image> (<reason>: <message>)")] for containers stuck pulling."""
    found = []
    for pod in pods:
        for cs in _container_statuses(pod):
            waiting = cs.state.waiting if cs.state else None
            if waiting is not None and waiting.reason in IMAGE_PULL_REASONS:
                image = _image_of(pod, cs.name, cs.image)
                detail = f"{waiting.reason}: {waiting.message}" if waiting.message else waiting.reason
                found.append((f"{pod.metadata.name}/{cs.name}", f"image pull error: {image} ({detail})"))
    return found


def unschedulable_problems(pods: Iterable[Any], events: Iterable[Any] = ()) -> list[tuple[str, str]]:
    """[(pod, "unschedulable: pod <pod>: <scheduler message>")] from PodScheduled=False or FailedScheduling events."""
    messages: dict[str, str] = {}
    for pod in pods:
        for cond in (pod.status.conditions if pod.status else None) or []:
            if cond.type == "PodScheduled" and cond.status == "False" and cond.reason == "Unschedulable":
                messages[pod.metadata.name] = cond.message or "no node fits"
    for ev in events:
        if ev.reason == "FailedScheduling" and ev.involved_object is not None:
            messages.setdefault(ev.involved_object.name, ev.message or "no node fits")
    return [(pod, f"unschedulable: pod {pod}: {_gpu_hint(msg)}") for pod, msg in messages.items()]


def _gpu_hint(message: str) -> str:
    if "nvidia.com/gpu" in message:
        return (
            f"{message.strip()} (no node has enough free nvidia.com/gpu: check workers.gpusPerWorker, "
            "the GPU node pool, and workers.tolerations/nodeSelector)"
        )
    return message.strip()


def oom_problems(pods: Iterable[Any]) -> list[tuple[str, str]]:
    found = []
    for pod in pods:
        for cs in _container_statuses(pod):
            for state in (cs.state, cs.last_state):
                term = state.terminated if state else None
                if term is not None and term.reason == "OOMKilled":
                    key = f"{pod.metadata.name}/{cs.name}"
                    found.append((key, f"out of memory: container {key} was OOMKilled (raise its memory limit)"))
                    break
    return found


def _event_problems(events: Iterable[Any]) -> list[str]:
    """Warnings other than scheduling: FailedMount (a missing PVC), FailedCreate (quota, service account)..."""
    return [
        f"{ev.reason}: {ev.involved_object.kind}/{ev.involved_object.name}: {ev.message}"
        for ev in events
        if ev.type == "Warning" and ev.reason not in ("FailedScheduling", "BackOff") and ev.involved_object is not None
    ]


def diagnose(status: Mapping[str, Any], pods: list[Any], events: list[Any], log_tail: list[str]) -> tuple[str, str]:
    """(reason, details) for a RayJob that failed or timed out; the most specific cause wins."""
    for problems in (image_pull_problems(pods), unschedulable_problems(pods, events), oom_problems(pods)):
        if problems:
            return problems[0][1], "\n".join(p[1] for p in problems[1:])
    if extract_traceback(log_tail):
        return driver_failure(log_tail)
    if status.get("jobStatus") == "STOPPED":
        return "the Ray job was stopped (ray job stop, or the RayJob was deleted)", "\n".join(log_tail[-30:])
    kube_reason, message = status.get("reason"), status.get("message")
    warnings = _event_problems(events)
    if kube_reason or message:
        details = "\n".join([*warnings, *log_tail[-30:]])
        return f"{kube_reason or 'failed'}: {message or ''}".strip(), details
    if warnings:
        return warnings[0], "\n".join(warnings[1:])
    return driver_failure(log_tail) if log_tail else ("no cause found in pod statuses, events or logs", "")
