"""Fixtures of the tests against a real API server, controllers, kwok GPU nodes and the KubeRay operator.

One control plane per session (``control_plane.ControlPlane``; ~20 s to start). The binaries come from
``scripts/k8s_control_plane.sh`` (``make k8s-tools`` runs it); without them the tests skip, or fail under
``FP8RL_REQUIRE_K8S_TOOLS=1`` (CI). Every test gets a namespace of its own, deleted after it.

The real-node tests (``real_node`` marker) get a second cluster of their own, ``real_cluster``: a control plane
with a real node (``real_node.RealNode``: containerd, kubelet, kube-proxy, CoreDNS) and the component image of
``make images`` imported into it. They skip where the node cannot start (not root, containerd or the CNI plugins
missing, the image not built), or fail under ``FP8RL_REQUIRE_REAL_NODE=1`` (CI).
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
from real_node import RealNode, host_ip, missing_dependencies  # noqa: E402

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
    return _helm(cluster_tools, control_plane.kubeconfig, tmp_path_factory.mktemp("helm-home"))


def _helm(tools: Path, kubeconfig: Path, home: Path) -> Callable[..., Any]:
    import subprocess

    env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }

    def run(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([str(tools / "bin" / "helm"), *args], capture_output=True, text=True, env=env,
                              timeout=timeout)  # fmt: skip
        if check and proc.returncode != 0:
            pytest.fail(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}{proc.stdout}")
        return proc

    return run


# ------------------------------------------------------------------------------------------------ real node


class RealCluster:
    """A control plane with one real node; ``data`` is the host directory behind the tests' data volumes."""

    def __init__(self, cp: ControlPlane, node: RealNode, helm: Callable[..., Any], image: str, data: Path) -> None:
        self.cp, self.node, self.helm, self.image, self.data = cp, node, helm, image, data
        self.api = _api_client(cp)


def _real_node_unavailable(why: str) -> None:
    if os.environ.get("FP8RL_REQUIRE_REAL_NODE") == "1":
        pytest.fail(why + " (FP8RL_REQUIRE_REAL_NODE=1)", pytrace=False)
    pytest.skip(why)


def _component_image() -> str:
    """The component image of ``make images`` (waiting for a build running beside the tests, as tests/image do)."""
    import shutil
    import subprocess
    import time

    from components.images import COMPONENT_IMAGE

    ready = os.environ.get("FP8RL_IMAGES_READY_FILE", "")
    deadline = time.monotonic() + 3600
    while ready and not Path(ready).is_file() and time.monotonic() < deadline:
        time.sleep(5)
    if ready and Path(ready).is_file() and Path(ready).read_text().strip() != "ok":
        _real_node_unavailable(f"the image build failed: {Path(ready).read_text().strip()}")
    ref = f"localhost/{COMPONENT_IMAGE}"
    if shutil.which("podman") is None or subprocess.run(["podman", "image", "exists", ref]).returncode != 0:
        _real_node_unavailable(f"image {ref} not built (make images)")
    return ref


@pytest.fixture(scope="session")
def real_cluster(cluster_tools: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    import subprocess
    import time

    image = _component_image()  # first: `make node-deps`, which brings the node's packages, runs before that build
    missing = missing_dependencies()
    if missing:
        _real_node_unavailable("the real node needs: " + "; ".join(missing) + " (make node-deps)")
    kube = cluster_tools / "bin" / "kube"
    if subprocess.run([str(kube), "kubelet", "--version"], capture_output=True).returncode != 0:
        _real_node_unavailable(f"{kube} has no kubelet: rebuild it with scripts/k8s_control_plane.sh")
    work = tmp_path_factory.mktemp("real-cluster")
    cp = ControlPlane(cluster_tools, work / "control-plane", node_ip=host_ip(), kwok=False)
    store = Path(os.environ.get("FP8RL_NODE_STORE") or cluster_tools.parent / "node-store")
    node = RealNode(kube, cp.kubeconfig, cp.pki / "ca.crt", work / "node", store)
    try:
        cp.start()
        node.start()
        t0 = time.monotonic()
        print(f"\n[real node] {node.import_local_image(image)} ({time.monotonic() - t0:.0f} s)", flush=True)
        # its layers are held once, unpacked (the pods below start from them), not also as blobs
        assert node.discard_layer_blobs(image) == 0, "the import left the image's layer blobs in the content store"
        core = __import__("kubernetes").client.CoreV1Api(_api_client(cp))
        _wait(lambda: any(_node_ready(n) for n in core.list_node().items), 60, "the real node Ready")
    except BaseException:
        node.stop()
        cp.stop()
        raise
    data = work / "volumes"
    data.mkdir(mode=0o777)
    yield RealCluster(cp, node, _helm(cluster_tools, cp.kubeconfig, work / "helm"), image, data)
    node.stop()
    cp.stop()


# Pod Security Standards "restricted", enforced (refused at admission), and warned and audited at the same level
RESTRICTED = {f"pod-security.kubernetes.io/{mode}": "restricted" for mode in ("enforce", "warn", "audit")}


@pytest.fixture
def real_namespace(real_cluster: RealCluster) -> Iterator[str]:
    """A fresh namespace on the real cluster (deleted after the test, with its pods) that enforces Pod Security
    Standards ``restricted``, as a shared cluster's would: the API server's PodSecurity admission refuses any pod
    of the chart, the step or a RayJob that is not."""
    yield from _real_namespace(real_cluster, RESTRICTED)


@pytest.fixture
def real_namespace_unrestricted(real_cluster: RealCluster) -> Iterator[str]:
    """A fresh namespace without Pod Security labels: for KFP's own backend parts, which its installation runs in a
    namespace of their own (they are not fp8rl's pods)."""
    yield from _real_namespace(real_cluster, {})


def _real_namespace(real_cluster: RealCluster, labels: dict[str, str]) -> Iterator[str]:
    from kubernetes import client

    core = client.CoreV1Api(real_cluster.api)
    name = f"r-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"metadata": {"name": name, "labels": labels}})
    _wait(lambda: core.read_namespaced_service_account("default", name), 30, f"service account of {name}")
    yield name
    core.delete_namespace(name)
