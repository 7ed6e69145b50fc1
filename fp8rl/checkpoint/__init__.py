"""FP8 checkpoint conversion: HF safetensors <-> FP8 checkpoints that vLLM and transformers load natively.

The names below load their module on first use (PEP 562): ``fp8rl.checkpoint.cli`` is imported by every ``fp8rl``
command, and the conversion's modules bring in torch (1-2 s), which ``fp8rl --help``, ``fp8rl recipes`` or
``fp8rl accuracy report`` do not need.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fp8rl.lazy import lazy_names

if TYPE_CHECKING:
    from fp8rl.checkpoint.convert import MANIFEST_NAME, REPORT_JSON, REPORT_MD, ConvertOptions, convert_checkpoint
    from fp8rl.checkpoint.dequantize import dequantize_checkpoint, dequantize_weight
    from fp8rl.checkpoint.report import ConversionReport, TensorReport
    from fp8rl.checkpoint.shards import CheckpointError

_HOME = {
    "MANIFEST_NAME": "convert",
    "REPORT_JSON": "convert",
    "REPORT_MD": "convert",
    "ConvertOptions": "convert",
    "convert_checkpoint": "convert",
    "dequantize_checkpoint": "dequantize",
    "dequantize_weight": "dequantize",
    "ConversionReport": "report",
    "TensorReport": "report",
    "CheckpointError": "shards",
}

__all__ = [
    "MANIFEST_NAME",
    "REPORT_JSON",
    "REPORT_MD",
    "CheckpointError",
    "ConversionReport",
    "ConvertOptions",
    "TensorReport",
    "convert_checkpoint",
    "dequantize_checkpoint",
    "dequantize_weight",
]


__getattr__ = lazy_names(__name__, _HOME)
