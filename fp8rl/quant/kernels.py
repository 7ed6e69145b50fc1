"""Fused FP8 quantization kernels (Triton) for CUDA tensors: one pass over the input.

The torch code in :mod:`fp8rl.quant.quantize` is the reference; these kernels compute the same
function and are tested byte for byte against it on the GPU (``tests/gpu/test_quant_kernels.py``).
They do the same float32 arithmetic in the same order, so the bytes agree exactly:

    amax = max |x| over the group            (float32; order-free, so exact; NaN counts as +inf)
    s    = div_rn(max(amax, 1e-10), fmt_max)  IEEE division, as the reference's tensor division
    s    = 2^ceil(log2 s)                     on the float32 bit pattern (``pow2``)
    q    = rtne(clamp(x * div_rn(1, s), +-fmt_max))   one reciprocal per group, a multiply per value

Why fused: the reference makes a padded float32 copy, an ``abs``, a reduction, a division, a clamp
and a cast, each a pass over memory (about 5% of the copy bandwidth on an H100 for an 8192x4096
activation).  Here each program loads one tile once, reduces it in registers and writes the FP8
bytes and the scales, so a quantization moves the input once and the outputs once.

Kernels (each a function below):
    quantize_groups   ``[R, C]`` in 1 x G groups along C (activations, gradients; the forward and
                      dgrad GEMMs) and, in the same pass, the transpose ``[C, R]`` in 1 x G groups
                      along R (the wgrad GEMM contracts over tokens, so it needs both operands
                      grouped along R).  Rows may be padded with zeros to a multiple the GEMM needs.
    quantize_tiles    ``[R, C]`` in Br x Bc tiles (weights) and optionally the transposed bytes
                      (the dgrad GEMM's W^T: square tiles make quantize(W^T) == quantize(W)^T).
    quantize_rows     one scale per row (two passes over the row; the second mostly hits L2).
    quantize_tensor   one scale: an amax pass (atomic max), then a cast pass.

Scale layouts: every scale is written through explicit strides, so a caller can ask for the
row-major grid the reference returns or the "outer-dimension-major" layouts cuBLAS's block-scaled
GEMM reads (``fp8rl.quant.gemm``) without a copy.
"""

from __future__ import annotations

import math
from functools import cache

import torch

from fp8rl.quant import launch_config
from fp8rl.quant.formats import FP8Format
from fp8rl.quant.launch_config import COPIES, TILE_COPIES, is_pow2, launch_kernel

try:  # Triton ships with PyTorch's CUDA wheels on Linux; elsewhere the reference runs.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without Triton
    triton = None
    tl = None

AMAX_FLOOR = 1e-10  # the same floor as fp8rl.quant.scaling.AMAX_FLOOR (imported there, not here, to stay cycle-free)


@cache
def cuda_capability(index: int) -> tuple[int, int]:
    """The compute capability of CUDA device ``index`` (cached: it is asked on every linear call)."""
    return torch.cuda.get_device_capability(index)


def kernels_available(x: torch.Tensor) -> bool:
    """Whether the fused kernels can quantize ``x``: a CUDA tensor on an FP8-capable GPU (sm_89+) with Triton."""
    if triton is None or x.device.type != "cuda":
        return False
    return cuda_capability(x.device.index if x.device.index is not None else torch.cuda.current_device()) >= (8, 9)


def hopper(device: torch.device) -> bool:
    """Whether ``device`` is an sm_90 CUDA GPU and Triton is here: what the fused training linears' GEMMs
    (cuBLAS's block- and row-scaled ones) and quantizers need."""
    if device.type != "cuda" or triton is None:
        return False
    return cuda_capability(device.index if device.index is not None else torch.cuda.current_device())[0] == 9


def padded_shape(x: torch.Tensor, rows_out: int | None, who: str) -> tuple[int, int, int]:
    """``(R, C, R_out)`` of a 2-D ``x`` padded to ``rows_out`` rows (default R); ``ValueError`` naming ``who``."""
    if x.dim() != 2:
        raise ValueError(f"{who} needs a 2-D tensor, got shape {tuple(x.shape)}")
    r, c = x.shape
    r_out = r if rows_out is None else rows_out
    if r_out < r:
        raise ValueError(f"rows_out ({r_out}) must be at least the row count ({r})")
    return r, c, r_out


