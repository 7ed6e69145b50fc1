#!/usr/bin/env bash
# Issue 13 in one call on the GPU machine: the fused-kernel GPU tests, the kernel/GEMM/linear benchmark table
# (FP8 next to BF16, same run), the torch trainer step and requantize + pack of an 8B-shaped model.
# Usage on the device, from the repository root: bash experiments/gpu_kernels.sh
# Writes $OUT/pytest_kernels.log, $OUT/kernels.json, $OUT/fp8_speed.json.
set -uo pipefail
export PYTHONPATH="$PWD:$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT="${OUT:-.}"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
# every GPU test module must collect (skip cleanly) on a machine without pydantic, vLLM or TE
python3 -m pytest -q -p no:cacheprovider --co tests/gpu 2>&1 | tail -2
python3 -m pytest -q -p no:cacheprovider --maxfail=25 ${TESTS:-tests/gpu/test_quant_kernels.py tests/gpu/test_quant_cuda.py} \
    > "$OUT/pytest_kernels.log" 2>&1
test_rc=$?
tail -25 "$OUT/pytest_kernels.log"
python3 -m fp8rl.bench.kernels --shapes "${SHAPES:-8192x14336x4096,8192x4096x4096,4096x4096x4096,16384x6144x4096,256x1536x1536}" \
    --json "$OUT/kernels.json" ${BENCH_ARGS:-}
bench_rc=$?
timeout "${SPEED_TIMEOUT:-300}" python3 experiments/gpu_fp8_speed.py ${SPEED_ARGS:-}
speed_rc=$?
echo "tests rc=$test_rc bench rc=$bench_rc speed rc=$speed_rc"
exit $(( test_rc || bench_rc || speed_rc ))
