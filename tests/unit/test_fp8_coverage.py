"""A conversion or a run that would be FP8 in name only is refused before anything is written or trained.

tiny-odd's decoder linears are all partial 128x128 tiles (as SmolLM2-135M's 576- and 1536-wide ones are): block
scaling with partial tiles kept leaves none of them FP8.  tiny's are whole tiles."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fp8rl.checkpoint import CheckpointError, ConvertOptions, convert_checkpoint
from fp8rl.config import QuantConfig, RunConfig, load_recipe
from fp8rl.errors import UserError
from fp8rl.fp8_coverage import fp8_linear_counts


def test_a_block_conversion_that_quantizes_nothing_is_refused_and_writes_nothing(
    tmp_path: Path, tiny_models: dict[str, Path]
) -> None:
    dst = tmp_path / "fp8"
    with pytest.raises(CheckpointError) as e:
        convert_checkpoint(tiny_models["tiny-odd"], dst, ConvertOptions(), show_progress=False)
    message = str(e.value)
    assert "would quantize 0 of 14 eligible decoder linears (0% of their weights)" in message
    assert "--granularity row" in message and "--partial-tiles quantize" in message
    assert "--allow-unquantized" in message
    assert not dst.exists() and list(tmp_path.iterdir()) == []
    report = convert_checkpoint(tiny_models["tiny-odd"], dst, ConvertOptions(), show_progress=False,
                                allow_unquantized=True)  # fmt: skip
    assert not report.tensors and len(report.kept_partial_tiles) == 14


def test_every_layer_kept_in_bf16_is_refused_too(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    with pytest.raises(CheckpointError, match="every decoder layer is kept in BF16"):
        convert_checkpoint(
            tiny_models["tiny"], tmp_path / "a", ConvertOptions(QuantConfig(bf16_first_layers=2)), show_progress=False
        )


def test_conversions_that_quantize_pass(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    assert len(convert_checkpoint(tiny_models["tiny"], tmp_path / "a", show_progress=False).tensors) == 14
    row = convert_checkpoint(tiny_models["tiny-odd"], tmp_path / "b", ConvertOptions(QuantConfig(granularity="row")),
                             show_progress=False)  # fmt: skip
    assert len(row.tensors) == 14
    # one layer of two kept in BF16: half the eligible weights are FP8, which passes
    half = convert_checkpoint(tiny_models["tiny"], tmp_path / "c", ConvertOptions(QuantConfig(bf16_first_layers=1)),
                              show_progress=False)  # fmt: skip
    assert len(half.tensors) == 7


def test_the_cli_exits_2_and_names_the_fix(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    def convert(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "fp8rl", "convert", str(tiny_models["tiny-odd"]), str(tmp_path / "out"), *extra],
            capture_output=True, text=True,
        )  # fmt: skip

    refused = convert()
    assert refused.returncode == 2, refused.stderr
    assert "fp8rl convert: error: this conversion would quantize 0 of 14" in refused.stderr
    assert "wrote FP8 checkpoint" not in refused.stdout and not (tmp_path / "out").exists()
    allowed = convert("--allow-unquantized")
    assert allowed.returncode == 0 and "wrote FP8 checkpoint" in allowed.stdout
    assert convert("--granularity", "row", "--overwrite").returncode == 0


def test_the_convert_component_refuses_it_too(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    from kfp.dsl import Markdown, Model

    from components.convert import convert_to_fp8

    def art(cls: type, name: str):  # an output artifact whose path is under tmp_path
        a = cls(name=name, uri=str(tmp_path / name))
        a.path = str(tmp_path / name)  # type: ignore[misc]
        return a

    model = art(Model, "src")
    model.path = str(tiny_models["tiny-odd"])  # type: ignore[misc]
    with pytest.raises(CheckpointError, match="would quantize 0 of 14"):
        convert_to_fp8.python_func(model=model, recipe="fp8-rollout", fp8_model=art(Model, "fp8"),
                                   report=art(Markdown, "report.md"))  # fmt: skip
    assert not (tmp_path / "fp8").exists()


@pytest.mark.parametrize(
    ("recipe", "engine", "trainer", "refused"),
    [
        ("bf16", 0, 0, None),
        ("fp8-rollout", 7, 0, None),
        ("fp8-rollout", 0, 0, "the rollout engine holds no FP8 linear"),
        ("fp8-e2e", 7, 0, "the trainer holds no FP8 linear"),
        ("fp8-e2e", 0, 0, "the rollout engine holds no FP8 linear .*; the trainer holds no FP8 linear"),
        ("fp8-e2e", 3, 5, None),
    ],
)
def test_fp8_linear_counts(recipe: str, engine: int, trainer: int, refused: str | None) -> None:
    if refused is None:
        counts = fp8_linear_counts(load_recipe(recipe), engine, trainer)
        assert counts == {"fp8_linears_engine": engine, "fp8_linears_trainer": trainer}
    else:
        with pytest.raises(UserError, match=refused):
            fp8_linear_counts(load_recipe(recipe), engine, trainer)


def _cfg(recipe: str, tmp_path: Path, **quant: int) -> RunConfig:
    r = load_recipe(recipe)
    r = r.model_copy(update={"quant": r.quant.model_copy(update=quant)})
    return RunConfig(recipe=r, steps=1, work_dir=str(tmp_path), device="cpu")


def test_a_run_whose_fp8_recipe_holds_no_fp8_linear_fails_before_the_first_step(
    tmp_path: Path, tiny_models: dict[str, Path]
) -> None:
    from fp8rl.build import build_parts
    from fp8rl.loop import run_rl
    from fp8rl.tracking import MemorySink

    parts = build_parts(_cfg("fp8-e2e", tmp_path), tiny_models["tiny"], "cpu")
    assert parts.fp8_linears == {"fp8_linears_engine": 14, "fp8_linears_trainer": 14}
    sink = MemorySink()
    with pytest.raises(UserError, match="recipe 'fp8-e2e': the rollout engine holds no FP8 linear"):
        run_rl(_cfg("fp8-e2e", tmp_path, bf16_first_layers=2), tiny_models["tiny"], sink)
    assert sink.metrics == {} and sink.params == {}
