#!/usr/bin/env bash
# make test's pytest on a 2-core machine, in two processes that each print their own summary (the second's when
# both are done); the exit status is the worse of the two. Beside the bulk of the suite, the second runs the tiers
# that mostly wait (tests/cluster: an API server, controllers, the KubeRay operator, and last the real node's tests,
# whose pods run the built image), the local recipe-comparison pipeline, then tests/image (the container images;
# with FP8RL_IMAGES_READY_FILE set, its tests and the real node's wait for the image build that writes that file:
# .ci/run).
# What runs where balances the two, measured in CI, warm: with the RL loop's and the real model's tests in the second,
# the first took 1,128 s and the second 1,511 s (the real node's retry test had added 170 s to it); those two files
# (about 160 s) run in the first since. Three processes (the long runs in a third) were slower: 1,814 s and 1,852 s
# against 1,698 s for two, since every test then gets a third of the machine less (a local pipeline run took 547 s
# instead of 285 s).
# Arguments go to both (e.g. -x, -k EXPR). PYTHON: the interpreter (default .venv/bin/python).
# pytest runs from its console script beside the interpreter, not as `python -m pytest`: runpy's frozen frames under
# every test have no source file, and each `inspect.stack()` of the KFP SDK (several per pipeline step it builds) then
# scans all of sys.modules for them; in a process that has imported torch, transformers, MLflow and Ray, a pipeline
# build took 3-4 s instead of 0.1 s.
# Each process, and what it starts (Ray workers, pipeline steps, ranks), runs torch on half the cores (unless
# OMP_NUM_THREADS is set): the two processes fill the machine, and a torch op split over more threads than it gets
# cores waits for the one that is not scheduled. On 2 busy cores the 2,048-token generation test took 80 s on two
# threads, 24 s on one.
set -uo pipefail
half=$(( $(nproc) / 2 ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( half > 0 ? half : 1 ))}
py=${PYTHON:-.venv/bin/python}
pytest_bin="$(dirname "$py")/pytest"
[ -x "$pytest_bin" ] || { echo "scripts/pytest_tiers.sh: no $pytest_bin (install the dev extra: make install)" >&2; exit 2; }
side=(tests/cluster tests/integration/test_pipeline_local.py tests/image)
side_log=$(mktemp)
trap 'rm -f "$side_log"' EXIT
"$pytest_bin" -p no:cacheprovider "${side[@]}" "$@" >"$side_log" 2>&1 &
side_pid=$!
ignore=()
for path in "${side[@]}"; do ignore+=("--ignore=$path"); done
"$pytest_bin" "${ignore[@]}" "$@"
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