def supports_block(block: tuple[int, int]) -> bool:
    """Block shapes the kernels handle: powers of two up to 128 (1 x G groups or Br x Bc tiles)."""
    br, bc = block
    return is_pow2(br) and is_pow2(bc) and br <= 128 and 16 <= bc <= 128


def _fp8_tl_dtype(fmt: FP8Format):
    return tl.float8e4nv if fmt.name == "e4m3" else tl.float8e5


if triton is not None:

    @triton.jit
    def _abs_nan_as_inf(x):
        ax = tl.abs(x)
        return tl.where(ax == ax, ax, float("inf"))

    @triton.jit
    def _scale_of(amax, FMT_MAX: tl.constexpr, POW2: tl.constexpr):
        amax = tl.maximum(amax, 1e-10)
        s = tl.div_rn(amax, tl.zeros_like(amax) + FMT_MAX)
        if POW2:
            bits = s.to(tl.int32, bitcast=True)
            exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
            s = (exponent << 23).to(tl.float32, bitcast=True)
        return s

    @triton.jit
    def _inverse(s):
        # IEEE 1/s, once per scale: a division per value (div_rn is ~10 instructions and a slow-path check) made
        # these kernels bound by instruction issue, not bandwidth (docs/benchmarks.md)
        return tl.div_rn(tl.zeros_like(s) + 1.0, s)

    @triton.jit
    def _cast(x, inv, FMT_MAX: tl.constexpr, OUT: tl.constexpr):
        x, inv = tl.broadcast(x, inv)
        y = x * inv
        y = tl.minimum(tl.maximum(y, -FMT_MAX), FMT_MAX)
        return y.to(OUT, fp_downcast_rounding="rtne")

    @triton.jit
    def _groups_kernel(
        x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr,
        R, C, R_OUT,
        sx_r, sx_c, sq_r, ss_r, ss_g, sqt_c, sst_c, sst_g,
        FMT_MAX: tl.constexpr, POW2: tl.constexpr, OUT: tl.constexpr,
        G: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, ROWWISE: tl.constexpr, TRANSPOSE: tl.constexpr,
    ):  # fmt: skip
        # A program quantizes rows [pid_r*BR, +BR) x cols [pid_g*BC, +BC); with ROWWISE, BC == G (one group per row).
        pid_r = tl.program_id(0)
        pid_g = tl.program_id(1)
        rows = pid_r * BR + tl.arange(0, BR)
        cols = pid_g * BC + tl.arange(0, BC)
        col_ok = cols[None, :] < C
        # Kept in the input's dtype until the scaling: |x| and max are exact in any float format, and
        # half the registers (a 128x128 tile) leaves room for more programs per multiprocessor.
        x = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * sx_r + cols[None, :].to(tl.int64) * sx_c,
            mask=(rows[:, None] < R) & col_ok,
            other=0.0,
        )
        ax = _abs_nan_as_inf(x)
        out_ok = (rows[:, None] < R_OUT) & col_ok
        if ROWWISE:
            s = _scale_of(tl.max(ax, axis=1).to(tl.float32), FMT_MAX, POW2)
            q = _cast(x.to(tl.float32), _inverse(s)[:, None], FMT_MAX, OUT)
            tl.store(q_ptr + rows[:, None].to(tl.int64) * sq_r + cols[None, :], q, mask=out_ok)
            tl.store(s_ptr + rows.to(tl.int64) * ss_r + pid_g * ss_g, s, mask=rows < R_OUT)
        if TRANSPOSE:
            st = _scale_of(tl.max(ax, axis=0).to(tl.float32), FMT_MAX, POW2)
            qt = _cast(x.to(tl.float32), _inverse(st)[None, :], FMT_MAX, OUT)
            tl.store(qt_ptr + cols[None, :].to(tl.int64) * sqt_c + rows[:, None], qt, mask=out_ok)
            tl.store(st_ptr + cols.to(tl.int64) * sst_c + pid_r * sst_g, st, mask=cols < C)

    @triton.jit
    def _tiles_kernel(
        x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr,
        R, C,
        sx_r, sx_c, sq_r, ss_r, ss_c, sqt_c, sst_r, sst_c,
        FMT_MAX: tl.constexpr, POW2: tl.constexpr, OUT: tl.constexpr,
        BR: tl.constexpr, BC: tl.constexpr, TRANSPOSE: tl.constexpr,
    ):  # fmt: skip
        pid_r = tl.program_id(0)
        pid_c = tl.program_id(1)
        rows = pid_r * BR + tl.arange(0, BR)
        cols = pid_c * BC + tl.arange(0, BC)
        ok = (rows[:, None] < R) & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * sx_r + cols[None, :].to(tl.int64) * sx_c, mask=ok, other=0.0)
        amax = tl.max(tl.max(_abs_nan_as_inf(x), axis=1), axis=0).to(tl.float32)
        s = _scale_of(amax, FMT_MAX, POW2)
        q = _cast(x.to(tl.float32), _inverse(s), FMT_MAX, OUT)
        tl.store(q_ptr + rows[:, None].to(tl.int64) * sq_r + cols[None, :], q, mask=ok)
        tl.store(s_ptr + pid_r * ss_r + pid_c * ss_c, s)
        if TRANSPOSE:
            tl.store(qt_ptr + cols[None, :].to(tl.int64) * sqt_c + rows[:, None], q, mask=ok)
            tl.store(st_ptr + pid_c * sst_r + pid_r * sst_c, s)

    @triton.jit
    def _rows_kernel(
        x_ptr, q_ptr, s_ptr, R, C, sx_r, sx_c, sq_r,
        FMT_MAX: tl.constexpr, POW2: tl.constexpr, OUT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        row_ok = rows[:, None] < R
        base = x_ptr + rows[:, None].to(tl.int64) * sx_r
        amax = tl.zeros([BR], dtype=tl.float32)
        for c0 in range(0, C, BC):
            cols = c0 + tl.arange(0, BC)
            x = tl.load(base + cols[None, :].to(tl.int64) * sx_c, mask=row_ok & (cols[None, :] < C), other=0.0)
            amax = tl.maximum(amax, tl.max(_abs_nan_as_inf(x.to(tl.float32)), axis=1))
        s = _scale_of(amax, FMT_MAX, POW2)
        inv = _inverse(s)[:, None]
        for c0 in range(0, C, BC):
            cols = c0 + tl.arange(0, BC)
            ok = row_ok & (cols[None, :] < C)
            x = tl.load(base + cols[None, :].to(tl.int64) * sx_c, mask=ok, other=0.0).to(tl.float32)
            tl.store(q_ptr + rows[:, None].to(tl.int64) * sq_r + cols[None, :], _cast(x, inv, FMT_MAX, OUT), mask=ok)
        tl.store(s_ptr + rows, s, mask=rows < R)

    @triton.jit
    def _amax_kernel(x_ptr, amax_ptr, R, C, sx_r, sx_c, BR: tl.constexpr, BC: tl.constexpr):
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        ok = (rows[:, None] < R) & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * sx_r + cols[None, :].to(tl.int64) * sx_c, mask=ok, other=0.0)
        tl.atomic_max(amax_ptr, tl.max(tl.max(_abs_nan_as_inf(x.to(tl.float32)), axis=1), axis=0))

    @triton.jit
    def _cast_tensor_kernel(
        x_ptr, q_ptr, amax_ptr, s_ptr, R, C, sx_r, sx_c, sq_r,
        FMT_MAX: tl.constexpr, POW2: tl.constexpr, OUT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        ok = (rows[:, None] < R) & (cols[None, :] < C)
        s = _scale_of(tl.load(amax_ptr), FMT_MAX, POW2)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * sx_r + cols[None, :].to(tl.int64) * sx_c, mask=ok, other=0.0)
        tl.store(
            q_ptr + rows[:, None].to(tl.int64) * sq_r + cols[None, :],
            _cast(x.to(tl.float32), _inverse(s), FMT_MAX, OUT),
            mask=ok,
        )
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(s_ptr, s)


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(1, -1) if x.dim() == 1 else x.reshape(-1, x.shape[-1])


