#!/usr/bin/env bash
# make test's pytest on a 2-core machine, in three processes that each print their own summary (the two side ones'
# when all are done); the exit status is the worst of the three.
# - the cluster side: the tiers that mostly wait (tests/cluster: an API server, controllers, the KubeRay operator,
#   and last the real node's tests, whose pods run the built image), the RL loop's integration tests, then
#   tests/image (the container images; with FP8RL_IMAGES_READY_FILE set, its tests and the real node's wait for the
#   image build that writes that file: .ci/run);
# - the long-run side: the local recipe-comparison pipeline, the real pretrained model, the RL evidence (9 runs) and
#   the RL loop on a local Ray;
# - the bulk of the suite.
# With two processes (the cluster tiers beside the rest) the cores were idle a fifth of the time: while the cluster
# tiers waited on pods and controllers, and after they ended, since every process computes on one thread. A third
# process fills those waits.
# Arguments go to all three (e.g. -x, -k EXPR). PYTHON: the interpreter (default .venv/bin/python).
# pytest runs from its console script beside the interpreter, not as `python -m pytest`: runpy's frozen frames under
# every test have no source file, and each `inspect.stack()` of the KFP SDK (several per pipeline step it builds) then
# scans all of sys.modules for them; in a process that has imported torch, transformers, MLflow and Ray, a pipeline
# build took 3-4 s instead of 0.1 s.
# Each process, and what it starts (Ray workers, pipeline steps, ranks), runs torch on half the cores (unless
# OMP_NUM_THREADS is set): a torch op split over more threads than it gets cores waits for the one that is not
# scheduled. On 2 busy cores the 2,048-token generation test took 80 s on two threads, 24 s on one.
set -uo pipefail
half=$(( $(nproc) / 2 ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( half > 0 ? half : 1 ))}
py=${PYTHON:-.venv/bin/python}
pytest_bin="$(dirname "$py")/pytest"
[ -x "$pytest_bin" ] || { echo "scripts/pytest_tiers.sh: no $pytest_bin (install the dev extra: make install)" >&2; exit 2; }
# What runs where balances the three on 2 cores (measured: with the cluster and image tiers alone beside them, the
# long runs ended after 1,052 s and the cluster tiers after 986 s, and the rest alone until 1,713 s)
cluster_side=(tests/cluster tests/integration/test_rl_loop.py tests/image)
long_side=(tests/integration/test_pipeline_local.py tests/integration/test_real_model.py
           tests/integration/test_rl_evidence.py tests/integration/test_ray_loop.py)
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
"$pytest_bin" -p no:cacheprovider "${cluster_side[@]}" "$@" >"$logs/cluster" 2>&1 &
cluster_pid=$!
"$pytest_bin" -p no:cacheprovider "${long_side[@]}" "$@" >"$logs/long" 2>&1 &
long_pid=$!
ignore=()
for path in "${cluster_side[@]}" "${long_side[@]}"; do ignore+=("--ignore=$path"); done
"$pytest_bin" "${ignore[@]}" "$@"
rcs=($?)
wait "$long_pid"; rcs+=($?)
wait "$cluster_pid"; rcs+=($?)
echo "---- ${long_side[*]} (run beside the tests above) ----"
cat "$logs/long"
echo "---- ${cluster_side[*]} (run beside the tests above) ----"
cat "$logs/cluster"
# 5 is pytest's "no tests collected": fine for a process whose tiers a filter emptied, not for all three
worst=0 collected=0
for rc in "${rcs[@]}"; do
  [ "$rc" = 5 ] && continue
  collected=1
  [ "$rc" -gt "$worst" ] && worst=$rc
done
[ "$collected" = 0 ] && exit 5
exit "$worst"
