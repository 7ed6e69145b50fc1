"""FP8 checkpoint conversion: HF safetensors <-> FP8 checkpoints that vLLM and transformers load natively."""

from fp8rl.checkpoint.convert import MANIFEST_NAME, REPORT_JSON, REPORT_MD, ConvertOptions, convert_checkpoint
from fp8rl.checkpoint.dequantize import dequantize_checkpoint, dequantize_weight
from fp8rl.checkpoint.report import ConversionReport, TensorReport
from fp8rl.checkpoint.shards import CheckpointError

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