def quantize_groups(
    x: torch.Tensor,
    fmt: FP8Format,
    pow2: bool,
    group: int = 128,
    *,
    rowwise: bool = True,
    colwise: bool = False,
    rows_out: int | None = None,
    outer_major_scales: bool = False,
    config: tuple[int, int, str] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """1 x ``group`` quantization of a 2-D ``x [R, C]``: returns ``(q, s, qt, st)``.

    rowwise: ``q [R_out, C]``, ``s [R_out, ceil(C/group)]`` (groups along C).
    colwise: ``qt [C, R_out]``, ``st [C, ceil(R_out/group)]`` (groups along R: the transpose's 1 x group
             quantization, computed from the same loaded tile).
    ``rows_out`` (>= R, default R) pads the outputs with zero rows (the GEMMs need multiples of 16 or 128;
    zero rows leave every real group's amax unchanged).  ``outer_major_scales`` lays ``s`` and ``st`` out
    with stride ``(1, rows)`` -- what cuBLAS's 1x128 block scaling reads -- instead of row-major.
    ``config`` = ``(rows or columns per program, warps, mode)`` overrides the tuned launch (benchmarks): with
    only ``rowwise`` the first entry is rows per program; with ``colwise`` the mode ``"fused"`` writes both
    copies from one 128x128 tile per program, ``"split"`` runs a rowwise launch and a colwise-only launch
    over 128 x ``cols`` tiles (an extra read of the input, far fewer registers per program).
    """
    _, c, r_out = padded_shape(x, rows_out, "quantize_groups")
    if colwise and group > 128:
        raise ValueError("the transposed output needs groups of at most 128")
    q, s, qt, st = _group_outputs(x, fmt, r_out, c, group, rowwise, colwise, outer_major_scales)
    if r_out == 0 or c == 0:
        return q, s, qt, st
    size, warps, mode = config or (
        launch_config.GROUPS_COLWISE_CONFIG if colwise else launch_config.GROUPS_ROWWISE_CONFIG
    )

    def launch(rw: bool, cw: bool, br: int, bc: int, w: int) -> None:
        _launch_groups(x, (q, s, qt, st), fmt, pow2, group, r_out, (rw, cw), (br, bc), w)

    if not colwise:
        launch(True, False, size, group, warps)
    elif mode == "fused":  # one 128x128 tile per program: a program's rows are one transposed group
        launch(rowwise, True, group, group, warps)
    else:
        if rowwise:
            rows, rows_warps, _ = launch_config.GROUPS_ROWWISE_CONFIG
            launch(True, False, rows, group, rows_warps)
        launch(False, True, group, size, warps)
    return q, s, qt, st


def _group_outputs(
    x: torch.Tensor, fmt: FP8Format, r_out: int, c: int, group: int, rowwise: bool, colwise: bool,
    outer_major_scales: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """``quantize_groups``' outputs, empty: ``q [r_out, c]`` and ``s`` (rowwise), ``qt [c, r_out]`` and ``st``
    (colwise); scales row-major, or with stride ``(1, rows)`` for ``outer_major_scales``."""
    dev = x.device

    def scales(rows: int, groups: int) -> torch.Tensor:
        if outer_major_scales:
            return torch.empty(groups, rows, dtype=torch.float32, device=dev).t()
        return torch.empty(rows, groups, dtype=torch.float32, device=dev)

    q = torch.empty(r_out, c, dtype=fmt.dtype, device=dev) if rowwise else None
    s = scales(r_out, math.ceil(c / group)) if rowwise else None
    qt = torch.empty(c, r_out, dtype=fmt.dtype, device=dev) if colwise else None
    st = scales(c, math.ceil(r_out / group)) if colwise else None
    return q, s, qt, st


def _launch_groups(
    x: torch.Tensor, outs: tuple[torch.Tensor | None, ...], fmt: FP8Format, pow2: bool, group: int, r_out: int,
    copies: tuple[bool, bool], block: tuple[int, int], warps: int,
) -> None:  # fmt: skip
    """One launch of the 1 x ``group`` kernel over ``block``-sized programs, writing the rowwise copy, the
    transposed copy or both (``copies``) into ``outs`` = ``(q, s, qt, st)``; an output not written gets any
    tensor's pointer."""
    (rw, cw), (br, bc) = copies, block
    q, s, qt, st = outs
    r, c = x.shape
    launch_kernel(
        _groups_kernel, (triton.cdiv(r_out, br), triton.cdiv(c, bc)),
        (x, q if rw and q is not None else x, s if rw and s is not None else x,
         qt if cw and qt is not None else x, st if cw and st is not None else x,
         r, c, r_out,
         x.stride(0), x.stride(1),
         c, s.stride(0) if s is not None else 0, s.stride(1) if s is not None else 0,
         r_out, st.stride(0) if st is not None else 0, st.stride(1) if st is not None else 0),
        warps, ("1x", group, "/", r_out, "x", c, "/", COPIES[rw, cw]),
        FMT_MAX=fmt.max, POW2=pow2, OUT=_fp8_tl_dtype(fmt), G=group, BR=br, BC=bc,
        ROWWISE=rw, TRANSPOSE=cw,
    )  # fmt: skip


_Opt = torch.Tensor | None


def _tile_outputs(
    x: torch.Tensor, fmt: FP8Format, grid: tuple[int, int], transpose: bool, given: tuple[_Opt, _Opt, _Opt, _Opt]
) -> tuple[torch.Tensor, torch.Tensor, _Opt, _Opt]:
    """``quantize_tiles``'s ``(q, s, qt, st)``: ``given`` (``q_out, scale_out, qt_out, scale_t_out``) checked, or new."""
    q_out, scale_out, qt_out, scale_t_out = given
    (r, c), (n_r, n_c), dev = x.shape, grid, x.device
    for name, buf, shape in (("q_out", q_out, (r, c)), ("qt_out", qt_out, (c, r))):
        if buf is not None and (tuple(buf.shape) != shape or buf.dtype != fmt.dtype or not buf.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous {fmt.dtype} tensor of shape {list(shape)}")
    q = q_out if q_out is not None else torch.empty(r, c, dtype=fmt.dtype, device=dev)
    s = scale_out if scale_out is not None else torch.empty(n_r, n_c, dtype=torch.float32, device=dev)
    qt = (qt_out if qt_out is not None else torch.empty(c, r, dtype=fmt.dtype, device=dev)) if transpose else None
    st = None
    if transpose:
        st = scale_t_out if scale_t_out is not None else torch.empty(n_c, n_r, dtype=torch.float32, device=dev)
    if tuple(s.shape) != (n_r, n_c) or (st is not None and tuple(st.shape) != (n_c, n_r)):
        raise ValueError(f"scale outputs must be [{n_r}, {n_c}] (and its transpose)")
    return q, s, qt, st


def quantize_tiles(
    x: torch.Tensor,
    fmt: FP8Format,
    pow2: bool,
    block: tuple[int, int] = (128, 128),
    *,
    transpose: bool = False,
    scale_out: torch.Tensor | None = None,
    scale_t_out: torch.Tensor | None = None,
    q_out: torch.Tensor | None = None,
    qt_out: torch.Tensor | None = None,
    warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Br x Bc tile quantization of ``x [R, C]``: returns ``(q, s, qt, st)``.

    ``s [ceil(R/Br), ceil(C/Bc)]``; with ``transpose``, ``qt [C, R]`` holds the same bytes transposed and
    ``st`` is ``s`` transposed (for square tiles, exactly the quantization of ``x.T``).  ``scale_out`` /
    ``scale_t_out`` may be views with any strides (e.g. the zero-padded grids cuBLAS reads) to write into;
    ``q_out`` / ``qt_out`` (contiguous, of the output format) take the bytes in place: a weight requantized
    into the buffers a captured CUDA graph reads.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_tiles needs a 2-D tensor, got shape {tuple(x.shape)}")
    br, bc = block
    if transpose and br != bc:
        raise ValueError("the transposed output needs square tiles")
    r, c = x.shape
    n_r, n_c = math.ceil(r / br), math.ceil(c / bc)
    q, s, qt, st = _tile_outputs(x, fmt, (n_r, n_c), transpose, (q_out, scale_out, qt_out, scale_t_out))
    if r == 0 or c == 0:
        return q, s, qt, st
    launch_kernel(
        _tiles_kernel, (n_r, n_c),
        (x, q, s, qt if qt is not None else q, st if st is not None else s,
         r, c,
         x.stride(0), x.stride(1), c, s.stride(0), s.stride(1),
         r, st.stride(0) if st is not None else 0, st.stride(1) if st is not None else 0),
        warps or (launch_config.TILES_WARPS if br * bc >= 8192 else 4), (br, "x", bc, "/", r, "x", c, "/", TILE_COPIES[transpose]),
        FMT_MAX=fmt.max, POW2=pow2, OUT=_fp8_tl_dtype(fmt), BR=br, BC=bc, TRANSPOSE=transpose,
    )  # fmt: skip
    return q, s, qt, st


def quantize_rows(x: torch.Tensor, fmt: FP8Format, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row of ``x [..., C]``: ``(q [..., C], s [..., 1])``."""
    x2 = _as_2d(x)
    r, c = x2.shape
    q = torch.empty(r, c, dtype=fmt.dtype, device=x.device)
    s = torch.empty(r, 1, dtype=torch.float32, device=x.device)
    if r and c:
        br = 4
        launch_kernel(
            _rows_kernel, (triton.cdiv(r, br),), (x2, q, s, r, c, x2.stride(0), x2.stride(1), c), 4,
            FMT_MAX=fmt.max, POW2=pow2, OUT=_fp8_tl_dtype(fmt), BR=br, BC=1024,
        )  # fmt: skip
    return q.view(x.shape), s.view(*x.shape[:-1], 1)


def quantize_tensor(x: torch.Tensor, fmt: FP8Format, pow2: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One scale for the whole tensor: ``(q, s [], amax [])``; two passes (an amax must precede the cast)."""
    x2 = _as_2d(x) if x.dim() else x.reshape(1, 1)
    r, c = x2.shape
    q = torch.empty(r, c, dtype=fmt.dtype, device=x.device)
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    s = torch.empty((), dtype=torch.float32, device=x.device)
    br, bc = 32, 256
    grid = (triton.cdiv(max(r, 1), br), triton.cdiv(max(c, 1), bc))
    if r and c:
        launch_kernel(_amax_kernel, grid, (x2, amax, r, c, x2.stride(0), x2.stride(1)), 4, BR=br, BC=bc)
    launch_kernel(
        _cast_tensor_kernel, grid, (x2, q, amax, s, r, c, x2.stride(0), x2.stride(1), c), 4,
        FMT_MAX=fmt.max, POW2=pow2, OUT=_fp8_tl_dtype(fmt), BR=br, BC=bc,
    )  # fmt: skip
    return q.view(x.shape), s, amax


# the stride arguments a quantize_block_input launch passes as 1 (a contiguous input, outer-major scales)
UNIT_STRIDES = frozenset({"sx_c", "ss_r", "sst_c"})


def compile_ahead(
    kernel, fp8: str, constexprs: dict[str, object], num_warps: int, specialize: bool = False, capability: int = 90
) -> bytes:
    """The cubin Triton builds for ``kernel`` on a CUDA GPU of ``capability``, here, without one (its bundled ptxas):
    a bf16 input, FP8 outputs of Triton type ``fp8`` (``"fp8e4nv"``, ``"fp8e5"``), fp32 scales, i32 integers.
    ``specialize``: as Triton specializes a ``quantize_block_input`` launch at run time (``UNIT_STRIDES`` constant,
    the other integers divisible by 16), which changes the code.  For ``tests/unit/test_quant_kernels_compile.py``
    and ``experiments/quant_kernel_sass.py``."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    runtime = [p.name for p in kernel.params if not p.is_constexpr]
    ones = UNIT_STRIDES & set(runtime) if specialize else frozenset()
    consts = {**constexprs, **{a: 1 for a in ones}}
    pointers = {"x_ptr": "*bf16", "q_ptr": f"*{fp8}", "qt_ptr": f"*{fp8}"}
    sig = {n: "constexpr" if n in consts else pointers.get(n, "*fp32" if n.endswith("_ptr") else "i32") for n in names}
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in runtime if specialize and a not in ones}
    src = ASTSource(kernel, sig, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options={"num_warps": num_warps}).asm["cubin"]
