"""Which way of writing the transposed FP8 copy is fast on this GPU (issue 13's open quantization target).

The 1 x 128 activation quantizer and the 128 x 128 weight quantizer reach 82-92% of the copy bandwidth on an
H100, but the transposed copies the wgrad / dgrad GEMMs need reach 50-57%: even the weight kernel that reads its
tile once and writes the same bytes twice drops from 82% to 50%, so the transposed store itself is slow.  This
script times the same computation written several ways, each checked byte for byte against
``fp8rl.quant.kernels`` (the tested reference of the fused path):

    base     the shipped kernels (pointer store whose contiguous axis is the tile's row axis)
    trans    ``tl.trans`` of the bf16 tile first, then reduce / cast / store along the contiguous axis
    pack     4 FP8 bytes of consecutive rows packed into one 32-bit word before the transposed store
    tma      the transposed tile written by a TMA descriptor store (``TensorDescriptor``)

for the colwise-only launch (the second launch of the split mode), the one-read fused launch (both copies from
one 128 x 128 tile) and the weight tiles.  Writes ``$OUT/transpose_probe.json`` (or the path given) and prints a
table.  Usage on the GPU machine: ``python3 experiments/gpu_transpose_probe.py``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8rl.bench.timing import copy_bandwidth_gbs, gpu_time_ms
from fp8rl.quant import kernels
from fp8rl.quant.formats import E4M3

FMAX = E4M3.max


@triton.jit
def _scale(amax, FMT_MAX: tl.constexpr):
    amax = tl.maximum(amax, 1e-10)
    return tl.div_rn(amax, tl.zeros_like(amax) + FMT_MAX)


@triton.jit
def _abs(x):
    ax = tl.abs(x)
    return tl.where(ax == ax, ax, float("inf"))


@triton.jit
def _cast(x, s, FMT_MAX: tl.constexpr):
    x, s = tl.broadcast(x, s)
    y = tl.div_rn(x, s)
    y = tl.minimum(tl.maximum(y, -FMT_MAX), FMT_MAX)
    return y.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def _cw_kernel(
    x_ptr, q_ptr, s_ptr, qt_ptr, qt32_ptr, st_ptr, qt_desc,
    R, C, sx_r, sst_c,
    FMT_MAX: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, ROWWISE: tl.constexpr, MODE: tl.constexpr,
):  # fmt: skip
    # rows [pid_r*BR, +BR) are one transposed group (BR == 128); cols [pid_c*BC, +BC).
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BR + tl.arange(0, BR)
    cols = pid_c * BC + tl.arange(0, BC)
    ok = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * sx_r + cols[None, :], mask=ok, other=0.0)
    if ROWWISE:  # BC == 128: one row group per row
        s = _scale(tl.max(_abs(x), axis=1).to(tl.float32), FMT_MAX)
        q = _cast(x.to(tl.float32), s[:, None], FMT_MAX)
        tl.store(q_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], q, mask=ok)
        tl.store(s_ptr + rows.to(tl.int64) + pid_c * R, s, mask=rows < R)  # outer-major [groups, R]
    if MODE == 0:  # trans
        xt = tl.trans(x)
        st = _scale(tl.max(_abs(xt), axis=1).to(tl.float32), FMT_MAX)
        qt = _cast(xt.to(tl.float32), st[:, None], FMT_MAX)
        tl.store(
            qt_ptr + cols[:, None].to(tl.int64) * R + rows[None, :], qt, mask=(cols[:, None] < C) & (rows[None, :] < R)
        )
    else:
        st = _scale(tl.max(_abs(x), axis=0).to(tl.float32), FMT_MAX)
        qt = _cast(x.to(tl.float32), st[None, :], FMT_MAX)
        if MODE == 1:  # pack 4 consecutive rows of one column into a 32-bit word (R % 4 == 0)
            b = qt.to(tl.uint8, bitcast=True).to(tl.uint32)
            b = tl.reshape(b, (BR // 4, 4, BC))
            sh = (tl.arange(0, 4) * 8).to(tl.uint32)
            w = tl.sum(b << sh[None, :, None], axis=1)  # distinct bit ranges: the sum is an OR
            wt = tl.trans(w)  # [BC, BR // 4]
            words = pid_r * (BR // 4) + tl.arange(0, BR // 4)
            tl.store(qt32_ptr + cols[:, None].to(tl.int64) * (R // 4) + words[None, :], wt,
                     mask=(cols[:, None] < C) & (words[None, :] < R // 4))  # fmt: skip
        else:  # tma
            qt_desc.store([pid_c * BC, pid_r * BR], tl.trans(qt))
    tl.store(st_ptr + cols.to(tl.int64) * sst_c + pid_r, st, mask=cols < C)


@triton.jit
def _tiles_t_kernel(
    x_ptr, q_ptr, s_ptr, qt_ptr, qt32_ptr, qt_desc, R, C,
    FMT_MAX: tl.constexpr, B: tl.constexpr, MODE: tl.constexpr,
):  # fmt: skip
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * B + tl.arange(0, B)
    cols = pid_c * B + tl.arange(0, B)
    ok = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], mask=ok, other=0.0)
    s = _scale(tl.max(tl.max(_abs(x), axis=1), axis=0).to(tl.float32), FMT_MAX)
    q = _cast(x.to(tl.float32), s, FMT_MAX)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], q, mask=ok)
    tl.store(s_ptr + pid_r * tl.cdiv(C, B) + pid_c, s)
    if MODE == 0:
        tl.store(qt_ptr + cols[:, None].to(tl.int64) * R + rows[None, :], tl.trans(q),
                 mask=(cols[:, None] < C) & (rows[None, :] < R))  # fmt: skip
    elif MODE == 1:
        b = tl.reshape(q.to(tl.uint8, bitcast=True).to(tl.uint32), (B // 4, 4, B))
        sh = (tl.arange(0, 4) * 8).to(tl.uint32)
        wt = tl.trans(tl.sum(b << sh[None, :, None], axis=1))
        words = pid_r * (B // 4) + tl.arange(0, B // 4)
        tl.store(qt32_ptr + cols[:, None].to(tl.int64) * (R // 4) + words[None, :], wt,
                 mask=(cols[:, None] < C) & (words[None, :] < R // 4))  # fmt: skip
    else:
        qt_desc.store([pid_c * B, pid_r * B], tl.trans(q))


MODES = {"trans": 0, "pack": 1, "tma": 2}


def colwise(x: torch.Tensor, mode: str, bc: int, warps: int, rowwise: bool):
    r, c = x.shape
    qt = torch.empty(c, r, dtype=torch.float8_e4m3fn, device=x.device)
    st = torch.empty(c, triton.cdiv(r, 128), dtype=torch.float32, device=x.device)
    q = torch.empty(r, c, dtype=torch.float8_e4m3fn, device=x.device) if rowwise else qt
    s = torch.empty(triton.cdiv(c, 128), r, dtype=torch.float32, device=x.device).t() if rowwise else st
    qt32 = qt.view(torch.int32) if r % 4 == 0 else qt
    desc = TensorDescriptor.from_tensor(qt, [bc, 128]) if mode == "tma" else None
    grid = (triton.cdiv(r, 128), triton.cdiv(c, bc))

    def run():
        _cw_kernel[grid](
            x, q, s, qt, qt32, st, desc, r, c, x.stride(0), st.stride(0),
            FMT_MAX=FMAX, BR=128, BC=bc, ROWWISE=rowwise, MODE=MODES[mode], num_warps=warps,
        )  # fmt: skip
        return q, s, qt, st

    return run


def tiles_t(x: torch.Tensor, mode: str, warps: int):
    r, c = x.shape
    q = torch.empty(r, c, dtype=torch.float8_e4m3fn, device=x.device)
    qt = torch.empty(c, r, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(triton.cdiv(r, 128), triton.cdiv(c, 128), dtype=torch.float32, device=x.device)
    qt32 = qt.view(torch.int32)
    desc = TensorDescriptor.from_tensor(qt, [128, 128]) if mode == "tma" else None
    grid = (triton.cdiv(r, 128), triton.cdiv(c, 128))

    def run():
        _tiles_t_kernel[grid](x, q, s, qt, qt32, desc, r, c, FMT_MAX=FMAX, B=128, MODE=MODES[mode], num_warps=warps)
        return q, s, qt, s

    return run


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.itemsize == 1:
        return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))
    return bool(torch.equal(a.contiguous(), b.contiguous()))


try:
    from triton.tools.tensor_descriptor import TensorDescriptor

    def _alloc(size: int, alignment: int, stream):
        return torch.empty(size, dtype=torch.int8, device="cuda")

    triton.set_allocator(_alloc)
except Exception:
    TensorDescriptor = None  # type: ignore[assignment,misc]


def main() -> None:
    out_path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(os.environ.get("OUT", ".")) / "transpose_probe.json"
    torch.manual_seed(0)
    copy = copy_bandwidth_gbs()
    results: dict[str, object] = {"device": torch.cuda.get_device_name(), "copy_gbs": copy, "rows": []}
    print(f"copy bandwidth {copy:.0f} GB/s")
    for m, k in [(8192, 4096), (8192, 14336), (2000, 4096)]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        n = m * k
        _, _, ref_qt, ref_st = kernels.quantize_groups(x, E4M3, False, 128, rowwise=False, colwise=True)
        ref_q, ref_s, _, _ = kernels.quantize_groups(x, E4M3, False, 128, outer_major_scales=True)
        ref_wq, ref_ws, ref_wqt, _ = kernels.quantize_tiles(x, E4M3, False, transpose=True)
        cases = [
            (
                "cw base",
                lambda x=x: kernels.quantize_groups(x, E4M3, False, 128, rowwise=False, colwise=True),
                3 * n,
                None,
            )
        ]
        cases.append(
            (
                "both base(split)",
                lambda x=x: kernels.quantize_groups(x, E4M3, False, 128, colwise=True, outer_major_scales=True),
                4 * n,
                None,
            )
        )
        cases.append(("tiles+T base", lambda x=x: kernels.quantize_tiles(x, E4M3, False, transpose=True), 4 * n, None))
        for mode in ("trans", "pack", "tma"):
            for bc, w in [(32, 4), (64, 4), (64, 8), (128, 8)]:
                cases.append((f"cw {mode} bc{bc} w{w}", colwise(x, mode, bc, w, False), 3 * n, "cw"))
            for w in (8, 16):
                cases.append((f"both {mode} w{w}", colwise(x, mode, 128, w, True), 4 * n, "both"))
            for w in (8, 16):
                cases.append((f"tiles+T {mode} w{w}", tiles_t(x, mode, w), 4 * n, "tiles"))
        only = os.environ.get("PROBE_ONLY")
        for name, fn, nbytes, kind in cases:
            if only and only not in name:
                continue
            row: dict[str, object] = {"shape": f"{m}x{k}", "name": name}
            try:
                if "pack" in name and m % 4:
                    raise ValueError("pack needs rows % 4 == 0")
                if "tma" in name and TensorDescriptor is None:
                    raise RuntimeError("no TensorDescriptor in this Triton")
                outs = fn()
                torch.cuda.synchronize()
                if kind == "cw":
                    ok = same(outs[2], ref_qt) and same(outs[3], ref_st)
                elif kind == "both":
                    ok = (
                        same(outs[0], ref_q)
                        and same(outs[1], ref_s)
                        and same(outs[2], ref_qt)
                        and same(outs[3], ref_st)
                    )
                elif kind == "tiles":
                    parts = {"q": same(outs[0], ref_wq), "s": same(outs[1], ref_ws), "qt": same(outs[2], ref_wqt)}
                    ok = all(parts.values())
                    if not ok:
                        diff = (outs[2].view(torch.uint8) != ref_wqt.view(torch.uint8)).nonzero()
                        row["mismatch"] = {"parts": parts, "qt_bytes": int(diff.shape[0]), "first": diff[:4].tolist()}
                        print(f"   mismatch {row['mismatch']}", flush=True)
                else:
                    ok = True
                ms = gpu_time_ms(fn)
                row.update(ok=ok, ms=ms, gbs=nbytes / ms / 1e6, of_copy=nbytes / ms / 1e6 / copy)
                print(
                    f"{m}x{k} {name:24s} {'OK ' if ok else 'BAD'} {ms:.4f} ms {nbytes / ms / 1e6:7.0f} GB/s {100 * nbytes / ms / 1e6 / copy:4.0f}%",
                    flush=True,
                )
            except Exception as exc:
                row.update(error=f"{type(exc).__name__}: {str(exc)[:300]}")
                print(f"{m}x{k} {name:24s} ERROR {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                traceback.print_exc(limit=1)
            results["rows"].append(row)  # type: ignore[union-attr]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(results, indent=1))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
