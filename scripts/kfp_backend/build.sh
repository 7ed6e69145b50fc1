#!/usr/bin/env bash
# Builds the Kubeflow Pipelines backend of the release the SDK matches (kfp 2.17.0) into the tools
# cache, for the local cluster's KFP tier. Nothing is built inside this repository.
#
#   $TOOLS/kfp-2.17.0/bin/apiserver            KFP API server (backend/src/apiserver)
#   $TOOLS/kfp-2.17.0/bin/persistence_agent    persistence agent (backend/src/agent/persistence)
#   $TOOLS/kfp-2.17.0/bin/scheduledworkflow    ScheduledWorkflow controller: recurring runs (backend/src/crd/controller/scheduledworkflow)
#   $TOOLS/kfp-2.17.0/bin/driver               v2 driver, static (backend/src/v2/cmd/driver)
#   $TOOLS/kfp-2.17.0/bin/launcher-v2          v2 launcher, static (backend/src/v2/cmd/launcher-v2)
#   $TOOLS/kfp-2.17.0/bin/workflow-controller  Argo Workflows controller, the version the release's go.mod names
#   $TOOLS/kfp-2.17.0/bin/argoexec             Argo executor, static
#   $TOOLS/kfp-2.17.0/bin/weed                 SeaweedFS (its S3 gateway is KFP's object store), from the Go module proxy
#   $TOOLS/kfp-2.17.0/crds/                    Argo's CRDs (from the same Argo source) and KFP's ScheduledWorkflow CRD
#   $TOOLS/kfp-2.17.0/BUILD-INFO               what was built from what, and how long it took
#
# Inputs (the Go module proxy refuses github.com/kubeflow/pipelines, so KFP's source is given):
#   KFP_SRC=<dir>   a checkout or export of kubeflow/pipelines at tag 2.17.0 (its VERSION file is checked).
#                   Without it, the script clones that tag from KFP_GIT_URL where the network allows.
#   ARGO_SRC=<dir>  optional: argo-workflows at the version KFP's go.mod names. Without it, Argo is built
#                   from the Go module proxy (it serves github.com/argoproj/argo-workflows/v4 v4.0.5).
#   FP8RL_TOOLS_DIR (default ~/.cache/fp8rl/tools); FORCE=1 rebuilds what is built already.
#
# Not built here, and why (scripts/kfp_backend/README.md): the ML Metadata (MLMD) server that the
# 2.17.0 driver and launcher call is C++ built with Bazel (no Bazel toolchain or its downloads here);
# scripts/kfp_backend/mlmd_server.py serves the same gRPC service from the ml-metadata wheel of PyPI instead.
# The database is MariaDB from Debian (KFP 2.17.0 speaks mysql or pgx, not SQLite; its PostgreSQL path fails at
# start, README.md): nothing to build. The images of the parts that run in pods: images.sh.
#
# Builds run with `nice -n 19` and `go -p=1` (2 shared cores). Everything goes to a temporary directory
# first and is renamed into place only when every binary built: a failure leaves nothing half-built.
set -euo pipefail

KFP_VERSION=2.17.0                    # = the kfp SDK in pyproject/constraints (kfp 2.17.0)
ARGO_MODULE=github.com/argoproj/argo-workflows/v4
ARGO_VERSION=v4.0.5                   # what KFP 2.17.0's go.mod requires (checked below)
# SeaweedFS (the object store of KFP 2.17.0's manifests): the Go module proxy lists only this pseudo-version of
# github.com/seaweedfs/seaweedfs (weed 4.53). Its go.mod has a replace directive, so `go install` refuses it; the
# module's own directory is built as the main module instead.
SEAWEEDFS_MODULE=github.com/seaweedfs/seaweedfs
SEAWEEDFS_VERSION=v0.0.0-20261109003541-7506e5f91cd6
KFP_GIT_URL="${KFP_GIT_URL:-https://github.com/kubeflow/pipelines.git}"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TOOLS_DIR="${FP8RL_TOOLS_DIR:-$HOME/.cache/fp8rl/tools}"
DEST="$TOOLS_DIR/kfp-$KFP_VERSION"

