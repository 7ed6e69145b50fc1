"""CUDA IPC weight sync (``fp8rl.sync.ipc``) between two processes on one GPU.

The receiver is a second Python process, as a colocated rollout worker is: it maps the sender's packed
buffer from the pickled handle and reports the checksums of every tensor it sees, which must equal the
sender's bit for bit; the sender's buffer is freed after the receiver lets go.  The Ray path (trainer and
vLLM/torch rollout actors sharing the GPU) is ``tests/gpu/test_ray_ipc_sync.py``."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ROOT = Path(__file__).resolve().parents[2]

RECEIVER = """
import json, pickle, sys
import torch
from fp8rl.sync.buckets import payload_checksums
from fp8rl.sync.ipc import open_payload
shared = pickle.load(open(sys.argv[1], "rb"))
payload, buffer = open_payload(shared)
sums = payload_checksums(payload, shared.layout, "cuda").cpu().tolist()
fp8 = sorted(k for k, v in payload.items() if hasattr(v, "scale_inv"))
out = {"sums": sums, "fp8": fp8, "nbytes": buffer.numel(), "device": str(buffer.device)}
del payload, buffer  # unmaps: torch tells the sender through the shared reference count (a worker does the same)
torch.cuda.synchronize()
print(json.dumps(out))
"""


def _payload() -> dict[str, object]:
    from fp8rl.quant import QuantSpec
    from fp8rl.sync import requantize_for_rollout

    g = torch.Generator(device="cuda").manual_seed(0)
    weights = {
        "model.layers.0.mlp.up_proj.weight": torch.randn(384, 256, device="cuda", generator=g, dtype=torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(256, 200, device="cuda", generator=g).bfloat16(),
        "model.norm.weight": torch.randn(256, device="cuda", generator=g, dtype=torch.bfloat16),
        "lm_head.weight": torch.randn(1000, 256, device="cuda", generator=g, dtype=torch.bfloat16),
    }
    fp8 = {"model.layers.0.mlp.up_proj.weight", "model.layers.0.self_attn.q_proj.weight"}
    return requantize_for_rollout(weights, fp8, QuantSpec(granularity="block"))  # type: ignore[return-value]


def test_a_second_process_maps_the_payload_bit_for_bit(tmp_path: Path) -> None:
    from fp8rl.sync.buckets import layout_of, payload_checksums
    from fp8rl.sync.ipc import release, share_payload

    payload = _payload()
    shared, buffer = share_payload(payload)  # type: ignore[arg-type]
    expected = payload_checksums(payload, layout_of(payload), "cuda").cpu().tolist()  # type: ignore[arg-type]
    handle = tmp_path / "shared.pkl"
    handle.write_bytes(pickle.dumps(shared))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", RECEIVER, str(handle)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["sums"] == expected
    assert got["fp8"] == sorted(k for k, v in payload.items() if hasattr(v, "scale_inv"))
    assert got["nbytes"] == shared.nbytes == buffer.numel()
    # the receiver has exited: once the sender drops its buffer, the memory is the allocator's again
    before = torch.cuda.memory_allocated()
    del buffer
    release()
    assert torch.cuda.memory_allocated() <= before - shared.nbytes


def test_refusals_name_the_problem() -> None:
    from fp8rl.sync.ipc import IpcUnavailableError, local_device, share_payload

    with pytest.raises(IpcUnavailableError, match="needs the whole payload on one CUDA device"):
        share_payload({"w": torch.zeros(4)})
    with pytest.raises(IpcUnavailableError, match="is not visible in this process"):
        local_device("00000000-0000-0000-0000-000000000000")
    with pytest.raises(ValueError, match="payload is empty"):
        share_payload({})
