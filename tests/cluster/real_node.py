"""A real node for the local cluster: containerd + runc + the CNI bridge, a kubelet, kube-proxy and CoreDNS.

Pods scheduled to it really run (the images of ``make images``, imported into containerd: no registry), reach
each other and Services by name (CoreDNS on the node's address, kube-proxy's iptables rules), and the API
server through the ``kubernetes`` Service.  The Kubernetes binaries are the multi-call ``kube`` of
``scripts/k8s_control_plane.sh`` (kubelet, kube-proxy and CoreDNS built from the same Go modules as the control
plane); containerd, runc and the CNI plugins are Debian's (``make node-deps``).

Needs root (a kubelet manages cgroups, mounts and network namespaces).  Runs on cgroup v1 or v2; on v1 the
kubelet is told not to refuse it (``failCgroupV1: false``), as Kubernetes 1.34 still allows.  CoreDNS listens on
port 53 of the node's address, so one real node runs per machine.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from control_plane import spawn_logged, wait_until

# a tiny model's CPU run on Ray on this node: 2 trainer workers and 1 rollout worker, a few short steps (the RL
# step's run config of the real-node tests and of scripts/kfp_backend/e2e.py)
CPU_RAY_RUN_CONFIG: dict[str, Any] = {
    "device": "cpu",
    "eval_every": 2,
    "eval_examples": 8,
    "eval_samples": 1,
    "grpo": {"prompts_per_step": 4, "group_size": 4},
    "optim": {"micro_batch_size": 8},
    "ray": {"trainer_workers": 2, "rollout_workers": 1, "layout": "split", "object_store_mb": 128},
}

NODE_NAME = "fp8rl-node"
NODE_LABEL = "fp8rl.dev/node"  # "real" on this node (kwok's GPU nodes say nothing)
POD_SUBNET = "10.244.0.0/24"
CLUSTER_DOMAIN = "cluster.local"
PAUSE_IMAGE = "localhost/fp8rl/pause:1"
CNI_DIRS = (Path("/usr/lib/cni"), Path("/opt/cni/bin"))
IMAGE_LABEL = "fp8rl.dev/source-id"  # on an imported image: the local image ID it came from (skip re-imports)
_REF_NAME = "org.opencontainers.image.ref.name"

# The pause process of every pod sandbox: waits for a signal, reaps its children.
PAUSE_C = r"""
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
static void stop(int sig) { (void)sig; _exit(0); }
static void reap(int sig) { (void)sig; while (waitpid(-1, 0, WNOHANG) > 0) {} }
int main(void) {
    signal(SIGINT, stop); signal(SIGTERM, stop); signal(SIGCHLD, reap);
    for (;;) pause();
}
"""


class NodeError(RuntimeError):
    """The real node cannot start here; the message names what is missing."""


def host_ip() -> str:
    """This machine's address on its default route (what pods use to reach the API server and DNS)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the route's source address
        return str(s.getsockname()[0])


def missing_dependencies() -> list[str]:
    """What the real node needs from the host and does not find (empty when it can start)."""
    missing = [f"{b} (Debian package {p})" for b, p in (("containerd", "containerd"), ("runc", "runc"),
               ("iptables", "iptables"), ("gcc", "gcc"), ("skopeo", "skopeo")) if shutil.which(b) is None]  # fmt: skip
    if not any((d / "bridge").is_file() for d in CNI_DIRS):
        missing.append("CNI plugins (Debian package containernetworking-plugins)")
    if os.geteuid() != 0:
        missing.append("root (a kubelet manages cgroups, mounts and network namespaces)")
    return missing


def cni_dir() -> Path:
    return next(d for d in CNI_DIRS if (d / "bridge").is_file())


# ------------------------------------------------------------------------------------------- pause image


