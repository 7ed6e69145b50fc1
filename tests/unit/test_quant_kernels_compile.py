"""The fused FP8 quantization kernels compile for Hopper (sm_90) on a machine without a GPU.

Triton compiles ahead of time for a named target (its bundled ptxas), so a kernel that no longer compiles is caught
here rather than on the lent GPU; what the kernels compute is tested byte for byte there
(``tests/gpu/test_quant_kernels.py``). Every kernel, both scalings (plain and power-of-two scales), both formats.
"""

from __future__ import annotations

import pytest

tl = pytest.importorskip("triton.language")

from fp8rl.quant import kernels, launch_config, row_linear  # noqa: E402
from fp8rl.quant.kernels import compile_ahead  # noqa: E402


@pytest.mark.parametrize("pow2", [False, True], ids=["plain", "pow2"])
@pytest.mark.parametrize(("fp8", "fmt_max", "out"), [("fp8e4nv", 448.0, "float8e4nv"), ("fp8e5", 57344.0, "float8e5")])
def test_every_quantization_kernel_compiles_for_sm90(pow2: bool, fp8: str, fmt_max: float, out: str) -> None:
    fmt = {"FMT_MAX": fmt_max, "POW2": pow2, "OUT": getattr(tl, out)}
    br, warps, _ = launch_config.GROUPS_ROWWISE_CONFIG
    cast_rows, cast_cols, cast_warps = row_linear.CAST_TILE
    bc_t, warps_t, _ = launch_config.GROUPS_COLWISE_CONFIG
    # (rows, columns per program, rowwise, transposed, warps): the split mode's two launches, the one-read mode
    group_launches = [(br, 128, True, False, warps), (128, bc_t, False, True, warps_t), (128, 128, True, True, 16)]
    cubins = [
        compile_ahead(
            kernels._groups_kernel, fp8,
            fmt | {"G": 128, "BR": r, "BC": c, "ROWWISE": rw, "TRANSPOSE": tr}, w, specialize=specialize,
        )
        for r, c, rw, tr, w in group_launches
        for specialize in (False, True)  # as written, and as Triton specializes a launch at run time
    ]  # fmt: skip
    cubins += [
        compile_ahead(
            kernels._tiles_kernel, fp8, fmt | {"BR": 128, "BC": 128, "TRANSPOSE": True}, launch_config.TILES_WARPS
        ),
        compile_ahead(kernels._rows_kernel, fp8, fmt | {"BR": 4, "BC": 1024}, 4),
        compile_ahead(kernels._cast_tensor_kernel, fp8, fmt | {"BR": 32, "BC": 256}, 4),
    ]
    cubins += [
        compile_ahead(
            row_linear._cast_rows_cols_kernel, fp8,
            fmt | {"BR": cast_rows, "BC": cast_cols, "ROWWISE": rw, "TRANSPOSE": tr}, cast_warps,
        )
        for rw, tr in ((True, False), (True, True), (False, True))
    ]  # fmt: skip
    cubins += [
        compile_ahead(row_linear._row_one_pass_kernel, fp8, fmt | {"BC": bc}, 8)
        for bc in (4096, row_linear.ONE_PASS_MAX)
    ]
    assert all(c[:4] == b"\x7fELF" for c in cubins)  # each an sm_90 ELF cubin


def test_the_row_and_column_amax_kernel_compiles_for_sm90() -> None:
    br, bc, warps = row_linear.AMAX_TILE
    for rows, cols in ((True, False), (True, True), (False, True)):
        consts = {"BR": br, "BC": bc, "ROWS": rows, "COLS": cols}
        assert compile_ahead(row_linear._amax_rows_cols_kernel, "fp8e4nv", consts, warps)[:4] == b"\x7fELF"
