#!/usr/bin/env bash
# Installs what `make images` needs to build and run the project's images without a Docker daemon: podman and
# buildah (rootful, runc), mmdebstrap (the local base images), umoci and skopeo (OCI archives). Debian/Ubuntu
# packages; needs root. Does nothing when they are all present.
set -euo pipefail
missing=()
for tool in podman buildah mmdebstrap runc umoci skopeo; do
    command -v "$tool" >/dev/null || missing+=("$tool")
done
[ ${#missing[@]} -gt 0 ] || exit 0
[ "$(id -u)" = 0 ] || { echo "container_tools.sh: missing ${missing[*]}; install them as root (apt-get install podman buildah mmdebstrap runc umoci skopeo)" >&2; exit 1; }
command -v apt-get >/dev/null || { echo "container_tools.sh: missing ${missing[*]} and no apt-get to install them" >&2; exit 1; }
echo "container_tools.sh: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends podman buildah mmdebstrap runc umoci skopeo \
    fuse-overlayfs uidmap ca-certificates curl >/dev/null