def _tar_bytes(files: dict[str, tuple[bytes, int]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, (data, mode) in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def pause_image_archive(workdir: Path) -> Path:
    """An OCI image archive of ``PAUSE_IMAGE``: one layer holding a static ``/pause`` built here with gcc."""
    src, binary = workdir / "pause.c", workdir / "pause"
    src.write_text(PAUSE_C)
    subprocess.run(["gcc", "-static", "-Os", "-s", "-o", str(binary), str(src)], check=True, capture_output=True)
    layer = _tar_bytes({"pause": (binary.read_bytes(), 0o755)})
    layer_gz = gzip.compress(layer, mtime=0)
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Entrypoint": ["/pause"], "User": "65535:65535"},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()]},
    }).encode()  # fmt: skip
    blobs = {}

    def blob(data: bytes, media_type: str) -> dict[str, Any]:
        digest = hashlib.sha256(data).hexdigest()
        blobs[f"blobs/sha256/{digest}"] = (data, 0o644)
        return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)}

    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": blob(config, "application/vnd.oci.image.config.v1+json"),
        "layers": [blob(layer_gz, "application/vnd.oci.image.layer.v1.tar+gzip")],
    }).encode()  # fmt: skip
    desc = blob(manifest, "application/vnd.oci.image.manifest.v1+json")
    desc["annotations"] = {"io.containerd.image.name": PAUSE_IMAGE, "org.opencontainers.image.ref.name": "1"}
    index = json.dumps({"schemaVersion": 2, "manifests": [desc]}).encode()
    archive = workdir / "pause.tar"
    archive.write_bytes(_tar_bytes({"oci-layout": (b'{"imageLayoutVersion":"1.0.0"}', 0o644),
                                    "index.json": (index, 0o644), **blobs}))  # fmt: skip
    return archive


# ------------------------------------------------------------------------------------------ config files


def cri_ready(socket_path: Path) -> bool:
    """Whether containerd's CRI service answers ``RuntimeService/Version`` (an empty request: the message's one
    field left unset; the reply is not decoded); raises while it is not initialized."""
    import grpc  # ray[default]'s

    with grpc.insecure_channel(f"unix://{socket_path}") as channel:
        channel.unary_unary("/runtime.v1.RuntimeService/Version")(b"", timeout=5)
    return True


def containerd_config(root: Path, state: Path, socket_path: Path, cni_conf: Path) -> str:
    return f"""version = 2
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]
[grpc]
  address = "{socket_path}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # no CAP_SYS_RESOURCE in a sandboxed machine: never ask for an OOM score below containerd's own
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{state}/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_dir()}"
    conf_dir = "{cni_conf}"
"""


