"""FP8 checkpoint conversion: layout, report, manifest, dequantize, errors."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fp8rl.atomic import OutputExistsError
from fp8rl.checkpoint import (
    MANIFEST_NAME,
    CheckpointError,
    ConvertOptions,
    convert_checkpoint,
    dequantize_checkpoint,
)
from fp8rl.checkpoint.shards import sha256_file
from fp8rl.config import BUILTIN_RECIPES, QuantConfig, Recipe, load_recipe, parse_recipe, vllm_recipe_problem
from fp8rl.models import PRESETS, UnsupportedModelError
from fp8rl.quant import QuantSpec, quantize_weight

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LINEARS_FULL = tuple(
    f"self_attn.{n}" if n.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else f"mlp.{n}" for n in LINEARS
)


def all_tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


@pytest.mark.parametrize("preset", ["tiny", "tiny-odd"])
def test_block_layout_matches_deepseek_vllm_format(tmp_path: Path, tiny_models: dict[str, Path], preset: str) -> None:
    dst = tmp_path / "fp8"
    # tiny-odd: partial tiles quantized on request (fp8rl's own engines read them; the default keeps them bf16)
    convert_checkpoint(tiny_models[preset], dst, ConvertOptions(partial_tiles="quantize"), show_progress=False)
    src, out = all_tensors(tiny_models[preset]), all_tensors(dst)
    qcfg = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "fp8" and qcfg["weight_block_size"] == [128, 128]
    assert qcfg["activation_scheme"] == "dynamic" and qcfg["fmt"] == "e4m3"
    assert qcfg["modules_to_not_convert"] == ["lm_head"] == qcfg["ignored_layers"]
    n_quantized = 0
    for name, t in src.items():
        module = name.removesuffix(".weight")
        if any(f".{lin}.weight" in name for lin in LINEARS):
            n_quantized += 1
            q, s = out[name], out[module + ".weight_scale_inv"]
            assert q.dtype == torch.float8_e4m3fn and q.shape == t.shape
            assert s.dtype == torch.float32
            assert s.shape == (math.ceil(t.shape[0] / 128), math.ceil(t.shape[1] / 128))
            ref = quantize_weight(t, QuantSpec())
            assert torch.equal(q.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(s, ref.scale_inv)
        else:
            assert torch.equal(out[name], t) and out[name].dtype == t.dtype, name
    assert n_quantized == 7 * PRESETS[preset].num_hidden_layers


@pytest.mark.parametrize(("granularity", "scale_shape"), [("row", lambda o: (o, 1)), ("tensor", lambda o: (1,))])
def test_row_and_tensor_use_compressed_tensors_layout(
    tmp_path: Path, tiny_models: dict[str, Path], granularity: str, scale_shape
) -> None:
    dst = tmp_path / "fp8"
    convert_checkpoint(
        tiny_models["tiny"], dst, ConvertOptions(QuantConfig(granularity=granularity)), show_progress=False
    )
    qcfg = json.loads((dst / "config.json").read_text())["quantization_config"]
    group = qcfg["config_groups"]["group_0"]
    assert qcfg["quant_method"] == "compressed-tensors" and qcfg["format"] == "float-quantized"
    assert group["weights"]["strategy"] == ("channel" if granularity == "row" else "tensor")
    assert group["input_activations"]["dynamic"] is True
    out = all_tensors(dst)
    w = out["model.layers.0.mlp.down_proj.weight"]
    assert w.dtype == torch.float8_e4m3fn
    assert out["model.layers.0.mlp.down_proj.weight_scale"].shape == scale_shape(w.shape[0])


def test_bf16_layers_stay_and_are_listed(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    dst = tmp_path / "fp8"
    opts = ConvertOptions(QuantConfig(bf16_first_layers=1, bf16_last_layers=1))
    report = convert_checkpoint(tiny_models["small-sharded"], dst, opts, show_progress=False)
    out = all_tensors(dst)
    assert out["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert out["model.layers.3.mlp.up_proj.weight"].dtype == torch.bfloat16
    assert out["model.layers.1.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    ignored = json.loads((dst / "config.json").read_text())["quantization_config"]["ignored_layers"]
    assert "model.layers.0.self_attn.q_proj" in ignored and "model.layers.3.mlp.down_proj" in ignored
    assert not any(".layers.1." in m or ".layers.2." in m for m in ignored)
    assert report.kept_layers == [0, 3] and len(report.tensors) == 14
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(out)
    for name, file in index.items():
        with safe_open(str(dst / file), framework="pt") as f:
            assert name in f.keys()  # noqa: SIM118


def test_report_error_matches_e4m3_theory(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    """RMS relative error of RNE to 3 mantissa bits, for values with log-uniform mantissa:
    ulp/sqrt(12) * sqrt(E[1/m^2]) = 2^-3/sqrt(12) * sqrt(3/(8 ln 2)) = 0.02654.
    The Gaussian-initialised weights fill whole binades, so each tensor's Frobenius
    relative error should sit within 10% of it."""
    theory = 2.0**-3 / math.sqrt(12) * math.sqrt(3 / (8 * math.log(2)))
    report = convert_checkpoint(tiny_models["small"], tmp_path / "fp8", show_progress=False)
    for t in report.tensors:
        assert abs(t.rel_error - theory) / theory < 0.10, (t.name, t.rel_error)
    s = report.summary()
    assert s["quantized_bytes_after"] / s["quantized_bytes_before"] == pytest.approx(0.5, abs=0.002)
    md = (tmp_path / "fp8" / "fp8rl_conversion_report.md").read_text()
    assert "tensors quantized: 28" in md


def test_manifest_hashes_every_file(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    dst = tmp_path / "fp8"
    convert_checkpoint(
        tiny_models["small-sharded"], dst, ConvertOptions(QuantConfig(pow2_scales=True)), show_progress=False
    )
    manifest = json.loads((dst / MANIFEST_NAME).read_text())
    files = {p.name for p in dst.iterdir()} - {MANIFEST_NAME}
    assert set(manifest["files"]) == files
    for name, digest in manifest["files"].items():
        assert sha256_file(dst / name) == digest
    assert manifest["recipe"]["pow2_scales"] is True and manifest["tool"] == "fp8rl"
    assert manifest["source"]["files"]["config.json"] == sha256_file(tiny_models["small-sharded"] / "config.json")
    # pow2 scales really are powers of two
    s = all_tensors(dst)["model.layers.0.mlp.up_proj.weight_scale_inv"]
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)


@pytest.mark.parametrize("granularity", ["block", "row", "tensor"])
def test_dequantize_inverts_stored_values(tmp_path: Path, tiny_models: dict[str, Path], granularity: str) -> None:
    fp8, deq = tmp_path / "fp8", tmp_path / "deq"
    opts = ConvertOptions(QuantConfig(granularity=granularity), partial_tiles="quantize")
    convert_checkpoint(tiny_models["tiny-odd"], fp8, opts, show_progress=False)
    dequantize_checkpoint(fp8, deq, show_progress=False)
    src, back = all_tensors(tiny_models["tiny-odd"]), all_tensors(deq)
    assert set(src) == set(back)
    assert "quantization_config" not in json.loads((deq / "config.json").read_text())
    w = src["model.layers.1.mlp.down_proj.weight"]
    spec = QuantSpec(granularity=granularity)  # type: ignore[arg-type]
    assert torch.equal(back["model.layers.1.mlp.down_proj.weight"], quantize_weight(w, spec).dequantize(torch.bfloat16))
    assert torch.equal(back["lm_head.weight"], src["lm_head.weight"])


# ---- bad input: clear error, nothing written --------------------------------------------------------------


def _expect_clean_failure(tmp_path: Path, src: Path, match: str, exc: type[Exception] = CheckpointError) -> None:
    dst = tmp_path / "out"
    with pytest.raises(exc, match=match):
        convert_checkpoint(src, dst, show_progress=False)
    assert not dst.exists()
    assert leftovers(tmp_path) == []


def test_missing_directory(tmp_path: Path) -> None:
    _expect_clean_failure(tmp_path, tmp_path / "nope", "does not exist", FileNotFoundError)


def test_no_config(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    src = tmp_path / "src"
    shutil.copytree(tiny_models["tiny"], src)
    (src / "config.json").unlink()
    _expect_clean_failure(tmp_path, src, "config.json is missing", UnsupportedModelError)


def test_already_fp8(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    fp8 = tmp_path / "fp8"
    convert_checkpoint(tiny_models["tiny"], fp8, show_progress=False)
    _expect_clean_failure(tmp_path, fp8, "already quantized")
    # FP8 tensors without a quantization_config are caught per tensor
    cfg = json.loads((fp8 / "config.json").read_text())
    del cfg["quantization_config"]
    (fp8 / "config.json").write_text(json.dumps(cfg))
    _expect_clean_failure(tmp_path, fp8, "already FP8")


def _corrupt(tmp_path: Path, src: Path, name: str, value: torch.Tensor) -> Path:
    out = tmp_path / "src"
    shutil.copytree(src, out)
    tensors = load_file(out / "model.safetensors")
    tensors[name] = value
    save_file(tensors, out / "model.safetensors")
    return out


def test_nan_weights(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    name = "model.layers.1.mlp.up_proj.weight"
    w = load_file(tiny_models["tiny"] / "model.safetensors")[name].clone()
    w[3, 4] = float("nan")
    src = _corrupt(tmp_path, tiny_models["tiny"], name, w)
    _expect_clean_failure(tmp_path, src, f"model.safetensors: tensor {name} holds NaN")


def test_unsupported_dtype(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    name = "model.layers.0.mlp.up_proj.weight"
    src = _corrupt(tmp_path, tiny_models["tiny"], name, torch.zeros(384, 128, dtype=torch.int8))
    _expect_clean_failure(tmp_path, src, "unsupported dtype torch.int8")


def test_existing_destination_needs_overwrite(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="--overwrite"):
        convert_checkpoint(tiny_models["tiny"], dst, show_progress=False)
    assert (dst / "keep.txt").read_text() == "mine"
    convert_checkpoint(tiny_models["tiny"], dst, overwrite=True, show_progress=False)
    assert not (dst / "keep.txt").exists() and (dst / MANIFEST_NAME).exists()
    assert leftovers(tmp_path) == []


def test_failure_midway_leaves_nothing(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    dst = tmp_path / "out"

    def boom(shard: str) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(tiny_models["small-sharded"], dst, show_progress=False, on_shard=boom)
    assert not dst.exists() and leftovers(tmp_path) == []


def test_partial_tiles_are_kept_in_bf16_by_default_and_named(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    dst = tmp_path / "fp8"
    report = convert_checkpoint(
        tiny_models["tiny-odd"],
        dst,
        ConvertOptions(QuantConfig(bf16_first_layers=1)),
        show_progress=False,
        allow_unquantized=True,
    )
    src, out = all_tensors(tiny_models["tiny-odd"]), all_tensors(dst)
    qcfg = json.loads((dst / "config.json").read_text())["quantization_config"]
    kept = {m["module"] for m in report.kept_partial_tiles}
    # layer 0 is a BF16 layer (listed as such, not as a partial tile); the other layers' partial modules are kept
    assert kept and not any(m.startswith("model.layers.0.") for m in kept)
    assert set(qcfg["modules_to_not_convert"]) == {"lm_head"} | {f"model.layers.0.{s}" for s in LINEARS_FULL} | kept
    for module in kept:
        w = out[module + ".weight"]
        assert w.dtype == torch.bfloat16 and torch.equal(w, src[module + ".weight"])
        assert module + ".weight_scale_inv" not in out
        shape = src[module + ".weight"].shape
        assert shape[0] % 128 or shape[1] % 128
    for t in report.tensors:  # whatever was quantized is whole tiles
        assert t.shape[0] % 128 == 0 and t.shape[1] % 128 == 0
    assert report.to_dict()["kept_partial_tiles"] == report.kept_partial_tiles
    for opts in (ConvertOptions(QuantConfig(granularity="row")), ConvertOptions(partial_tiles="quantize")):
        assert not convert_checkpoint(tiny_models["tiny-odd"], tmp_path / opts.quant.granularity / opts.partial_tiles, opts,
                                      show_progress=False).kept_partial_tiles  # fmt: skip
    with pytest.raises(CheckpointError, match="partial_tiles"):
        convert_checkpoint(
            tiny_models["tiny"], tmp_path / "bad", ConvertOptions(partial_tiles="pad"), show_progress=False
        )


@pytest.mark.parametrize("damage", ["truncated", "garbage", "missing-shard", "layers", "hidden"])
def test_bad_inputs_name_the_file_and_write_nothing(tmp_path: Path, tiny_models: dict[str, Path], damage: str) -> None:
    src = tmp_path / "src"
    shutil.copytree(tiny_models["small-sharded"], src)
    shard = sorted(src.glob("*.safetensors"))[-1]
    cfg_path = src / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if damage == "truncated":
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) // 2])
        expect = f"{shard}: not a readable safetensors file"
    elif damage == "garbage":
        shard.write_bytes(b"not safetensors at all")
        expect = f"{shard}: not a readable safetensors file"
    elif damage == "missing-shard":
        shard.unlink()
        expect = "names shard(s) that do not exist"
    elif damage == "layers":
        cfg_path.write_text(json.dumps({**cfg, "num_hidden_layers": cfg["num_hidden_layers"] + 2}))
        expect = f"{cfg_path}: num_hidden_layers is"
    else:
        cfg_path.write_text(json.dumps({**cfg, "hidden_size": cfg["hidden_size"] * 2}))
        expect = f"{cfg_path}: hidden_size is"
    dst = tmp_path / "out"
    with pytest.raises(CheckpointError) as err:
        convert_checkpoint(src, dst, ConvertOptions(), show_progress=False)
    assert expect in str(err.value)
    assert not dst.exists() and not leftovers(tmp_path)


# ---------------------------------------------------------------- options from a recipe


def fp8_recipe(**quant: object) -> Recipe:
    return parse_recipe({"name": "custom", "rollout_precision": "fp8", "train_precision": "bf16", "quant": quant})


@pytest.mark.parametrize("name", BUILTIN_RECIPES)
def test_builtin_recipes_convert_to_128_block_e4m3(name: str) -> None:
    # bf16's quant is the default; both FP8 recipes spell out block scaling, no pow2 scales, no BF16 layers; the
    # row recipes per-channel scaling, otherwise the same
    assert ConvertOptions(load_recipe(name).quant).record() == dict(
        granularity="row" if name.startswith("fp8-e2e-row") else "block", pow2_scales=False, bf16_first_layers=0,
        bf16_last_layers=0, weight_block=(128, 128), fmt="e4m3", partial_tiles="keep",
    )  # fmt: skip


def test_convert_options_take_every_quant_setting_of_the_recipe() -> None:
    recipe = fp8_recipe(
        granularity="row", pow2_scales=True, bf16_first_layers=1, bf16_last_layers=2, weight_block=[64, 32]
    )
    assert ConvertOptions(recipe.quant).record() == dict(
        granularity="row", pow2_scales=True, bf16_first_layers=1, bf16_last_layers=2, weight_block=(64, 32), fmt="e4m3",
        partial_tiles="keep",
    )  # fmt: skip


def test_report_and_manifest_record_the_checkpoint_settings_of_the_recipe(
    tmp_path: Path, tiny_models: dict[str, Path]
) -> None:
    # act_block is how an engine groups activations at run time: the manifest's spec keeps the default
    recipe = fp8_recipe(pow2_scales=True, act_block=64)
    dst = tmp_path / "fp8"
    report = convert_checkpoint(tiny_models["tiny"], dst, ConvertOptions(recipe.quant), show_progress=False)
    fields = ["granularity", "pow2_scales", "bf16_first_layers", "bf16_last_layers", "weight_block", "fmt"]
    assert list(report.options) == [*fields, "partial_tiles"]
    manifest = json.loads((dst / MANIFEST_NAME).read_text())["recipe"]
    assert list(manifest) == [*fields, "partial_tiles", "spec"] and manifest["weight_block"] == [128, 128]
    assert manifest["spec"] == {
        "granularity": "block", "fmt": "e4m3", "weight_block": [128, 128], "act_block": 128, "pow2_scales": True,
    }  # fmt: skip
    assert (
        "- options: granularity=block, pow2_scales=True, bf16_first_layers=0, bf16_last_layers=0, "
        "weight_block=(128, 128), fmt=e4m3, partial_tiles=keep" in (dst / "fp8rl_conversion_report.md").read_text()
    )


def vllm_serving_options(recipe: Recipe) -> dict[str, object]:
    """What serving_checkpoint converted with before it took the recipe's quant: block, 128x128, default fmt."""
    q = recipe.quant
    return dict(
        granularity="block", pow2_scales=q.pow2_scales, bf16_first_layers=q.bf16_first_layers,
        bf16_last_layers=q.bf16_last_layers, weight_block=(128, 128), fmt="e4m3", partial_tiles="keep",
    )  # fmt: skip


