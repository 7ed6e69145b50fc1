"""Every touch of vLLM internals, in one place, for vLLM 0.26.x only.

Nothing here monkey-patches vLLM: these are the few reads and writes of vLLM objects
that its public API does not cover.  Each function runs behind ``guarded``: it checks
the installed version first and fails loudly, naming the attribute, when the object it
reaches for is not where 0.26 keeps it.  ``tests/unit/test_vllm_engine.py`` exercises
each one on stand-in modules, ``tests/gpu/test_vllm_engine.py`` on a real engine.

What is touched and why:

- ``engine_model``: the model object of an in-process engine, through the public
  ``LLM.apply_model`` (it returns the module itself only when the engine runs in this
  process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).  Read for the bit-exact sync check:
  vLLM names fused parameters (``qkv_proj``, ``gate_up_proj``) and keeps block-FP8
  weights as ``weight`` float8_e4m3fn [out, in] + ``weight_scale_inv`` float32
  [ceil(out/128), ceil(in/128)] after ``process_weights_after_loading`` on CUDA
  (``CutlassFp8BlockScaledMMKernel``); ``fp8rl.rollout.vllm_weights`` un-fuses them.
- ``write_kv_scales`` / ``read_kv_scales``: the attention layer's per-tensor FP8 KV
  scales.  0.26 keeps them as 0-d float32 buffers ``_q_scale``/``_k_scale``/``_v_scale``
  (read by the FlashAttention kernels and by CUDA graphs, so they are written in place),
  with host copies ``_q_scale_float``/``_k_scale_float``/``_v_scale_float`` and
  ``_k_scale_cpu``/``_v_scale_cpu`` that other backends read.  vLLM itself only sets them
  from a checkpoint or once on the first forward; RL changes the weights every step.
- ``shutdown`` / ``release_memory``: ``LLM.llm_engine.engine_core.shutdown()`` (0.26's
  ``LLMEngine`` has no ``shutdown`` of its own), then vLLM's ``cleanup_dist_env_and_memory``
  frees the engine's GPU memory and its distributed state, so another engine can start in
  the same process.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
from torch import nn

from fp8rl.errors import UserError

SUPPORTED_VERSION_PREFIX = "0.26."
ATTENTION_MODULE = re.compile(r"^model\.layers\.(?P<layer>\d+)\.self_attn\.attn$")
SCALE_BUFFERS = ("_q_scale", "_k_scale", "_v_scale")
SCALE_FLOATS = ("_q_scale_float", "_k_scale_float", "_v_scale_float")
SCALE_CPU = ("_k_scale_cpu", "_v_scale_cpu")

_F = TypeVar("_F", bound=Callable[..., Any])


class VLLMPatchError(UserError, RuntimeError):
    """The installed vLLM is not the version these accessors were written for, or an object moved."""


def _installed_version() -> str:
    import vllm

    return str(vllm.__version__)


def check_version(version: str) -> None:
    if not version.startswith(SUPPORTED_VERSION_PREFIX):
        raise VLLMPatchError(
            f"fp8rl.rollout.vllm_patches is written for vLLM {SUPPORTED_VERSION_PREFIX}x, found vLLM {version}: "
            "install vllm==0.26.* (the fp8rl[gpu] extra), or re-check every accessor in this module against "
            "the new version before raising the pin"
        )


def guarded(fn: _F) -> _F:
    """Check the installed vLLM version before every call of ``fn``."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        check_version(_installed_version())
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def require_attrs(obj: object, names: tuple[str, ...], what: str) -> None:
    missing = [n for n in names if not hasattr(obj, n)]
    if missing:
        raise VLLMPatchError(
            f"{what} ({type(obj).__name__}) has no attribute(s) {missing}: vLLM moved them; "
            "fp8rl.rollout.vllm_patches must be updated for this vLLM version"
        )


@guarded
def engine_model(llm: Any) -> nn.Module:
    """The ``nn.Module`` an in-process ``vllm.LLM`` serves (a single worker)."""
    models = llm.apply_model(lambda model: model)
    if len(models) != 1 or not isinstance(models[0], nn.Module):
        raise VLLMPatchError(
            "LLM.apply_model did not hand back the model object: the engine must run in this process "
            "with one worker (VLLM_ENABLE_V1_MULTIPROCESSING=0, tensor_parallel_size=1)"
        )
    return models[0]


def attention_layers(model: nn.Module) -> dict[int, nn.Module]:
    """The attention modules by decoder-layer index (``model.layers.N.self_attn.attn``)."""
    found: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        m = ATTENTION_MODULE.match(name)
        if m:
            require_attrs(module, SCALE_BUFFERS + SCALE_FLOATS + SCALE_CPU, name)
            found[int(m["layer"])] = module
    if not found:
        raise VLLMPatchError("no module named model.layers.N.self_attn.attn in the vLLM model: its layout moved")
    return found


@guarded
def write_kv_scales(model: nn.Module, scales: Mapping[int, tuple[float, float, float]]) -> None:
    """Set each layer's (q, k, v) FP8 scales in place (dequantization multipliers: x = x_fp8 * scale)."""
    layers = attention_layers(model)
    unknown = sorted(set(scales) - set(layers))
    if unknown:
        raise KeyError(f"the vLLM model has no attention layer(s) {unknown}")
    with torch.no_grad():  # compressed-tensors' KV method points _k_scale etc. at its nn.Parameters (grad on)
        _write_kv_scales(layers, scales)


def _write_kv_scales(layers: Mapping[int, nn.Module], scales: Mapping[int, tuple[float, float, float]]) -> None:
    for index, (q, k, v) in scales.items():
        layer = layers[index]
        for buffer, float_attr, value in zip(SCALE_BUFFERS, SCALE_FLOATS, (q, k, v), strict=True):
            tensor = getattr(layer, buffer)
            if not isinstance(tensor, torch.Tensor) or tensor.numel() != 1:
                raise VLLMPatchError(f"layer {index}: {buffer} is not a one-element tensor; vLLM changed its KV scales")
            tensor.fill_(float(value))  # in place: CUDA graphs hold this storage
            setattr(layer, float_attr, float(value))
        # getattr: plain tensor attributes, which mypy would type as nn.Module's Tensor | Module
        getattr(layer, "_k_scale_cpu").fill_(float(k))  # noqa: B009
        getattr(layer, "_v_scale_cpu").fill_(float(v))  # noqa: B009


@guarded
def read_kv_scales(model: nn.Module) -> dict[int, tuple[float, float, float]]:
    """Each layer's (q, k, v) scales as the kernels read them (the device buffers)."""
    out = {}
    for index, layer in attention_layers(model).items():
        q, k, v = (float(getattr(layer, b).item()) for b in SCALE_BUFFERS)
        out[index] = (q, k, v)
    return out


@guarded
def attention_backend_names() -> list[str]:
    """The attention backends this vLLM knows by name (``rollout.attention_backend`` is checked against them)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return sorted(AttentionBackendEnum.__members__)


@guarded
def shutdown(llm: Any) -> None:
    """Stop an in-process engine's core (vLLM 0.26's ``LLMEngine`` has no ``shutdown`` of its own; its
    ``engine_core`` client has).  The caller drops its references, then calls :func:`release_memory`."""
    require_attrs(llm, ("llm_engine",), "vllm.LLM")
    require_attrs(llm.llm_engine, ("engine_core",), "vllm.v1.engine.llm_engine.LLMEngine")
    llm.llm_engine.engine_core.shutdown()


@guarded
def release_memory() -> None:
    """Free the GPU memory and the distributed state an engine left, so another can start in this process."""
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()
