"""submit_to_ray_cluster against a real local Ray cluster, with Ray token authentication on.

Ray 2.60 turns token auth on by default only for a cluster that ``ray.init()`` starts; ``ray start``
turns it on when ``RAY_AUTH_MODE=token`` is set or a token already exists
(``ray/_private/authentication/authentication_token_setup.py``). We set it explicitly, as a
KubeRay cluster with ``rayTokenSecret`` does, and pass the token to the client, which sends it as
``Authorization: Bearer``. The cluster gets its own ports and temp dir so it cannot collide with another
Ray on this machine, and it is stopped through its own process group, never with ``ray stop``
(that would kill every Ray on the machine).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fp8rl.kube.errors import RayJobFailed, RayJobTimeout
from fp8rl.kube.job_submission import submit_to_ray_cluster

# A real Ray head plus five jobs: about 30-35 s on 2 CPU cores.
pytestmark = [
    pytest.mark.slow,
    # raised inside ray.job_submission (its websocket call passes ssl=None to aiohttp), not by our code
    pytest.mark.filterwarnings("ignore:ssl=None is deprecated:DeprecationWarning"),
]

START_TIMEOUT_S = 120


@dataclass(frozen=True)
class RayHead:
    address: str
    token: str


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _ready(address: str, token: str) -> bool:
    request = urllib.request.Request(f"{address}/api/jobs/", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM lets `ray start --block` stop its children; then anything left in its process group is killed."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # the group we created with start_new_session: only our processes


@pytest.fixture(scope="module")
def ray_head() -> Iterator[RayHead]:
    # Short temp dir: Ray puts unix sockets under it, and those paths are limited to 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="fp8rl-ray-", dir="/tmp")
    gcs, dashboard, client, agent_http, agent_grpc, runtime_env_agent, metrics, node_manager, object_manager = (
        _free_ports(9)
    )
    token = secrets.token_hex(16)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    cmd = [
        str(Path(sys.executable).parent / "ray"),
        "start",
        "--head",
        "--block",
        "--num-cpus=1",
        "--object-store-memory=100000000",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        "--node-ip-address=127.0.0.1",
        "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
        f"--port={gcs}",
        f"--dashboard-port={dashboard}",
        f"--ray-client-server-port={client}",
        f"--dashboard-agent-listen-port={agent_http}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--runtime-env-agent-port={runtime_env_agent}",
        f"--metrics-export-port={metrics}",
        f"--node-manager-port={node_manager}",
        f"--object-manager-port={object_manager}",
    ]
    log = open(Path(temp_dir) / "ray-start.log", "wb")  # noqa: SIM115 -- closed below, after the process
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _ready(address, token):
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                output = (Path(temp_dir) / "ray-start.log").read_text(errors="replace")[-3000:]
                pytest.fail(f"local Ray head did not come up (exit {proc.poll()}):\n{output}")
            time.sleep(0.5)
        yield RayHead(address, token)
    finally:
        _stop(proc)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _python(code: str) -> str:
    return shlex.join([sys.executable, "-c", code])


def test_success_streams_the_driver_log_as_it_happens(ray_head: RayHead) -> None:
    from ray.job_submission import JobSubmissionClient

    arrivals: dict[str, float] = {}
    code = (
        'import os, time; print("first line", os.environ["FP8RL_PROBE"], flush=True); time.sleep(4); print("last line")'
    )
    result = submit_to_ray_cluster(
        ray_head.address,
        _python(code),
        runtime_env={"env_vars": {"FP8RL_PROBE": "42"}},
        timeout_s=120,
        token=ray_head.token,
        log_sink=lambda line: None if line in arrivals else arrivals.update({line: time.time()}),
    )
    assert result.status == "SUCCEEDED"
    assert "first line 42" in arrivals and "last line" in arrivals
    # Streamed, not fetched at the end: the first line reached us while the driver was still sleeping.
    client = JobSubmissionClient(ray_head.address, headers={"Authorization": f"Bearer {ray_head.token}"})
    ended_ms = client.get_job_info(result.submission_id).end_time
    assert ended_ms is not None
    assert arrivals["first line 42"] < ended_ms / 1000


def test_driver_exception_is_raised_with_its_traceback(ray_head: RayHead) -> None:
    code = 'print("step 1 done"); raise ValueError("reward shape mismatch: 7 != 8")'
    with pytest.raises(RayJobFailed) as e:
        submit_to_ray_cluster(
            ray_head.address, _python(code), timeout_s=120, token=ray_head.token, log_sink=lambda _: None
        )
    assert e.value.reason == "driver raised ValueError: reward shape mismatch: 7 != 8"
    assert "Traceback (most recent call last):" in e.value.details


def test_worker_exception_reaches_the_caller(ray_head: RayHead) -> None:
    """A Ray task that raises: the driver re-raises it, and the original exception is in our error."""
    code = (
        "import ray; ray.init()\n"
        "@ray.remote(num_cpus=0)\n"
        "def rollout():\n"
        '    raise RuntimeError("rollout worker lost its engine")\n'
        "ray.get(rollout.remote())"
    )
    with pytest.raises(RayJobFailed) as e:
        submit_to_ray_cluster(
            ray_head.address, _python(code), timeout_s=120, token=ray_head.token, log_sink=lambda _: None
        )
    assert "RayTaskError(RuntimeError)" in e.value.reason
    assert "RuntimeError: rollout worker lost its engine" in str(e.value)


def test_timeout_stops_the_job(ray_head: RayHead) -> None:
    from ray.job_submission import JobStatus, JobSubmissionClient

    code = 'import time; print("sleeping", flush=True); time.sleep(600)'
    with pytest.raises(RayJobTimeout) as e:
        submit_to_ray_cluster(
            ray_head.address,
            _python(code),
            timeout_s=5,
            token=ray_head.token,
            submission_id="fp8rl-timeout",
            log_sink=lambda _: None,
        )
    assert "not finished after 5 s" in e.value.reason
    client = JobSubmissionClient(ray_head.address, headers={"Authorization": f"Bearer {ray_head.token}"})
    deadline = time.monotonic() + 60
    while client.get_job_status("fp8rl-timeout") != JobStatus.STOPPED:
        assert time.monotonic() < deadline, "the job was not stopped"
        time.sleep(0.5)


def test_wrong_token_is_an_authentication_error(ray_head: RayHead) -> None:
    with pytest.raises(RayJobFailed, match="Ray token authentication failed"):
        submit_to_ray_cluster(ray_head.address, "echo hi", timeout_s=30, token="not-the-token", log_sink=lambda _: None)


def test_unreachable_dashboard_is_a_clear_error() -> None:
    (port,) = _free_ports(1)
    with pytest.raises(RayJobFailed, match="cannot reach the Ray dashboard"):
        submit_to_ray_cluster(f"http://127.0.0.1:{port}", "echo hi", timeout_s=30, log_sink=lambda _: None)
