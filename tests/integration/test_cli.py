"""The fp8rl command end to end, in subprocesses, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml


def fp8rl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fp8rl", *args], capture_output=True, text=True)


def test_commands_that_load_no_model_start_without_torch(tmp_path: Path) -> None:
    """``fp8rl recipes`` answers without importing torch, transformers, MLflow or Ray (torch and transformers alone
    took about 5 s on a 2-core machine), and ``convert`` imports torch but not transformers: the sub-commands
    import what they run."""

    def heavy_after(argv: list[str]) -> str:
        code = (
            f"import sys; from fp8rl.cli import main; rc = main({argv!r}); "
            "print('HEAVY', sorted(m for m in ('torch', 'transformers', 'mlflow', 'ray') if m in sys.modules), rc)"
        )
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout

    out = heavy_after(["recipes"])
    assert "HEAVY [] 0" in out and "fp8-e2e" in out
    model = tmp_path / "m"
    assert fp8rl("make-model", str(model)).returncode == 0
    assert "HEAVY ['torch'] 0" in heavy_after(["convert", str(model), str(tmp_path / "fp8")])


def test_make_convert_dequantize(tmp_path: Path) -> None:
    model, fp8, deq = tmp_path / "m", tmp_path / "fp8", tmp_path / "deq"
    assert fp8rl("make-model", str(model), "--preset", "tiny").returncode == 0
    r = fp8rl("convert", str(model), str(fp8), "--granularity", "block", "--bf16-last-layers", "1")
    assert r.returncode == 0, r.stderr
    assert "# FP8 conversion report" in r.stdout and "tensors quantized: 7" in r.stdout
    assert "convert -> fp8 block" in r.stderr  # progress bar
    qcfg = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    assert "model.layers.1.mlp.up_proj" in qcfg["ignored_layers"]
    r = fp8rl("dequantize", str(fp8), str(deq))
    assert r.returncode == 0, r.stderr
    assert "quantization_config" not in json.loads((deq / "config.json").read_text())


def test_errors_exit_non_zero_and_name_the_input(tmp_path: Path) -> None:
    r = fp8rl("convert", str(tmp_path / "missing"), str(tmp_path / "out"))
    assert r.returncode == 2 and "missing does not exist" in r.stderr and "Traceback" not in r.stderr
    model = tmp_path / "m"
    fp8rl("make-model", str(model))
    r = fp8rl("convert", str(model), str(model))
    assert r.returncode == 2 and "already exists" in r.stderr
    r = fp8rl("convert", str(model), str(tmp_path / "o"), "--granularity", "channel")
    assert r.returncode == 2 and "invalid choice" in r.stderr
    r = fp8rl("convert", str(model), str(tmp_path / "o"), "--bf16-first-layers", "-1")
    assert r.returncode == 2 and "--bf16-first-layers must be >= 0" in r.stderr
    assert not (tmp_path / "o").exists()
    r = fp8rl("dequantize", str(model), str(tmp_path / "d"))
    assert r.returncode == 2 and "not an FP8 checkpoint" in r.stderr


def test_convert_takes_the_options_of_a_recipe(tmp_path: Path) -> None:
    model, fp8, recipe = tmp_path / "m", tmp_path / "fp8", tmp_path / "b64.yaml"
    fp8rl("make-model", str(model))
    quant = {"weight_block": [64, 64], "bf16_last_layers": 1}  # the tile size has no flag: only a recipe sets it
    recipe.write_text(
        yaml.safe_dump({"name": "b64", "rollout_precision": "fp8", "train_precision": "bf16", "quant": quant})
    )
    r = fp8rl("convert", str(model), str(fp8), "--recipe", str(recipe), "--granularity", "block")  # agrees: fine
    assert r.returncode == 0, r.stderr
    qcfg = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    assert qcfg["weight_block_size"] == [64, 64] and "model.layers.1.mlp.up_proj" in qcfg["ignored_layers"]
    r = fp8rl("convert", str(model), str(tmp_path / "o"), "--recipe", "fp8-e2e", "--bf16-first-layers", "1")
    assert r.returncode == 2 and "--bf16-first-layers 1 but recipe.quant.bf16_first_layers is 0" in r.stderr
    r = fp8rl("convert", str(model), str(tmp_path / "o"), "--recipe", "fp9")
    assert r.returncode == 2 and "not a built-in recipe" in r.stderr
    assert not (tmp_path / "o").exists()


def test_import_model_from_a_preset_and_a_directory(tmp_path: Path) -> None:
    model, copy = tmp_path / "m", tmp_path / "copy"
    r = fp8rl("import-model", "tiny", str(model), "--seed", "3")
    assert r.returncode == 0, r.stderr
    assert "imported tiny:tiny" in r.stdout
    assert json.loads((model / "config.json").read_text())["model_type"] == "llama"
    r = fp8rl("import-model", model.as_uri(), str(copy))
    assert r.returncode == 0, r.stderr
    assert (copy / "model.safetensors").read_bytes() == (model / "model.safetensors").read_bytes()
    r = fp8rl("import-model", "tiny", str(model))
    assert r.returncode == 2 and "already exists (pass --overwrite" in r.stderr


@pytest.mark.parametrize("source", ["tiny-typo", "s3://bucket/model", "hf://org/name"])
def test_import_model_names_a_bad_source_and_writes_nothing(tmp_path: Path, source: str) -> None:
    r = fp8rl("import-model", source, str(tmp_path / "m"))  # hf://: the test session is offline (conftest)
    assert r.returncode == 2 and f"model source {source!r}" in r.stderr and "Traceback" not in r.stderr
    assert list(tmp_path.iterdir()) == []
