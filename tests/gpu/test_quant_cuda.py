"""FP8 quantization and GEMM on CUDA: bit-identical to the CPU path, tensor cores agree with emulation."""

from __future__ import annotations

import pytest
import torch

from fp8rl.quant import QuantSpec, fp8_gemm, fp8_gemm_backend, quantize, quantize_activation, quantize_weight
from tests.conftest import cuda_fp8_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
needs_fp8 = pytest.mark.skipif(not cuda_fp8_available(), reason="needs FP8 tensor cores (sm_89+)")

SHAPES = [(4096, 4096), (1000, 3000), (129, 257), (7, 128), (1, 1)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("block", [(128, 128), (1, 128)])
def test_cuda_quantization_is_bit_identical_to_cpu(shape, granularity, fmt, pow2, block) -> None:
    gen = torch.Generator().manual_seed(hash((shape, granularity, fmt, pow2, block)) % 2**31)
    x = (torch.randn(shape, generator=gen) * torch.logspace(-4, 3, shape[1])).to(torch.bfloat16)
    x[0, 0] = 0.0
    cpu = quantize(x, granularity, fmt, block, pow2)
    gpu = quantize(x.cuda(), granularity, fmt, block, pow2)
    assert torch.equal(gpu.data.cpu().view(torch.uint8), cpu.data.view(torch.uint8))
    assert torch.equal(gpu.scale_inv.cpu(), cpu.scale_inv)


@needs_fp8
@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
@pytest.mark.parametrize("mnk", [(256, 512, 1024), (4096, 4096, 4096), (64, 1536, 256)])
def test_tensor_core_gemm_matches_emulation(granularity: str, mnk: tuple[int, int, int]) -> None:
    m, n, k = mnk
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
    spec = QuantSpec(granularity=granularity)  # type: ignore[arg-type]
    xq, wq = quantize_activation(x, spec), quantize_weight(w, spec)
    if granularity == "block" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("1x128 x 128x128 cuBLAS block scaling is Hopper-only")
    assert fp8_gemm_backend(xq, wq) == "scaled_mm"
    fast = fp8_gemm(xq, wq, out_dtype=torch.float32)
    ref = fp8_gemm(xq, wq, out_dtype=torch.float32, backend="emulated")
    # same FP8 operands; differences come from FP32 summation order and the bf16 output
    rel = ((fast - ref).norm() / ref.norm()).item()
    assert rel < 4e-3, rel