say() { printf 'kfp-backend: %s\n' "$*" >&2; }
die() { say "ERROR: $*"; exit 2; }

command -v go >/dev/null || die "go is not on PATH (needed to build the KFP backend)"
command -v git >/dev/null || die "git is not on PATH"

if [ -f "$DEST/BUILD-INFO" ] && [ "${FORCE:-0}" != 1 ]; then
    say "KFP $KFP_VERSION backend already built in $DEST (FORCE=1 rebuilds)"
    exit 0
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/kfp-backend.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
STAGE="$WORK/kfp-$KFP_VERSION"
mkdir -p "$STAGE/bin" "$STAGE/crds"

# --- KFP source: given, or cloned -------------------------------------------------------------------
# shellcheck source=scripts/kfp_backend/kfp_src.sh
. "$ROOT/scripts/kfp_backend/kfp_src.sh"
kfp_source
[ "$(head -n1 "$KFP_SRC/go.mod" 2>/dev/null)" = "module github.com/kubeflow/pipelines" ] ||
    die "KFP_SRC=$KFP_SRC is not kubeflow/pipelines (its go.mod does not declare module github.com/kubeflow/pipelines)"
grep -q "^[[:space:]]*$ARGO_MODULE $ARGO_VERSION\$" "$KFP_SRC/go.mod" ||
    die "KFP_SRC's go.mod does not require $ARGO_MODULE $ARGO_VERSION (this script pins that pair)"

export GOFLAGS="-buildvcs=false -mod=readonly -p=1"
INFO="$WORK/BUILD-INFO"
{
    echo "kfp $KFP_VERSION from $src_from (commit $src_commit)"
    echo "$(go version)"
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), GOFLAGS=$GOFLAGS, nice -n 19"
} >"$INFO"

# build NAME DIR PACKAGE [go build args...]: one binary into the stage, timed, logged.
build() {
    local name="$1" dir="$2" pkg="$3"; shift 3
    local t0=$SECONDS log="$WORK/$name.log"
    say "building $name ($pkg)"
    if ! (cd "$dir" && nice -n 19 go build "$@" -o "$STAGE/bin/$name" "$pkg") >"$log" 2>&1; then
        tail -n 20 "$log" >&2
        die "go build of $name failed (above; full log $log is removed on exit, rerun to see it)"
    fi
    say "  $name took $((SECONDS - t0)) s"
    echo "$name: $pkg, $((SECONDS - t0)) s" >>"$INFO"
}

say "module download for KFP $KFP_VERSION (the proxy must serve every module but KFP's own, which go.mod replaces)"
if ! (cd "$KFP_SRC" && go mod download) >"$WORK/download.log" 2>&1; then
    grep -iE "error|forbidden|not available|not found|404|403" "$WORK/download.log" | head -n 20 >&2
    die "go mod download in $KFP_SRC failed (modules and errors above)"
fi

static=(-tags netgo -ldflags '-s -w -extldflags "-static"')
# As KFP's own Dockerfiles: the API server and agents with cgo as Go defaults; driver and launcher static,
# since the launcher is copied into every component's image.
build apiserver "$KFP_SRC" ./backend/src/apiserver
build persistence_agent "$KFP_SRC" ./backend/src/agent/persistence
build scheduledworkflow "$KFP_SRC" ./backend/src/crd/controller/scheduledworkflow
CGO_ENABLED=0 build driver "$KFP_SRC" ./backend/src/v2/cmd/driver "${static[@]}"
CGO_ENABLED=0 build launcher-v2 "$KFP_SRC" ./backend/src/v2/cmd/launcher-v2 "${static[@]}"
# (backend/src/crd/install/manifests holds an apiextensions.k8s.io/v1beta1 copy that Kubernetes >= 1.22 refuses)
cp "$KFP_SRC/manifests/kustomize/base/pipeline/cluster-scoped/scheduled-workflow-crd.yaml" "$STAGE/crds/" ||
    die "KFP's ScheduledWorkflow CRD is not at manifests/kustomize/base/pipeline/cluster-scoped in $KFP_SRC"

