"""The fused FP8 quantization kernels compile for Hopper (sm_90) on a machine without a GPU.

Triton compiles ahead of time for a named target (its bundled ptxas), so a kernel that no longer compiles is caught
here rather than on the lent GPU; what the kernels compute is tested byte for byte there
(``tests/gpu/test_quant_kernels.py``). Every kernel, both scalings (plain and power-of-two scales), both formats.
"""

from __future__ import annotations

from typing import Any

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fp8rl.quant import kernels  # noqa: E402

I32 = "i32"
GROUPS = ["x_ptr", "q_ptr", "s_ptr", "qt_ptr", "st_ptr", "R", "C", "R_OUT", "sx_r", "sx_c", "sq_r", "ss_r", "ss_g",
          "sqt_c", "sst_c", "sst_g"]  # fmt: skip
TILES = ["x_ptr", "q_ptr", "s_ptr", "qt_ptr", "st_ptr", "R", "C", "sx_r", "sx_c", "sq_r", "ss_r", "ss_c", "sqt_c",
         "sst_r", "sst_c"]  # fmt: skip
ROWS = ["x_ptr", "q_ptr", "s_ptr", "R", "C", "sx_r", "sx_c", "sq_r"]
CAST = ["x_ptr", "q_ptr", "amax_ptr", "s_ptr", "R", "C", "sx_r", "sx_c", "sq_r"]


def _compile(fn: Any, args: list[str], fp8: str, consts: dict[str, Any], warps: int, specialize: bool = False) -> bytes:
    """``specialize``: as Triton specializes a launch at run time (integer arguments equal to 1 become constants, the
    others are marked divisible by 16), which changes the code it generates."""
    types = {"x_ptr": "*bf16", "q_ptr": f"*{fp8}", "qt_ptr": f"*{fp8}", "s_ptr": "*fp32", "st_ptr": "*fp32",
             "amax_ptr": "*fp32"}  # fmt: skip
    ones = {"sx_c", "ss_r", "sst_c"} & set(args) if specialize else set()
    consts = consts | {a: 1 for a in ones}
    sig = {a: types.get(a, I32) for a in args} | {k: "constexpr" for k in consts}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(args) if specialize and a not in ones}
    src = ASTSource(fn, sig, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["cubin"]


@pytest.mark.parametrize("pow2", [False, True], ids=["plain", "pow2"])
@pytest.mark.parametrize(("fp8", "fmt_max", "out"), [("fp8e4nv", 448.0, "float8e4nv"), ("fp8e5", 57344.0, "float8e5")])
def test_every_quantization_kernel_compiles_for_sm90(pow2: bool, fp8: str, fmt_max: float, out: str) -> None:
    fmt = {"FMT_MAX": fmt_max, "POW2": pow2, "OUT": getattr(tl, out)}
    br, warps, _ = kernels.GROUPS_ROWWISE_CONFIG
    bc_t, warps_t, _ = kernels.GROUPS_COLWISE_CONFIG
    # (rows, columns per program, rowwise, transposed, warps): the split mode's two launches, the one-read mode
    group_launches = [(br, 128, True, False, warps), (128, bc_t, False, True, warps_t), (128, 128, True, True, 16)]
    cubins = [
        _compile(
            kernels._groups_kernel, GROUPS, fp8,
            fmt | {"G": 128, "BR": r, "BC": c, "ROWWISE": rw, "TRANSPOSE": tr}, w, specialize=specialize,
        )
        for r, c, rw, tr, w in group_launches
        for specialize in (False, True)  # as written, and as Triton specializes a launch at run time
    ]  # fmt: skip
    cubins += [
        _compile(
            kernels._tiles_kernel, TILES, fp8, fmt | {"BR": 128, "BC": 128, "TRANSPOSE": True}, kernels.TILES_WARPS
        ),
        _compile(kernels._rows_kernel, ROWS, fp8, fmt | {"BR": 4, "BC": 1024}, 4),
        _compile(kernels._cast_tensor_kernel, CAST, fp8, fmt | {"BR": 32, "BC": 256}, 4),
    ]
    assert all(c[:4] == b"\x7fELF" for c in cubins)  # each an sm_90 ELF cubin
