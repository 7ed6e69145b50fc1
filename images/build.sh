#!/usr/bin/env bash
# Builds and tags both images from the repository root:
#   [$REGISTRY/]fp8rl-runtime:$TAG     GPU runtime: Ray pods and GPU components (Dockerfile.runtime)
#   [$REGISTRY/]fp8rl-component:$TAG   light component image, also the MLflow server (Dockerfile.component)
# The version build args are read from pyproject.toml (gpu extra) and constraints.txt, so the
# images cannot drift from what CI tests. Prints one "image: NAME ID" line per image on stdout.
#
# Usage: images/build.sh [--push] [--save DIR] [--local-base] [--dry-run] [runtime] [component]   (default: both)
#   --save DIR     also write each image as an OCI archive DIR/fp8rl-<target>-<tag>.oci.tar (push it with
#                  `crane push`, `skopeo copy oci-archive:...` or `podman push`); podman only
#   --local-base   build on the local stand-ins of the public base images (images/local-base.sh makes them,
#                  from Ubuntu packages, when missing): for build hosts that reach no registry; podman only
# Env:   REGISTRY   registry prefix, e.g. registry.example.com/ml (default: none)
#        TAG        image tag (default: the project version in pyproject.toml = the chart's appVersion)
#        DOCKER     docker, podman or buildah (default: docker; podman with --save or --local-base)
#        PLATFORM   (default: linux/amd64); CUDA_ARCHS TransformerEngine kernels to build (default: "90;100");
#        MAX_JOBS   parallel compile jobs of that build (default: the Dockerfile's, 8)
#        TORCH_INDEX_URL, TORCH_VARIANT   the component image's torch (default: the PyTorch CPU index, "+cpu")
#        BASE_IMAGE, BUILD_BASE_IMAGE     override the Dockerfiles' base images
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

die() { printf 'build.sh: %s\n' "$*" >&2; exit 1; }

push=0 dry_run=0 local_base=0 save_dir="" targets=()
while [ $# -gt 0 ]; do
    case "$1" in
        --push) push=1 ;;
        --dry-run) dry_run=1 ;;
        --local-base) local_base=1 ;;
        --save)
            [ $# -ge 2 ] || die "--save needs a directory"
            save_dir="$2"
            shift
            ;;
        runtime | component) targets+=("$1") ;;
        -h | --help) sed -n '2,24p' "$0"; exit 0 ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
    shift
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

if [ "$local_base" = 1 ] || [ -n "$save_dir" ]; then
    DOCKER="${DOCKER:-podman}"
    case "$DOCKER" in podman | buildah) ;; *) die "--save and --local-base need podman or buildah, not '$DOCKER'" ;; esac
fi
DOCKER="${DOCKER:-docker}"
export DOCKER_BUILDKIT=1  # BuildKit reads images/Dockerfile.<target>.dockerignore (podman and buildah do too)
PLATFORM="${PLATFORM:-linux/amd64}"
prefix="${REGISTRY:+${REGISTRY%/}/}"
build_cmd=("$DOCKER" build)
# podman and buildah write OCI image configs by default, which drop the Dockerfiles' SHELL (pipefail).
[ "$DOCKER" = podman ] && build_cmd+=(--format docker)
[ "$DOCKER" = buildah ] && build_cmd=(buildah bud --layers --format docker)
if [ -n "$save_dir" ] && [ "$dry_run" = 0 ]; then
    mkdir -p "$save_dir" || die "cannot create --save directory '$save_dir'"
fi

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
        [ -z "${MAX_JOBS:-}" ] || args+=(--build-arg "MAX_JOBS=$MAX_JOBS")
        base="${BASE_IMAGE:-}" build_base="${BUILD_BASE_IMAGE:-}"
        if [ "$local_base" = 1 ]; then
            base="${base:-localhost/fp8rl-base/run:24.04}" build_base="${build_base:-localhost/fp8rl-base/build:24.04}"
        fi
        [ -z "$build_base" ] || args+=(--build-arg "BUILD_BASE_IMAGE=$build_base")
    else
        base="${BASE_IMAGE:-}"
        [ "$local_base" = 0 ] || base="${base:-localhost/fp8rl-base/python:3.12-noble}"
        [ -z "${TORCH_INDEX_URL+set}" ] || args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
        [ -z "${TORCH_VARIANT+set}" ] || args+=(--build-arg "TORCH_VARIANT=$TORCH_VARIANT")
    fi
    [ -z "$base" ] || args+=(--build-arg "BASE_IMAGE=$base")
    if [ "$local_base" = 1 ] && [ "$dry_run" = 0 ]; then
        images/local-base.sh
    fi
    printf 'build.sh: building %s\n' "$image" >&2
    start=$SECONDS
    run "${build_cmd[@]}" --platform "$PLATFORM" -f "images/Dockerfile.$target" "${args[@]}" -t "$image" .
    [ "$dry_run" = 1 ] || printf 'build.sh: built %s in %ss\n' "$image" "$((SECONDS - start))" >&2
    if [ "$DOCKER" != docker ]; then
        # podman and buildah cache the build stage as untagged intermediate images, which `podman image prune`
        # (what frees the disk that each rebuild's new venv layer takes) removes with the untagged old images:
        # a tag keeps that cache (the TransformerEngine build, the dependencies' install). All cached: seconds.
        run "${build_cmd[@]}" --platform "$PLATFORM" -f "images/Dockerfile.$target" "${args[@]}" --target build \
            -t "fp8rl-$target-build:$TAG" .
    fi
    if [ -n "$save_dir" ]; then
        archive="$save_dir/fp8rl-$target-$TAG.oci.tar"
        if [ "$DOCKER" = buildah ]; then
            run buildah push "$image" "oci-archive:$archive.tmp:$image"
        else
            run podman save --format oci-archive -o "$archive.tmp" "$image"
        fi
        run mv "$archive.tmp" "$archive"
    fi
    if [ "$push" = 1 ]; then
        if [ "$DOCKER" = docker ]; then
            run docker push "$image"
        else
            digest_file="$(mktemp)"
            run "$DOCKER" push --digestfile "$digest_file" "$image"
            [ "$dry_run" = 1 ] || printf 'pushed: %s@%s\n' "${image%:*}" "$(cat "$digest_file")"
            rm -f "$digest_file"
        fi
    fi
    if [ "$dry_run" = 0 ]; then
        printf 'image: %s %s\n' "$image" "$("$DOCKER" inspect --type image --format '{{.Id}}' "$image")"
    fi
done
