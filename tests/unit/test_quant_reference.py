"""fp8rl.quant against an independent float64 reference of the FP8 formats and scaling rules."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fp8rl.quant import (
    E4M3,
    E5M2,
    FP8Format,
    NonFiniteError,
    QuantSpec,
    dequantize,
    fp8_gemm,
    quantize,
    quantize_activation,
    quantize_blockwise,
    quantize_weight,
    round_scale_up_to_pow2,
)


def fp8_grid(fmt: FP8Format) -> np.ndarray:
    """All finite non-negative values of the format, from its definition (not from torch)."""
    exp_bits = 4 if fmt is E4M3 else 5
    m_bits = fmt.mantissa_bits
    bias = 2 ** (exp_bits - 1) - 1
    values = [m / 2**m_bits * 2.0 ** (1 - bias) for m in range(2**m_bits)]  # zero and subnormals
    for e in range(1, 2**exp_bits):
        for m in range(2**m_bits):
            v = (1 + m / 2**m_bits) * 2.0 ** (e - bias)
            if v <= fmt.max:
                values.append(v)
    grid = np.array(sorted(set(values)))
    assert grid[-1] == fmt.max
    return grid


def ref_round(v: np.ndarray, fmt: FP8Format) -> np.ndarray:
    """Round-to-nearest-even onto the format's grid, saturating at +-max (float64)."""
    grid = fp8_grid(fmt)
    mag = np.minimum(np.abs(v), fmt.max)
    idx = np.clip(np.searchsorted(grid, mag), 1, len(grid) - 1)
    lo, hi = grid[idx - 1], grid[idx]
    pick_hi = (mag - lo > hi - mag) | ((mag - lo == hi - mag) & (idx % 2 == 0))
    out = np.where(pick_hi, hi, lo)
    out = np.where(mag == 0, 0.0, out)
    return np.sign(v) * out


def ref_quantize_groups(x: np.ndarray, fmt: FP8Format, pow2: bool) -> tuple[np.ndarray, np.ndarray]:
    """Quantize each row of x (one group per row) with the documented formulas in float64."""
    amax = np.max(np.abs(x), axis=1)
    scale = np.float32(np.maximum(amax, 1e-10).astype(np.float64) / fmt.max)  # IEEE float32 division
    if pow2:
        scale = np.float32(2.0 ** np.ceil(np.log2(scale.astype(np.float64))))
    inv = np.float32(1.0 / scale.astype(np.float64))  # IEEE float32 reciprocal, once per group
    ratio = np.float32(x.astype(np.float32) * inv[:, None])  # one float32 multiply per value
    return ref_round(ratio.astype(np.float64), fmt), scale.astype(np.float64)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_grid_matches_torch_dtype(fmt: FP8Format) -> None:
    grid = fp8_grid(fmt)
    every_byte = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).to(torch.float64).numpy()
    finite = np.unique(np.abs(every_byte[np.isfinite(every_byte)]))
    np.testing.assert_array_equal(finite, grid)
    assert fmt.min_subnormal == grid[1] and fmt.min_normal == grid[2**fmt.mantissa_bits]


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (1, 5), (129, 1)])
def test_block_quantization_equals_reference(fmt: FP8Format, pow2: bool, shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen, dtype=torch.float32) * torch.logspace(-3, 2, shape[1])
    q = quantize_blockwise(x, (1, 128), fmt, pow2)
    xs = x.numpy()
    k = shape[1]
    for j in range(math.ceil(k / 128)):
        cols = slice(128 * j, min(128 * (j + 1), k))
        ref_q, ref_s = ref_quantize_groups(xs[:, cols], fmt, pow2)
        np.testing.assert_array_equal(q.scale_inv[:, j].numpy().astype(np.float64), ref_s)
        np.testing.assert_array_equal(q.data[:, cols].to(torch.float64).numpy(), ref_q)


def test_values_are_scaled_by_the_reciprocal_not_divided() -> None:
    """``x * (1 / s)`` and ``x / s`` round to different FP8 bytes for a few values next to a rounding boundary; the
    quantizers (and the fused kernels, tested against them on the GPU) take the reciprocal's."""
    amax = np.float32(1.3092078)  # the group's scale: float32(amax / 448)
    s = np.float32(np.float64(amax) / E4M3.max)
    grid = fp8_grid(E4M3)
    mids = (grid[1:] + grid[:-1]) / 2  # FP8 rounding boundaries; values a few float32 ulps around mid * s
    near = np.float32(mids * np.float64(s))
    x = np.concatenate([[amax], *(np.nextafter(near, np.float32(k * np.inf)) for k in (-1, 1)), near])
    for _ in range(3):
        x = np.concatenate([x, np.nextafter(x[1:], np.float32(np.inf)), np.nextafter(x[1:], np.float32(-np.inf))])
    x = np.unique(x).astype(np.float32).reshape(1, -1)
    divided = ref_round(np.float32(x.astype(np.float64) / np.float64(s)).astype(np.float64), E4M3)
    ref_q, ref_s = ref_quantize_groups(x, E4M3, pow2=False)
    assert (divided != ref_q).sum() > 0  # the two formulas do disagree somewhere in this group
    q = quantize_blockwise(torch.from_numpy(x), (1, x.shape[1]), E4M3, False)
    np.testing.assert_array_equal(q.scale_inv.numpy().astype(np.float64).ravel(), ref_s)
    np.testing.assert_array_equal(q.data.to(torch.float64).numpy(), ref_q)


