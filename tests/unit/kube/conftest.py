"""Fixtures for the chart tests: real `helm template` renders, cached per session.

The chart has no dependencies, so it renders offline as committed; the renders use a staged copy of
it (identical, a test checks) so that tests can write next to it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

TESTS = Path(__file__).resolve().parents[2]
if str(TESTS) not in sys.path:  # tests/conftest.py's directory is on sys.path already; be explicit
    sys.path.insert(0, str(TESTS))

from kube_chart import NAMESPACE, RELEASE, Render, stage_chart  # noqa: E402
from kube_schemas import schemas_manifest, tools_dir  # noqa: E402


@pytest.fixture(scope="session")
def tools() -> Path:
    return tools_dir()


@pytest.fixture(scope="session")
def kube_version(tools: Path) -> str:
    return schemas_manifest(tools)["kubernetes_version"]


@pytest.fixture(scope="session")
def helm(tools: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run the pinned helm with its config, cache and data in a temporary home."""
    home = tmp_path_factory.mktemp("helm-home")
    env = {
        **os.environ,
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(tools / "bin" / "helm"), *args], capture_output=True, text=True, env=env, timeout=120
        )
        if check and proc.returncode != 0:
            pytest.fail(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}{proc.stdout}")
        return proc

    return run


@pytest.fixture(scope="session")
def staged_chart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return stage_chart(tmp_path_factory.mktemp("chart"))


@pytest.fixture(scope="session")
def render(helm, staged_chart: Path, kube_version: str) -> Callable[..., Render]:
    """render(*values_files, **set_values) -> Render, one helm call per distinct input per session.

    set_values keys use `__` for `.` (``ray__auth__enabled=False``); values are passed with
    --set-json, so types survive.
    """
    cache: dict[tuple, Render] = {}

    def _render(*values_files: Path | str, **set_values: object) -> Render:
        key = (tuple(str(v) for v in values_files), tuple(sorted((k, repr(v)) for k, v in set_values.items())))
        if key not in cache:
            args = ["template", RELEASE, str(staged_chart), "--namespace", NAMESPACE, "--kube-version", kube_version]
            for f in values_files:
                args += ["--values", str(f)]
            for name, value in set_values.items():
                args += ["--set-json", f"{name.replace('__', '.')}={json.dumps(value)}"]
            text = helm(*args).stdout
            docs = [d for d in yaml.safe_load_all(text) if d]
            cache[key] = Render(text=text, docs=docs)
        return cache[key]

    return _render
