"""The dependency rule of docs/architecture.md, on the import statements of fp8rl/: only ``fp8rl/cluster`` (and the
Ray Job API client, ``fp8rl/kube/job_submission.py``) imports ray, only ``fp8rl/kube`` imports kubernetes, nothing in the
library imports kfp; ``fp8rl.sync`` (the weight-sync transports) imports no cluster module either."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "fp8rl"

# top-level package -> the paths under fp8rl/ allowed to import it
ALLOWED = {
    "ray": ("cluster/", "kube/job_submission.py"),
    "kubernetes": ("kube/",),
    "kfp": (),
}


def _imported(tree: ast.AST) -> set[str]:
    """Every module an ``import``/``from ... import`` names, at any depth (a function's lazy imports too)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _imports_by_file() -> dict[str, set[str]]:
    return {
        str(path.relative_to(LIBRARY)): _imported(ast.parse(path.read_text(), str(path)))
        for path in sorted(LIBRARY.rglob("*.py"))
    }


def test_only_the_runtime_packages_import_ray_kubernetes_or_kfp() -> None:
    wrong = sorted(
        f"fp8rl/{rel} imports {module}"
        for rel, modules in _imports_by_file().items()
        for module in modules
        if (top := module.split(".")[0]) in ALLOWED and not rel.startswith(ALLOWED[top])
    )
    assert not wrong, wrong


def test_the_sync_package_imports_nothing_of_the_cluster() -> None:
    wrong = sorted(
        f"fp8rl/{rel} imports {module}"
        for rel, modules in _imports_by_file().items()
        if rel.startswith("sync/")
        for module in modules
        if module.startswith(("fp8rl.cluster", "fp8rl.kube"))
    )
    assert not wrong, wrong
