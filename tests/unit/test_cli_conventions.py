"""What a CLI user expects of ``fp8rl``: a version, help on every option, one spelling of the options that repeat
across subcommands, one device rule, and one line (not a traceback) for an unexpected error."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from fp8rl import __version__, cli
from fp8rl.checkpoint import cli as checkpoint_cli
from fp8rl.devices import resolve_device
from fp8rl.errors import UserError


def _subparsers(parser: argparse.ArgumentParser, path: str = "fp8rl"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subparsers(sub, f"{path} {name}")


def test_every_option_and_positional_has_help() -> None:
    missing = [
        f"{path}: {'/'.join(a.option_strings) or a.dest}"
        for path, parser in _subparsers(cli.build_parser())
        for a in parser._actions
        if not isinstance(a, argparse._SubParsersAction | argparse._HelpAction) and not a.help
    ]
    assert missing == []


def test_version_names_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out.strip()
    assert re.fullmatch(rf"fp8rl {re.escape(__version__)}( \(git [0-9a-f]{{7,40}}\))?", out), out


def test_version_carries_the_sha_an_image_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FP8RL_GIT_SHA", "0123456789ab")
    assert cli.version_string() == f"fp8rl {__version__} (git 0123456789ab)"


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["train", "--recipes", "bf16,fp8-e2e"], ["bf16", "fp8-e2e"]),
        (["train", "--recipe", "bf16", "--recipe", "fp8-e2e"], ["bf16", "fp8-e2e"]),
        (["train", "--recipe", "bf16", "--recipes", "fp8-rollout,fp8-e2e"], ["bf16", "fp8-rollout", "fp8-e2e"]),
        (["train"], None),
        (["bench", "step", "--shape", "tiny", "--recipe", "bf16", "--recipe", "fp8-e2e"], ["bf16", "fp8-e2e"]),
        (["bench", "step", "--shape", "tiny", "--recipes", "bf16,fp8-e2e"], ["bf16", "fp8-e2e"]),
    ],
)
def test_recipes_take_both_spellings(argv: list[str], want: list[str] | None) -> None:
    assert cli.build_parser().parse_args(argv).recipes == want


def test_output_dir_is_canonical_and_out_still_works() -> None:
    parser = cli.build_parser()
    for argv in (["diagnose", "m"], ["bench", "step", "--shape", "tiny"]):
        assert parser.parse_args([*argv, "--output-dir", "d1"]).out == "d1"
        assert parser.parse_args([*argv, "--out", "d2"]).out == "d2"


def test_one_device_rule_on_every_command_that_computes() -> None:
    parser = cli.build_parser()
    for argv in (["train"], ["sft"], ["diagnose", "m"], ["bench", "step", "--shape", "tiny"]):
        for choice in ("auto", "cpu", "cuda"):
            assert parser.parse_args([*argv, "--device", choice]).device == choice
        with pytest.raises(SystemExit):
            parser.parse_args([*argv, "--device", "gpu"])


def test_device_auto_is_cuda_only_when_present(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(UserError, match="--device 'cuda': no CUDA device is visible"):
        resolve_device("cuda", "--device")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda"
    with pytest.raises(UserError, match="device must be one of auto, cpu, cuda"):
        resolve_device("tpu")


def test_the_run_config_carries_the_device_and_the_flag_overrides_it() -> None:
    from fp8rl.config import parse_run_config

    cfgs = cli._run_configs(cli.build_parser().parse_args(["train", "--recipe", "bf16", "--device", "cpu"]))
    assert [c.device for c in cfgs] == ["cpu"]
    assert cli._run_configs(cli.build_parser().parse_args(["train", "--recipe", "bf16"]))[0].device == "auto"
    with pytest.raises(UserError, match="device"):
        parse_run_config({"recipe": "bf16", "device": "gpu"}, "run.yaml")


def test_an_unexpected_error_is_one_line_naming_the_step(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    def boom(args: argparse.Namespace) -> int:
        raise RuntimeError("the engine died")

    monkeypatch.setattr(checkpoint_cli, "_cmd_dequantize", boom)
    assert cli.main(["dequantize", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fp8rl dequantize: unexpected error: RuntimeError: the engine died" in err
    assert "--debug" in err
    with pytest.raises(RuntimeError, match="the engine died"):
        cli.main(["--debug", "dequantize", str(tmp_path / "a"), str(tmp_path / "b")])


def test_the_real_model_gpu_example_parses_as_documented() -> None:
    """docs/configs/real-model.yaml's GPU command (vLLM, the row recipe, which quantizes SmolLM2's partial-tile
    widths): its run configs are valid and serve the FP8 recipe per channel."""
    root = Path(__file__).resolve().parents[2]
    doc = (root / "docs/configs/real-model.yaml").read_text()
    assert "--recipes bf16,fp8-e2e-row" in doc and "--set rollout.engine=vllm" in doc
    argv = ["train", "--config", str(root / "docs/configs/real-model.yaml"), "--model", "m", "--recipes",
            "bf16,fp8-e2e-row", "--set", "rollout.engine=vllm", "--set", "rollout.gpu_memory_utilization=0.3"]  # fmt: skip
    cfgs = cli._run_configs(cli.build_parser().parse_args(argv))
    assert [c.recipe.name for c in cfgs] == ["bf16", "fp8-e2e-row"]
    assert all(c.rollout.engine == "vllm" and c.device == "auto" for c in cfgs)
    assert cfgs[1].recipe.quant.granularity == "row"
