"""Run the RL step on an existing Ray cluster through the Ray Job Submission API, and wait for it without hanging.

:func:`submit_to_ray_cluster` talks to a Ray dashboard (``http://head:8265``) through
``ray.job_submission``: it submits the entrypoint, streams the driver's log to ``log_sink`` (the
``tail_job_logs`` websocket, topped up from ``get_job_logs`` at the end), and returns a
:class:`RayClusterJobResult` on success. The contract is the RayJob path's
(:func:`fp8rl.kube.submit.submit_rayjob`): :class:`~fp8rl.kube.errors.RayJobFailed` says why
(the driver's traceback, or Ray's own message), :class:`~fp8rl.kube.errors.RayJobTimeout` when a
deadline passes, and the job is stopped if we give up on it (timeout, Ctrl-C).

The Ray SDK's HTTP requests carry no timeout of their own, so each runs in a daemon thread bounded
by ``request_timeout_s``. Timeout defaults, for both paths: the table in :mod:`fp8rl.kube.submit`.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fp8rl.kube.errors import RayJobFailed, RayJobTimeout
from fp8rl.kube.job_failure import driver_failure, extract_traceback
from fp8rl.kube.submit import DEFAULT_REQUEST_TIMEOUT_S, DEFAULT_TIMEOUT_S, LOG_TAIL_LINES, LogSink, print_line

DEFAULT_RAY_POLL_S = 1.0
TAIL_STOP_S = 2.0  # for the log-tail thread to notice it was cancelled


@dataclass(frozen=True)
class RayClusterJobResult:
    """A finished job on an existing Ray cluster (Job Submission API)."""

    submission_id: str
    status: str
    elapsed_s: float


def _bounded(fn: Callable[[], Any], timeout_s: float, what: str, job: str, map_errors: bool = True) -> Any:
    """Run a blocking Ray SDK call in a daemon thread: its HTTP requests carry no timeout of their own."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=run, name=f"ray-sdk-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise RayJobTimeout(job, f"{what}: no answer from the Ray dashboard within {timeout_s:.0f} s")
    if "error" in box:
        if not map_errors:
            raise box["error"]
        raise _ray_error(box["error"], what, job) from box["error"]
    return box.get("value")


def _ray_error(e: BaseException, what: str, job: str) -> BaseException:
    from ray.exceptions import AuthenticationError

    if isinstance(e, AuthenticationError):
        return RayJobFailed(job, f"{what}: Ray token authentication failed (pass token= or set RAY_AUTH_TOKEN)", str(e))
    if isinstance(e, ConnectionError):
        return RayJobFailed(job, f"{what}: cannot reach the Ray dashboard ({e}); is the address http://<head>:8265?")
    return e


class _LogTail:
    """Follows ``tail_job_logs`` (a websocket) in a daemon thread; the caller drains ``chunks`` with timeouts."""

    def __init__(self, client: Any, job_id: str):
        self.chunks: queue.Queue[str] = queue.Queue()
        self.done = threading.Event()
        self._client, self._job_id = client, job_id
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        threading.Thread(target=self._run, name=f"ray-log-tail-{job_id}", daemon=True).start()

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._task = self._loop.create_task(self._pump())
            self._loop.run_until_complete(self._task)
        except BaseException:  # a broken websocket: the final get_job_logs still fills in what we missed
            pass
        finally:
            self._loop.close()
            self.done.set()

    async def _pump(self) -> None:
        async for chunk in self._client.tail_job_logs(self._job_id):
            self.chunks.put(chunk)

    def cancel(self) -> None:
        # Cancelling before the task exists is harmless: the tail socket closes once the job has ended.
        loop, task = self._loop, self._task
        if loop is not None and task is not None and not self.done.is_set():
            with contextlib.suppress(RuntimeError):  # the loop closed in between
                loop.call_soon_threadsafe(task.cancel)


class _LineSink:
    """Turns text chunks into whole lines for ``log_sink``; remembers every character it was given."""

    def __init__(self, log_sink: LogSink):
        self.log_sink, self.partial, self.received = log_sink, "", 0
        self.lines: deque[str] = deque(maxlen=LOG_TAIL_LINES)

    def feed(self, chunk: str) -> None:
        self.received += len(chunk)
        *complete, self.partial = (self.partial + chunk).split("\n")
        for line in complete:
            self.lines.append(line)
            self.log_sink(line)

    def flush(self) -> None:
        if self.partial:
            self.lines.append(self.partial)
            self.log_sink(self.partial)
            self.partial = ""


def _drain(chunks: queue.Queue[str], sink: _LineSink, wait_s: float) -> None:
    """Feed what the tail thread has, waiting up to ``wait_s`` for the first chunk."""
    try:
        sink.feed(chunks.get(timeout=wait_s))
        while True:
            sink.feed(chunks.get_nowait())
    except queue.Empty:
        return


