"""On-disk FP8 checkpoint layouts that vLLM and transformers load natively.

block (``quant_method: fp8``, DeepSeek-V3 / vLLM / transformers FineGrainedFP8)::

    config.json  quantization_config = {
        "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": [...],   # transformers' key
        "ignored_layers": [...]}           # vLLM's key, same list
    <module>.weight            float8_e4m3fn [out, in]
    <module>.weight_scale_inv  float32       [ceil(out/128), ceil(in/128)]

row / tensor (``quant_method: compressed-tensors``, format ``float-quantized``)::

    config_groups.group_0 = {"targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"|"tensor",
                    "symmetric": true, "dynamic": false},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token"|"tensor",
                              "symmetric": true, "dynamic": true}}
    ignore = [...]
    <module>.weight        float8_e4m3fn [out, in]
    <module>.weight_scale  float32       [out, 1] (channel) or [1] (tensor)

Why two formats: vLLM's ``fp8`` method reads only per-tensor or 128x128-block
weight scales, while per-channel weights with per-token dynamic activations -- the
``row`` recipe -- are what compressed-tensors' FP8 "channel"/"token" scheme
describes, and vLLM serves it with the same CUTLASS kernels.  Using it for
``tensor`` too keeps the two non-block layouts one code path.  In both formats the
stored scale is the dequantization multiplier (``w = q * scale``).
"""

from __future__ import annotations

from typing import Any

BLOCK_SCALE_SUFFIX = ".weight_scale_inv"
CT_SCALE_SUFFIX = ".weight_scale"


def scale_name(module: str, granularity: str) -> str:
    return module + (BLOCK_SCALE_SUFFIX if granularity == "block" else CT_SCALE_SUFFIX)


def quantization_config(
    granularity: str, weight_block: tuple[int, int], not_converted: list[str], fmt: str = "e4m3"
) -> dict[str, Any]:
    """The ``quantization_config`` entry of config.json for a converted checkpoint."""
    if granularity == "block":
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": fmt,
            "weight_block_size": list(weight_block),
            "modules_to_not_convert": not_converted,
            "ignored_layers": not_converted,
        }
    weight_strategy, act_strategy = ("channel", "token") if granularity == "row" else ("tensor", "tensor")
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": weight_strategy,
                    "symmetric": True,
                    "dynamic": False,
                },
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": act_strategy,
                    "symmetric": True,
                    "dynamic": True,
                },
                "output_activations": None,
            }
        },
        "ignore": not_converted,
        "kv_cache_scheme": None,
    }


def read_granularity(qcfg: dict[str, Any]) -> tuple[str, tuple[int, int]]:
    """(granularity, weight block) of a quantization_config written by :func:`quantization_config`."""
    method = qcfg.get("quant_method")
    if method == "fp8":
        block = qcfg.get("weight_block_size")
        if block is None:
            raise ValueError("per-tensor 'fp8' checkpoints (weight_scale) are not an fp8rl layout")
        return "block", (int(block[0]), int(block[1]))
    if method == "compressed-tensors":
        strategy = qcfg["config_groups"]["group_0"]["weights"]["strategy"]
        return ("row" if strategy == "channel" else "tensor"), (0, 0)
    raise ValueError(f"unsupported quant_method {method!r}")
