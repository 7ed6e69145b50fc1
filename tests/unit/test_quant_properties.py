"""Property-based round-trip bounds derived from the FP8 formats (hypothesis)."""

from __future__ import annotations

import hypothesis.extra.numpy as hnp
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8rl.quant import E4M3, E5M2, FP8Format, dequantize, quantize
from fp8rl.quant.quantize import expand_scale

FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


def roundtrip_bound(x: np.ndarray, scale: np.ndarray, fmt: FP8Format) -> np.ndarray:
    """Largest |deq(q(x)) - x| the format allows for each element.

    With v = x / s: in the normal range RNE to m mantissa bits errs by at most half
    an ulp, |v| * 2^-(m+1); below min_normal the grid step is min_subnormal, so the
    error is at most min_subnormal / 2.  Multiplying back by s scales both.  The
    float32 product x * (1 / s) (a rounded reciprocal, then a rounded multiply) adds
    at most ~2^-23 relative before the FP8 rounding.
    """
    v = np.abs(x) / scale
    normal = v * 2.0 ** -(fmt.mantissa_bits + 1)
    sub = np.full_like(v, fmt.min_subnormal / 2)
    return np.maximum(normal, sub) * scale * (1 + 2.0**-22) + np.abs(x) * 2.0**-23


finite_floats = st.floats(min_value=-(2.0**20), max_value=2.0**20, allow_nan=False, allow_infinity=False, width=32)
wide_floats = st.one_of(
    finite_floats,
    st.floats(min_value=-(2.0**-20), max_value=2.0**-20, allow_nan=False, width=32),  # subnormal range of the groups
)


@settings(max_examples=150, deadline=None)
@given(
    x=hnp.arrays(np.float32, hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=300), elements=wide_floats),
    granularity=st.sampled_from(["tensor", "row", "block"]),
    fmt=st.sampled_from(sorted(FORMATS)),
    pow2=st.booleans(),
    block_rows=st.sampled_from([1, 128]),
)
def test_roundtrip_within_format_bound(x: np.ndarray, granularity: str, fmt: str, pow2: bool, block_rows: int) -> None:
    f = FORMATS[fmt]
    q = quantize(torch.from_numpy(x), granularity, f, (block_rows, 128), pow2)  # type: ignore[arg-type]
    back = dequantize(q, torch.float64).numpy()
    scale = np.broadcast_to(expand_scale(q.scale_inv, q.data.shape, q.block).double().numpy(), x.shape)
    err = np.abs(back - x.astype(np.float64))
    assert np.all(err <= roundtrip_bound(x.astype(np.float64), scale, f))
    # scaled values never exceed the format's max, and the group amax is near it
    assert np.all(np.abs(q.data.to(torch.float64).numpy()) <= f.max)
    assert torch.isfinite(q.scale_inv).all() and (q.scale_inv > 0).all()


@settings(max_examples=60, deadline=None)
@given(
    x=hnp.arrays(np.float32, st.tuples(st.integers(1, 4), st.integers(1, 260)), elements=finite_floats),
    pow2=st.booleans(),
)
def test_group_amax_uses_the_top_of_the_range(x: np.ndarray, pow2: bool) -> None:
    q = quantize(torch.from_numpy(x), "row", "e4m3", pow2=pow2)
    top = q.data.to(torch.float32).abs().amax(dim=-1)
    amax = torch.from_numpy(np.abs(x)).amax(dim=-1)
    nonzero = amax > 1e-10
    # exact scales put the amax at 448; power-of-two scales lose at most one binade
    lower = 448.0 * (0.5 if pow2 else 1.0) * 0.99
    assert torch.all(top[nonzero] >= lower)
