"""The quantization kernels' launch configurations: ``FP8RL_QUANT_LAUNCH`` and ``launch_config.parse_launch``.

What a configuration computes is the same bytes whatever it is (``tests/gpu/test_quant_launch_config.py`` runs every one
the sweep may pick); here, that the override is read, validated with errors that name the key, and applied in a fresh
process as Ray's trainer workers would see it, and that every candidate compiles for Hopper.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fp8rl.quant import kernels, launch_config


def test_parse_launch_accepts_each_key_alone_and_all_together() -> None:
    assert launch_config.parse_launch("{}") == {}
    assert launch_config.parse_launch('{"colwise": [128, 8, "fused"]}') == {"colwise": (128, 8, "fused")}
    full = launch_config.parse_launch(json.dumps({"rowwise": [64, 8], "colwise": [32, 2, "split"], "tiles_warps": 8}))
    assert full == {"rowwise": (64, 8, ""), "colwise": (32, 2, "split"), "tiles_warps": 8}


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("fused", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"rows": [32, 4]}', "unknown key(s) ['rows']"),
        ('{"rowwise": [24, 4]}', "rowwise must be"),
        ('{"rowwise": [256, 4]}', "rowwise must be"),
        ('{"colwise": [256, 4, "split"]}', "colwise must be"),
        ('{"rowwise": [32, 3]}', "rowwise must be"),
        ('{"rowwise": [32, 4, ""]}', "rowwise must be"),
        ('{"colwise": [64, 4, "both"]}', "colwise must be"),
        ('{"colwise": [8, 4, "split"]}', "colwise must be"),
        ('{"colwise": [64.0, 4, "split"]}', "colwise must be"),
        ('{"tiles_warps": 12}', "tiles_warps must be"),
        ('{"tiles_warps": true}', "tiles_warps must be"),
    ],
)
def test_parse_launch_names_what_is_wrong(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match="FP8RL_QUANT_LAUNCH") as e:
        launch_config.parse_launch(text)
    assert needle in str(e.value)


def _launch_in_fresh_process(value: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != launch_config.LAUNCH_ENV}
    if value is not None:
        env[launch_config.LAUNCH_ENV] = value
    code = "import json; from fp8rl.quant import launch_config; print(json.dumps(launch_config.launch_now()))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_the_environment_variable_sets_the_launch_of_a_new_process_and_a_bad_one_stops_it() -> None:
    default = json.loads(_launch_in_fresh_process(None).stdout)
    assert default == {"rowwise": [32, 4], "colwise": [64, 4, "split"], "tiles_warps": 16}
    done = _launch_in_fresh_process('{"colwise": [128, 8, "fused"], "tiles_warps": 8}')
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"rowwise": [32, 4], "colwise": [128, 8, "fused"], "tiles_warps": 8}
    bad = _launch_in_fresh_process('{"colwise": [128, 8]}')
    assert bad.returncode != 0 and "FP8RL_QUANT_LAUNCH: colwise must be" in bad.stderr


def test_set_launch_changes_what_quantize_groups_uses_and_launch_now_reports_it() -> None:
    before = launch_config.launch_now()
    try:
        launch_config.set_launch({"rowwise": (16, 2, ""), "colwise": (128, 16, "fused")})
        assert launch_config.GROUPS_ROWWISE_CONFIG == (16, 2, "") and launch_config.GROUPS_COLWISE_CONFIG == (
            128,
            16,
            "fused",
        )
        assert launch_config.launch_now()["colwise"] == [128, 16, "fused"]
    finally:
        launch_config.set_launch(launch_config.launch_from(before))
    assert launch_config.launch_now() == before


def test_every_sweep_candidate_compiles_for_sm90() -> None:
    tl = pytest.importorskip("triton.language")
    from fp8rl.bench.kernels import COLWISE_CANDIDATES, ROWWISE_CANDIDATES, TILES_CANDIDATES

    fmt = {"FMT_MAX": 448.0, "POW2": False, "OUT": tl.float8e4nv, "G": 128}
    launches = [(rows, 128, True, False, warps) for rows, warps in ROWWISE_CANDIDATES]
    for size, warps, mode in COLWISE_CANDIDATES:  # fused: one 128x128 tile writes both; split: the transposed launch
        launches.append((128, 128, True, True, warps) if mode == "fused" else (128, size, False, True, warps))
    cubins = [
        kernels.compile_ahead(
            kernels._groups_kernel,
            "fp8e4nv",
            fmt | {"BR": r, "BC": c, "ROWWISE": rw, "TRANSPOSE": tr},
            w,
            specialize=True,
        )
        for r, c, rw, tr, w in launches
    ]
    tiles = {k: v for k, v in fmt.items() if k != "G"} | {"BR": 128, "BC": 128, "TRANSPOSE": True}
    cubins += [kernels.compile_ahead(kernels._tiles_kernel, "fp8e4nv", tiles, w) for w in TILES_CANDIDATES]
    assert all(c[:4] == b"\x7fELF" for c in cubins)
