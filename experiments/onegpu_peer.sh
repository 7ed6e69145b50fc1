#!/usr/bin/env bash
# The one-GPU headline beside TRL, run on the GPU machine by `experiments/gpu_stack.sh start`: the preset of this
# GPU (llama-8b-h200 on a 141 GB GPU, llama-3b-h100 on an 80 GB one; PRESET overrides), fp8rl's recipes then TRL's
# GRPOTrainer (scripts/bench_peer_trl.py), results under $RES/peer. TRL and its dependencies come as wheels in
# .carry/trl (installed here; pyarrow only where the image's is older than datasets needs).
set -uo pipefail
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n1)
preset=${PRESET:-$([ "${mem:-0}" -gt 100000 ] && echo llama-8b-h200 || echo llama-3b-h100)}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; df -h /tmp | tail -n1; free -g | head -n2
if [ -d .carry/trl ]; then
  have=$(python3 -c "import pyarrow; print(pyarrow.__version__.split('.')[0])" 2>/dev/null || echo 0)
  wheels=$(ls .carry/trl/*.whl | grep -v pyarrow); [ "$have" -lt 24 ] && wheels="$wheels $(ls .carry/trl/pyarrow-*.whl)"
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 $wheels || echo "TRL wheels: install failed"
fi
python3 -c "import trl, datasets, pyarrow; print('TRL', trl.__version__, 'datasets', datasets.__version__, 'pyarrow', pyarrow.__version__)"
echo "PRESET $preset"
date -u +"%T peer"; python3 scripts/bench_peer_trl.py --preset "$preset" --output-dir "$RES/peer" --work-dir /tmp/w
# the FP8 linear against BF16 at every decoder linear's shape of the 1B, 3B and 8B presets (16,384-token micro-batch):
# where an FP8 GEMM pays for its quantization
shapes=16384x512x2048,16384x2048x2048,16384x8192x2048,16384x2048x8192,16384x1024x3072,16384x3072x3072
shapes=$shapes,16384x8192x3072,16384x3072x8192,16384x1024x4096,16384x4096x4096,16384x14336x4096,16384x4096x14336
date -u +"%T kernels"; timeout 300 python3 -m fp8rl bench kernels --shapes "$shapes" --json "$RES/kernels-layer-shapes.json"
# MLflow's system metrics of an RL run on this GPU (the one-process loop, the tiny model): the system/ keys the run
# holds and the GPU ones' samples, from the run's own MLflow store
date -u +"%T system metrics run"
timeout 300 python3 -m fp8rl train --recipe fp8-e2e --steps 30 --sft-steps 100 --device cuda --work-dir /tmp/w/sysm \
  --set tracking.system_metrics_interval_s=1 > "$RES/sysm-train.log" 2>&1 || echo "system metrics run: exit $?"
python3 - <<'PY' || echo "system metrics: could not read the store"
import json, os
import mlflow
client = mlflow.MlflowClient("sqlite:////tmp/w/sysm/mlflow.db")
rows = []
for exp in client.search_experiments():
    for run in client.search_runs([exp.experiment_id]):
        keys = sorted(k for k in run.data.metrics if k.startswith("system/"))
        gpu = {k: [m.value for m in client.get_metric_history(run.info.run_id, k)] for k in keys if "gpu" in k}
        rows.append({"run": run.info.run_name, "status": run.info.status, "system_keys": keys, "gpu_samples": gpu})
        print("RUN", run.info.run_name, run.info.status, len(keys), "system keys;", sorted(gpu))
with open(os.path.join(os.environ["RES"], "system-metrics-gpu.json"), "w") as f:
    json.dump(rows, f, indent=1)
PY
date -u +"%T done"
