"""Following the RayJob submitter pod's log (in K8sJobMode, the driver's log) by polling the Kubernetes API.

Each poll reads the log with ``timestamps=True`` and a ``sinceSeconds`` window that overlaps the last read by
``LOG_OVERLAP_S``; the lines are keyed by their timestamps, so each is emitted once however the windows overlap.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from kubernetes.client.exceptions import ApiException

from fp8rl.kube.rayjob import SUBMITTER_CONTAINER

LOG_OVERLAP_S = 10  # re-read this much of the pod log each poll; duplicates are dropped by timestamp
_TS = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?Z\s?(.*)$")


def split_timestamp(line: str) -> tuple[str | None, str]:
    """``2025-01-01T00:00:00.12Z text`` -> (sortable key, text); kubelet trims nanoseconds, so pad them."""
    m = _TS.match(line)
    if not m:
        return None, line
    return f"{m.group(1)}.{(m.group(2) or '').ljust(9, '0')}", m.group(3)


class PodLogFollower:
    """Polls one pod's log with ``timestamps=True`` and a ``sinceSeconds`` window; emits each line once."""

    def __init__(self, core: Any, namespace: str, pod: str, request_timeout_s: float, clock: Callable[[], float]):
        self.core, self.namespace, self.pod = core, namespace, pod
        self.request_timeout_s, self.clock = request_timeout_s, clock
        self.last_key: str | None = None
        self.at_last_key: set[str] = set()
        self.read_at: float | None = None

    def poll(self) -> list[str]:
        kwargs: dict[str, Any] = {"container": SUBMITTER_CONTAINER, "timestamps": True}
        if self.read_at is not None:
            kwargs["since_seconds"] = int(self.clock() - self.read_at) + LOG_OVERLAP_S
        now = self.clock()
        try:
            text = self.core.read_namespaced_pod_log(
                self.pod, self.namespace, _request_timeout=self.request_timeout_s, **kwargs
            )
        except ApiException as e:
            if e.status in (400, 404):  # container not started yet, or the pod is gone
                return []
            raise
        self.read_at = now
        return self._new_lines(text or "")

    def _new_lines(self, text: str) -> list[str]:
        fresh = []
        for raw in text.splitlines():
            key, line = split_timestamp(raw)
            if key is None or self.last_key is None or key > self.last_key:
                if key is not None and key != self.last_key:
                    self.last_key, self.at_last_key = key, set()
                self.at_last_key.add(line)
                fresh.append(line)
            elif key == self.last_key and line not in self.at_last_key:
                self.at_last_key.add(line)
                fresh.append(line)
        return fresh
