#!/usr/bin/env bash
# optim.cuda_graphs (issue 13) in one call on the GPU machine: its GPU tests, then the RL train phase at Llama-3.2-1B
# shape (BF16 vs FP8, eager vs CUDA graphs) and, with STEP=1, the 4-layer Llama-3-8B-width trainer step with
# compile_elementwise, with and without graphs.
# Usage on the device, from the repository root: bash experiments/gpu_graphs.sh
# Writes $OUT/pytest_graphs.log, $OUT/fp8_speed_rl.json and (STEP=1) $OUT/fp8_speed_step_{graphs,eager}.json.
set -uo pipefail
export PYTHONPATH="$PWD:$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT="${OUT:-.}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
rc=0
if [ "${TESTS:-1}" = 1 ]; then
    # two processes: a failed capture leaves its process's CUDA state unusable for the tests after it
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_graphs_trainer.py \
        > "$OUT/pytest_graphs.log" 2>&1 || rc=1
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_quant_kernels.py \
        -k "in_place or once_per_weight or share or train_linear" >> "$OUT/pytest_graphs.log" 2>&1 || rc=1
    grep -E "passed|failed|^E " "$OUT/pytest_graphs.log" | head -30
fi
if [ "${RL:-1}" = 1 ]; then
    timeout "${RL_TIMEOUT:-300}" python3 experiments/gpu_fp8_speed.py --sections rl --warmup 2 --steps 2 \
        --json fp8_speed_rl.json ${RL_ARGS:-} || rc=1
fi
if [ "${STEP:-0}" = 1 ]; then
    for mode in graphs eager; do
        flag=$([ $mode = graphs ] && echo --cuda-graphs)
        timeout 150 python3 experiments/gpu_fp8_speed.py --sections trainer --compile-elementwise $flag --steps 7 \
            --json "fp8_speed_step_$mode.json" || rc=1
    done
fi
exit $rc
