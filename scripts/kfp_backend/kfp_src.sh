# Sourced by build.sh and build_ui.sh: finds KFP's source for KFP_VERSION. Expects ROOT (this repository), WORK (the
# build's temporary directory), KFP_VERSION, KFP_GIT_URL and die(); sets KFP_SRC (absolute), src_from and src_commit.
#   KFP_SRC=<dir>  a checkout or export of kubeflow/pipelines at tag KFP_VERSION (its VERSION file is checked);
#                  without it, that tag is cloned from KFP_GIT_URL where the network allows.
# REQUIRE (optional): a path the source must have, checked before anything else (build_ui.sh: frontend).
# inside_repo DIR: whether DIR lies inside this repository (sources read or built must stay outside it).

inside_repo() { case "$(realpath "$1")/" in "$ROOT"/*) return 0 ;; *) return 1 ;; esac; }

kfp_source() {
    if [ -n "${KFP_SRC:-}" ]; then
        [ -d "$KFP_SRC" ] || die "KFP_SRC=$KFP_SRC is not a directory"
        [ -z "${REQUIRE:-}" ] || [ -e "$KFP_SRC/$REQUIRE" ] || die "KFP_SRC=$KFP_SRC has no $REQUIRE/ directory"
        KFP_SRC="$(realpath "$KFP_SRC")"
        src_from="KFP_SRC=$KFP_SRC"
    else
        say "KFP_SRC is not set: cloning tag $KFP_VERSION of $KFP_GIT_URL"
        if ! timeout 600 git clone --quiet --depth 1 --branch "$KFP_VERSION" "$KFP_GIT_URL" "$WORK/kfp-src" \
            2>"$WORK/clone.err"; then
            say "$(tail -n 3 "$WORK/clone.err")"
            die "no KFP source: the clone of $KFP_GIT_URL failed (above); set KFP_SRC=<dir of kubeflow/pipelines at tag $KFP_VERSION>"
        fi
        KFP_SRC="$WORK/kfp-src"
        src_from="git clone --branch $KFP_VERSION $KFP_GIT_URL"
    fi
    ! inside_repo "$KFP_SRC" || die "KFP_SRC=$KFP_SRC is inside this repository: keep KFP's source outside it"
    local version
    version="$(tr -d '[:space:]' <"$KFP_SRC/VERSION" 2>/dev/null || true)"
    [ "$version" = "$KFP_VERSION" ] ||
        die "KFP_SRC=$KFP_SRC is KFP '${version:-unknown}' (its VERSION file), not $KFP_VERSION: check out tag $KFP_VERSION"
    src_commit="$(git -C "$KFP_SRC" rev-parse HEAD 2>/dev/null || echo unknown)"
}
