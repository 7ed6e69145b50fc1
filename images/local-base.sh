#!/usr/bin/env bash
# Makes local stand-ins for the Dockerfiles' public base images, from Ubuntu 24.04 packages, for a machine that
# reaches an Ubuntu package mirror but no container registry (CI, air-gapped build hosts). Needs root, mmdebstrap
# and podman. The images land in local container storage:
#   localhost/fp8rl-base/python:3.12-noble   for Dockerfile.component  (public default: python:3.12-slim-bookworm)
#   localhost/fp8rl-base/build:24.04         for Dockerfile.runtime's build stage (nvidia/cuda:*-cudnn-devel-ubuntu24.04)
#   localhost/fp8rl-base/run:24.04           for Dockerfile.runtime's final stage (nvidia/cuda:*-base-ubuntu24.04)
# The stand-ins have the release (Ubuntu 24.04, Python 3.12) and the tools the Dockerfiles use (python -m venv,
# useradd, apt-get, a C/C++ compiler in the build base) but no CUDA toolkit or driver hooks: enough to build the
# images and run them without a GPU, not to run them on one. images/build.sh --local-base uses them.
#
# Usage: images/local-base.sh [--force]     (an existing image is kept unless --force)
# Env:   UBUNTU_MIRROR (default http://archive.ubuntu.com/ubuntu)
set -euo pipefail

die() { printf 'local-base.sh: %s\n' "$*" >&2; exit 1; }

force=0
for arg in "$@"; do
    case "$arg" in
        --force) force=1 ;;
        -h | --help) sed -n '2,14p' "$0"; exit 0 ;;
        *) die "unknown argument '$arg' (see --help)" ;;
    esac
done

MIRROR="${UBUNTU_MIRROR:-http://archive.ubuntu.com/ubuntu}"
SUITE=noble
# The Ubuntu archive's signing keys, pinned by the SHA-256 of noble's ubuntu-keyring package (from its Packages
# index): the Release files mmdebstrap reads are verified against them.
KEYRING_DEB=pool/main/u/ubuntu-keyring/ubuntu-keyring_2023.11.28.1_all.deb
KEYRING_SHA256=36de43b15853ccae0028e9a767613770c704833f82586f28eb262f0311adb8a8
PREFIX=localhost/fp8rl-base

[ "$(id -u)" = 0 ] || die "needs root (mmdebstrap and rootful container storage)"
for tool in mmdebstrap podman dpkg-deb curl; do
    command -v "$tool" >/dev/null || die "'$tool' not found (apt-get install mmdebstrap podman buildah runc)"
done


work="$(mktemp -d)"
chmod 755 "$work"  # apt reads the keyring as its unprivileged _apt user
trap 'rm -rf "$work"' EXIT

curl -fsSL --retry 3 -o "$work/keyring.deb" "$MIRROR/$KEYRING_DEB" || die "cannot download $MIRROR/$KEYRING_DEB"
echo "$KEYRING_SHA256  $work/keyring.deb" | sha256sum --check --quiet - || die "$KEYRING_DEB: SHA-256 mismatch"
dpkg-deb -x "$work/keyring.deb" "$work/keyring"
KEYRING="$work/keyring/usr/share/keyrings/ubuntu-archive-keyring.gpg"
[ -s "$KEYRING" ] || die "$KEYRING_DEB holds no ubuntu-archive-keyring.gpg"

# image name, then the packages beyond minbase
make_base() {
    local image="$1"
    shift
    if podman image exists "$image" && [ "$force" = 0 ]; then
        printf 'local-base.sh: %s exists (--force rebuilds)\n' "$image" >&2
        return
    fi
    local packages
    packages="$(IFS=,; echo "$*")"
    printf 'local-base.sh: %s <- Ubuntu %s minbase + %s\n' "$image" "$SUITE" "$packages" >&2
    local start=$SECONDS
    mmdebstrap --quiet --variant=minbase --components=main,universe --keyring="$KEYRING" \
        --include="$packages" --aptopt='Acquire::Retries "3"' \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
        "$SUITE" "$work/rootfs.tar" \
        "deb $MIRROR $SUITE main universe" "deb $MIRROR $SUITE-updates main universe" \
        "deb $MIRROR $SUITE-security main universe"
    podman import --quiet --change 'ENV LANG=C.UTF-8' \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' --change 'CMD ["/bin/bash"]' \
        "$work/rootfs.tar" "$image" >/dev/null
    rm -f "$work/rootfs.tar"
    printf 'local-base.sh: %s built in %ss\n' "$image" "$((SECONDS - start))" >&2
}

# apt: Ubuntu's minbase leaves it out (priority important), the public images have it.
make_base "$PREFIX/python:3.12-noble" apt ca-certificates python3.12 python3.12-venv python-is-python3
make_base "$PREFIX/build:24.04" apt ca-certificates build-essential
make_base "$PREFIX/run:24.04" apt ca-certificates
