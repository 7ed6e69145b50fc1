"""The Markdown of ``fp8rl bench step --profile-train``: each recipe's profiled policy step (kernel time by category,
launches, the compute stream's idle gaps, the "other" kernels that took longest, the FP8 quantization kernels and
the bandwidth each reached), from the ``ThroughputResult`` fields ``fp8rl.bench.throughput`` fills."""

from __future__ import annotations

from collections.abc import Sequence

from fp8rl.bench.throughput import ThroughputResult
from fp8rl.quant.launch_config import COPIES, TILE_COPIES


def _largest_first(values: dict[str, float]) -> list[tuple[str, float]]:
    return sorted(values.items(), key=lambda t: -t[1])


PROFILE_COLUMNS = ("gemm", "fp8_quantize", "attention", "optimizer", "nccl", "other")


def profile_table(results: Sequence[ThroughputResult]) -> list[str]:
    """``--profile-train``: each recipe's profiled policy step, kernel ms by category."""
    profiled = [r for r in results if r.train_device_ms or r.train_profile_error]
    if not profiled:
        return []
    lines = [
        "",
        "Train phase by kernel category (one more step after the timed ones, its policy step under the profiler; "
        "kernel ms, summed per category (NCCL overlaps compute and includes waiting); on Ray the rank with the most "
        "non-NCCL kernel time):",
        "",
        "| recipe | policy step s (profiled) | " + " | ".join(PROFILE_COLUMNS) + " | sum |",
        "|---|---|" + "---|" * (len(PROFILE_COLUMNS) + 1),
    ]
    for r in profiled:
        if r.train_profile_error:
            why = r.train_profile_error.splitlines()[0][:200].replace("|", "\\|")
            lines.append(f"| {r.recipe} | failed: {why} |")
            continue
        ms = r.train_device_ms or {}
        cells = " | ".join(f"{ms[c]:,.0f}" if c in ms else "-" for c in PROFILE_COLUMNS)
        train_s = f"{r.profiled_train_s:.2f}" if r.profiled_train_s is not None else "-"
        lines.append(f"| {r.recipe} | {train_s} | {cells} | {sum(ms.values()):,.0f} |")
    means = []
    for r in profiled:
        ms, calls = r.train_device_ms or {}, r.train_kernel_calls or {}
        each = [f"{c} {calls[c]:,.0f} kernels ({ms[c] / calls[c]:.3f} ms each)" for c in PROFILE_COLUMNS
                if calls.get(c) and c in ms]  # fmt: skip
        if each:
            means.append(f"- {r.recipe}: " + ", ".join(each))
    if means:
        lines += ["", "Kernel launches of that step by category, and the mean kernel:", "", *means]
    gaps = [_gap_line(r) for r in profiled if r.train_gap_ms]
    if gaps:
        lines += ["", "The compute stream's idle time between kernels in that step, by gap size (and the gaps of 1 ms "
                  "or more by the kind of kernel that ended each):", "", *gaps]  # fmt: skip
    tops = [_top_other_line(r) for r in profiled if r.train_top_other_ms]
    if tops:
        lines += ["", 'The "other" kernels that took the most time in that step (ms, launches):', "", *tops]
    return lines + _quantize_table(profiled)


def _top_other_line(r: ThroughputResult) -> str:
    ms, calls = r.train_top_other_ms or {}, r.train_top_other_calls or {}
    return f"- {r.recipe}: " + "; ".join(f"`{k}` {v:,.0f} ({calls.get(k, 0):,.0f})" for k, v in _largest_first(ms))


def _gap_line(r: ThroughputResult) -> str:
    ms, n, before = r.train_gap_ms or {}, r.train_gaps or {}, r.train_gap_ms_before or {}
    sizes = ", ".join(f"{k} {ms[k]:,.0f} ms in {n.get(k, 0):,.0f}" for k in ms)
    after = "; before " + ", ".join(f"{k} {v:,.0f} ms" for k, v in _largest_first(before))
    during = r.train_gap_ms_during_collective
    waits = "" if during is None else f"; {during:,.0f} ms of it while a collective ran"
    kernels = _largest_first(r.train_gap_ms_before_kernel or {})
    named = "; the long gaps by the kernel after: " + ", ".join(f"`{k}` {v:,.0f} ms" for k, v in kernels)
    return f"- {r.recipe}: {sum(ms.values()):,.0f} ms idle ({sizes}){after if before else ''}{waits}{named if kernels else ''}"


def quantize_bytes(label: str) -> float | None:
    """Bytes a quantization launch moves (bf16 input read once, one FP8 byte and 4/group scale bytes written per
    value and copy) from its ``fp8rl.quant.kernels`` label ``GxS/RxC/copies``; None for a label of another form.
    R is the launch's padded row count (the read counts up to 127 zero rows the kernel does not read)."""
    parts = label.split("/")
    try:
        group = [int(v) for v in parts[0].split("x")]
        rows, cols = (int(v) for v in parts[1].split("x"))
    except (ValueError, IndexError):
        return None
    copies = 2 if parts[2] in (COPIES[True, True], TILE_COPIES[True]) else 1
    values = rows * cols
    return values * 2 + copies * values * (1 + 4 / (group[0] * group[1]))


def _quantize_table(profiled: Sequence[ThroughputResult]) -> list[str]:
    """The profiled step's FP8 quantization kernels by what each quantized, with the bandwidth each reached."""
    lines: list[str] = []
    for r in profiled:
        ms, calls = r.train_quant_ms or {}, r.train_quant_calls or {}
        if not ms:
            continue
        if not lines:
            lines = [
                "",
                "FP8 quantization kernels of that step by what each quantized (granularity / rows x columns of a "
                "launch / copies written; GB/s: bf16 read once + FP8 bytes and scales written, over kernel time):",
                "",
                "| recipe | launch | kernels | ms | ms each | GB/s |",
                "|---|---|---|---|---|---|",
            ]
        for label, total in _largest_first(ms):
            n = calls.get(label, 0.0)
            size = quantize_bytes(label)
            gbps = f"{size * n / (total / 1e3) / 1e9:,.0f}" if size and n and total > 0 else "-"
            each = f"{total / n:.3f}" if n else "-"
            lines.append(f"| {r.recipe} | {label} | {n:,.0f} | {total:,.1f} | {each} | {gbps} |")
    return lines