@pytest.mark.parametrize("quant", [{}, {"pow2_scales": True}, {"bf16_first_layers": 1, "bf16_last_layers": 2}])
def test_recipe_options_are_what_vllm_serves_for_the_recipes_it_accepts(quant: dict[str, object]) -> None:
    recipe = fp8_recipe(**quant)
    assert vllm_recipe_problem(recipe) is None
    assert ConvertOptions(recipe.quant).record() == vllm_serving_options(recipe)


def test_vllm_serves_per_channel_recipes_from_a_per_channel_conversion() -> None:
    # row: compressed-tensors per-channel weights; the weight tile does not apply
    recipe = fp8_recipe(granularity="row", bf16_last_layers=1, weight_block=[64, 64])
    assert vllm_recipe_problem(recipe) is None
    assert ConvertOptions(recipe.quant).record() == dict(
        granularity="row", pow2_scales=False, bf16_first_layers=0, bf16_last_layers=1, weight_block=(64, 64),
        fmt="e4m3", partial_tiles="keep",
    )  # fmt: skip


@pytest.mark.parametrize("quant", [{"granularity": "tensor"}, {"weight_block": [64, 64]}, {"act_block": 64}])
def test_vllm_refuses_the_recipes_whose_options_differ(quant: dict[str, object]) -> None:
    recipe = fp8_recipe(**quant)
    assert vllm_recipe_problem(recipe) is not None  # serving_checkpoint stops at check_recipe_supported
    if "act_block" not in quant:  # act_block is a rollout setting, not part of the checkpoint
        assert ConvertOptions(recipe.quant).record() != vllm_serving_options(recipe)


def test_the_package_names_load_their_modules_on_first_use() -> None:
    import fp8rl.checkpoint as ckpt

    assert all(getattr(ckpt, name) is not None for name in ckpt.__all__)
    with pytest.raises(AttributeError, match="no_such_name"):
        ckpt.no_such_name  # noqa: B018
