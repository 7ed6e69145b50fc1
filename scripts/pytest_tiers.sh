#!/usr/bin/env bash
# make test's pytest on a 2-core machine, in two processes that each print their own summary (the second's when
# both are done); the exit status is the worse of the two. Beside the bulk of the suite, the second runs the tiers
# that mostly wait (tests/cluster: an API server, controllers, the KubeRay operator, and last the real node's tests,
# whose pods run the built image) and the local recipe-comparison pipeline, then tests/image (the container images;
# with FP8RL_IMAGES_READY_FILE set, its tests and the real node's wait for the image build that writes that file:
# .ci/run).
# Arguments go to both (e.g. -x, -k EXPR). PYTHON: the interpreter (default .venv/bin/python).
set -uo pipefail
py=${PYTHON:-.venv/bin/python}
side=(tests/cluster tests/integration/test_pipeline_local.py tests/image)
side_log=$(mktemp)
trap 'rm -f "$side_log"' EXIT
"$py" -m pytest -p no:cacheprovider "${side[@]}" "$@" >"$side_log" 2>&1 &
side_pid=$!
ignore=()
for path in "${side[@]}"; do ignore+=("--ignore=$path"); done
"$py" -m pytest "${ignore[@]}" "$@"
main_rc=$?
wait "$side_pid"
side_rc=$?
echo "---- ${side[*]} (run beside the tests above) ----"
cat "$side_log"
# 5 is pytest's "no tests collected": fine for one process when a filter left its tier empty, not for both
[ "$main_rc" = 5 ] && [ "$side_rc" != 5 ] && main_rc=0
[ "$side_rc" = 5 ] && [ "$main_rc" != 5 ] && side_rc=0
[ "$main_rc" -ge "$side_rc" ] && exit "$main_rc"
exit "$side_rc"
