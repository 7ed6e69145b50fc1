"""scripts/compare_ir.py, the check that a refactor leaves the compiled pipelines alone apart from the component
sources KFP embeds (issue 16): byte-identical IR passes, a changed component body is shown and passes, anything else
fails."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from pipelines.compile import compile_all

ROOT = Path(__file__).resolve().parents[2]


def compare(a: Path, b: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(ROOT / "scripts" / "compare_ir.py"), str(a), str(b)]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def edit(path: Path, change: Callable[[list[Any]], None]) -> None:
    docs = list(yaml.safe_load_all(path.read_text()))
    change(docs)
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))


def test_compare_ir_tells_embedded_sources_from_the_rest(tmp_path: Path) -> None:
    before, after = tmp_path / "before", tmp_path / "after"
    compile_all(before, ["fp8-benchmark"])
    compile_all(after, ["fp8-benchmark"])
    r = compare(before, after)
    assert r.returncode == 0 and "fp8-benchmark.yaml: byte-identical" in r.stdout

    ir = after / "fp8-benchmark.yaml"

    def new_body(docs: list[Any]) -> None:
        command = docs[0]["deploymentSpec"]["executors"]["exec-prepare-model"]["container"]["command"]
        command[-1] = command[-1].replace("import_model", "import_model  # changed")

    edit(ir, new_body)
    r = compare(before, after)
    assert r.returncode == 0 and "identical apart from embedded component sources" in r.stdout
    assert "exec-prepare-model" in r.stdout and "# changed" in r.stdout

    def new_image(docs: list[Any]) -> None:
        docs[0]["deploymentSpec"]["executors"]["exec-prepare-model"]["container"]["image"] = "elsewhere:1"

    edit(ir, new_image)
    r = compare(before, after)
    assert r.returncode == 1 and "DIFFERS outside the embedded component sources" in r.stdout
