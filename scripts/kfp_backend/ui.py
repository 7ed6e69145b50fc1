"""The KFP 2.17.0 UI served against the backend that e2e.py starts (its build: scripts/kfp_backend/build_ui.sh).

Two host processes, as KFP's manifests run them in pods: ``grpcwebproxy`` in front of the MLMD server (the UI reads
ML Metadata through gRPC-Web; KFP runs Envoy there), and the frontend's own Node.js server, which serves the bundle
and proxies the API server (``/apis``), MLMD (``/ml_metadata``) and pod logs (``/k8s/pod/logs``, read from the
cluster with the kubeconfig).  ``start_ui`` returns the UI's URL; the browser check is tests/cluster/test_kfp_ui.py.
"""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path
from typing import Any, Protocol

TOOLS = Path(os.environ.get("FP8RL_TOOLS_DIR") or Path.home() / ".cache" / "fp8rl" / "tools")
UI_BUILD = TOOLS / "kfp-2.17.0-ui"
UI_PORT = 3000
GRPC_WEB_PORT = 19090  # the gRPC-Web side of the MLMD proxy (KFP's metadata-envoy-service listens on 9090)


class Starter(Protocol):
    def start(self, name: str, argv: list[Any], env: dict[str, str] | None = None) -> tuple[Any, Path]: ...


def missing_build() -> list[str]:
    """The parts of the UI build that are absent (empty: it can be served)."""
    parts = [UI_BUILD / "node" / "bin" / "node", UI_BUILD / "server" / "dist" / "server.js",
             UI_BUILD / "client" / "index.html", UI_BUILD / "bin" / "grpcwebproxy"]  # fmt: skip
    return [str(p) for p in parts if not p.is_file()]


def ui_env(api_http: int, s3: tuple[int, str, str], namespace: str, kubeconfig: Path) -> dict[str, str]:
    """The frontend server's settings (frontend/server/configs.ts names them) for services on this host."""
    port, access_key, secret_key = s3
    return {
        "ML_PIPELINE_SERVICE_HOST": "127.0.0.1",
        "ML_PIPELINE_SERVICE_PORT": str(api_http),
        "METADATA_ENVOY_SERVICE_SERVICE_HOST": "127.0.0.1",
        "METADATA_ENVOY_SERVICE_SERVICE_PORT": str(GRPC_WEB_PORT),
        # artifacts are read from the S3 gateway directly (an empty namespace: the host name is used as given)
        "MINIO_HOST": "127.0.0.1",
        "MINIO_NAMESPACE": "",
        "MINIO_PORT": str(port),
        "MINIO_ACCESS_KEY": access_key,
        "MINIO_SECRET_KEY": secret_key,
        "FRONTEND_SERVER_NAMESPACE": namespace,
        "KUBECONFIG": str(kubeconfig),
        "DISABLE_GKE_METADATA": "true",
    }


def start_ui(procs: Starter, mlmd_grpc: int, env: dict[str, str], wait_for: Any) -> str:
    """grpcwebproxy and the frontend server, started and answering; returns the UI's URL."""
    proc, log = procs.start("grpcwebproxy", [
        UI_BUILD / "bin" / "grpcwebproxy", f"--backend_addr=127.0.0.1:{mlmd_grpc}", "--run_tls_server=false",
        f"--server_http_debug_port={GRPC_WEB_PORT}", "--allow_all_origins", "--backend_max_call_recv_msg_size=67108864",
    ])  # fmt: skip
    wait_for("the gRPC-Web proxy of MLMD", lambda: _answers(f"http://127.0.0.1:{GRPC_WEB_PORT}/"), 60, proc, log)
    server = UI_BUILD / "server"
    proc, log = procs.start("ui", [UI_BUILD / "node" / "bin" / "node", server / "dist" / "server.js",
                                   UI_BUILD / "client", UI_PORT], env)  # fmt: skip
    url = f"http://127.0.0.1:{UI_PORT}"
    wait_for("the KFP UI", lambda: _answers(f"{url}/apis/v2beta1/healthz"), 90, proc, log)
    return url


def _answers(url: str) -> bool:
    """True once something answers HTTP at ``url`` (any status: the proxy answers its root with 404)."""
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
