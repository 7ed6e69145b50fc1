"""The tables ``fp8rl bench kernels`` prints from its results (``fp8rl.bench.kernels.run``)."""

from __future__ import annotations

import json
from typing import Any


def format_tables(r: dict[str, Any]) -> str:
    lines = [
        f"device {r['device']}, torch {r['torch']}, copy bandwidth {r['copy_gb_per_s']:.0f} GB/s (read + write)",
        "",
    ]
    lines += _quant_table(r["quant"]) + _gemm_table(r["gemm"]) + _linear_table(r["linear"])
    if "sweep" in r:
        lines += _sweep_table(r["sweep"])
    if "host_costs_us" in r:
        lines += [
            "",
            "host us per call: "
            + "; ".join(f"{k} {v:.1f}" for k, v in r["host_costs_us"].items() if isinstance(v, float)),
        ]
    if "host_costs_us" in r:
        lines += ["", r["host_costs_us"].get("cprofile_fp8_linear_20_calls", "")]
    if "host_profile_8192x4096x4096" in r:
        lines += [
            "",
            "host time per FP8 linear fwd+bwd (8192x4096x4096), top ops: "
            + "; ".join(
                f"{e['op']} {e['self_cpu_us_per_call']:.0f}us x{e['count']:.0f}"
                for e in r["host_profile_8192x4096x4096"][:12]
            ),
        ]
    return "\n".join(lines)


def _quant_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| shape | quantizer | ms | GB/s | of copy |", "|---|---|---|---|---|"]
    for q in rows:
        lines.append(
            f"| {q['shape'][0]}x{q['shape'][1]} | {q['kernel']} | {q['ms']:.3f} | {q['gb_per_s']:.0f} | {q['fraction_of_copy']:.0%} |"
        )
    return lines


def _gemm_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["", "| M x N x K | BF16 ms | FP8 block GEMM ms | fused act quant ms | FP8 incl. quant vs BF16 | GEMM only | 1x128x1x128 ms | TFLOP/s bf16 / fp8 |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for g in rows:
        if "fp8_block_gemm_ms" not in g:
            continue
        lines.append(
            f"| {'x'.join(map(str, g['mnk']))} | {g['bf16_ms']:.3f} | {g['fp8_block_gemm_ms']:.3f} | {g['act_quant_fused_ms']:.3f} "
            f"| {g['block_speedup_incl_quant']:.2f}x | {g['block_speedup_gemm_only']:.2f}x | {g['fp8_block_1x128x1x128_gemm_ms']:.3f} "
            f"| {g['tflops_bf16']:.0f} / {g['tflops_fp8_block']:.0f} |"
        )
    return lines


def _linear_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["", "| M x N x K | BF16 fwd+bwd ms | FP8 ms | speedup | back to back: BF16 / FP8 ms (host FP8 ms), speedup | device only: BF16 / FP8, speedup | W requantized each call |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for li in rows:
        lines.append(
            f"| {'x'.join(map(str, li['mnk']))} | {li['bf16_ms']:.3f} | {li['fp8_ms']:.3f} | {li['speedup']:.2f}x "
            f"| {li['bf16_back_to_back_ms']:.3f} / {li['fp8_back_to_back_ms']:.3f} ({li['fp8_host_ms']:.3f}), {li['speedup_back_to_back']:.2f}x "
            f"| {li['bf16_device_ms']:.3f} / {li['fp8_device_ms']:.3f}, {li['speedup_device']:.2f}x "
            f"| {li['fp8_weight_requantized_each_call_ms']:.3f}, {li['speedup_weight_requantized']:.2f}x |"
        )
    return lines


def _sweep_table(sw: dict[str, Any]) -> list[str]:
    lines = ["", f"launch sweep (default {json.dumps(sw['default'])}, fastest {json.dumps(sw['best'])}):",
             "", "| shape | kernel | config | ms | of copy |", "|---|---|---|---|---|"]  # fmt: skip
    for e in sw["rows"]:
        lines.append(
            f"| {e['shape'][0]}x{e['shape'][1]} | {e['kernel']} | {e['config']} | {e['ms']:.3f} | {e['fraction_of_copy']:.0%} |"
        )
    return lines
