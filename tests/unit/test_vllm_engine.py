"""The vLLM engine's CPU-testable parts: naming and un-fusing, checkpoints, engine kwargs, KV scales, patches.

vLLM does not run here; what vLLM would hold is built independently (the fused tensors are
concatenated and quantized the way vLLM's loader fuses a checkpoint) and un-fused back.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from fp8rl.config import (
    ConfigError,
    QuantConfig,
    RolloutConfig,
    kv_scales_calibrated,
    load_recipe,
    parse_run_config,
)
from fp8rl.errors import UserError
from fp8rl.models import make_tiny_model
from fp8rl.models.loading import read_model_config
from fp8rl.quant import QuantizedTensor, QuantSpec, quantize_weight
from fp8rl.rollout import kv_calibration, vllm_patches
from fp8rl.rollout import vllm_engine as ve
from fp8rl.rollout import vllm_weights as vw
from fp8rl.sync import requantize_for_rollout
from fp8rl.train.trainer import SequenceBatch


def _recipe(name: str, **quant: Any) -> Any:
    r = load_recipe(name)
    return r.model_copy(update={"quant": r.quant.model_copy(update=quant)}) if quant else r


def _vllm_params(
    hf: dict[str, torch.Tensor], fp8: set[str], cfg: dict[str, Any], pad_vocab: int, granularity: str = "block"
) -> dict[str, Any]:
    """What vLLM holds for ``hf``: q/k/v and gate/up concatenated (then quantized as one tensor when FP8),
    vocabulary rows padded -- written from vLLM's packed_modules_mapping, not from fp8rl's layout.  Per-channel
    FP8 as vLLM's compressed-tensors W8A8 scheme keeps it after loading: the weight as ``weight.t()`` (a
    transposed view of the [out, in] bytes) and ``weight_scale`` [out, 1] (flat [out] for the fused modules,
    to cover both)."""
    spec, out = QuantSpec(granularity=granularity), {}  # type: ignore[arg-type]

    def put(module: str, w: torch.Tensor, flat_scale: bool) -> None:
        q = quantize_weight(w, spec)
        if granularity == "row":
            out[f"{module}.weight"] = q.data.t()
            out[f"{module}.weight_scale"] = q.scale_inv.flatten() if flat_scale else q.scale_inv
        else:
            out[f"{module}.weight"], out[f"{module}.weight_scale_inv"] = q.data, q.scale_inv

    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    for i in range(cfg["num_hidden_layers"]):
        for fused, parts in packed.items():
            sub = "self_attn" if fused == "qkv_proj" else "mlp"
            names = [f"model.layers.{i}.{sub}.{p}.weight" for p in parts]
            w = torch.cat([hf.pop(n) for n in names])
            if names[0] in fp8:
                put(f"model.layers.{i}.{sub}.{fused}", w, flat_scale=True)
            else:
                out[f"model.layers.{i}.{sub}.{fused}.weight"] = w
    for name, w in hf.items():
        if name in fp8:
            put(name.removesuffix(".weight"), w, flat_scale=False)
        elif name in vw.VOCAB_PARAMS:
            out[name] = torch.cat([w, torch.zeros(pad_vocab, w.shape[1], dtype=w.dtype)])
        else:
            out[name] = w
    return out


def _same(a: torch.Tensor | QuantizedTensor, b: torch.Tensor | QuantizedTensor) -> bool:
    if isinstance(a, QuantizedTensor) and isinstance(b, QuantizedTensor):
        return torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale_inv, b.scale_inv)
    return not isinstance(a, QuantizedTensor) and not isinstance(b, QuantizedTensor) and torch.equal(a, b)


@pytest.mark.parametrize("granularity", ["block", "row"])
@pytest.mark.parametrize(("preset", "first", "last"), [("tiny", 0, 0), ("small", 1, 1), ("small", 0, 2)])
def test_unfuse_gives_back_the_requantized_payload_bit_for_bit(
    preset: str, first: int, last: int, granularity: str
) -> None:
    """What the sync pushes is what ``held_weights`` reads back, per block or per channel (the latter from
    vLLM's transposed weights, as [out, in] views)."""
    model, _ = make_tiny_model(preset)
    cfg = model.config.to_dict()
    recipe = _recipe("fp8-rollout", bf16_first_layers=first, bf16_last_layers=last, granularity=granularity)
    fp8 = {m + ".weight" for m in vw.fp8_module_names_from_config(cfg, recipe)}
    hf = {n: p.detach() for n, p in model.named_parameters()}
    payload = requantize_for_rollout(hf, fp8, recipe.quant.spec())
    params = _vllm_params(dict(hf), fp8, cfg, pad_vocab=64, granularity=granularity)
    layout = vw.fused_layout(cfg)
    held = vw.unfuse_params(params, layout, cfg["vocab_size"])
    assert set(held) == set(payload)
    for name in fp8:
        value = held[name]
        assert isinstance(value, QuantizedTensor) and value.granularity == granularity
        module = name.removesuffix(".weight")
        base = params[(layout[module].target if module in layout else module) + ".weight"]
        assert value.data.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()  # a view, no copy
    bad = [n for n in payload if not _same(held[n], payload[n])]
    assert not bad
    # the BF16 layers are the recipe's first/last ones and only those
    bf16_layers = {
        int(n.split(".")[2]) for n in payload if "_proj" in n and not isinstance(payload[n], QuantizedTensor)
    }
    n = cfg["num_hidden_layers"]
    assert bf16_layers == set(range(first)) | set(range(n - last, n))


def test_fused_layout_rows_follow_heads_and_kv_heads() -> None:
    cfg = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 768,
           "num_hidden_layers": 1, "vocab_size": 128}  # fmt: skip
    lay = vw.fused_layout(cfg)
    assert lay["model.layers.0.self_attn.k_proj"] == vw.FusedSlice("model.layers.0.self_attn.qkv_proj", 256, 128)
    assert lay["model.layers.0.self_attn.v_proj"] == vw.FusedSlice("model.layers.0.self_attn.qkv_proj", 384, 128)
    assert lay["model.layers.0.mlp.up_proj"] == vw.FusedSlice("model.layers.0.mlp.gate_up_proj", 768, 768)


