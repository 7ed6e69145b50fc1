"""KFP backend tier: the parts of KFP 2.17.0 that run in pods, on the real node (``-m kfp_backend``).

Needs the backend build of scripts/kfp_backend/build.sh in the tools cache (``~/.cache/fp8rl/tools/kfp-2.17.0``,
from KFP's source) and everything the real node needs; skips, saying which, where either is absent (CI on a fresh
machine has no KFP build: the skip is decided at collection, before any cluster starts).

What it checks: the driver, launcher and argoexec images of scripts/kfp_backend/images.sh run on the real node the
way a compiled KFP workflow runs them (the launcher copies itself into the shared ``/kfp-launcher`` volume and the
component image runs that copy; argoexec likewise into ``/var/run/argo``), and a pod reaches a host-process service
by KFP's in-cluster name (``ml-pipeline.kubeflow``) through tests/cluster/kfp_backend.py's Service + Endpoints.
"""

from __future__ import annotations

import http.server
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from kfp_backend import BackendSettings, HostPorts, backend_manifests

ROOT = Path(__file__).resolve().parents[2]
KFP_BUILD = Path(os.environ.get("FP8RL_TOOLS_DIR") or Path.home() / ".cache" / "fp8rl" / "tools") / "kfp-2.17.0"
_MISSING = [b for b in ("driver", "launcher-v2", "argoexec") if not (KFP_BUILD / "bin" / b).is_file()]

pytestmark = [
    pytest.mark.kfp_backend,
    pytest.mark.real_node,
    pytest.mark.skipif(
        bool(_MISSING),
        reason=f"no KFP backend build in {KFP_BUILD} (missing: {', '.join(_MISSING)}): "
        "run scripts/kfp_backend/build.sh with KFP_SRC=<kubeflow/pipelines at 2.17.0>",
    ),
]


def _kfp_images() -> dict[str, str]:
    out = subprocess.run([str(ROOT / "scripts" / "kfp_backend" / "images.sh")], capture_output=True, text=True)
    assert out.returncode == 0, f"images.sh failed:\n{out.stderr[-3000:]}"
    refs = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("image: ")]
    return {ref.split("/")[-1].split(":")[0]: ref for ref in refs}


def _run(core: Any, namespace: str, pod: dict[str, Any], timeout_s: float = 120) -> str:
    name = pod["metadata"]["name"]
    core.create_namespaced_pod(namespace, pod)
    deadline = time.monotonic() + timeout_s
    phase = ""
    while time.monotonic() < deadline:
        phase = core.read_namespaced_pod(name, namespace).status.phase
        if phase in ("Succeeded", "Failed"):
            break
        time.sleep(1)
    logs = core.read_namespaced_pod_log(name, namespace, container="main")
    assert phase == "Succeeded", f"pod {name}: {phase or 'no phase'} after {timeout_s:.0f} s; main's log:\n{logs}"
    return str(logs)


def test_kfp_images_and_host_services_on_the_real_node(real_cluster: Any, real_namespace_unrestricted: str) -> None:
    real_namespace = real_namespace_unrestricted  # KFP's own parts, not fp8rl's pods (conftest)
    from kubernetes import client, utils

    images = _kfp_images()
    for ref in images.values():
        print(f"\n[kfp] {real_cluster.node.import_local_image(ref)}", flush=True)
    server = http.server.ThreadingHTTPServer(("0.0.0.0", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        settings = BackendSettings(real_cluster.node.node_ip, real_namespace, "minio", "minio123",
                                   ports=HostPorts(api_http=server.server_address[1]))  # fmt: skip
        objs = backend_manifests(settings)
        core = client.CoreV1Api(real_cluster.api)
        if any(ns.metadata.name == "kubeflow" for ns in core.list_namespace().items):
            objs = objs[1:]
        utils.create_from_yaml(real_cluster.api, yaml_objects=objs)
        shared = [{"name": "kfp-launcher", "mountPath": "/kfp-launcher"}, {"name": "var-run-argo", "mountPath": "/var/run/argo"}]  # fmt: skip
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "kfp-parts"}, "spec": {
            "restartPolicy": "Never",
            "volumes": [{"name": "kfp-launcher", "emptyDir": {}}, {"name": "var-run-argo", "emptyDir": {}}],
            "initContainers": [
                {"name": "kfp-launcher", "image": images["fp8rl-kfp-launcher"], "imagePullPolicy": "Never",
                 "command": ["launcher-v2"], "args": ["--copy", "/kfp-launcher/launch"], "volumeMounts": shared},
                {"name": "init", "image": images["fp8rl-argoexec"], "imagePullPolicy": "Never",
                 "command": ["sh", "-c", "cp /bin/argoexec /var/run/argo/argoexec"], "volumeMounts": shared},
                {"name": "driver", "image": images["fp8rl-kfp-driver"], "imagePullPolicy": "Never",
                 "command": ["sh", "-c", "driver --help 2>&1 | grep -q mlmd_server_address"]},
            ],
            "containers": [{"name": "main", "image": real_cluster.image, "imagePullPolicy": "Never",
                            "volumeMounts": shared, "command": ["sh", "-c",
                            "/kfp-launcher/launch --help 2>&1 | head -n1 && /var/run/argo/argoexec version | head -n1"
                            f" && python -c \"import urllib.request as u; print(u.urlopen('http://ml-pipeline.kubeflow:"
                            f"{settings.ports.api_http}/', timeout=20).status)\""]}],
        }}  # fmt: skip
        logs = _run(core, real_namespace, pod)
    finally:
        server.shutdown()
    assert "Usage of /kfp-launcher/launch" in logs and "argoexec: v4.0.5" in logs, logs
    assert logs.strip().endswith("200"), logs