def cni_conflist(ipam_dir: Path) -> dict[str, Any]:
    return {
        "cniVersion": "1.0.0",
        "name": "fp8rl",
        "plugins": [
            {
                "type": "bridge", "bridge": "fp8rl0", "isGateway": True, "ipMasq": True, "hairpinMode": True,
                "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_SUBNET}]],
                         "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(ipam_dir)},
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }  # fmt: skip


def kubelet_config(ca: Path, runtime_socket: Path, node_ip: str, port: int, healthz: int, logs: Path) -> dict[str, Any]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": node_ip,
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz,
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                           "x509": {"clientCAFile": str(ca)}},
        "authorization": {"mode": "AlwaysAllow"},
        "containerRuntimeEndpoint": f"unix://{runtime_socket}",
        "cgroupDriver": "cgroupfs",
        "cgroupsPerQOS": False,  # no QoS cgroup tree: fewer host cgroup controllers needed (limits still apply)
        "enforceNodeAllocatable": [],
        "failCgroupV1": False,
        "failSwapOn": False,
        "clusterDNS": [node_ip],
        "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": "/etc/resolv.conf",
        "podLogsDir": str(logs),
        "hairpinMode": "hairpin-veth",
        "serializeImagePulls": False,
        # a shared development disk: never evict for disk, never garbage-collect the imported images
        "evictionHard": {"memory.available": "200Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                         "nodefs.inodesFree": "1%"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "protectKernelDefaults": False,
        "makeIPTablesUtilChains": False,
        "shutdownGracePeriod": "0s",
        "registerNode": True,
        "nodeStatusReportFrequency": "10s",
    }  # fmt: skip


def corefile(kubeconfig: Path, health: int, ready: int) -> str:
    return f""".:53 {{
    errors
    health 127.0.0.1:{health}
    ready 127.0.0.1:{ready}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig} test
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    cache 5
    forward . /etc/resolv.conf
}}
"""


# ------------------------------------------------------------------------------------------------ node


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class OciLayout:
    """An OCI image layout of the images imported into the node, kept in its store so that an import sends only
    what containerd lacks.

    ``skopeo copy`` from podman's store writes the layers uncompressed (their digests are then the config's
    diff_ids, containerd's snapshot chain) and skips a blob the layout already has; ``write_archive`` streams
    ``ctr images import`` the manifest, the config and the layers whose snapshots are missing (containerd's unpack
    skips a layer whose snapshot exists without reading its blob).  A layer once unpacked is emptied here
    (``empty_layers``: a sparse file of its size, listed in ``emptied.txt``), so the layout holds no second copy of
    the image; skopeo still sees it and skips it.  If containerd's store lost a layer the layout emptied, the import
    starts the layout again."""

    LAYER_TYPES = ("application/vnd.oci.image.layer.v1.tar", "application/vnd.docker.image.rootfs.diff.tar")

    def __init__(self, root: Path) -> None:
        self.root = root

    def _blob(self, digest: str) -> Path:
        algorithm, hexdigest = digest.split(":", 1)
        return self.root / "blobs" / algorithm / hexdigest

    def _json(self, digest: str) -> Any:
        return json.loads(self._blob(digest).read_bytes())

    @property
    def _emptied_list(self) -> Path:
        return self.root / "emptied.txt"

    def emptied(self) -> set[str]:
        path = self._emptied_list
        return set(path.read_text().split()) if path.is_file() else set()

    def clear(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def copy_from_podman(self, ref: str, name: str) -> dict[str, Any]:
        """``ref`` from podman's store into the layout as ``name``; its manifest."""
        self.root.mkdir(parents=True, exist_ok=True)
        subprocess.run(["skopeo", "copy", "--quiet", "--dest-oci-accept-uncompressed-layers",
                        f"containers-storage:{ref}", f"oci:{self.root}:{name}"],
                       check=True, capture_output=True)  # fmt: skip
        index = json.loads((self.root / "index.json").read_text())
        (desc,) = [m for m in index["manifests"] if (m.get("annotations") or {}).get(_REF_NAME) == name]
        manifest: dict[str, Any] = self._json(desc["digest"])
        manifest["_digest"], manifest["_size"] = desc["digest"], desc["size"]
        for layer in manifest["layers"]:
            if layer["mediaType"] not in self.LAYER_TYPES:
                raise NodeError(f"{name}: layer {layer['digest']} is {layer['mediaType']}, not an uncompressed tar")
        self._collect(index)
        return manifest

    def _collect(self, index: dict[str, Any]) -> None:
        """Drop the index's unnamed entries (skopeo keeps an image a copy untagged) and delete the blobs no named
        image refers to (an earlier build's layers, manifests and configs)."""
        index["manifests"] = [m for m in index["manifests"] if (m.get("annotations") or {}).get(_REF_NAME)]
        tmp = self.root / "index.json.tmp"
        tmp.write_text(json.dumps(index))
        tmp.replace(self.root / "index.json")
        keep = set()
        for desc in index["manifests"]:
            manifest = self._json(desc["digest"])
            keep |= {desc["digest"], manifest["config"]["digest"], *(layer["digest"] for layer in manifest["layers"])}
        for path in (self.root / "blobs").glob("*/*"):
            if f"{path.parent.name}:{path.name}" not in keep:
                path.unlink()
        if self._emptied_list.is_file():
            self._emptied_list.write_text("".join(f"{d}\n" for d in sorted(self.emptied() & keep)))

    def layers_to_send(self, manifest: dict[str, Any], unpacked: set[str]) -> list[str]:
        """The layers whose snapshot (their chain ID) is not among ``unpacked``."""
        diff_ids = self._json(manifest["config"]["digest"])["rootfs"]["diff_ids"]
        layers = [layer["digest"] for layer in manifest["layers"]]
        if layers != diff_ids:
            raise NodeError(f"layers {layers} are not the config's diff_ids {diff_ids}: not uncompressed")
        needed, chain = [], ""
        for diff_id in diff_ids:
            chain = diff_id if not chain else "sha256:" + hashlib.sha256(f"{chain} {diff_id}".encode()).hexdigest()
            if chain not in unpacked:
                needed.append(diff_id)
        return needed

    def write_archive(self, manifest: dict[str, Any], name: str, layers: list[str], out: Any) -> int:
        """An OCI archive of the image named ``name`` with only ``layers`` of its layers, to ``out``; the layers'
        bytes."""
        desc = {"mediaType": manifest.get("mediaType", "application/vnd.oci.image.manifest.v1+json"),
                "digest": manifest["_digest"], "size": manifest["_size"],
                "annotations": {"io.containerd.image.name": name, _REF_NAME: name}}  # fmt: skip
        index = json.dumps({"schemaVersion": 2, "manifests": [desc]}).encode()
        with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for arcname, data in (("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'), ("index.json", index)):
                info = tarfile.TarInfo(arcname)
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
            for digest in (manifest["_digest"], manifest["config"]["digest"], *layers):
                tar.add(self._blob(digest), arcname=f"blobs/{digest.replace(':', '/')}")
        return sum(self._blob(d).stat().st_size for d in layers)

    def empty_layers(self, manifest: dict[str, Any]) -> None:
        """Once containerd holds ``manifest``'s layers unpacked: each layer blob becomes a sparse file of its size."""
        done = self.emptied()
        for layer in manifest["layers"]:
            if layer["digest"] not in done:
                path = self._blob(layer["digest"])
                os.truncate(path, 0)
                os.truncate(path, layer["size"])
                done.add(layer["digest"])
        self._emptied_list.write_text("".join(f"{d}\n" for d in sorted(done)))


@dataclass
class RealNode:
    """containerd, CoreDNS, kubelet and kube-proxy for one control plane (``start()``/``stop()``).

    ``store`` keeps containerd's content and snapshots between runs (imported images stay imported)."""

    kube: Path  # the multi-call binary
    kubeconfig: Path
    ca: Path
    workdir: Path
    store: Path
    procs: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)
    node_ip: str = ""

    @property
    def socket(self) -> Path:
        return self.workdir / "containerd.sock"

    def log(self, name: str) -> Path:
        return self.workdir / "logs" / f"{name}.log"

    def tail(self, name: str, lines: int = 40) -> str:
        path = self.log(name)
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"

    def _spawn(self, name: str, *argv: str | Path) -> None:
        spawn_logged(self.procs, self.log(name), name, argv)

    def _wait(self, what: str, ready: Any, timeout_s: float, name: str) -> None:
        wait_until(self.procs, self.tail, what, ready, timeout_s, name, NodeError)

    def ctr(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(["ctr", "--address", str(self.socket), "--namespace", "k8s.io", *args],
                              capture_output=True, check=True, **kw)  # fmt: skip

    def start(self) -> RealNode:
        missing = missing_dependencies()
        if missing:
            raise NodeError("the real node needs: " + "; ".join(missing))
        self.node_ip = self.node_ip or host_ip()
        for d in ("logs", "cni", "cni-ipam", "kubelet", "pod-logs", "state"):
            (self.workdir / d).mkdir(parents=True, exist_ok=True)
        self.store.mkdir(parents=True, exist_ok=True)
        conf = self.workdir / "containerd.toml"
        conf.write_text(containerd_config(self.store, self.workdir / "state", self.socket, self.workdir / "cni"))
        (self.workdir / "cni" / "10-fp8rl.conflist").write_text(json.dumps(cni_conflist(self.workdir / "cni-ipam")))
        self._spawn("containerd", "containerd", "--config", conf)
        self._wait("containerd", lambda: self.socket.exists() and self.ctr("version").returncode == 0, 60, "containerd")
        # containerd serves before its CRI service has recovered the store's state (seconds when the store holds
        # many earlier pods), and a kubelet started then exits: "server is not initialized yet"
        self._wait("containerd's CRI service", lambda: cri_ready(self.socket), 120, "containerd")
        if not self.has_image(PAUSE_IMAGE):
            self.ctr("images", "import", "--no-unpack", str(pause_image_archive(self.workdir)))

        health, ready = free_port(), free_port()
        (self.workdir / "Corefile").write_text(corefile(self.kubeconfig, health, ready))
        self._spawn("coredns", self.kube, "coredns", "-conf", self.workdir / "Corefile")
        self._wait("CoreDNS", lambda: _http_ok(f"http://127.0.0.1:{ready}/ready"), 60, "coredns")

        kubelet_port, kubelet_health = free_port(), free_port()
        (self.workdir / "kubelet.yaml").write_text(yaml.safe_dump(kubelet_config(
            self.ca, self.socket, self.node_ip, kubelet_port, kubelet_health, self.workdir / "pod-logs")))  # fmt: skip
        self._spawn(
            "kubelet", self.kube, "kubelet", f"--config={self.workdir / 'kubelet.yaml'}",
            f"--kubeconfig={self.kubeconfig}", f"--root-dir={self.workdir / 'kubelet'}",
            f"--hostname-override={NODE_NAME}", f"--node-ip={self.node_ip}",
            f"--node-labels={NODE_LABEL}=real", "--v=1",
        )  # fmt: skip
        self._spawn(
            "kube-proxy", self.kube, "kube-proxy", f"--kubeconfig={self.kubeconfig}",
            f"--hostname-override={NODE_NAME}", "--proxy-mode=iptables", f"--cluster-cidr={POD_SUBNET}",
            "--conntrack-max-per-core=0", "--conntrack-tcp-timeout-established=0s",
            "--conntrack-tcp-timeout-close-wait=0s",
            f"--metrics-bind-address=127.0.0.1:{free_port()}", f"--healthz-bind-address=127.0.0.1:{free_port()}",
        )  # fmt: skip
        self._wait("kubelet", lambda: _http_ok(f"http://127.0.0.1:{kubelet_health}/healthz"), 120, "kubelet")
        return self

    def has_image(self, ref: str) -> bool:
        return ref in self.ctr("images", "list", "--quiet").stdout.decode().split()

    def import_local_image(self, ref: str, name: str | None = None) -> str:
        """Import ``ref`` from podman's store (``make images``) as ``name`` (default ``ref``); skipped when the same
        image is imported already.  Only the layers containerd does not hold unpacked are sent (``OciLayout``): after
        a change of the project, the component image's few new layers instead of its 6 GB.  Returns how it went."""
        name = name or ref
        image_id = subprocess.run(["podman", "image", "inspect", "--format", "{{.Id}}", ref],
                                  capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        listed = self.ctr("images", "list", f"name=={name}").stdout.decode()
        if image_id and f"{IMAGE_LABEL}={image_id}" in listed:
            self.discard_layer_blobs(name)  # a store from before the blobs were discarded
            return f"{name}: already imported ({image_id[:12]})"
        t0 = time.monotonic()
        layout = OciLayout(self.store / "fp8rl-oci-layout")
        manifest = layout.copy_from_podman(ref, name)
        unpacked = {line.split()[0] for line in self.ctr("snapshots", "list").stdout.decode().splitlines()[1:]}
        needed = layout.layers_to_send(manifest, unpacked)
        if set(needed) & layout.emptied():  # the store lost layers the layout gave up: start it again
            layout.clear()
            manifest = layout.copy_from_podman(ref, name)
        with tempfile.TemporaryFile() as output:
            reader = subprocess.Popen(["ctr", "--address", str(self.socket), "--namespace", "k8s.io", "images",
                                       "import", "--all-platforms", "-"], stdin=subprocess.PIPE, stdout=output,
                                      stderr=subprocess.STDOUT)  # fmt: skip
            assert reader.stdin is not None
            with reader.stdin:
                sent = layout.write_archive(manifest, name, needed, reader.stdin)
            if reader.wait() != 0:
                output.seek(0)
                raise NodeError(f"ctr images import of {name} failed: {output.read().decode()[-2000:]}")
        self.ctr("images", "label", name, f"{IMAGE_LABEL}={image_id}")
        freed = self.discard_layer_blobs(name)
        layout.empty_layers(manifest)
        return (f"{name}: imported from podman in {time.monotonic() - t0:.0f} s ({len(needed)} of "
                f"{len(manifest['layers'])} layers sent, {sent / 2**30:.2f} GiB; {freed / 2**30:.1f} GiB of blobs freed)")  # fmt: skip

    def discard_layer_blobs(self, name: str) -> int:
        """Delete the layer blobs of ``name``, an unpacked image, from containerd's content store: what the CRI's
        ``discard_unpacked_layers`` does after a pull. Containers run from the unpacked snapshots, so the image keeps
        working, and the disk holds its layers once instead of twice (6 GB for the component image). Returns the
        bytes freed."""
        (row,) = self.ctr("images", "list", f"name=={name}").stdout.decode().splitlines()[1:]
        manifests = [json.loads(self.ctr("content", "get", row.split()[2]).stdout)]
        for entry in manifests[0].get("manifests", []):  # an index: each platform's manifest
            manifests.append(json.loads(self.ctr("content", "get", entry["digest"]).stdout))
        have = {line.split()[0] for line in self.ctr("content", "list", "--quiet").stdout.decode().splitlines()}
        layers = {layer["digest"]: layer["size"] for m in manifests for layer in m.get("layers", [])}
        gone = [digest for digest in layers if digest in have]
        if gone:
            self.ctr("content", "rm", *gone)
        return sum(layers[d] for d in gone)

    def stop(self) -> None:
        """Stop the node's processes, then every pod container they left (kubelet does not on exit)."""
        for _name, proc in reversed(self.procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 15)
        for _name, proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 9)
                proc.wait()
        self.procs.clear()
        self.clean_up(self.workdir)

    @staticmethod
    def clean_up(workdir: Path) -> None:
        """What a stopped node leaves: its containers (their shims outlive containerd), mounts and bridge."""
        _kill_leftover_shims(workdir)
        _unmount_under(workdir)
        subprocess.run(["ip", "link", "delete", "fp8rl0"], capture_output=True)


def _http_ok(url: str) -> bool:
    import urllib.request

    with urllib.request.urlopen(url, timeout=2) as r:
        return bool(r.status == 200)


def _kill_leftover_shims(workdir: Path) -> None:
    """containerd's shims (and the containers under them) outlive containerd: end this node's (their command line
    names its containerd socket), then its containers (runc's root is in its state dir)."""
    state = workdir / "state"
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            if cmd and cmd[0].endswith(b"containerd-shim-runc-v2") and str(workdir).encode() in b" ".join(cmd):
                os.kill(int(proc.name), 9)
    runc = ["runc", "--root", str(state / "runc")]
    listed = subprocess.run([*runc, "list", "--quiet"], capture_output=True, text=True)
    for container in listed.stdout.split():
        subprocess.run([*runc, "delete", "--force", container], capture_output=True)


def _unmount_under(root: Path) -> None:
    """Unmount what the kubelet and containerd mounted below ``root`` (deepest first)."""
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    for target in sorted((m for m in mounts if m.startswith(str(root) + "/")), key=len, reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True)
