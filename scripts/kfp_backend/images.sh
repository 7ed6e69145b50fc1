#!/usr/bin/env bash
# Builds the images of the KFP backend's parts that run in pods, from the static binaries that build.sh put in the
# tools cache, on the local Ubuntu base (images/local-base.sh), with podman (daemon-free; no registry needed):
#   localhost/fp8rl-kfp-driver:2.17.0     KFP's v2 driver      (the API server's V2_DRIVER_IMAGE)
#   localhost/fp8rl-kfp-launcher:2.17.0   KFP's v2 launcher    (the API server's V2_LAUNCHER_IMAGE)
#   localhost/fp8rl-argoexec:v4.0.5       Argo's executor      (the workflow-controller's --executor-image)
# An image whose binary has not changed since it was built (label fp8rl.binary-sha256) is kept. The real node
# imports them from podman's store into containerd like the component image (tests/cluster/real_node.py).
# Prints one "image: NAME ID" line per image on stdout.
#
# Usage: scripts/kfp_backend/images.sh [--force] [--dry-run]
# Env:   FP8RL_TOOLS_DIR (default ~/.cache/fp8rl/tools); BASE_IMAGE (default localhost/fp8rl-base/run:24.04);
#        CONTAINERS_CONF (default: images/sandbox-containers.conf, the locked-down VM's podman settings)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
KFP_VERSION=2.17.0
ARGO_VERSION=v4.0.5
TOOLS="${FP8RL_TOOLS_DIR:-$HOME/.cache/fp8rl/tools}/kfp-$KFP_VERSION"
BASE_IMAGE="${BASE_IMAGE:-localhost/fp8rl-base/run:24.04}"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$ROOT/images/sandbox-containers.conf}"

die() { printf 'images.sh: %s\n' "$*" >&2; exit 1; }

force=0 dry_run=0
for arg in "$@"; do
    case "$arg" in
        --force) force=1 ;;
        --dry-run) dry_run=1 ;;
        -h | --help) sed -n '2,13p' "$0"; exit 0 ;;
        *) die "unknown argument '$arg' (see --help)" ;;
    esac
done

command -v podman >/dev/null || die "'podman' not found (apt-get install podman buildah runc)"
[ -d "$TOOLS/bin" ] || die "no KFP build in '$TOOLS/bin': run scripts/kfp_backend/build.sh first (KFP_SRC=...)"
if ! podman image exists "$BASE_IMAGE"; then
    [ "$BASE_IMAGE" = localhost/fp8rl-base/run:24.04 ] || die "base image '$BASE_IMAGE' not in podman's store"
    [ "$dry_run" = 1 ] || "$ROOT/images/local-base.sh"
fi

# name binary tag user: argoexec runs as Argo's own images do (uid 8737), KFP's parts as KFP's (65532).
images=(
    "fp8rl-kfp-driver driver $KFP_VERSION 65532"
    "fp8rl-kfp-launcher launcher-v2 $KFP_VERSION 65532"
    "fp8rl-argoexec argoexec $ARGO_VERSION 8737"
)
context="$(mktemp -d "${TMPDIR:-/tmp}/fp8rl-kfp-images.XXXXXX")"
trap 'rm -rf "$context"' EXIT
for entry in "${images[@]}"; do
    read -r name binary tag user <<<"$entry"
    image="localhost/$name:$tag"
    [ -x "$TOOLS/bin/$binary" ] || die "'$TOOLS/bin/$binary' missing: rerun scripts/kfp_backend/build.sh"
    sha="$(sha256sum "$TOOLS/bin/$binary" | cut -d' ' -f1)"
    if [ "$force" = 0 ] && podman image exists "$image" &&
        [ "$(podman image inspect --format '{{index .Labels "fp8rl.binary-sha256"}}' "$image")" = "$sha" ]; then
        printf 'images.sh: %s is current (binary %s)\n' "$image" "${sha:0:12}" >&2
    else
        printf 'images.sh: building %s from %s\n' "$image" "$TOOLS/bin/$binary" >&2
        start=$SECONDS
        rm -f "$context"/*
        cp "$TOOLS/bin/$binary" "$context/$binary"
        cmd=(podman build --format docker -f "$ROOT/scripts/kfp_backend/Dockerfile.kfp"
            --build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg "BINARY=$binary" --build-arg "RUN_AS=$user"
            --label "fp8rl.binary-sha256=$sha" -t "$image" "$context")
        printf '+ %s\n' "${cmd[*]}" >&2
        if [ "$dry_run" = 0 ]; then
            "${cmd[@]}" >&2
            printf 'images.sh: built %s in %ss\n' "$image" "$((SECONDS - start))" >&2
        fi
    fi
    [ "$dry_run" = 1 ] || printf 'image: %s %s\n' "$image" "$(podman image inspect --format '{{.Id}}' "$image")"
done
