#!/usr/bin/env bash
# Builds the local Kubernetes control plane the cluster tests (tests/cluster) start, from Go modules only:
#   bin/kube               etcd + kube-apiserver + kube-controller-manager + kube-scheduler, and for the real node
#                          kubelet + kube-proxy + CoreDNS, in one binary (scripts/k8s-control-plane:
#                          k8s.io/kubernetes with its staging modules replaced, github.com/coredns/coredns)
#   bin/kwok               fake nodes and pods (sigs.k8s.io/kwok)
#   bin/ray-operator       the KubeRay operator, run out of cluster (the version the chart pins)
#   control-plane/crds/    the KubeRay CRDs of that version
#   control-plane/stages/  kwok's "fast" node and pod stages (from the kwok module)
# into ${FP8RL_TOOLS_DIR:-$HOME/.cache/fp8rl/tools}. Idempotent: a stamp of the pinned versions and of
# the wrapper module's files skips what is built already. Cold, on 2 cores: several minutes (see
# docs/helm.md, "Tests against a real control plane").
set -euo pipefail

KUBERNETES_VERSION=v1.34.4      # k8s.io/kubernetes (the staging modules are v0.34.4, pinned in go.mod)
KWOK_VERSION=v0.8.0
KUBERAY_VERSION=v1.6.2          # the chart's operator version (scripts/k8s_tools.sh pins the same)

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS_DIR="${FP8RL_TOOLS_DIR:-$HOME/.cache/fp8rl/tools}"
BIN="$TOOLS_DIR/bin"
CP="$TOOLS_DIR/control-plane"
MODULE="$ROOT/scripts/k8s-control-plane"

say() { printf 'k8s-control-plane: %s\n' "$*" >&2; }
die() { say "ERROR: $*"; exit 1; }

command -v go >/dev/null || die "go is not on PATH (needed to build the control plane)"
mkdir -p "$BIN" "$CP"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
gocmd() { (cd "$WORK" && GOFLAGS=-buildvcs=false GO111MODULE=on CGO_ENABLED=0 "$@"); }
stamp_of() { printf '%s' "$*" | sha256sum | cut -c1-16; }
have() { [ -x "$1" ] && [ "$(cat "$1.stamp" 2>/dev/null || true)" = "$2" ]; }
timed() { local t0=$SECONDS; "$@"; say "  took $((SECONDS - t0)) s"; }

# --- kube: etcd, apiserver, controller-manager, scheduler -------------------------------------------
minor="${KUBERNETES_VERSION#v1.}"; minor="${minor%%.*}"
kube_stamp="$(stamp_of "$KUBERNETES_VERSION" "$(cat "$MODULE/go.mod" "$MODULE/go.sum" "$MODULE/main.go")")"
if have "$BIN/kube" "$kube_stamp"; then
    say "kube $KUBERNETES_VERSION already built"
else
    say "building kube $KUBERNETES_VERSION (etcd, kube-apiserver, -controller-manager, -scheduler, kubelet, kube-proxy, CoreDNS; minutes)"
    v=k8s.io/component-base/version
    build() {
        (cd "$MODULE" && GOFLAGS="-buildvcs=false -mod=readonly" CGO_ENABLED=0 go build -trimpath -o "$WORK/kube" \
            -ldflags "-s -w -X $v.gitVersion=$KUBERNETES_VERSION -X $v.gitMajor=1 -X $v.gitMinor=$minor \
                -X $v.gitTreeState=clean -X $v.buildDate=1970-01-01T00:00:00Z" .)
    }
    timed build || die "go build of scripts/k8s-control-plane failed"
    mv "$WORK/kube" "$BIN/kube" && echo "$kube_stamp" >"$BIN/kube.stamp"
fi

# --- kwok --------------------------------------------------------------------------------------------
kwok_dir="$(gocmd go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" |
    python3 -c 'import json,sys; d=json.load(sys.stdin); sys.exit(d["Error"]) if "Error" in d else print(d["Dir"])')" ||
    die "go mod download of sigs.k8s.io/kwok $KWOK_VERSION failed"
if have "$BIN/kwok" "$KWOK_VERSION"; then
    say "kwok $KWOK_VERSION already built"
else
    say "building kwok $KWOK_VERSION"
    timed gocmd env GOBIN="$WORK" go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION" ||
        die "go install kwok $KWOK_VERSION failed"
    mv "$WORK/kwok" "$BIN/kwok" && echo "$KWOK_VERSION" >"$BIN/kwok.stamp"
fi
rm -rf "$CP/stages" && mkdir -p "$CP/stages"
for f in node/fast/node-initialize.yaml node/heartbeat/node-heartbeat.yaml \
    pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
    [ -f "$kwok_dir/kustomize/stage/$f" ] || die "kwok $KWOK_VERSION has no kustomize/stage/$f"
    install -m 0644 "$kwok_dir/kustomize/stage/$f" "$CP/stages/$(basename "$f")"
done

# --- KubeRay operator --------------------------------------------------------------------------------
ray_dir="$(gocmd go mod download -json "github.com/ray-project/kuberay/ray-operator@$KUBERAY_VERSION" |
    python3 -c 'import json,sys; d=json.load(sys.stdin); sys.exit(d["Error"]) if "Error" in d else print(d["Dir"])')" ||
    die "go mod download of ray-operator $KUBERAY_VERSION failed"
if have "$BIN/ray-operator" "$KUBERAY_VERSION"; then
    say "ray-operator $KUBERAY_VERSION already built"
else
    say "building the KubeRay operator $KUBERAY_VERSION"
    timed gocmd env GOBIN="$WORK" go install -trimpath -ldflags "-s -w" \
        "github.com/ray-project/kuberay/ray-operator@$KUBERAY_VERSION" || die "go install ray-operator failed"
    mv "$WORK/ray-operator" "$BIN/ray-operator" && echo "$KUBERAY_VERSION" >"$BIN/ray-operator.stamp"
fi
rm -rf "$CP/crds" && mkdir -p "$CP/crds"
install -m 0644 "$ray_dir"/config/crd/bases/ray.io_*.yaml "$CP/crds/"

printf '{"kubernetes": "%s", "kwok": "%s", "kuberay": "%s"}\n' "$KUBERNETES_VERSION" "$KWOK_VERSION" \
    "$KUBERAY_VERSION" >"$CP/VERSIONS.json"
say "ready: $BIN/kube (Kubernetes $KUBERNETES_VERSION), $BIN/kwok ($KWOK_VERSION), $BIN/ray-operator ($KUBERAY_VERSION)"
