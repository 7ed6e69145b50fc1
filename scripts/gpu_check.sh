#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, CPU unit tests (Python 3.12 there), then the measurements.
# Usage on the device: bash scripts/gpu_check.sh   (writes $OUT/gpu_check.json and $OUT/pytest_gpu.log)
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT="${OUT:-.}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch, transformers, safetensors; print("torch", torch.__version__, "transformers", transformers.__version__, "safetensors", safetensors.__version__)'
python3 -m pytest -q -p no:cacheprovider tests/gpu -m gpu 2>&1 | tee "$OUT/pytest_gpu.log"
gpu_rc=${PIPESTATUS[0]}
python3 -m pytest -q -p no:cacheprovider tests/unit 2>&1 | tail -3
python3 scripts/gpu_check.py > "$OUT/gpu_check.stdout" 2>&1; check_rc=$?
tail -c 3000 "$OUT/gpu_check.stdout"
echo "gpu tests rc=$gpu_rc check rc=$check_rc"
exit $(( gpu_rc || check_rc ))
