"""A real ``mlflow server`` for the integration tests: SQLite store, proxied artifacts, on loopback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

MLFLOW = Path(sys.executable).parent / "mlflow"
STARTUP_TIMEOUT_S = 120  # migrations + uvicorn import take ~15 s on 2 busy cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until_healthy(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"mlflow server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    pytest.fail(f"mlflow server not healthy after {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server (it forwards to its uvicorn child); kill its process group if it hangs."""
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the group serve_mlflow started (start_new_session)
        proc.wait(timeout=10)


@contextmanager
def serve_mlflow(
    server_dir: Path, extra_args: Sequence[str] = (), extra_env: Mapping[str, str] | None = None
) -> Iterator[str]:
    """``mlflow server`` with its store, artifacts and log under ``server_dir``; yields its URL, stops it after.
    ``extra_args`` and ``extra_env`` (e.g. ``--app-name basic-auth`` and its settings) are added as given."""
    assert MLFLOW.is_file(), f"no mlflow executable next to {sys.executable}"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server_dir.mkdir(parents=True)
    log = server_dir / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    # No telemetry; no GenAI job runner (seven huey consumer processes the tests have no use for).
    env |= {"MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    cmd = [
        str(MLFLOW), "server", "--backend-store-uri", f"sqlite:///{server_dir / 'mlflow.db'}", "--serve-artifacts",
        "--artifacts-destination", str(server_dir / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
        "--workers", "1", *extra_args,
    ]  # fmt: skip
    env |= dict(extra_env or {})
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=server_dir, start_new_session=True
        )
        try:
            wait_until_healthy(url, proc, log)
            yield url
        finally:
            stop(proc)
