#!/usr/bin/env bash
# vLLM inside the Ray rollout workers on the lent GPU (issue 17): the RL step on a local Ray with the trainer actor
# and a vLLM rollout actor colocated on one GPU (the engine sleeps while the trainer runs; the memory it frees is
# reported), objectstore sync with the bit-exact verify mode, and FP8 KV cache recalibrated on Ray.
#
# The GPU machine is offline and takes at most 64 MiB per command, so vLLM 0.26.0 (../shared/device/vllm/pack.sh),
# Ray 2.60.0 and the wheels of Ray's dependencies travel as one bundle cut into parts:
#   bash experiments/gpu_ray_vllm.sh pack                    here: fills .carry/rv1 .. .carry/rvN (git-ignored)
#   bash experiments/gpu_ray_vllm.sh part .carry/rvK         on the GPU machine, one call per part, back to back
#                                                        (/tmp there lasts ~30 s after a command); the last one
#                                                        unpacks vLLM and installs Ray into /tmp/site
#   bash experiments/gpu_ray_vllm.sh run                     the benchmark, detached; waits up to WAIT_S (540 s)
#   bash experiments/gpu_ray_vllm.sh ipc                     the CUDA IPC sync: its GPU tests, then the same benchmark with
#                                                        ray.sync ipc (RECIPES) and objectstore (STORE_RECIPES), detached
#   bash experiments/gpu_ray_vllm.sh overhead                experiments/gpu_vllm_overhead.py (its ARGS), detached, after
#                                                        PYTEST's GPU tests; with ENGINE_PROCESS_TOO=1 again with
#                                                        --engine-process, same job
#   bash experiments/gpu_ray_vllm.sh x2                      two GPUs (nvidia-h100-x2), detached, in order, the parts named in
#                                                        X2 (default "tests split overhead fsdp"): tests = the 2-GPU
#                                                        GPU tests (FSDP over NCCL, vLLM on Ray split/colocated, every
#                                                        sync verified); split = the step, split layout + NCCL sync
#                                                        (SPLIT_SHAPE, default llama-1b: a replicated trainer's
#                                                        ~20 bytes a parameter fill one 80 GB GPU near 3B);
#                                                        overhead = gpu_vllm_overhead.py
#                                                        in-process on GPU 0 and --engine-process on GPU 1 at once
#                                                        (ARGS); fsdp = the step, 2 FSDP trainer ranks + vLLM colocated
#                                                        (FSDP_SHAPE, default llama-3b; FSDP_RECIPES); fsdp8b (not in
#                                                        the default) = the same at llama-8b, 32 prompts
#                                                        (PROMPTS_8B), AdamW's moments offloaded, a vLLM worker per
#                                                        GPU (CONFIG_8B, default
#                                                        docs/configs/bench-vllm-ray-fsdp-8b.yaml); SET_8B adds
#                                                        flags (e.g. "--set ray.sleep_after_sync=false"), COMPILE_8B=auto
#                                                        adds optim.compile_elementwise when the compile part passed,
#                                                        FSDP8B_RECIPES_B then runs those recipes again with
#                                                        SET_8B_B's flags instead (a setting compared in one job),
#                                                        GATHER_8B=auto turns optim.fp8_gather_once off unless its GPU
#                                                        test passed in the tests part;
#                                                        compile (not in the default) = tests/gpu/test_compiled_trainer_cuda.py;
#                                                        kernels (not in the default) = fp8rl bench kernels on GPU 0 at
#                                                        the 8B step's quantization shapes (KERNEL_SHAPES; KERNEL_ARGS, e.g. --sweep,
#                                                        which also writes the fastest launch configurations: with
#                                                        QUANT_LAUNCH=auto the fsdp8b part runs with them);
#                                                        rollout8b (not in the default) = gpu_vllm_overhead.py at
#                                                        llama-8b, ROLLOUT_GPU0 (fp8,fp8-row) on GPU 0 and ROLLOUT_GPU1
#                                                        (fp8-row-kv,bf16) on GPU 1 at once, the bench's checkpoint; kvbudget (not
#                                                        in the default) = fp8-e2e-kv split, the KV recalibration on
#                                                        the whole batch, then on 16k tokens of it
#   bash experiments/gpu_ray_vllm.sh te-part .carry/te      after the parts: TransformerEngine too (x2's te part)
#   bash experiments/gpu_ray_vllm.sh poll                    waits again for a run that outlasted one command; call it
#                                                        at once: the machine goes back 30 s after a call ends, and
#                                                        the job (and the vLLM setup in /tmp) with it: nothing
#                                                        between the calls, not even copying the returned files
#                                                        (each call's stay where it put them; 2026-11-26 a job was
#                                                        lost that way, halfway through the 8B benchmark)
# PYTEST (pytest arguments, e.g. GPU test files) runs before the benchmark of run, ipc and overhead, in the same
# detached job (tests that take the real model need `bash experiments/gpu_engines.sh model-part/model` first).
# MBT sets the benchmarks' --micro-batch-tokens (default 4096); BENCH_FLAGS adds flags to every benchmark (e.g.
# "--profile-train": one more step per recipe, its train phase's kernel time by category); TESTS_RAY the Ray/vLLM tests of x2's tests part (its
# own pytest call, after the trainer's GPU tests (TESTS_TRAINER, default the sharded and offload files); e.g.
# "tests/gpu/test_ray_vllm.py -k fsdp2"; none: skip them).
# Results: $OUT/ray_vllm.log and $OUT/results.tar.gz (every .json, .md and .log the job wrote under /tmp/res).
set -uo pipefail
step=${1:?step}; arg=${2:-}
OUT=${OUT:-.}
RES=/tmp/res

