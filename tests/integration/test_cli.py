"""The fp8rl command end to end, in subprocesses, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def fp8rl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fp8rl", *args], capture_output=True, text=True)


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