def test_partial_payload_reports_missing_fused_parts_and_groups_them() -> None:
    model, _ = make_tiny_model("tiny")
    lay = vw.fused_layout(model.config.to_dict())
    names = ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight", "model.layers.0.self_attn.v_proj.weight"]
    ordered, missing = vw.order_by_fused_module(names, lay)
    assert ordered == [names[0], names[2], names[1]]  # q and v side by side
    assert missing == {"model.layers.0.self_attn.qkv_proj": ["model.layers.0.self_attn.k_proj"]}
    q = quantize_weight(torch.randn(128, 128), QuantSpec())
    items = vw.checkpoint_items({"model.layers.0.self_attn.q_proj.weight": q})
    assert [n for n, _ in items] == ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight_scale_inv"]  # fmt: skip
    # per-channel: compressed-tensors' name, the [out, 1] scales as they are
    r = quantize_weight(torch.randn(128, 128), QuantSpec(granularity="row"))
    items = vw.checkpoint_items({"model.layers.0.self_attn.q_proj.weight": r})
    assert [n for n, _ in items] == ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight_scale"]  # fmt: skip
    assert items[1][1] is r.scale_inv and r.scale_inv.shape == (128, 1)
    with pytest.raises(ValueError, match="q_proj.weight: vLLM loads block or per-channel FP8, not 'tensor'"):
        vw.checkpoint_items({"model.layers.0.self_attn.q_proj.weight": quantize_weight(torch.randn(128, 128), QuantSpec(granularity="tensor"))})  # fmt: skip


def test_row_major_undoes_vllms_transposed_fp8_weights_only() -> None:
    w = torch.randn(256, 128).to(torch.float8_e4m3fn)
    assert vw.row_major(w) is w  # contiguous [out, in]
    back = vw.row_major(w.t())  # what the per-channel CUTLASS path holds
    assert back.shape == (256, 128) and back.data_ptr() == w.data_ptr() and torch.equal(back.view(torch.uint8), w.view(torch.uint8))  # fmt: skip
    square = torch.randn(128, 128).to(torch.float8_e4m3fn)
    assert vw.row_major(square) is square and vw.row_major(square.t()).is_contiguous()
    bf16 = torch.randn(128, 256, dtype=torch.bfloat16).t()
    assert vw.row_major(bf16) is bf16  # only FP8 weights are held transposed


def test_a_per_channel_weight_held_otherwise_than_transposed_is_a_layout_problem() -> None:
    w = torch.randn(128, 128).to(torch.float8_e4m3fn)
    ok = {"model.layers.0.self_attn.o_proj.weight": w.t(), "model.norm.weight": torch.ones(128)}
    assert vw.per_channel_layout_problem(ok) is None
    copied = {"model.layers.0.self_attn.o_proj.weight": w.t().contiguous()}  # same shape, other bytes order
    problem = vw.per_channel_layout_problem(copied)
    assert problem is not None and problem.startswith("model.layers.0.self_attn.o_proj.weight: vLLM holds")


def test_unfuse_refuses_per_channel_scales_that_do_not_match_the_rows() -> None:
    q = quantize_weight(torch.randn(256, 128), QuantSpec(granularity="row"))
    params = {"model.layers.0.self_attn.o_proj.weight": q.data, "model.layers.0.self_attn.o_proj.weight_scale": q.scale_inv[:128]}  # fmt: skip
    with pytest.raises(vllm_patches.VLLMPatchError, match=r"o_proj.weight_scale: \(128, 1\) is not one scale per row"):
        vw.unfuse_params(params, {}, 0)
    with pytest.raises(vllm_patches.VLLMPatchError, match=r"o_proj.weight is FP8 but vLLM holds no"):
        vw.unfuse_params({"model.layers.0.self_attn.o_proj.weight": q.data}, {}, 0)


