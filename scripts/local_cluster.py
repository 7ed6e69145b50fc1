"""A one-machine Kubernetes cluster to try the chart on: ``make cluster-up`` / ``make cluster-down``.

    python scripts/local_cluster.py up [--gpu-nodes N] [--image REF ...]
    python scripts/local_cluster.py down
    python scripts/local_cluster.py status

``up`` starts, in the background: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, the KubeRay
operator and a real node (containerd, kubelet, kube-proxy, CoreDNS), imports the images of ``make images`` into
the node (no registry), and writes ``~/.cache/fp8rl/cluster/kubeconfig.yaml``.  ``--gpu-nodes N`` adds N kwok
nodes with 8 fake ``nvidia.com/gpu`` each (tainted: only pods that ask for GPUs go there, and never really run).
``down`` stops everything and removes what the node left (containers, mounts, its bridge).

Needs root and what ``make node-deps`` installs, plus the binaries of ``make k8s-tools``.  The same code starts
the real-node tests' cluster (tests/cluster: control_plane.py, real_node.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "cluster"))

from control_plane import ControlPlane, gpu_node  # noqa: E402
from real_node import NodeError, RealNode, host_ip  # noqa: E402

TOOLS = Path(os.environ.get("FP8RL_TOOLS_DIR") or Path.home() / ".cache" / "fp8rl" / "tools")
STATE = Path(os.environ.get("FP8RL_CLUSTER_DIR") or Path.home() / ".cache" / "fp8rl" / "cluster")
PIDS = STATE / "pids.json"


def _say(msg: str) -> None:
    print(f"local-cluster: {msg}", flush=True)


def _default_images() -> list[str]:
    sys.path.insert(0, str(ROOT))
    from components.images import COMPONENT_IMAGE, RUNTIME_IMAGE

    return [f"localhost/{COMPONENT_IMAGE}", f"localhost/{RUNTIME_IMAGE}"]


def up(gpu_nodes: int, images: list[str]) -> int:
    if PIDS.exists():
        _say(f"already up ({PIDS}); `make cluster-down` first")
        return 1
    if not (TOOLS / "bin" / "kube").is_file():
        _say(f"no {TOOLS / 'bin' / 'kube'}: run `make k8s-tools` first")
        return 1
    shutil.rmtree(STATE, ignore_errors=True)
    STATE.mkdir(parents=True)
    t0 = time.monotonic()
    cp = ControlPlane(TOOLS, STATE / "control-plane", node_ip=host_ip(), kwok=gpu_nodes > 0)
    node = RealNode(
        TOOLS / "bin" / "kube", cp.kubeconfig, cp.pki / "ca.crt", STATE / "node", STATE.parent / "node-store"
    )
    try:
        _say("starting the control plane")
        cp.start()
        _say("starting the node (containerd, CoreDNS, kubelet, kube-proxy)")
        node.start()
        for ref in images:
            if shutil.which("podman") and os.system(f"podman image exists {ref}") == 0:
                _say(f"importing {ref} (minutes for a large image)")
                _say(node.import_local_image(ref))
            else:
                _say(f"{ref}: not built (make images), not imported")
        if gpu_nodes:
            from kubernetes import client, config

            core = client.CoreV1Api(config.new_client_from_config(str(cp.kubeconfig)))
            for i in range(gpu_nodes):
                core.create_node(gpu_node(f"gpu-node-{i}", taint=True))
    except (NodeError, RuntimeError, OSError) as e:
        _say(f"failed: {e}")
        node.stop()
        cp.stop()
        return 1
    procs = {name: p.pid for name, p in [*cp.procs, *node.procs]}
    PIDS.write_text(json.dumps({"pids": procs, "node_workdir": str(node.workdir)}, indent=2))
    (STATE / "kubeconfig.yaml").write_text(cp.kubeconfig.read_text())
    _say(f"up in {time.monotonic() - t0:.0f} s; logs under {STATE}/*/logs")
    print(f"export KUBECONFIG={STATE / 'kubeconfig.yaml'}")
    return 0


def down() -> int:
    if not PIDS.exists():
        _say("not up")
        return 0
    state = json.loads(PIDS.read_text())
    for name, pid in reversed(list(state["pids"].items())):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
            _say(f"stopped {name}")
    deadline = time.monotonic() + 15
    for pid in state["pids"].values():
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    RealNode.clean_up(Path(state["node_workdir"]))
    PIDS.unlink()
    _say("down")
    return 0


def status() -> int:
    if not PIDS.exists():
        _say("not up")
        return 1
    pids = json.loads(PIDS.read_text())["pids"]
    dead = [name for name, pid in pids.items() if not Path(f"/proc/{pid}").exists()]
    _say(f"up; KUBECONFIG={STATE / 'kubeconfig.yaml'}" + (f"; exited: {', '.join(dead)}" if dead else ""))
    return 1 if dead else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="local_cluster.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="start the cluster in the background")
    p_up.add_argument("--gpu-nodes", type=int, default=0, help="kwok nodes with 8 fake GPUs each (default 0)")
    p_up.add_argument("--image", action="append", help="an image of podman's store to import (default: fp8rl's)")
    sub.add_parser("down", help="stop it and remove what it left")
    sub.add_parser("status", help="whether it is up")
    args = parser.parse_args(argv)
    if args.command == "up":
        return up(args.gpu_nodes, args.image or _default_images())
    return down() if args.command == "down" else status()


if __name__ == "__main__":
    sys.exit(main())