case $step in
  pack)  # on this machine
    VP=${PACK_DIR:-${TMPDIR:-/tmp}/vllm_pack}
    [ -e "$VP/slim.tar.xz" ] && [ -d .carry/vllm2/deps ] || { echo "run ../shared/device/vllm/pack.sh first"; exit 2; }
    W=$(mktemp -d); mkdir -p "$W/b/deps"
    PIPDL="python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d $W/b/deps"
    for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_28_x86_64 any; do PIPDL="$PIPDL --platform $p"; done
    # Ray and its dependencies at the versions constraints.txt pins (requests/packaging come with the image)
    pins=$(grep -i -E '^(ray|click|filelock|jsonschema|jsonschema-specifications|referencing|rpds-py|attrs|msgpack|protobuf|pyyaml)==' constraints.txt)
    # shellcheck disable=SC2086
    $PIPDL $pins || exit 3
    cp "$VP/slim.tar.xz" "$W/b/vllm_slim.tar.xz"
    cp .carry/vllm2/deps/*.whl "$W/b/deps/"
    tar -C "$W/b" -cf "$W/bundle.tar" . || exit 4
    sha=$(sha256sum "$W/bundle.tar" | cut -d' ' -f1)
    rm -rf .carry/rv*; split -n "${PARTS:-4}" -d -a 1 "$W/bundle.tar" "$W/part."  # ~53 MB each + the tree
    n=$(ls "$W"/part.* | wc -l); k=1
    for p in "$W"/part.*; do
      mkdir -p .carry/rv$k && mv "$p" .carry/rv$k/ && echo "$sha $n" > .carry/rv$k/manifest.txt; k=$((k + 1))
    done
    rm -rf "$W"; du -sb .carry/rv*; echo "send .carry/rv1 .. .carry/rv$n with 'part', back to back"
    ;;
  te-part)  # on the GPU machine, after the parts: TransformerEngine (../shared/device/te/pack.sh's .carry/te; with
    # SKIP_EXT=1 it carries the torch extension's sdist, which device_setup.sh builds there in the background, ~2 min)
    # into /tmp/site beside vLLM and Ray; x2's te part waits for that build
    bash "$arg"/device_setup.sh "$arg" || exit 2
    ;;
  part)  # on the GPU machine
    mkdir -p /tmp/parts; cp "$arg"/part.* /tmp/parts/ || exit 2
    read -r SHA NP < "$arg/manifest.txt"; have=$(ls /tmp/parts | wc -l)
    [ -e /tmp/site/.rv_done ] && { echo "already installed"; exit 0; }
    [ "$have" -lt "$NP" ] && { echo "have $have of $NP parts; send the next now"; exit 0; }
    T0=$(date +%s); cat /tmp/parts/part.* > /tmp/bundle.tar; rm -rf /tmp/parts
    echo "$SHA  /tmp/bundle.tar" | sha256sum -c - || exit 3
    mkdir -p /tmp/b /tmp/site && tar -C /tmp/b -xf /tmp/bundle.tar && rm /tmp/bundle.tar || exit 4
    tar -xJf /tmp/b/vllm_slim.tar.xz -C /tmp/site || exit 5
    # a dependency the image already has stays the image's; vLLM's own dependency wheels and Ray always go in
    for w in /tmp/b/deps/*.whl; do
      mod=$(basename "$w" | cut -d- -f1 | tr 'A-Z' 'a-z')
      case $mod in pyyaml) mod=yaml;; protobuf) mod=google.protobuf;; rpds_py) mod=rpds;; esac
      case $mod in ray) ;; click|filelock|jsonschema|jsonschema_specifications|referencing|attrs|msgpack|google.protobuf|yaml|rpds)
        python3 -c "import $mod" 2>/dev/null && continue;; esac
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" || exit 6
    done
    touch /tmp/site/.rv_done; rm -rf /tmp/b
    PYTHONPATH=/tmp/site python3 -c "import ray, vllm; print('IMPORT_OK ray', ray.__version__, 'vllm', vllm.__version__)" 2>&1 | tail -1
    echo "SETUP_SECONDS $(( $(date +%s) - T0 ))"
    ;;
  run|ipc|overhead|x2|poll)
    export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_DEEP_GEMM=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
    export PYTHONPATH=/tmp/site:$PWD RAY_DEDUP_LOGS=0
    export FP8RL_MODEL_CACHE=${FP8RL_MODEL_CACHE:-/tmp/models}  # the smollm2 fixture (experiments/gpu_engines.sh model)
    # a new job starts from an empty results folder: a machine handed out again keeps /tmp, and its old files would
    # travel back in results.tar.gz beside the new ones (2026-11-26); poll reads the running job's (KEEP_RES=1 keeps:
    # e.g. COMPILE_8B=auto reading an earlier job's compile_ok). Never under a job that is still running.
    if [ "$step" != poll ] && [ -e $RES/job.pid ] && kill -0 "$(cat $RES/job.pid)" 2>/dev/null; then
      echo "a job is still running on this machine: poll it (or wait) before starting another"; exit 4
    fi
    [ "$step" = poll ] || [ -n "${KEEP_RES:-}" ] || rm -rf "$RES"
    mkdir -p $RES
    bench() {  # bench <config> <recipes> <out dir> [shape] [prompts]
      echo "python3 -m fp8rl bench step --shape ${4:-${SHAPE:-llama-1b}} --config $1 --recipes $2 --prompts ${5:-${PROMPTS:-16}} \
        --samples 8 --max-tokens ${MAX_TOKENS:-1024} --steps 2 --warmup 1 --micro-batch-tokens ${MBT:-4096} --no-mlflow \
        --out $3 --work-dir /tmp/work ${BENCH_FLAGS:-}"
    }
    tests=""
    [ -n "${PYTEST:-}" ] && tests="python3 -m pytest -q -p no:cacheprovider $PYTEST > $RES/pytest.log 2>&1; tail -n 3 $RES/pytest.log; "
    if [ "$step" = overhead ]; then
      # PYTEST first, in the same job; --shape llama-8b writes its random checkpoint under /tmp/work/bench-models
      job="${tests}OUT=$RES FP8RL_GPU_WORK=/tmp/work python3 experiments/gpu_vllm_overhead.py ${ARGS:-}"
      # ENGINE_PROCESS_TOO=1: then the same with vLLM's engine core in its own process, results in $RES/engine-process
      [ -n "${ENGINE_PROCESS_TOO:-}" ] && job="$job; mkdir -p $RES/engine-process; \
        OUT=$RES/engine-process python3 experiments/gpu_vllm_overhead.py ${ARGS:-} --engine-process"
    elif [ "$step" = x2 ]; then
      job="nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; true"
      # with te in X2: torch's cuDNN first for TE (TE's README: the image's older one in /usr/lib otherwise wins), in
      # the te part's tests and in the 8B benchmark, every recipe of it (so that one may train with TE:
      # docs/configs/fp8-e2e-te.yaml; the BF16 baseline then runs with the same libraries)
      te_env=""
      case " ${X2:-} " in *" te "*) sp=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
        te_env="CUDNN_HOME=$sp/nvidia/cudnn LD_LIBRARY_PATH=$sp/nvidia/cudnn/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}";; esac
      for part in ${X2:-tests split overhead fsdp}; do
        case $part in
          # PYTEST in its own process: the trainer tests compare against an in-process reference, and other test
          # files change process-wide state (collecting vLLM's imports vLLM, which patches torch; 2026-11-26: with
          # them in one process the replicated reference's grad norm moved 3e-4, the sharded subprocess did not)
          # with te in X2, the te part runs the TE case (its cuDNN set up); here TE may be half installed
          tests) te_case="tests/gpu/test_sharded_trainer_cuda.py::test_sharded_trainer_on_cuda_matches_the_replicated_one[te-fp8"
                 case " ${X2:-} " in *" te "*) te_case="--deselect '$te_case]' --deselect '$te_case-bench]'";; *) te_case="";; esac
                 job="$job; python3 -m pytest -q -rA -p no:cacheprovider $te_case \
                   ${TESTS_TRAINER:-tests/gpu/test_sharded_trainer_cuda.py tests/gpu/test_optimizer_offload_cuda.py} \
                   > $RES/pytest_x2_trainer.log 2>&1; \
                   ${PYTEST:+python3 -m pytest -q -rA -p no:cacheprovider $PYTEST > $RES/pytest_x2_extra.log 2>&1;} \
                   $([ "${TESTS_RAY:-}" = none ] || echo "python3 -m pytest -q -rA -p no:cacheprovider \
                   ${TESTS_RAY:-tests/gpu/test_ray_vllm.py} > $RES/pytest_x2.log 2>&1;") grep -h '^step \|sharded\|moments\|passed\|failed' \
                   $RES/pytest_x2_trainer.log $RES/pytest_x2_extra.log $RES/pytest_x2.log 2>/dev/null | cut -c1-240";;
          # te (not in the default; after te-part): the TE trainer sharded over both GPUs, plain and with the 8B
          # benchmark's settings, against the replicated TE trainer (te_env: torch's cuDNN first)
          te) W=transformer_engine/wheel_lib
                 job="$job; echo PART te; if [ ! -e /tmp/site/$W/transformer_engine_torch*.so ]; then \
                   while [ -e /tmp/build_te.pid ] && ! grep -q BUILD_SECONDS /tmp/build_te.log; do sleep 5; done; \
                   tail -n 1 /tmp/build_te.log; cp /tmp/site_dev/$W/transformer_engine_torch*.so /tmp/site/$W/; \
                   cp -r /tmp/site_dev/transformer_engine_torch-*.dist-info /tmp/site/; fi; $te_env \
                   python3 -m pytest -q -rA -p no:cacheprovider "tests/gpu/test_sharded_trainer_cuda.py::test_sharded_trainer_on_cuda_matches_the_replicated_one[te-fp8]" \
                   "tests/gpu/test_sharded_trainer_cuda.py::test_sharded_trainer_on_cuda_matches_the_replicated_one[te-fp8-bench]" \
                   > $RES/pytest_te.log 2>&1; grep -h 'passed\|failed\|Error' $RES/pytest_te.log | cut -c1-240 | tail -n 12";;
          split) job="$job; echo PART split; $(bench docs/configs/bench-vllm-ray-split.yaml \
                   "${RECIPES:-bf16,fp8-e2e,fp8-e2e-kv}" $RES/split "${SPLIT_SHAPE:-llama-1b}")";;
          overhead) A="${ARGS:---variants bf16,fp8-kv --modes fp8rl,neither --long-tokens 0 --profile-tokens 0}"
                 job="$job; echo PART overhead; mkdir -p $RES/overhead/in-process $RES/overhead/engine-process; \
                   CUDA_VISIBLE_DEVICES=0 OUT=$RES/overhead/in-process python3 experiments/gpu_vllm_overhead.py $A \
                      > $RES/overhead/in-process/run.log 2>&1 & \
                   CUDA_VISIBLE_DEVICES=1 OUT=$RES/overhead/engine-process FP8RL_GPU_WORK=/tmp/fp8rl-vllm-ep python3 \
                      experiments/gpu_vllm_overhead.py $A --engine-process > $RES/overhead/engine-process/run.log 2>&1 & \
                   wait; grep -h 'neither\|fp8rl\|FAILED' $RES/overhead/*/run.log | cut -c1-200";;
          fsdp) job="$job; echo PART fsdp; $(bench docs/configs/bench-vllm-ray-fsdp.yaml "${FSDP_RECIPES:-bf16,fp8-e2e}" \
                   $RES/fsdp "${FSDP_SHAPE:-llama-3b}")";;
          kernels) lj=""; case " ${KERNEL_ARGS:-} " in *" --sweep "*) lj="--launch-json $RES/quant_launch.json";; esac
                 job="$job; echo PART kernels; CUDA_VISIBLE_DEVICES=0 python3 -m fp8rl bench kernels \
                   --shapes ${KERNEL_SHAPES:-15488x14336x4096,15488x4096x4096,15488x1024x4096} ${KERNEL_ARGS:-} $lj \
                   --json $RES/kernels.json > $RES/kernels.log 2>&1; grep -h 'fused\|copy\|sweep' $RES/kernels.log | head -n 30";;
          compile) job="$job; echo PART compile; python3 -m pytest -q -rA -p no:cacheprovider \
                   tests/gpu/test_compiled_trainer_cuda.py > $RES/pytest_compile.log 2>&1 && touch $RES/compile_ok; \
                   grep -h 'passed\|failed\|Error' $RES/pytest_compile.log | cut -c1-240 | tail -n 12";;
          fsdp8b) c8=""; [ "${COMPILE_8B:-}" = auto ] && c8='$([ -e '$RES'/compile_ok ] && echo --set optim.compile_elementwise=true)'
                 # QUANT_LAUNCH=auto: the launch configurations the kernels part's sweep found fastest, if it ran
                 ql=""; [ "${QUANT_LAUNCH:-}" = auto ] && ql='FP8RL_QUANT_LAUNCH="$(cat '$RES'/quant_launch.json 2>/dev/null)" '
                 # GATHER_8B=auto: optim.fp8_gather_once (the default) only if its GPU test passed in the tests part
                 [ "${GATHER_8B:-}" = auto ] && c8="$c8 "'$(grep -q "PASSED.*fp8_gather_once_on_cuda.*checkpointed" '$RES'/pytest_x2_trainer.log 2>/dev/null || echo --set optim.fp8_gather_once=false)'
                 job="$job; echo PART fsdp8b $c8 launch \$(cat $RES/quant_launch.json 2>/dev/null); $te_env $ql$(bench ${CONFIG_8B:-docs/configs/bench-vllm-ray-fsdp-8b.yaml} \
                   "${FSDP8B_RECIPES:-bf16,fp8-e2e,fp8-e2e-kv}" $RES/fsdp8b llama-8b "${PROMPTS_8B:-32}") \
                   ${SET_8B:-} $c8"
                 # FSDP8B_RECIPES_B: then those recipes again with SET_8B_B instead of SET_8B (another run-config
                 # setting next to the first on the same machine, in the same job), results in $RES/fsdp8b-b
                 [ -n "${FSDP8B_RECIPES_B:-}" ] && job="$job; echo PART fsdp8b-b; $te_env $ql$(bench ${CONFIG_8B:-docs/configs/bench-vllm-ray-fsdp-8b.yaml} \
                   "$FSDP8B_RECIPES_B" $RES/fsdp8b-b llama-8b "${PROMPTS_8B:-32}") ${SET_8B_B:-} $c8";;
          rollout8b) V0=${ROLLOUT_GPU0:-fp8,fp8-row}; V1=${ROLLOUT_GPU1:-fp8-row-kv,bf16}
                 A="--shape llama-8b --modes fp8rl --long-tokens 0 --profile-tokens 128 ${ARGS:-}"
                 job="$job; echo PART rollout8b; mkdir -p $RES/rollout8b/gpu0 $RES/rollout8b/gpu1; \
                   python3 -c 'from fp8rl.models.shapes import make_shape_model as m; m(\"llama-8b\", \"/tmp/work/bench-models/llama-8b\", \"cuda\")'; \
                   CUDA_VISIBLE_DEVICES=0 OUT=$RES/rollout8b/gpu0 FP8RL_GPU_WORK=/tmp/work python3 experiments/gpu_vllm_overhead.py \
                      $A --variants $V0 > $RES/rollout8b/gpu0/run.log 2>&1 & \
                   CUDA_VISIBLE_DEVICES=1 OUT=$RES/rollout8b/gpu1 FP8RL_GPU_WORK=/tmp/work python3 experiments/gpu_vllm_overhead.py \
                      $A --variants $V1 > $RES/rollout8b/gpu1/run.log 2>&1 & \
                   wait; grep -h 'fp8rl (repeat\|profile\|FAILED\|up in\|checkpoint in' $RES/rollout8b/*/run.log | cut -c1-300";;
          kvbudget) job="$job; echo PART kvbudget; $(bench docs/configs/bench-vllm-ray-split.yaml fp8-e2e-kv \
                   $RES/kv-all "${SPLIT_SHAPE:-llama-1b}"); $(bench docs/configs/bench-vllm-ray-split.yaml \
                   fp8-e2e-kv $RES/kv-16k "${SPLIT_SHAPE:-llama-1b}") \
                   --set rollout.kv_calibration_tokens=16384";;
          *) echo "unknown x2 part $part"; exit 2;;
        esac
      done
    elif [ "$step" = run ]; then
      job="$tests$(bench "${CONFIG:-docs/configs/bench-vllm-ray.yaml}" "${RECIPES:-bf16,fp8-e2e,fp8-e2e-kv}" $RES)"
    elif [ "$step" = ipc ]; then
      # the CUDA IPC transport's GPU tests, then the step with ray.sync ipc and, in the same call, objectstore
      job="${tests}python3 -m pytest -q -p no:cacheprovider tests/gpu/test_ipc_sync.py tests/gpu/test_ray_ipc_sync.py \
        > $RES/pytest_ipc.log 2>&1; tail -n 3 $RES/pytest_ipc.log; \
        $(bench docs/configs/bench-vllm-ray-ipc.yaml "${RECIPES:-bf16,fp8-e2e}" $RES/ipc) && \
        $(bench docs/configs/bench-vllm-ray.yaml "${STORE_RECIPES:-fp8-e2e}" $RES/objectstore)"
    fi
    if [ "$step" = poll ] && [ ! -e $RES/ray_vllm.log ]; then
      # a poll that came after the machine went back lands on a fresh one: say so now, not after WAIT_S
      echo "no job on this machine (it was given back and this is a fresh one): start the run again"; exit 3
    fi
    if [ "$step" != poll ]; then
      rm -f $RES/done
      setsid nohup bash -c "($job) > $RES/ray_vllm.log 2>&1; echo EXIT \$? >> $RES/ray_vllm.log; touch $RES/done" \
        > /dev/null 2>&1 < /dev/null &
      echo $! > $RES/job.pid
    fi
    # at most 8 files come back: the log, and everything in one archive; refreshed every 30 s, so that a call cut
    # short (the session's device time running out under it) still brings back what the job wrote so far
    collect() {
      mkdir -p "$OUT"; cp -f $RES/ray_vllm.log "$OUT/" 2>/dev/null
      # a log still growing makes tar exit 1 ("file changed as we read it"): what it read is still an archive
      (cd $RES && find . -name '*.json' -o -name '*.md' -o -name '*.log' \
        | tar --warning=no-file-changed -czf "$OUT/results.tar.gz.tmp" -T -); [ $? -le 1 ] \
        && mv -f "$OUT/results.tar.gz.tmp" "$OUT/results.tar.gz"
    }
    t0=$(date +%s); seen=0; last=$t0
    while [ ! -e $RES/done ] && [ $(( $(date +%s) - t0 )) -lt ${WAIT_S:-540} ]; do
      sleep 5; n=$(wc -l < $RES/ray_vllm.log 2>/dev/null || echo 0)
      [ "$n" -gt "$seen" ] && { sed -n "$((seen + 1)),${n}p" $RES/ray_vllm.log | grep -v "Warning\|warn(" | cut -c1-250; seen=$n; }
      [ $(( $(date +%s) - last )) -ge 30 ] && { collect; last=$(date +%s); }
      # a hand-off for a call that cannot change its command (poll only): gpu_after.sh in the project root (untracked,
      # never committed) names on its first line ("# path") a file under the results; once it exists the job is
      # stopped, its processes (Ray's too) killed, and the script runs here, its output in after.log
      after=$([ -e gpu_after.sh ] && head -n 1 gpu_after.sh | sed -n 's/^# *\([^ !].*\)$/\1/p')
      if [ "$step" = poll ] && [ -n "$after" ] && [ -f "$RES/$after" ]; then
        kill -9 -- -"$(cat $RES/job.pid)" 2>/dev/null; sleep 2
        pkill -9 -f 'raylet|gcs_server|ray::|default_worker.py|python3 -m fp8rl' 2>/dev/null; sleep 5
        echo "job stopped for gpu_after.sh"; nvidia-smi --query-gpu=memory.used --format=csv,noheader
        RES=$RES bash gpu_after.sh > $RES/after.log 2>&1; tail -n 20 $RES/after.log; touch $RES/done
      fi
    done
    collect
    [ -e $RES/done ] && echo "RUN DONE: $(tail -n 1 $RES/ray_vllm.log)" || echo "RUN STILL GOING: poll"
    ;;
  *) echo "unknown step $step"; exit 2;;
esac
