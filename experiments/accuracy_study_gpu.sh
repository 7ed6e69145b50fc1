#!/usr/bin/env bash
# The accuracy study (docs/accuracy.md) on an offline GPU machine that takes at most 64 MiB per command.
# vLLM + Ray travel as experiments/gpu_ray_vllm.sh's parts (.carry/rv1..rv4), the real model as experiments/gpu_engines.sh's
# (.carry/model1, .carry/model2), and MLflow's wheels (.whl/, ~32 MB) cut into four pieces that ride along the rv parts:
#   bash experiments/accuracy_study_gpu.sh pack               here: .whl/ -> .carry/w1 .. .carry/w4
#   bash experiments/accuracy_study_gpu.sh setup N            there, N = 1..4 back to back, carry .carry/rvN and .carry/wN
#   bash experiments/gpu_engines.sh model-part .carry/model1  there, then (PYTHONPATH=/tmp/site:$PWD)
#   bash experiments/gpu_engines.sh model .carry/model2
#   bash experiments/accuracy_study_gpu.sh start              there: the study, detached (setsid); waits up to WAIT_S
#   bash experiments/accuracy_study_gpu.sh wait               there: waits again for the running study
# The study stops its runs after DEADLINE_S (default 1000 s) from its start; they keep their last checkpoint and
# the report compares every run at the last step all of them evaluated. start/wait put the study's log and a tarball of
# its MLflow store (work dir /tmp/acc/work, the same path here: extract with tar -C / -xzf) under $OUT.
# RECIPES, SEEDS, PARALLEL, STEPS, CONFIG and SET (extra --set flags) change the study.
set -uo pipefail
step=${1:?step}; n=${2:-}
OUT=${OUT:-.}
WORK=/tmp/acc/work
LOG=/tmp/acc/study.log

collect() {
  cp "$LOG" "$OUT/study.log" 2>/dev/null
  for f in "$WORK"/accuracy/runs/*/train.log; do
    r=$(basename "$(dirname "$f")"); grep -E 'FP8 linears|step 0 held-out|eval|Error|error' "$f" | cut -c1-200 | tail -n 8 | sed "s/^/$r: /"
  done > "$OUT/runs_summary.log" 2>/dev/null
  tail -n 30 "$WORK"/accuracy/runs/*/train.log 2>/dev/null | cut -c1-300 > "$OUT/runs_tail.log"
  du -sh "$WORK"/* 2>/dev/null
  # the MLflow store and the study's bookkeeping (a few MB), not the checkpoints (GBs) or the engines' logs
  tar -C / -czf "$OUT/mlflow_store.tar.gz" --exclude='checkpoints' --exclude='*.pt' --exclude='*.safetensors' \
    --exclude='train.log' "${WORK#/}" 2>/dev/null
  nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv,noheader
  tail -n 25 "$LOG"
}

wait_study() {
  local t0; t0=$(date +%s)
  while [ -e /tmp/acc/study.pid ] && [ ! -e /tmp/acc/study.rc ]; do  # (a finished child of this shell stays a zombie)
    [ $(( $(date +%s) - t0 )) -ge "${WAIT_S:-540}" ] && { echo "STILL_RUNNING after ${WAIT_S:-540}s"; break; }
    sleep 10
  done
  [ -e /tmp/acc/study.rc ] && echo "STUDY_EXITED rc=$(cat /tmp/acc/study.rc)"
  collect
}

case $step in
  pack)  # here
    W=$(mktemp -d); tar -C .whl -cf "$W/whl.tar" . || exit 2
    rm -rf .carry/w1 .carry/w2 .carry/w3 .carry/w4; mkdir -p .carry/w1 .carry/w2 .carry/w3 .carry/w4
    split -n 4 -d "$W/whl.tar" "$W/part"
    for i in 1 2 3 4; do mv "$W/part0$((i - 1))" ".carry/w$i/part0$((i - 1))"; done
    sha256sum "$W/whl.tar" | cut -d' ' -f1 > .carry/w4/sha256; rm -rf "$W"; du -sb .carry/w*
    ;;
  setup)  # there, N = 1..4
    bash experiments/gpu_ray_vllm.sh part ".carry/rv$n" || exit 2
    mkdir -p /tmp/wparts && cp ".carry/w$n"/part* /tmp/wparts/ || exit 3
    if [ "$(ls /tmp/wparts | wc -l)" -eq 4 ]; then
      cat /tmp/wparts/part* > /tmp/whl.tar && echo "$(cat .carry/w4/sha256)  /tmp/whl.tar" | sha256sum -c - || exit 4
      mkdir -p /tmp/whl && tar -C /tmp/whl -xf /tmp/whl.tar || exit 5
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site2 /tmp/whl/*.whl \
        || exit 6
      PYTHONPATH=/tmp/site2 python3 -c "import mlflow; print('IMPORT_OK mlflow', mlflow.__version__)"
    fi
    ;;
  start)  # there
    export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_DEEP_GEMM=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
    export PYTHONPATH=/tmp/site:/tmp/site2:$PWD TRANSFORMERS_VERBOSITY=error
    mkdir -p /tmp/acc
    python3 -c "import torch, vllm, transformers, mlflow; print('torch', torch.__version__, 'vllm', vllm.__version__, \
'transformers', transformers.__version__, 'mlflow', mlflow.__version__, torch.cuda.get_device_name())"
    RECIPES=${RECIPES:-bf16,docs/configs/accuracy/fp8-rollout-no-is.yaml,fp8-rollout,fp8-e2e,fp8-e2e-row,fp8-e2e-row-kv}
    setflags=(); for s in ${SET:-}; do setflags+=(--set "$s"); done
    setsid bash -c "python3 -m fp8rl accuracy run --config ${CONFIG:-docs/configs/accuracy/smollm2.yaml} \
      --model /tmp/models/smollm2-135m-instruct --recipes $RECIPES --seeds ${SEEDS:-0,1,2} --work-dir $WORK \
      --parallel ${PARALLEL:-18} --stagger-s ${STAGGER_S:-3} --deadline-s ${DEADLINE_S:-1000} \
      ${STEPS:+--steps $STEPS} ${setflags[*]} > $LOG 2>&1; echo \$? > /tmp/acc/study.rc" &
    echo $! > /tmp/acc/study.pid
    sleep 5; wait_study
    ;;
  wait) wait_study ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
