#!/usr/bin/env bash
# Block-scaled FP8 GEMMs on the lent H100 (issue 13, item 2): cuBLAS (the project's path) vs vLLM 0.26.0's CUTLASS
# and Triton block GEMMs vs BF16, one process (experiments/gpu_block_gemm.py). vLLM travels as three parts
# (.carry/va, .carry/vb, .carry/vc, each under the 64 MiB a call may carry); /tmp survives only while the machine
# stays warm (about 30 s between commands), so issue the three device calls back to back, one part each:
#   bash experiments/gpu_block_gemm.sh part .carry/va
#   bash experiments/gpu_block_gemm.sh part .carry/vb
#   bash experiments/gpu_block_gemm.sh run .carry/vc      the last part, then the measurements (ARGS: extra options)
# Writes $OUT/block_gemm_cutlass_h100.json and $OUT/gpu_block_gemm.log.
set -uo pipefail
step=${1:?step}; carry=${2:-}
OUT=${OUT:-.}
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_DEEP_GEMM=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:$PWD
case $step in
  part)
    bash "$carry/device_setup.sh" "$carry" ;;
  run)
    [ -z "$carry" ] || bash "$carry/device_setup.sh" "$carry" || exit $?
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
    timeout "${BENCH_TIMEOUT:-420}" python3 experiments/gpu_block_gemm.py ${ARGS:-} 2>&1 | tee "$OUT/gpu_block_gemm.log" ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
