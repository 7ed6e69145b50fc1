"""Which path quantizes what: the torch reference on CPU, the fused kernels only where they can run.

The kernels themselves are GPU-only (tests/gpu/test_quant_kernels.py proves them byte-identical to
the reference); these tests pin the dispatch rules, the NaN/Inf contract of the unchecked path, the
CPU behaviour of the FP8 linears, and the benchmark command's argument errors.
"""

from __future__ import annotations

import pytest
import torch

from fp8rl.cli import main
from fp8rl.quant import NonFiniteError, QuantSpec, kernels, quantize, quantize_activation, quantize_weight
from fp8rl.quant.block_linear import block_linear_supported, padded_rows
from fp8rl.quant.quantize import check_scales_finite


def test_cpu_tensors_take_the_reference_and_refuse_the_triton_backend() -> None:
    x = torch.randn(130, 300)
    assert not kernels.kernels_available(x)
    auto, ref = quantize(x, "block", block=(1, 128)), quantize(x, "block", block=(1, 128), backend="torch")
    assert torch.equal(auto.data.view(torch.uint8), ref.data.view(torch.uint8))
    with pytest.raises(ValueError, match="backend='triton' needs"):
        quantize(x, "block", backend="triton")
    with pytest.raises(ValueError, match="backend must be"):
        quantize(x, "row", backend="cuda")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="float16/bfloat16"):
        quantize(torch.zeros(4, 4, dtype=torch.int32), "tensor")


@pytest.mark.parametrize(
    ("block", "ok"), [((1, 128), True), ((128, 128), True), ((32, 32), True), ((1, 100), False), ((256, 256), False)]
)
def test_kernel_block_shapes(block: tuple[int, int], ok: bool) -> None:
    assert kernels.supports_block(block) is ok


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
def test_unchecked_quantization_returns_a_non_finite_scale_and_one_check_catches_it(granularity: str) -> None:
    x = torch.randn(256, 256)
    x[7, 9] = float("inf")
    with pytest.raises(NonFiniteError):
        quantize(x, granularity)
    q = quantize(x, granularity, check_finite=False)
    assert not torch.isfinite(q.scale_inv).all()
    good = quantize(torch.randn(8, 128), granularity)
    check_scales_finite([good], "ok")
    with pytest.raises(NonFiniteError, match="many"):
        check_scales_finite([good, q], "many")


def test_requantize_for_rollout_checks_the_whole_model_once() -> None:
    from fp8rl.sync import requantize_for_rollout

    weights = {"a": torch.randn(256, 128), "b": torch.randn(128, 128), "n": torch.randn(128)}
    weights["b"][3, 3] = float("nan")
    with pytest.raises(NonFiniteError, match="requantize_for_rollout"):
        requantize_for_rollout(weights, {"a", "b"}, QuantSpec())
    ok = requantize_for_rollout({k: v for k, v in weights.items() if k != "b"}, {"a"}, QuantSpec())
    assert ok["n"].dtype == torch.bfloat16


def test_fused_linear_path_is_hopper_cuda_block_only() -> None:
    spec = QuantSpec()
    assert not block_linear_supported(4096, 4096, spec, torch.device("cpu"))
    assert padded_rows(1, 16) == 16 and padded_rows(129, 128) == 256 and padded_rows(0, 16) == 16


def test_fused_row_path_is_hopper_cuda_row_recipe_only() -> None:
    from fp8rl.quant.row_linear import padded_tokens, row_linear_supported
    from fp8rl.train.fp8_linear import FP8TrainLinear

    row = QuantSpec(granularity="row")
    assert not row_linear_supported(4096, 4096, row, torch.device("cpu"))
    assert padded_tokens(0) == 16 and padded_tokens(16) == 16 and padded_tokens(17) == 32
    lin = FP8TrainLinear.from_linear(torch.nn.Linear(256, 128, dtype=torch.bfloat16), row)
    assert lin._fused_operands() is None  # on the CPU: the reference linear, row-scaled