def test_weight_tiles_equal_reference() -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(300, 260, generator=gen)
    q = quantize_weight(w, QuantSpec())
    assert q.scale_inv.shape == (3, 3)
    for i in range(3):
        for j in range(3):
            tile = w[128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)].numpy()
            ref_q, ref_s = ref_quantize_groups(tile.reshape(1, -1), E4M3, False)
            assert q.scale_inv[i, j].item() == ref_s[0]
            got = q.data[128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)].to(torch.float64).numpy()
            np.testing.assert_array_equal(got.reshape(1, -1), ref_q)


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_tensor_and_row_equal_reference(granularity: str) -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, 96, generator=gen) * torch.logspace(-2, 1, 64)[:, None]
    q = quantize(x, granularity)  # type: ignore[arg-type]
    groups = x.numpy().reshape(1, -1) if granularity == "tensor" else x.numpy()
    ref_q, ref_s = ref_quantize_groups(groups, E4M3, False)
    np.testing.assert_array_equal(q.data.to(torch.float64).numpy().reshape(ref_q.shape), ref_q)
    np.testing.assert_array_equal(q.scale_inv.numpy().reshape(-1).astype(np.float64), ref_s)
    assert q.scale_inv.shape == (() if granularity == "tensor" else (64, 1))


def test_pow2_rounding_is_exact() -> None:
    s = torch.tensor([1.0, 1.5, 0.25, 3.0, 2.0**-40, 7.0e-13, 0.75, 2.0**20 + 1], dtype=torch.float32)
    expected = [2.0 ** math.ceil(math.log2(v)) for v in s.double().tolist()]
    assert round_scale_up_to_pow2(s).tolist() == expected


def test_amax_maps_to_format_max_and_values_saturate() -> None:
    x = torch.tensor([[3.0, -7.0, 0.5, 7.0]])
    q = quantize_activation(x, QuantSpec())
    assert q.data.to(torch.float32).abs().max().item() == 448.0
    assert q.scale_inv.item() == np.float32(7.0 / 448.0)


def test_zero_groups_have_finite_scales() -> None:
    x = torch.zeros(4, 256)
    x[0, 200] = 1.0
    q = quantize_activation(x, QuantSpec())
    assert torch.isfinite(q.scale_inv).all() and (q.scale_inv > 0).all()
    assert torch.equal(dequantize(q), x)


def test_huge_and_tiny_values() -> None:
    x = torch.tensor([[1.0e30, -3.0e29, 1.0e25], [1.0e-30, -2.0e-31, 0.0]])
    q = quantize(x, "row")
    back = dequantize(q, torch.float64)
    assert torch.isfinite(back).all()
    # 1e30 and 3e29 land in the normal range (half-ulp relative error); 1e25 is
    # 1e-5 of the row's amax, so it lands among the subnormals of the scaled grid.
    rel = ((back[0, :2] - x[0, :2].double()).abs() / x[0, :2].double().abs()).max().item()
    assert rel <= 2.0**-4
    scale = q.scale_inv[0, 0].double().item()
    assert abs(back[0, 2].item() - 1.0e25) <= 0.5 * E4M3.min_subnormal * scale
    # Below the amax floor (1e-10) everything is representable only as zero or a few
    # subnormal steps of 1e-10/448: the absolute error stays below half a step.
    assert (back[1] - x[1].double()).abs().max().item() <= 0.5 * E4M3.min_subnormal * 1e-10 / 448


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
def test_non_finite_input_raises(bad: float, granularity: str) -> None:
    x = torch.randn(8, 256)
    x[3, 7] = bad
    with pytest.raises(NonFiniteError, match="NaN or Inf"):
        quantize(x, granularity, block=(1, 128))  # type: ignore[arg-type]


def test_non_contiguous_input_matches_contiguous() -> None:
    x = torch.randn(384, 256)
    xt = x.t()
    assert not xt.is_contiguous()
    a, b = quantize_weight(xt, QuantSpec()), quantize_weight(xt.contiguous(), QuantSpec())
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    assert torch.equal(a.scale_inv, b.scale_inv)


def test_input_dtypes_bf16_fp16_quantize_like_fp32() -> None:
    x = torch.randn(16, 256).to(torch.bfloat16)
    a = quantize_activation(x, QuantSpec())
    b = quantize_activation(x.float(), QuantSpec())
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    with pytest.raises(TypeError):
        quantize_activation(torch.ones(4, 4, dtype=torch.int32), QuantSpec())


def test_fp8_halves_bf16_bytes() -> None:
    w = torch.randn(1024, 1024, dtype=torch.bfloat16)
    q = quantize_weight(w, QuantSpec())
    assert q.nbytes == 1024 * 1024 + 64 * 4
    assert q.nbytes / (w.numel() * 2) < 0.51


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
def test_emulated_gemm_matches_float64(granularity: str) -> None:
    gen = torch.Generator().manual_seed(11)
    x, w = torch.randn(32, 256, generator=gen), torch.randn(384, 256, generator=gen)
    spec = QuantSpec(granularity=granularity)  # type: ignore[arg-type]
    xq, wq = quantize_activation(x, spec), quantize_weight(w, spec)
    out = fp8_gemm(xq, wq, out_dtype=torch.float32, backend="emulated")
    ref = dequantize(xq, torch.float64) @ dequantize(wq, torch.float64).t()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)
    # and it is an FP8 approximation of the exact product
    exact = x.double() @ w.double().t()
    assert ((out.double() - exact).norm() / exact.norm()).item() < 0.06
