#!/usr/bin/env bash
# make test's pytest on a 2-core machine: the cluster and image tiers (tests/cluster, tests/image: mostly waiting on
# an API server, controllers and containers) run in a second pytest process beside the rest, whose tests mostly
# compute. Each process prints its own summary (the side one's when both are done); the exit status is the worse.
# Arguments go to both (e.g. -x, -k EXPR). PYTHON: the interpreter (default .venv/bin/python).
set -uo pipefail
py=${PYTHON:-.venv/bin/python}
side_log=$(mktemp)
trap 'rm -f "$side_log"' EXIT
"$py" -m pytest -m "cluster or image" -p no:cacheprovider "$@" >"$side_log" 2>&1 &
side=$!
"$py" -m pytest -m "not cluster and not image" "$@"
main_rc=$?
wait "$side"
side_rc=$?
echo "---- tests/cluster and tests/image (run beside the tests above) ----"
cat "$side_log"
# 5 is pytest's "no tests collected": fine for one process when a filter left its tier empty, not for both
[ "$main_rc" = 5 ] && [ "$side_rc" != 5 ] && main_rc=0
[ "$side_rc" = 5 ] && [ "$main_rc" != 5 ] && side_rc=0
[ "$main_rc" -ge "$side_rc" ] && exit "$main_rc"
exit "$side_rc"
