"""A throwaway Kubernetes control plane on loopback ports, for the cluster tests.

Started from the binaries ``scripts/k8s_control_plane.sh`` builds into the tools cache: etcd, a real
kube-apiserver (RBAC, admission, its own CA and serving certificate, service-account tokens),
kube-controller-manager (garbage collection, service-account tokens, Jobs, ReplicaSets),
kube-scheduler, kwok (fake nodes that run no containers: a scheduled pod is marked Running, a Job's
pod Succeeded), and the KubeRay operator out of cluster with its CRDs installed.  Every process writes
its log under ``workdir/logs`` (a failing start prints the tail).  ``stop()`` ends them in reverse order.

Not real here: container runtimes (kwok fakes pod status) and cluster DNS (a Ray head cannot be reached).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# kwok node label/annotation that marks the nodes kwok manages
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
# an image the fake kubelet (kwok) reports as failing to pull (stage image-pull-error.yaml below)
BAD_IMAGE = "registry.invalid/fp8rl/no-such-image:0"

# Our own kwok Stage: a pod of BAD_IMAGE is left Pending with ErrImagePull, as a kubelet reports it.
# Weight 1 beats the fast stages' (unset) weight, so pod-ready never runs such a pod.
IMAGE_PULL_ERROR_STAGE = f"""\
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: fp8rl-image-pull-error
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: 'DoesNotExist'
    - key: '.status.phase'
      operator: 'In'
      values: ['Pending']
    - key: '.spec.containers.[0].image'
      operator: 'In'
      values: ['{BAD_IMAGE}']
  weight: 1
  delay:
    durationMilliseconds: 500
  next:
    statusTemplate: |
      {{{{ $now := Now }}}}
      conditions:
      - lastTransitionTime: {{{{ $now | Quote }}}}
        status: "True"
        type: PodScheduled
      - lastTransitionTime: {{{{ $now | Quote }}}}
        status: "False"
        type: Ready
        reason: ContainersNotReady
      containerStatuses:
      {{{{ range .spec.containers }}}}
      - image: {{{{ .image | Quote }}}}
        name: {{{{ .name | Quote }}}}
        ready: false
        restartCount: 0
        started: false
        state:
          waiting:
            reason: ErrImagePull
            message: 'failed to pull and unpack image "{{{{ .image }}}}": failed to resolve reference: no such host'
      {{{{ end }}}}
      phase: Pending
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------------------- certificates