def test_reload_items_complete_a_partial_payload_with_copies_of_the_held_parts() -> None:
    model, _ = make_tiny_model("tiny")
    cfg = model.config.to_dict()
    fp8 = {m + ".weight" for m in vw.fp8_module_names_from_config(cfg, load_recipe("fp8-rollout"))}
    hf = {n: p.detach() for n, p in model.named_parameters()}
    layout = vw.fused_layout(cfg)
    held = vw.unfuse_params(_vllm_params(dict(hf), fp8, cfg, pad_vocab=0), layout, cfg["vocab_size"])
    attn = "model.layers.0.self_attn"
    new_k = quantize_weight(torch.randn_like(hf[f"{attn}.k_proj.weight"].float()), QuantSpec())
    items = dict(
        vw.reload_items({f"{attn}.k_proj.weight": new_k, "model.norm.weight": hf["model.norm.weight"]}, held, layout)
    )
    assert list(items)[:6] == [f"{attn}.{p}_proj.{s}" for p in "kqv" for s in ("weight", "weight_scale_inv")]
    assert list(items)[6:] == ["model.norm.weight"]  # no other fused module is touched
    assert items[f"{attn}.k_proj.weight"] is new_k.data
    for part in ("q_proj", "v_proj"):
        ref = held[f"{attn}.{part}.weight"]
        assert isinstance(ref, QuantizedTensor)
        sent = items[f"{attn}.{part}.weight"]
        assert torch.equal(sent.view(torch.uint8), ref.data.view(torch.uint8))
        assert sent.data_ptr() != ref.data.data_ptr()  # a copy: the reload overwrites what ``held`` views
        assert torch.equal(items[f"{attn}.{part}.weight_scale_inv"], ref.scale_inv)


def test_engine_kwargs_per_recipe() -> None:
    ro = RolloutConfig(gpu_memory_utilization=0.3, enforce_eager=True, max_model_len=256)
    bf16 = ve.vllm_engine_kwargs("/m", load_recipe("bf16"), ro)
    assert bf16["quantization"] is None and bf16["kv_cache_dtype"] == "auto"
    assert bf16["skip_tokenizer_init"] and bf16["logprobs_mode"] == "processed_logprobs"
    assert bf16["max_model_len"] == 256 and bf16["enforce_eager"] and bf16["gpu_memory_utilization"] == 0.3
    fp8 = ve.vllm_engine_kwargs("/c", load_recipe("fp8-e2e").model_copy(update={"kv_cache": "fp8"}), RolloutConfig())
    assert fp8["quantization"] == "fp8" and fp8["kv_cache_dtype"] == "fp8" and not fp8["calculate_kv_scales"]
    assert "max_model_len" not in fp8 and fp8["model"] == "/c"
    channel = ve.vllm_engine_kwargs("/c", _recipe("fp8-e2e", granularity="row"), RolloutConfig())
    assert channel["quantization"] == "compressed-tensors"
    assert "attention_backend" not in fp8 and "attention_backend" not in channel  # vLLM's choice
    assert bf16["enable_prefix_caching"] and fp8["enable_prefix_caching"]  # vLLM's default, kept
    off = ve.vllm_engine_kwargs("/c", load_recipe("fp8-e2e"), RolloutConfig(prefix_caching=False))
    assert off["enable_prefix_caching"] is False


def test_engine_kwargs_pass_further_vllm_arguments_but_not_the_ones_fp8rl_sets() -> None:
    ro = RolloutConfig(engine_kwargs={"block_size": 32, "max_num_seqs": 512, "compilation_config": {"level": 3}})
    got = ve.vllm_engine_kwargs("/c", load_recipe("fp8-e2e"), ro)
    assert (got["block_size"], got["max_num_seqs"], got["compilation_config"]) == (32, 512, {"level": 3})
    assert got["quantization"] == "fp8" and got["model"] == "/c"  # fp8rl's own stay
    with pytest.raises(ConfigError, match=r"rollout\.engine_kwargs\.enable_prefix_caching: .*rollout\.prefix_caching"):
        parse_run_config({"recipe": "bf16", "rollout": {"engine_kwargs": {"enable_prefix_caching": False}}})
    with pytest.raises(ConfigError, match=r"rollout\.engine_kwargs\.quantization: .*recipe\.quant"):
        parse_run_config({"recipe": "bf16", "rollout": {"engine_kwargs": {"quantization": "fp8"}}})


