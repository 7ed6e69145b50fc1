#!/usr/bin/env bash
# Builds and tags both images from the repository root:
#   [$REGISTRY/]fp8rl-runtime:$TAG     GPU runtime: Ray pods and GPU components (Dockerfile.runtime)
#   [$REGISTRY/]fp8rl-component:$TAG   light component image, also the MLflow server (Dockerfile.component)
# The version build args are read from pyproject.toml (gpu extra) and constraints.txt, so the
# images cannot drift from what CI tests.
#
# Usage: images/build.sh [--push] [--dry-run] [runtime] [component]     (default: both)
# Env:   REGISTRY   registry prefix, e.g. registry.example.com/ml (default: none)
#        TAG        image tag (default: the project version in pyproject.toml = the chart's appVersion)
#        DOCKER     docker or podman (default: docker); PLATFORM (default: linux/amd64)
#        CUDA_ARCHS TransformerEngine kernels to build (default: "90;100", Hopper and Blackwell)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

die() { printf 'build.sh: %s\n' "$*" >&2; exit 1; }

push=0 dry_run=0 targets=()
for arg in "$@"; do
    case "$arg" in
        --push) push=1 ;;
        --dry-run) dry_run=1 ;;
        runtime | component) targets+=("$arg") ;;
        -h | --help) sed -n '2,14p' "$0"; exit 0 ;;
        *) die "unknown argument '$arg' (see --help)" ;;
    esac
done
[ ${#targets[@]} -gt 0 ] || targets=(runtime component)

# "name==version" pins: constraints.txt for the CPU side, the gpu extra of pyproject.toml for the rest.
constraint() { sed -n "s/^$1==\([^[:space:]]*\)\$/\1/p" constraints.txt; }
gpu_extra() { sed -n "s/.*\"$1==\([^\"]*\)\".*/\1/p" pyproject.toml | head -n1; }
project_version() { sed -n 's/^version = "\([^"]*\)"$/\1/p' pyproject.toml | head -n1; }

TAG="${TAG:-$(project_version)}"
TORCH_VERSION="$(constraint torch)"
RAY_VERSION="$(constraint ray)"
VLLM_VERSION="$(gpu_extra vllm)"
TRANSFORMER_ENGINE_VERSION="$(gpu_extra 'transformer-engine\[pytorch\]')"
for var in TAG TORCH_VERSION RAY_VERSION VLLM_VERSION TRANSFORMER_ENGINE_VERSION; do
    [ -n "${!var}" ] || die "could not read $var from pyproject.toml / constraints.txt"
done

DOCKER="${DOCKER:-docker}"
export DOCKER_BUILDKIT=1  # BuildKit reads images/Dockerfile.<target>.dockerignore
PLATFORM="${PLATFORM:-linux/amd64}"
prefix="${REGISTRY:+${REGISTRY%/}/}"

run() {
    printf '+ %s\n' "$*"
    [ "$dry_run" = 1 ] || "$@"
}

for target in "${targets[@]}"; do
    image="${prefix}fp8rl-${target}:${TAG}"
    args=(--build-arg "TORCH_VERSION=$TORCH_VERSION")
    if [ "$target" = runtime ]; then
        args+=(--build-arg "VLLM_VERSION=$VLLM_VERSION"
            --build-arg "TRANSFORMER_ENGINE_VERSION=$TRANSFORMER_ENGINE_VERSION"
            --build-arg "RAY_VERSION=$RAY_VERSION"
            --build-arg "CUDA_ARCHS=${CUDA_ARCHS:-90;100}")
    fi
    printf 'build.sh: building %s\n' "$image" >&2
    run "$DOCKER" build --platform "$PLATFORM" -f "images/Dockerfile.$target" "${args[@]}" -t "$image" .
    if [ "$push" = 1 ]; then
        run "$DOCKER" push "$image"
    fi
done