def _write_pki(d: Path, extra_ips: tuple[str, ...] = ()) -> None:
    """A CA, the apiserver's serving certificate (127.0.0.1, localhost, the kubernetes Service IP and
    ``extra_ips``), an admin client certificate (group system:masters) and the service-account signing key."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def key() -> rsa.RSAPrivateKey:
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)

    def save(name: str, k: rsa.RSAPrivateKey, cert: x509.Certificate | None = None) -> None:
        (d / f"{name}.key").write_bytes(
            k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )
        if cert is not None:
            (d / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def name(cn: str, org: str | None = None) -> x509.Name:
        attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
        if org:
            attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
        return x509.Name(attrs)

    def builder(subject: x509.Name, issuer: x509.Name, public: Any) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
        )

    ca_key = key()
    ca_name = name("fp8rl-test-ca")
    ca = (
        builder(ca_name, ca_name, ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )  # digital signature, cert sign, CRL sign
        .sign(ca_key, hashes.SHA256())
    )
    save("ca", ca_key, ca)
    serving_key = key()
    sans = [x509.DNSName("localhost"), x509.DNSName("kubernetes.default.svc")]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ("127.0.0.1", "10.0.0.1", *extra_ips)]
    serving = (
        builder(name("kube-apiserver"), ca_name, serving_key.public_key())
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    save("apiserver", serving_key, serving)
    admin_key = key()
    admin = (
        builder(name("fp8rl-test-admin", "system:masters"), ca_name, admin_key.public_key())
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    save("admin", admin_key, admin)
    sa_key = key()
    save("sa", sa_key)
    (d / "sa.pub").write_bytes(
        sa_key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )


def _kubeconfig(server: str, pki: Path) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "test", "cluster": {"server": server, "certificate-authority": str(pki / "ca.crt")}}],
        "users": [
            {
                "name": "admin",
                "user": {"client-certificate": str(pki / "admin.crt"), "client-key": str(pki / "admin.key")},
            }
        ],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "admin", "namespace": "default"}}],
        "current-context": "test",
    }


# -------------------------------------------------------------------------------------------- processes


# -------------------------------------------------------------------------------------------- processes
# (shared with real_node.RealNode)


def spawn_logged(procs: list[tuple[str, subprocess.Popen[bytes]]], log: Path, name: str, argv: Any,
                 env: dict[str, str] | None = None) -> None:  # fmt: skip
    """Start ``argv`` in a session of its own, stdout and stderr to ``log``; appended to ``procs``."""
    proc = subprocess.Popen(
        [str(a) for a in argv], stdout=log.open("wb"), stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
        start_new_session=True,
    )  # fmt: skip
    procs.append((name, proc))


def wait_until(procs: list[tuple[str, subprocess.Popen[bytes]]], tail: Any, what: str, ready: Any, timeout_s: float,
               name: str, error: type[Exception]) -> None:  # fmt: skip
    """Poll ``ready()`` until truthy; ``error`` (with the log's tail) if a process of ``procs`` exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for n, p in procs:
            if p.poll() is not None:
                raise error(f"{n} exited ({p.returncode}) while waiting for {what}:\n{tail(n)}")
        with contextlib.suppress(Exception):
            if ready():
                return
        time.sleep(0.25)
    raise error(f"{what} not ready after {timeout_s:.0f}s:\n{tail(name)}")


@dataclass
class ControlPlane:
    """The control plane's processes; ``start()`` returns when the API server, the controllers, a kwok GPU node
    and the KubeRay operator are up."""

    tools: Path
    workdir: Path
    procs: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)
    server: str = ""
    # set for a cluster with a real node (real_node.RealNode): the API server listens on this address too, so
    # pods reach it through the ``kubernetes`` Service, and it reaches the kubelet with the admin certificate
    node_ip: str | None = None
    # kwok's nodes and pods: without a real node, every pod is kwok's; with one, only the GPU nodes (tainted
    # nvidia.com/gpu, which the ExtendedResourceToleration admission plugin lets GPU pods tolerate)
    kwok: bool = True

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig.yaml"

    @property
    def pki(self) -> Path:
        return self.workdir / "pki"

    def log(self, name: str) -> Path:
        return self.workdir / "logs" / f"{name}.log"

    def _spawn(self, name: str, *argv: str | Path, env: dict[str, str] | None = None) -> None:
        spawn_logged(self.procs, self.log(name), name, argv, env)

    def _wait(self, what: str, ready: Any, timeout_s: float, name: str) -> None:
        wait_until(self.procs, self.tail, what, ready, timeout_s, name, RuntimeError)

    def tail(self, name: str, lines: int = 40) -> str:
        path = self.log(name)
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"

    def _ssl(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        ctx.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        return ctx

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(self.server + path, context=self._ssl(), timeout=5) as r:
            return bytes(r.read())

    def start(self) -> ControlPlane:
        t0 = time.monotonic()
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        self.pki.mkdir(exist_ok=True)
        _write_pki(self.pki, (self.node_ip,) if self.node_ip else ())
        kube, pki = self.tools / "bin" / "kube", self.pki
        etcd_port, api_port = free_port(), free_port()
        self.server = f"https://127.0.0.1:{api_port}"
        self.kubeconfig.write_text(yaml.safe_dump(_kubeconfig(self.server, pki)))

        self._spawn("etcd", kube, "etcd", "-data-dir", self.workdir / "etcd", "-client-port", etcd_port,
                    "-peer-port", free_port())  # fmt: skip
        self._wait("etcd", lambda: "ready on" in self.log("etcd").read_text(), 60, "etcd")
        if self.node_ip:
            serving = ["--bind-address=0.0.0.0", f"--advertise-address={self.node_ip}",
                       f"--kubelet-client-certificate={pki / 'admin.crt'}",
                       f"--kubelet-client-key={pki / 'admin.key'}", "--kubelet-preferred-address-types=InternalIP",
                       "--enable-admission-plugins=ExtendedResourceToleration"]  # fmt: skip
        else:
            serving = ["--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", "--endpoint-reconciler-type=none"]
        self._spawn(
            "kube-apiserver", kube, "kube-apiserver",
            f"--etcd-servers=http://127.0.0.1:{etcd_port}", *serving, f"--secure-port={api_port}",
            f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}", "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.pub'}", f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-cluster-ip-range=10.0.0.0/24",
            f"--cert-dir={self.workdir / 'apiserver-certs'}",
        )  # fmt: skip
        self._wait("kube-apiserver", lambda: self.get("/readyz") == b"ok", 120, "kube-apiserver")
        common = [f"--kubeconfig={self.kubeconfig}", "--leader-elect=false", "--secure-port=0"]
        self._spawn(
            "kube-controller-manager", kube, "kube-controller-manager", *common,
            f"--service-account-private-key-file={pki / 'sa.key'}", f"--root-ca-file={pki / 'ca.crt'}",
            "--use-service-account-credentials=true", f"--cluster-signing-cert-file={pki / 'ca.crt'}",
            f"--cluster-signing-key-file={pki / 'ca.key'}", "--service-cluster-ip-range=10.0.0.0/24",
        )  # fmt: skip
        self._spawn("kube-scheduler", kube, "kube-scheduler", *common)
        if self.kwok:
            stages = self.workdir / "stages.yaml"
            docs = [p.read_text() for p in sorted((self.tools / "control-plane" / "stages").glob("*.yaml"))]
            stages.write_text("\n---\n".join([*docs, IMAGE_PULL_ERROR_STAGE]))
            self._spawn(
                "kwok", self.tools / "bin" / "kwok", f"--kubeconfig={self.kubeconfig}", f"--config={stages}",
                "--manage-all-nodes=false", f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
                "--node-ip=127.0.0.1", "--cidr=10.245.0.0/16",  # not the real node's pod subnet (10.244.0.0/24)
            )  # fmt: skip
        self._install_crds()
        # Out of cluster, the operator reaches a Ray head's dashboard through the API server's service proxy.
        proxy = ["--use-kubernetes-proxy"] if self.node_ip else []
        self._spawn(
            "ray-operator", self.tools / "bin" / "ray-operator", f"--metrics-addr=127.0.0.1:{free_port()}",
            f"--health-probe-bind-address=127.0.0.1:{free_port()}", "--enable-leader-election=false", *proxy,
            env={"KUBECONFIG": str(self.kubeconfig)},
        )  # fmt: skip
        # the default namespace's service account exists once the controller-manager runs
        self._wait("service accounts", lambda: bool(self.get("/api/v1/namespaces/default/serviceaccounts/default")),
                   60, "kube-controller-manager")  # fmt: skip
        self.started_s = time.monotonic() - t0
        return self

    def _install_crds(self) -> None:
        from kubernetes import client, config

        api = client.ApiextensionsV1Api(config.new_client_from_config(str(self.kubeconfig)))
        names = []
        for path in sorted((self.tools / "control-plane" / "crds").glob("*.yaml")):
            crd = yaml.safe_load(path.read_text())
            api.create_custom_resource_definition(crd)
            names.append(crd["metadata"]["name"])

        def established() -> bool:
            for n in names:
                conds = api.read_custom_resource_definition(n).status.conditions or []
                if not any(c.type == "Established" and c.status == "True" for c in conds):
                    return False
            return True

        self._wait("KubeRay CRDs", established, 60, "kube-apiserver")

    def stop(self) -> None:
        for _name, proc in reversed(self.procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for _name, proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()


def gpu_node(name: str, gpus: int = 8, cpu: str = "64", memory: str = "512Gi", taint: bool = False) -> dict[str, Any]:
    """A kwok node with ``gpus`` ``nvidia.com/gpu`` and the labels the GPU operator sets; ``taint``: tainted
    ``nvidia.com/gpu:NoSchedule`` (as managed GPU pools are), so beside a real node only GPU pods land on it."""
    capacity = {"cpu": cpu, "memory": memory, "pods": "110", "nvidia.com/gpu": str(gpus)}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name,
                "type": "kwok",
                "nvidia.com/gpu.product": "NVIDIA-H200",
                "nvidia.com/gpu.present": "true",
            },
        },
        "spec": {"taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]} if taint else {},
        "status": {"capacity": capacity, "allocatable": capacity},
    }


def versions(tools: Path) -> dict[str, str]:
    return dict(json.loads((tools / "control-plane" / "VERSIONS.json").read_text()))