# --- Argo Workflows: controller and executor ---------------------------------------------------------
if [ -n "${ARGO_SRC:-}" ]; then
    [ -d "$ARGO_SRC" ] || die "ARGO_SRC=$ARGO_SRC is not a directory"
    ARGO_SRC="$(realpath "$ARGO_SRC")"
    inside_repo "$ARGO_SRC" && die "ARGO_SRC=$ARGO_SRC is inside this repository: keep Argo's source outside it"
    [ "$(head -n1 "$ARGO_SRC/go.mod" 2>/dev/null)" = "module $ARGO_MODULE" ] ||
        die "ARGO_SRC=$ARGO_SRC is not $ARGO_MODULE (its go.mod)"
    argo_dir="$ARGO_SRC"; argo_from="ARGO_SRC=$ARGO_SRC"
else
    say "ARGO_SRC is not set: $ARGO_MODULE $ARGO_VERSION from the Go module proxy"
    argo_dir="$(cd "$WORK" && GOFLAGS=-mod=mod go mod download -json "$ARGO_MODULE@$ARGO_VERSION" |
        python3 -c 'import json,sys; d=json.load(sys.stdin); sys.exit(d["Error"]) if "Error" in d else print(d["Dir"])')" ||
        die "no Argo source: go mod download of $ARGO_MODULE@$ARGO_VERSION failed (above); set ARGO_SRC=<dir>"
    argo_from="Go module $ARGO_MODULE@$ARGO_VERSION"
    # Module zips drop symbolic links, and Argo's workflow/executor/osspecific/signal_linux.go is one (to
    # signal_darwin.go): without it argoexec fails with "undefined: Setpgid". Build a copy with the link restored.
    cp -r "$argo_dir" "$WORK/argo-src" && chmod -R u+w "$WORK/argo-src"
    argo_dir="$WORK/argo-src"
    osdir="$argo_dir/workflow/executor/osspecific"
    [ -e "$osdir/signal_linux.go" ] || ln -s signal_darwin.go "$osdir/signal_linux.go"
    argo_from="$argo_from (signal_linux.go -> signal_darwin.go restored, as in Argo's repository)"
fi
echo "argo $ARGO_VERSION from $argo_from" >>"$INFO"
v="$ARGO_MODULE"
argo_ldflags="-s -w -extldflags -static -X $v.version=$ARGO_VERSION -X $v.gitTag=$ARGO_VERSION -X $v.gitTreeState=clean"
CGO_ENABLED=0 build workflow-controller "$argo_dir" ./cmd/workflow-controller -ldflags "$argo_ldflags"
CGO_ENABLED=0 build argoexec "$argo_dir" ./cmd/argoexec -ldflags "$argo_ldflags"
cp "$argo_dir"/manifests/base/crds/minimal/argoproj.io_*.yaml "$STAGE/crds/" ||
    die "Argo's CRDs are not at manifests/base/crds/minimal in $argo_dir"

# --- SeaweedFS -----------------------------------------------------------------------------------------
weed_dir="$(cd "$WORK" && GOFLAGS=-mod=mod go mod download -json "$SEAWEEDFS_MODULE@$SEAWEEDFS_VERSION" |
    python3 -c 'import json,sys; d=json.load(sys.stdin); sys.exit(d["Error"]) if "Error" in d else print(d["Dir"])')" ||
    die "go mod download of $SEAWEEDFS_MODULE@$SEAWEEDFS_VERSION failed (above)"
echo "seaweedfs from Go module $SEAWEEDFS_MODULE@$SEAWEEDFS_VERSION" >>"$INFO"
CGO_ENABLED=0 build weed "$weed_dir" ./weed -ldflags "-s -w -extldflags -static"

# --- into place ---------------------------------------------------------------------------------------
cp "$INFO" "$STAGE/BUILD-INFO"
mkdir -p "$TOOLS_DIR"
rm -rf "$DEST.old"
[ -e "$DEST" ] && mv "$DEST" "$DEST.old"
mv "$STAGE" "$DEST"
rm -rf "$DEST.old"
say "done: $DEST"
cat "$DEST/BUILD-INFO" >&2