def test_every_engine_argument_fp8rl_sets_is_one_engine_kwargs_refuses() -> None:
    """The refused names cover what ``vllm_engine_kwargs`` sets in every branch (an FP8 KV cache scaled per token
    and head, tensor parallelism, a model length), so a user's value can never be silently overwritten."""
    from fp8rl.config import ENGINE_KWARGS_SET_BY_FP8RL

    kv = load_recipe("fp8-e2e").model_copy(update={"kv_cache": "fp8"})
    every = RolloutConfig(kv_scaling="token_head", tensor_parallel_size=2, max_model_len=256)
    set_keys = set(ve.vllm_engine_kwargs("/c", kv, every, sleep_mode=True))
    assert set_keys <= set(ENGINE_KWARGS_SET_BY_FP8RL), set_keys - set(ENGINE_KWARGS_SET_BY_FP8RL)


def test_engine_kwargs_unknown_to_vllm_are_refused_naming_the_key() -> None:
    """vLLM is not importable on CPU: a stand-in module whose ``EngineArgs`` dataclass has two of vLLM's fields
    (the GPU test ``test_fp8rl_sets_real_engine_arguments`` checks the real one)."""

    @dataclasses.dataclass
    class EngineArgs:
        block_size: int | None = None
        max_num_seqs: int | None = None

    vllm = SimpleNamespace(EngineArgs=EngineArgs, __version__="0.26.0")
    ve.check_engine_kwargs(RolloutConfig(engine_kwargs={"block_size": 32}), vllm)
    with pytest.raises(UserError, match=r"rollout\.engine_kwargs\.blok_size: not an argument of vLLM 0\.26\.0"):
        ve.check_engine_kwargs(RolloutConfig(engine_kwargs={"blok_size": 32, "max_num_seqs": 8}), vllm)


def test_engine_kwargs_for_the_kv_cache_scaling_and_attention_backend() -> None:
    """``kv_scaling: token_head`` asks vLLM for its per-token-head FP8 cache and the Triton attention that reads it;
    nothing is calibrated then.  A BF16 cache ignores the KV scaling; ``attention_backend`` passes through."""
    kv = load_recipe("fp8-e2e").model_copy(update={"kv_cache": "fp8"})
    head = RolloutConfig(kv_scaling="token_head")
    got = ve.vllm_engine_kwargs("/c", kv, head)
    assert (got["kv_cache_dtype"], got["attention_backend"]) == ("fp8_per_token_head", "TRITON_ATTN")
    assert not kv_scales_calibrated(kv, head) and kv_scales_calibrated(kv, RolloutConfig())
    assert not kv_scales_calibrated(load_recipe("fp8-e2e"), RolloutConfig())
    bf16_cache = ve.vllm_engine_kwargs("/c", load_recipe("fp8-e2e"), head)
    assert bf16_cache["kv_cache_dtype"] == "auto" and "attention_backend" not in bf16_cache
    flex = ve.vllm_engine_kwargs("/c", kv, RolloutConfig(attention_backend="FLEX_ATTENTION"))
    assert (flex["kv_cache_dtype"], flex["attention_backend"]) == ("fp8", "FLEX_ATTENTION")


