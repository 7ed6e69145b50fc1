"""Fixtures of the tests against a real API server, controllers, kwok GPU nodes and the KubeRay operator.

One control plane per session (``control_plane.ControlPlane``; ~20 s to start). The binaries come from
``scripts/k8s_control_plane.sh`` (``make k8s-tools`` runs it); without them the tests skip, or fail under
``FP8RL_REQUIRE_K8S_TOOLS=1`` (CI). Every test gets a namespace of its own, deleted after it.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
for p in (HERE, HERE.parent):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from control_plane import ControlPlane, gpu_node  # noqa: E402

GPU_NODES = ("gpu-node-0", "gpu-node-1")


def _tools() -> Path:
    root = Path(os.environ.get("FP8RL_TOOLS_DIR") or Path.home() / ".cache" / "fp8rl" / "tools")
    needed = [root / "bin" / n for n in ("kube", "kwok", "ray-operator", "helm")]
    needed.append(root / "control-plane" / "VERSIONS.json")
    missing = [str(p.relative_to(root)) for p in needed if not p.is_file()]
    if missing:
        message = f"control plane missing under {root} ({', '.join(missing)}): run scripts/k8s_control_plane.sh"
        if os.environ.get("FP8RL_REQUIRE_K8S_TOOLS") == "1":
            pytest.fail(message + " (FP8RL_REQUIRE_K8S_TOOLS=1)", pytrace=False)
        pytest.skip(message)
    return root


@pytest.fixture(scope="session")
def cluster_tools() -> Path:
    return _tools()


@pytest.fixture(scope="session")
def control_plane(cluster_tools: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    cp = ControlPlane(cluster_tools, tmp_path_factory.mktemp("control-plane"))
    try:
        cp.start()
    except BaseException:
        cp.stop()
        raise
    from kubernetes import client

    core = client.CoreV1Api(_api_client(cp))
    for name in GPU_NODES:
        core.create_node(gpu_node(name))
    _wait(lambda: all(_node_ready(core.read_node(n)) for n in GPU_NODES), 60, "kwok GPU nodes Ready")
    yield cp
    cp.stop()


def _node_ready(node: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in (node.status.conditions or []))


def _api_client(cp: ControlPlane) -> Any:
    from kubernetes import config

    return config.new_client_from_config(str(cp.kubeconfig))


def _wait(ready: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.25) -> Any:
    import time

    deadline = time.monotonic() + timeout_s
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            got = ready()
            if got:
                return got
        except Exception as e:  # the object may not exist yet: keep polling, report the last error
            last = e
        time.sleep(poll_s)
    raise AssertionError(f"{what}: not after {timeout_s:.0f}s" + (f" (last error: {last})" if last else ""))


@pytest.fixture(scope="session")
def wait() -> Callable[..., Any]:
    """``wait(predicate, timeout_s, what)``: poll until ``predicate()`` is truthy; returns its value."""
    return _wait


@pytest.fixture(scope="session")
def api_client(control_plane: ControlPlane) -> Any:
    return _api_client(control_plane)


@pytest.fixture
def namespace(api_client: Any) -> Iterator[str]:
    """A fresh namespace for the test, deleted after it (the namespace controller removes what is left)."""
    from kubernetes import client

    core = client.CoreV1Api(api_client)
    name = f"t-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"metadata": {"name": name}})
    _wait(lambda: core.read_namespaced_service_account("default", name), 30, f"service account of {name}")
    yield name
    core.delete_namespace(name)


@pytest.fixture(scope="session")
def cluster_helm(
    cluster_tools: Path, control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., Any]:
    """The pinned helm, talking to the control plane."""
    import subprocess

    home = tmp_path_factory.mktemp("helm-home")
    env = {
        **os.environ,
        "KUBECONFIG": str(control_plane.kubeconfig),
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(cluster_tools / "bin" / "helm"), *args], capture_output=True, text=True, env=env, timeout=300
        )
        if check and proc.returncode != 0:
            pytest.fail(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}{proc.stdout}")
        return proc

    return run