def _poll_status(client: Any, job_id: str, request_timeout_s: float, log_sink: LogSink) -> Any:
    """The job's JobStatus, or None after a transient dashboard error (a restart, a network blip): poll again."""
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobStatus

    try:
        return JobStatus(
            _bounded(lambda: client.get_job_status(job_id), request_timeout_s, "get job status", job_id, False)
        )
    except AuthenticationError:
        raise
    except (OSError, RayJobTimeout) as e:  # requests' errors are OSErrors
        log_sink(f"[ray job {job_id}] dashboard error, retrying: {e}")
        return None


def _follow_job(
    client: Any, job_id: str, timeout_s: float, poll_s: float, request_timeout_s: float, sink: _LineSink
) -> str:
    """Stream logs until Ray reports a terminal status; that status, or RayJobTimeout after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    tail = _LogTail(client, job_id)
    try:
        while True:
            _drain(tail.chunks, sink, poll_s)
            status = _poll_status(client, job_id, request_timeout_s, sink.log_sink)
            if status is not None and status.is_terminal():
                # Ray's tail socket lags the job by seconds; the full log is already complete, so take the rest from it.
                tail.cancel()
                tail.done.wait(TAIL_STOP_S)
                _drain(tail.chunks, sink, 0.0)
                full = _bounded(lambda: client.get_job_logs(job_id), request_timeout_s, "get job logs", job_id)
                if len(full) > sink.received:  # whatever the websocket missed
                    sink.feed(full[sink.received :])
                sink.flush()
                return str(status.value)
            if time.monotonic() >= deadline:
                last = "\n".join(list(sink.lines)[-30:])
                raise RayJobTimeout(job_id, f"not finished after {timeout_s:.0f} s; the job was stopped", last)
    finally:
        tail.cancel()


def submit_to_ray_cluster(
    address: str,
    entrypoint: str,
    runtime_env: Mapping[str, Any] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    *,
    token: str | None = None,
    submission_id: str | None = None,
    poll_s: float = DEFAULT_RAY_POLL_S,
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    log_sink: LogSink = print_line,
) -> RayClusterJobResult:
    """Submit ``entrypoint`` to the Ray dashboard at ``address`` (``http://head:8265``) and wait for it.

    ``token``: the cluster's Ray auth token, sent as ``Authorization: Bearer``; without it Ray's own
    lookup applies (``RAY_AUTH_MODE=token`` with ``RAY_AUTH_TOKEN`` / ``~/.ray/auth_token``). On failure
    :class:`RayJobFailed` carries the driver's traceback; on timeout or Ctrl-C the job is stopped.
    """
    from ray.job_submission import JobSubmissionClient

    start = time.monotonic()
    job = submission_id or address
    headers = {"Authorization": f"Bearer {token}"} if token else None
    client = _bounded(lambda: JobSubmissionClient(address, headers=headers), request_timeout_s, "connect", job)
    job_id = _bounded(
        lambda: client.submit_job(
            entrypoint=entrypoint, runtime_env=dict(runtime_env or {}), submission_id=submission_id
        ),
        request_timeout_s,
        "submit job",
        job,
    )
    log_sink(f"[ray job {job_id}] submitted to {address}")
    sink = _LineSink(log_sink)
    finished = False
    try:
        status = _follow_job(client, job_id, timeout_s, poll_s, request_timeout_s, sink)
        finished = True
    finally:
        if not finished:
            _stop_quietly(client, job_id, request_timeout_s, log_sink)
    log_sink(f"[ray job {job_id}] {status}")
    if status != "SUCCEEDED":
        raise _job_failure(client, job_id, status, sink, request_timeout_s)
    return RayClusterJobResult(submission_id=job_id, status=status, elapsed_s=time.monotonic() - start)


def _job_failure(client: Any, job_id: str, status: str, sink: _LineSink, request_timeout_s: float) -> RayJobFailed:
    if status == "STOPPED":
        return RayJobFailed(job_id, "the job was stopped", "\n".join(list(sink.lines)[-30:]))
    reason, details = driver_failure(sink.lines)
    if not extract_traceback(sink.lines):  # e.g. a SyntaxError, a missing script: Ray's own message says what
        try:
            info = _bounded(lambda: client.get_job_info(job_id), request_timeout_s, "get job info", job_id)
            message = (getattr(info, "message", None) or "").strip()
        except Exception:  # the log tail already explains what it can
            message = ""
        reason = f"{status}: {message.splitlines()[0]}" if message else reason
    return RayJobFailed(job_id, reason, details)


def _stop_quietly(client: Any, job_id: str, request_timeout_s: float, log_sink: LogSink) -> None:
    try:
        _bounded(lambda: client.stop_job(job_id), request_timeout_s, "stop job", job_id)
        log_sink(f"[ray job {job_id}] stop requested")
    except Exception as e:  # never mask the timeout or Ctrl-C that brought us here
        log_sink(f"[ray job {job_id}] could not stop it ({e}): ray job stop {job_id}")