def test_an_attention_backend_vllm_does_not_have_is_a_user_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked against vLLM's own list before the engine starts (the list stands in for vLLM's registry here, where
    vLLM is not installed)."""
    monkeypatch.setattr(vllm_patches, "attention_backend_names", lambda: ["FLASH_ATTN", "TRITON_ATTN"])
    ve.check_attention_backend(None)
    ve.check_attention_backend("TRITON_ATTN")
    with pytest.raises(UserError, match=r"rollout.attention_backend 'FLASH_ATN': vLLM has no such backend; it has "
                                        r"FLASH_ATTN, TRITON_ATTN"):  # fmt: skip
        ve.check_attention_backend("FLASH_ATN")


def test_serving_checkpoint_converts_once_and_checks_given_fp8_dirs(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    src = tiny_models["small"]
    assert vw.serving_checkpoint(src, load_recipe("bf16"), tmp_path) == src
    recipe = _recipe("fp8-rollout", bf16_first_layers=1)
    dst = vw.serving_checkpoint(src, recipe, tmp_path)
    assert dst.parent == tmp_path / "vllm-checkpoints"
    qcfg = read_model_config(dst)["quantization_config"]
    assert qcfg["weight_block_size"] == [128, 128] and "model.layers.0.self_attn.q_proj" in qcfg["ignored_layers"]
    mtime = (dst / "config.json").stat().st_mtime_ns
    assert vw.serving_checkpoint(src, recipe, tmp_path) == dst and (dst / "config.json").stat().st_mtime_ns == mtime
    assert vw.serving_checkpoint(dst, recipe, tmp_path / "other") == dst  # an fp8rl FP8 checkpoint, used as is
    with pytest.raises(UserError, match="bf16_first_layers 0"):
        vw.serving_checkpoint(dst, load_recipe("fp8-rollout"), tmp_path)
    with pytest.raises(UserError, match="rolls out in bf16"):
        vw.serving_checkpoint(dst, load_recipe("bf16"), tmp_path)


def test_unsupported_recipes_and_shapes_are_user_errors(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(UserError, match="recipe.quant.granularity 'tensor'"):
        vw.serving_checkpoint(tiny_models["tiny"], _recipe("fp8-rollout", granularity="tensor"), tmp_path)
    with pytest.raises(UserError, match=r"recipe.quant.weight_block is \[64, 64\]"):
        vw.serving_checkpoint(tiny_models["tiny"], _recipe("fp8-rollout", weight_block=(64, 64)), tmp_path)
    assert not (tmp_path / "vllm-checkpoints").exists()


def test_partial_tiles_are_served_in_bf16_and_said(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """tiny-odd: no linear is whole 128x128 tiles, so vLLM's checkpoint keeps all of them in BF16 and the engine
    holds (and the sync sends) none in FP8; the checkpoint given back as is passes the recipe check."""
    recipe = load_recipe("fp8-rollout")
    dst = vw.serving_checkpoint(tiny_models["tiny-odd"], recipe, tmp_path)
    cfg = read_model_config(dst)
    ignored = set(cfg["quantization_config"]["ignored_layers"])
    linears = {f"model.layers.{i}.{s}" for i in range(cfg["num_hidden_layers"]) for s in vw.DECODER_LINEAR_SUFFIXES}
    assert linears <= ignored and vw.fp8_module_names_from_config(cfg, recipe) == []
    note = vw.partial_tile_note(dst, [], recipe)
    assert note is not None and f"serves {len(linears)} decoder linears in BF16" in note
    assert "fp8rl_conversion_report.json" in note
    assert vw.serving_checkpoint(dst, recipe, tmp_path / "other") == dst
    assert vw.partial_tile_note(dst, [], load_recipe("bf16")) is None


def test_a_partial_kv_projection_keeps_its_fused_qkv_in_bf16(tmp_path: Path) -> None:
    """k/v of 64 rows (one 64-wide KV head) are partial tiles; q (256x256) is whole but vLLM fuses it with them,
    so all three stay BF16 while o/gate/up/down are FP8 -- in the converter's report, vLLM's ignored_layers and
    the modules the engine holds in FP8."""
    from transformers import LlamaConfig, LlamaForCausalLM

    src = tmp_path / "gqa"
    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(src)
    recipe = load_recipe("fp8-rollout")
    dst = vw.serving_checkpoint(src, recipe, tmp_path / "work")
    cfg = read_model_config(dst)
    qkv = {f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkv"}
    assert set(cfg["quantization_config"]["ignored_layers"]) == {"lm_head"} | qkv
    report = json.loads((dst / "fp8rl_conversion_report.json").read_text())
    reasons = {m["module"]: m["reason"] for m in report["kept_partial_tiles"]}
    assert set(reasons) == qkv
    assert "64x256 is not whole 128x128 tiles" in reasons["model.layers.0.self_attn.k_proj"]
    assert "vLLM fuses it with k_proj" in reasons["model.layers.0.self_attn.q_proj"]
    fp8 = vw.fp8_module_names_from_config(cfg, recipe)
    assert set(fp8) == {f"model.layers.{i}.{s}" for i in range(2) for s in vw.DECODER_LINEAR_SUFFIXES} - qkv
    assert vw.partial_tile_note(dst, fp8, recipe) is not None
    assert vw.serving_checkpoint(dst, recipe, tmp_path / "other") == dst
    # a checkpoint that quantized the partial tiles is not what vLLM can load: refused with the modules named
    from fp8rl.checkpoint.convert import ConvertOptions, convert_checkpoint

    forced = tmp_path / "forced"
    convert_checkpoint(src, forced, ConvertOptions(partial_tiles="quantize"), show_progress=False)
    with pytest.raises(UserError, match="not whole tiles"):
        vw.serving_checkpoint(forced, recipe, tmp_path)


def test_per_channel_rollouts_serve_a_compressed_tensors_checkpoint(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """``rollout.fp8_scaling: channel``: the engine's recipe converts the BF16 checkpoint per channel (its BF16
    layers ignored, no partial tiles: a row has none), keyed apart from the block conversion; a given
    per-channel checkpoint is used as is, a block one refused for it and the other way round."""
    from fp8rl.config import rollout_recipe

    src = tiny_models["small"]
    cfg = parse_run_config({"recipe": _recipe("fp8-e2e", bf16_last_layers=1).model_dump(),
                            "rollout": {"engine": "vllm", "fp8_scaling": "channel"}})  # fmt: skip
    served = rollout_recipe(cfg.recipe, cfg.rollout)
    dst = vw.serving_checkpoint(src, served, tmp_path)
    qcfg = read_model_config(dst)["quantization_config"]
    assert qcfg["quant_method"] == "compressed-tensors"
    assert qcfg["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
    assert qcfg["config_groups"]["group_0"]["input_activations"]["strategy"] == "token"
    n = read_model_config(src)["num_hidden_layers"]
    assert f"model.layers.{n - 1}.mlp.down_proj" in qcfg["ignore"]
    fp8 = vw.fp8_module_names_from_config(read_model_config(dst), served)
    assert fp8 and all(f"layers.{n - 1}." not in m for m in fp8)
    assert vw.partial_tile_note(dst, fp8, served) is None
    block = vw.serving_checkpoint(src, cfg.recipe, tmp_path)
    assert block != dst and block.parent == dst.parent
    assert vw.serving_checkpoint(dst, served, tmp_path / "other") == dst
    with pytest.raises(UserError, match=r"checkpoint is FP8 row, but the engine serves recipe 'fp8-e2e' as FP8 block \[128, 128\] \(recipe.quant.granularity, or 'row' under rollout.fp8_scaling 'channel'\)"):  # fmt: skip
        vw.serving_checkpoint(dst, cfg.recipe, tmp_path)
    with pytest.raises(
        UserError, match=r"checkpoint is FP8 block \[128, 128\], but the engine serves recipe 'fp8-e2e' as FP8 row"
    ):
        vw.serving_checkpoint(block, served, tmp_path)


def test_given_fp8_checkpoints_of_another_layout_are_refused(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    from fp8rl.checkpoint.convert import ConvertOptions, convert_checkpoint

    per_tensor = tmp_path / "tensor"
    convert_checkpoint(
        tiny_models["tiny"], per_tensor, ConvertOptions(QuantConfig(granularity="tensor")), show_progress=False
    )
    with pytest.raises(
        UserError,
        match=r"checkpoint is FP8 tensor, but the engine serves recipe 'fp8-rollout' as FP8 block \[128, 128\]",
    ):
        vw.serving_checkpoint(per_tensor, load_recipe("fp8-rollout"), tmp_path)
    foreign = tmp_path / "awq"
    shutil.copytree(tiny_models["tiny"], foreign)
    cfg = json.loads((foreign / "config.json").read_text())
    (foreign / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(UserError, match=r"awq/config.json: quantization_config is not an fp8rl layout"):
        vw.serving_checkpoint(foreign, load_recipe("fp8-rollout"), tmp_path)


def test_conversion_cache_is_keyed_by_the_recipe_options(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    plain = vw.serving_checkpoint(tiny_models["tiny"], load_recipe("fp8-rollout"), tmp_path)
    pow2 = vw.serving_checkpoint(tiny_models["tiny"], _recipe("fp8-rollout", pow2_scales=True), tmp_path)
    assert plain != pow2 and plain.parent == pow2.parent
    assert read_model_config(pow2)["quantization_config"]["weight_block_size"] == [128, 128]


def test_vllm_multiprocessing_is_refused_before_importing_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ve.VLLM_ENV_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(UserError, match="set VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        ve.import_vllm()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_missing_vllm_names_the_field(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """vLLM is absent on the CPU machines; this is the error users get there, before an FP8 recipe's checkpoint is
    converted for the engine."""
    cfg = parse_run_config(
        {"recipe": load_recipe("fp8-rollout"), "rollout": {"engine": "vllm"}, "work_dir": str(tmp_path)}
    )
    with pytest.raises(UserError, match="rollout.engine 'vllm' needs vLLM"):
        ve.VLLMRolloutEngine.from_run_config(cfg, tiny_models["tiny"], "cuda")
    assert not list(tmp_path.iterdir()), "nothing written for an engine that cannot start"
    with pytest.raises(UserError, match="rollout.engine 'vllm' runs on the first visible CUDA device"):
        ve.VLLMRolloutEngine.from_run_config(cfg, tiny_models["tiny"], "cpu")


def test_rollout_from_outputs_pads_masks_and_marks_eos() -> None:
    lp = SimpleNamespace
    outs = [
        SimpleNamespace(
            token_ids=[7, 2], logprobs=[{7: lp(logprob=-0.5)}, {2: lp(logprob=-1.0)}], finish_reason="stop"
        ),
        SimpleNamespace(token_ids=[9, 9, 9], logprobs=[{9: lp(logprob=-0.1)}] * 3, finish_reason="length"),
    ]
    r = ve.rollout_from_outputs([[1], [1, 3]], outs, pad=0, version=4)
    assert r.response_ids.tolist() == [[7, 2, 0], [9, 9, 9]]
    assert r.response_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert r.logprobs[0].tolist() == [-0.5, -1.0, 0.0] and r.finished.tolist() == [True, False]
    assert r.policy_version == 4 and r.num_tokens == 5
    short = SimpleNamespace(token_ids=[7, 2], logprobs=[{7: lp(logprob=-0.5)}], finish_reason="stop")
    with pytest.raises(RuntimeError, match="1 logprobs for 2 tokens"):
        ve.rollout_from_outputs([[1]], [short], pad=0, version=0)


class _FlatLogprobs(list):  # vLLM's FlatLogprobs: a sequence of positions backed by flat lists
    def __init__(self, positions: list[list[tuple[int, float]]]) -> None:
        super().__init__(positions)
        self.start_indices, self.token_ids, self.logprobs = [], [], []
        for entries in positions:
            self.start_indices.append(len(self.token_ids))
            for token, logprob in entries:
                self.token_ids.append(token)
                self.logprobs.append(logprob)


def test_rollout_from_outputs_reads_flat_logprobs_at_each_positions_first_entry() -> None:
    # position 1 also carries a top-1 entry after the sampled token; only the sampled one is read
    flat = _FlatLogprobs([[(7, -0.5)], [(2, -1.0), (5, -0.25)], [(4, -2.0)]])
    out = SimpleNamespace(token_ids=[7, 2, 4], logprobs=flat, finish_reason="length")
    r = ve.rollout_from_outputs([[1]], [out], pad=0, version=1)
    assert r.logprobs.tolist() == [[-0.5, -1.0, -2.0]] and r.response_ids.tolist() == [[7, 2, 4]]
    wrong = SimpleNamespace(token_ids=[7, 5, 4], logprobs=flat, finish_reason="length")
    with pytest.raises(RuntimeError, match="do not start with the sampled tokens"):
        ve.rollout_from_outputs([[1]], [wrong], pad=0, version=1)
    with pytest.raises(RuntimeError, match="3 logprobs for 2 tokens"):
        ve.sampled_logprobs(flat, [7, 2])


# ---- KV-cache scales --------------------------------------------------------------------------------
def test_scale_and_quantile_math() -> None:
    assert kv_calibration.scale_from_amax(448.0, 1.1) == pytest.approx(1.1)
    assert kv_calibration.scale_from_amax(0.0, 1.0) == pytest.approx(1e-6 / 448)
    x = torch.randn(10_000, dtype=torch.float64)
    ref = x.sort().values[9990 - 1].item()  # k-th smallest, k = ceil(0.999 * n)
    assert kv_calibration.high_quantile(x, 0.999) == pytest.approx(ref)
    assert kv_calibration.high_quantile(x, 1.0) == pytest.approx(x.max().item())


def test_pair_norms_bound_every_rope_rotation() -> None:
    torch.manual_seed(0)
    model, _ = make_tiny_model("tiny", dtype=torch.float32)
    k = torch.randn(1, 2, 300, 64)  # [B, heads, T, head_dim]
    pos = torch.arange(300)[None]
    cos, sin = model.model.rotary_emb(k, pos)
    _, k_rot = apply_rotary_pos_emb(k, k, cos, sin)
    bound = kv_calibration.rope_pair_norms(k, 64)
    assert k_rot.abs().max() <= bound.max() + 1e-5
    assert bound.max() <= 2**0.5 * k.abs().max()  # and it is at most sqrt(2) above the pre-RoPE amax


def test_calibration_covers_the_post_rope_keys_of_the_model() -> None:
    torch.manual_seed(0)
    model, _ = make_tiny_model("small", dtype=torch.float32)
    ids = torch.randint(3, 100, (3, 40))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        model.model.layers[1].self_attn.k_proj.register_forward_hook(lambda _m, _i, o: seen.__setitem__("k", o)),
        model.model.layers[1].self_attn.v_proj.register_forward_hook(lambda _m, _i, o: seen.__setitem__("v", o)),
    ]
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=pos)
    for h in hooks:
        h.remove()
    scales = kv_calibration.calibrate_kv_scales(model, ids, mask, pos, quantile=1.0, margin=1.0)
    assert sorted(scales) == [0, 1, 2, 3]
    # independent reference: the keys after transformers' own RoPE, valid tokens only
    k = seen["k"].view(3, 40, 2, 64).transpose(1, 2)
    cos, sin = model.model.rotary_emb(k, pos)
    _, k_rot = apply_rotary_pos_emb(k, k, cos, sin)
    valid = mask.bool()[:, None, :, None].expand_as(k_rot)
    assert scales[1].k * 448 >= k_rot[valid].abs().max().item() - 1e-5
    assert scales[1].v * 448 == pytest.approx(seen["v"][mask.bool()].abs().max().item(), rel=1e-6)
    m = kv_calibration.kv_scale_metrics(scales, seconds=0.5)
    assert m["kv/k_scale_max"] >= m["kv/k_scale_mean"] >= m["kv/k_scale_min"] > 0
    assert m["kv/v_clip_ratio_max"] == pytest.approx(1.0) and m["kv/calibration_s"] == 0.5
    # a lower quantile gives smaller scales, so the largest values clip (ratio above 1)
    low = kv_calibration.calibrate_kv_scales(model, ids, mask, pos, quantile=0.5, margin=1.0)
    assert kv_calibration.kv_scale_metrics(low)["kv/v_clip_ratio_max"] > 1.0


# ---- the patch module -------------------------------------------------------------------------------
class _FakeAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for b in vllm_patches.SCALE_BUFFERS:
            self.register_buffer(b, torch.tensor(1.0))
        self._q_scale_float = self._k_scale_float = self._v_scale_float = 1.0
        self._k_scale_cpu, self._v_scale_cpu = torch.tensor(1.0), torch.tensor(1.0)


def _fake_vllm_model(layers: int) -> nn.Module:
    root = nn.Module()
    root.model = nn.Module()
    root.model.layers = nn.ModuleList()
    for _ in range(layers):
        layer = nn.Module()
        layer.self_attn = nn.Module()
        layer.self_attn.attn = _FakeAttention()
        root.model.layers.append(layer)
    return root


def test_patch_version_guard_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(vllm_patches.VLLMPatchError, match="written for vLLM 0.26.x, found vLLM 0.27.0"):
        vllm_patches.check_version("0.27.0")
    vllm_patches.check_version("0.26.3")
    monkeypatch.setattr(vllm_patches, "_installed_version", lambda: "0.25.1")
    for call in (
        lambda: vllm_patches.write_kv_scales(_fake_vllm_model(1), {0: (1.0, 1.0, 1.0)}),
        lambda: vllm_patches.read_kv_scales(_fake_vllm_model(1)),
        lambda: vllm_patches.engine_model(object()),
        lambda: vllm_patches.shutdown(object()),
    ):
        with pytest.raises(vllm_patches.VLLMPatchError, match="found vLLM 0.25.1"):
            call()


def test_kv_scale_patch_writes_in_place_and_fails_when_attributes_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_patches, "_installed_version", lambda: "0.26.0")
    model = _fake_vllm_model(2)
    k_buffer = model.model.layers[1].self_attn.attn._k_scale
    vllm_patches.write_kv_scales(model, {0: (0.1, 0.2, 0.3), 1: (0.4, 0.5, 0.6)})
    attn = model.model.layers[1].self_attn.attn
    assert attn._k_scale is k_buffer and attn._k_scale.item() == pytest.approx(0.5)  # same storage
    assert (attn._q_scale_float, attn._k_scale_float, attn._v_scale_float) == (0.4, 0.5, 0.6)
    assert attn._v_scale_cpu.item() == pytest.approx(0.6)
    assert vllm_patches.read_kv_scales(model)[0] == pytest.approx((0.1, 0.2, 0.3))
    # compressed-tensors' KV-cache method (the per-channel rollout) leaves _k_scale etc. as nn.Parameters with
    # gradients on; the in-place write must not trip autograd (it did on the GPU: docs/benchmarks.md)
    for b in vllm_patches.SCALE_BUFFERS:
        setattr(attn, b, nn.Parameter(torch.tensor(1.0)))
    vllm_patches.write_kv_scales(model, {1: (0.7, 0.8, 0.9)})
    assert attn._k_scale.item() == pytest.approx(0.8) and attn._k_scale.requires_grad
    with pytest.raises(KeyError, match=r"\[5\]"):
        vllm_patches.write_kv_scales(model, {5: (1.0, 1.0, 1.0)})
    del attn._k_scale_float
    with pytest.raises(vllm_patches.VLLMPatchError, match="_k_scale_float"):
        vllm_patches.write_kv_scales(model, {0: (1.0, 1.0, 1.0)})
    with pytest.raises(vllm_patches.VLLMPatchError, match="apply_model did not hand back"):
        vllm_patches.engine_model(SimpleNamespace(apply_model=lambda fn: [object(), object()]))


def test_converted_checkpoint_config_keeps_the_model_fields(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    dst = vw.serving_checkpoint(tiny_models["tiny"], load_recipe("fp8-e2e"), tmp_path)
    src_cfg = json.loads((tiny_models["tiny"] / "config.json").read_text())
    dst_cfg = json.loads((dst / "config.json").read_text())
    assert {k: v for k, v in dst_cfg.items() if k != "quantization_config"} == src_cfg


def test_a_resumed_run_recalibrates_kv_scales_for_the_restored_policy(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """``run_rl`` calibrates before the step-0 evaluation, again once a checkpoint is restored, and after every
    sync; the trainer's step count at each call says which policy the scales came from."""
    from fp8rl.build import build_parts
    from fp8rl.loop import run_rl
    from fp8rl.tracking import MemorySink

    def run(steps: int) -> list[int]:
        cfg = parse_run_config({
            "recipe": load_recipe("bf16"), "steps": steps, "checkpoint_every": 1, "eval_examples": 4,
            "eval_samples": 0, "grpo": {"group_size": 2, "prompts_per_step": 2}, "work_dir": str(tmp_path),
        })  # fmt: skip
        parts = build_parts(cfg, tiny_models["tiny"], "cpu")
        seen: list[int] = []

        def record(batch: SequenceBatch) -> dict[str, float]:
            seen.append(parts.trainer.step_count)
            return {}

        parts.calibrate_kv = record  # type: ignore[method-assign]
        run_rl(cfg, tiny_models["tiny"], MemorySink(), log=lambda _s: None, parts=parts, checkpoint_dir=tmp_path / "ck")
        return seen

    assert run(1) == [0, 1]
    assert run(2) == [0, 1, 2]  # resumed after step 1: recalibrated on the restored policy before step 2
