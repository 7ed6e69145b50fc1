"""Does a CUDA graph lift the host-bound FP8 linear (issue 13)? Forward + backward of ``FP8TrainLinear`` and of
``nn.Linear`` (BF16) issued back to back, eager and as ``torch.cuda.make_graphed_callables`` (the forward and
the backward each replayed as one graph), at the shapes of the kernel benchmark. Prints and writes
``$OUT/graphed_linear.json``. Usage on the GPU machine: ``python3 experiments/gpu_graphed_linear.py``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8rl.bench.timing import back_to_back_ms
from fp8rl.quant import QuantSpec
from fp8rl.train.fp8_linear import FP8TrainLinear


def row(m: int, n: int, k: int) -> dict[str, float | list[int]]:
    out: dict[str, float | list[int]] = {"mnk": [m, n, k]}
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    for name in ("bf16", "fp8"):
        base = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        mod = base if name == "bf16" else FP8TrainLinear.from_linear(base, QuantSpec())

        def eager(mod: torch.nn.Module = mod) -> None:
            mod(x.view_as(x)).backward(g)

        out[f"{name}_eager_ms"], out[f"{name}_eager_host_ms"] = back_to_back_ms(eager)
        graphed = torch.cuda.make_graphed_callables(mod, (x.detach().clone().requires_grad_(True),))

        def replay(graphed: torch.nn.Module = graphed) -> None:
            graphed(x).backward(g)

        out[f"{name}_graphed_ms"], out[f"{name}_graphed_host_ms"] = back_to_back_ms(replay)
        # the graph computes what the eager module does (same weights, same input)
        x.grad = None
        ref = mod(x.detach()).float()
        got = graphed(x.detach().requires_grad_(True)).float()
        out[f"{name}_graphed_rel_err"] = float((got - ref).norm() / ref.norm())
    out["eager_speedup"] = out["bf16_eager_ms"] / out["fp8_eager_ms"]  # type: ignore[operator]
    out["graphed_speedup"] = out["bf16_graphed_ms"] / out["fp8_graphed_ms"]  # type: ignore[operator]
    print(
        f"{m}x{n}x{k}: eager bf16 {out['bf16_eager_ms']:.3f} / fp8 {out['fp8_eager_ms']:.3f} ms ({out['eager_speedup']:.2f}x); "
        f"graphed bf16 {out['bf16_graphed_ms']:.3f} / fp8 {out['fp8_graphed_ms']:.3f} ms ({out['graphed_speedup']:.2f}x); "
        f"graph vs eager rel err bf16 {out['bf16_graphed_rel_err']:.1e} fp8 {out['fp8_graphed_rel_err']:.1e}",
        flush=True,
    )
    return out


def main() -> None:
    rows = [row(*s) for s in [(8192, 14336, 4096), (8192, 4096, 4096), (4096, 4096, 4096), (256, 1536, 1536)]]
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    path = Path(os.environ.get("OUT", ".")) / "graphed_linear.json"
    path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
