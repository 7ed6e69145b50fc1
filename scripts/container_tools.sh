#!/usr/bin/env bash
# Installs what `make images` needs to build and run the project's images without a Docker daemon: podman and
# buildah (rootful, runc), mmdebstrap (the local base images), umoci and skopeo (OCI archives). With --node, also
# what the local cluster's real node needs (`make node-deps`): containerd, the CNI plugins, iptables and gcc (the
# pod sandbox's pause binary). With --ui, also Chromium (`make e2e` drives the KFP UI in it); with --ui-only, Chromium
# alone (`make mlflow-ui-shots` drives the MLflow UI in it). With --kfp, also what the real KFP backend of `make e2e`
# runs and builds with (scripts/kfp_backend/prepare.py): MariaDB, git and npm. Debian/Ubuntu packages; needs root.
# Does nothing when they are all present. --check installs nothing: it prints the missing tools on one line (nothing
# when none is missing) and the packages that provide them on a second.
set -euo pipefail
tools=(podman buildah mmdebstrap runc umoci skopeo)
packages=(podman buildah mmdebstrap runc umoci skopeo fuse-overlayfs uidmap ca-certificates curl)
check=0
for opt in "$@"; do
    case "$opt" in
    --node)
        tools+=(containerd ctr iptables gcc /usr/lib/cni/bridge)
        packages+=(containerd containernetworking-plugins iptables gcc libc6-dev) ;;
    --ui)
        tools+=(chromium)
        packages+=(chromium) ;;
    --ui-only)
        tools=(chromium)
        packages=(chromium ca-certificates) ;;
    --kfp)
        tools+=(/usr/sbin/mariadbd mariadb-install-db git npm)
        packages+=(mariadb-server git)
        # npm only where none is on PATH: a Node.js from elsewhere (NodeSource's) brings its own npm, and Debian's
        # npm package conflicts with it ("held broken packages")
        command -v npm >/dev/null || packages+=(npm) ;;
    --check) check=1 ;;
    *) echo "container_tools.sh: unknown option $opt (--node, --ui, --ui-only, --kfp, --check)" >&2; exit 2 ;;
    esac
done
missing=()
for tool in "${tools[@]}"; do
    if [[ "$tool" == /* ]]; then [ -x "$tool" ] || missing+=("$tool"); else command -v "$tool" >/dev/null || missing+=("$tool"); fi
done
if [ "$check" = 1 ]; then
    [ ${#missing[@]} -eq 0 ] || printf '%s\n%s\n' "${missing[*]}" "${packages[*]}"
    exit 0
fi
[ ${#missing[@]} -gt 0 ] || exit 0
[ "$(id -u)" = 0 ] || { echo "container_tools.sh: missing ${missing[*]}; install them as root (apt-get install ${packages[*]})" >&2; exit 1; }
command -v apt-get >/dev/null || { echo "container_tools.sh: missing ${missing[*]} and no apt-get to install them" >&2; exit 1; }
echo "container_tools.sh: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