def test_train_linear_on_cpu_keeps_the_reference_path() -> None:
    from fp8rl.train.fp8_linear import FP8TrainLinear, _FP8LinearFunction

    torch.manual_seed(0)
    lin = FP8TrainLinear.from_linear(torch.nn.Linear(256, 128, dtype=torch.bfloat16), QuantSpec())
    assert lin._fused_operands() is None
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    assert torch.equal(lin(x), _FP8LinearFunction.apply(x, lin.weight, lin.bias, lin.spec))
    # the forward is the emulated FP8 GEMM of the reference quantizers
    spec = lin.spec
    want = (quantize_activation(x, spec).dequantize() @ quantize_weight(lin.weight, spec).dequantize().t()).to(x.dtype)
    assert torch.allclose(lin(x).float(), (want + lin.bias).float(), rtol=1e-2, atol=1e-2)


def test_bench_kernels_command_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from fp8rl.bench.kernels import parse_shapes

    assert parse_shapes("8192x4096x4096, 1x2x3") == [(8192, 4096, 4096), (1, 2, 3)]
    assert main(["bench", "kernels", "--shapes", "8192x4096"]) == 2
    assert "--shapes: '8192x4096' is not MxNxK" in capsys.readouterr().err
    assert main(["bench", "kernels", "--shapes", "128x128x128", "--launch-json", "x.json"]) == 2
    assert "--launch-json needs --sweep" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench", "kernels", "--shapes", "128x128x128"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bench_tables_render_every_section() -> None:
    from fp8rl.bench.kernels import format_tables

    result = {
        "device": "GPU", "torch": "2.x", "copy_gb_per_s": 3000.0,
        "quant": [{"shape": [8192, 4096], "kernel": "act 1x128 fused", "ms": 0.04, "eager_ms": 0.09, "gb_per_s": 2600.0, "fraction_of_copy": 0.87}],
        "gemm": [{"mnk": [8192, 4096, 4096], "bf16_ms": 0.48, "fp8_block_gemm_ms": 0.35, "act_quant_fused_ms": 0.12,
                  "block_speedup_incl_quant": 1.02, "block_speedup_gemm_only": 1.37, "fp8_block_1x128x1x128_gemm_ms": 0.44,
                  "tflops_bf16": 570.0, "tflops_fp8_block": 784.0}],
        "linear": [{"mnk": [8192, 4096, 4096], "bf16_ms": 1.1, "fp8_ms": 1.4, "speedup": 0.79, "bf16_back_to_back_ms": 1.0,
                    "fp8_back_to_back_ms": 1.1, "fp8_host_ms": 1.1, "speedup_back_to_back": 0.91, "bf16_device_ms": 1.06,
                    "fp8_device_ms": 0.88, "speedup_device": 1.21, "fp8_weight_requantized_each_call_ms": 1.7,
                    "speedup_weight_requantized": 0.69}],
        "sweep": {"rows": [{"shape": [8192, 4096], "kernel": "groups", "config": [32, 4], "ms": 0.039, "fraction_of_copy": 0.87}],
                  "best": {"rowwise": [32, 4], "colwise": [128, 8, "fused"], "tiles_warps": 16},
                  "default": {"rowwise": [32, 4], "colwise": [64, 4, "split"], "tiles_warps": 16}},
        "host_costs_us": {"quantize_groups": 45.0, "cprofile_fp8_linear_20_calls": "profile text"},
        "host_profile_8192x4096x4096": [{"op": "aten::_scaled_mm_v2", "self_cpu_us_per_call": 177.0, "count": 3.0}],
    }  # fmt: skip
    text = format_tables(result)
    for needle in ["| 8192x4096 | act 1x128 fused | 0.040 | 2600 | 87% |", "| 1.37x |", "0.91x", "1.21x",
                   "| 8192x4096 | groups | [32, 4] | 0.039 | 87% |", '"colwise": [128, 8, "fused"]' , "quantize_groups 45.0", "profile text", "aten::_scaled_mm_v2 177us"]:  # fmt: skip
        assert needle in text, needle
