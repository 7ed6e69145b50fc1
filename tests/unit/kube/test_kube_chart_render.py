"""The chart lints strictly and every rendered document is valid Kubernetes / KubeRay v1.

Validated twice, by two independent validators over the same schema files: kubeconform (Go,
what a user runs) over the whole render, and validate_manifest (Python jsonschema) per document.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from kube_chart import CI_VALUES
from kube_schemas import validate_manifest

VALUES_CASES = [pytest.param((), id="defaults")] + [pytest.param((f,), id=f.stem) for f in CI_VALUES]


def kubeconform(tools: Path, kube_version: str, manifests: str) -> subprocess.CompletedProcess[str]:
    schemas = tools / "schemas"
    return subprocess.run(
        [
            str(tools / "bin" / "kubeconform"),
            "-strict",
            "-summary",
            "-kubernetes-version",
            kube_version,
            "-schema-location",
            f"{schemas}/kubernetes/{{{{ .NormalizedKubernetesVersion }}}}-standalone{{{{ .StrictSuffix }}}}/"
            "{{ .ResourceKind }}{{ .KindSuffix }}.json",
            "-schema-location",
            f"{schemas}/crds/{{{{ .Group }}}}/{{{{ .ResourceKind }}}}_{{{{ .ResourceAPIVersion }}}}.json",
            "-",
        ],
        input=manifests,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_ci_values_files_exist() -> None:
    assert {f.name for f in CI_VALUES} >= {"production-values.yaml"}, CI_VALUES


@pytest.mark.parametrize("values", VALUES_CASES)
def test_helm_lint_strict(helm, staged_chart: Path, kube_version: str, values: tuple[Path, ...]) -> None:
    args = ["lint", "--strict", "--kube-version", kube_version, str(staged_chart)]
    for f in values:
        args += ["--values", str(f)]
    out = helm(*args).stdout
    assert "0 chart(s) failed" in out and "[WARNING]" not in out and "[ERROR]" not in out, out


@pytest.mark.parametrize("values", VALUES_CASES)
def test_every_document_validates(render, tools: Path, kube_version: str, values: tuple[Path, ...]) -> None:
    rendered = render(*values)
    assert len(rendered.docs) >= 5
    for doc in rendered.docs:
        validate_manifest(doc)
    proc = kubeconform(tools, kube_version, rendered.text)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"Valid: {len(rendered.docs)}, Invalid: 0, Errors: 0, Skipped: 0" in proc.stdout, proc.stdout


def test_kubeconform_rejects_an_unknown_field(render, tools: Path, kube_version: str) -> None:
    """The CLI path bites too: the same render with one misspelt RayCluster field fails."""
    text = render(ray__enabled=True).text
    assert "maxReplicas: 4" in text
    proc = kubeconform(tools, kube_version, text.replace("maxReplicas: 4", "maxReplicas: 4\n      maxReplicaz: 4", 1))
    assert proc.returncode != 0
    assert "maxReplicaz" in proc.stdout and "Invalid: 1" in proc.stdout, proc.stdout


def test_production_values_render_the_full_feature_set(render) -> None:
    """The production-like values file really exercises the non-default branches."""
    prod = render(next(f for f in CI_VALUES if f.name == "production-values.yaml"))
    cluster = prod.one("RayCluster")
    assert cluster["spec"]["enableInTreeAutoscaling"] is True
    deployment = prod.one("Deployment", "-mlflow")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--app-name=basic-auth" in args
    assert "--artifacts-destination=s3://fp8rl-artifacts/runs" in args
    assert not any(a.startswith("--backend-store-uri") for a in args)  # from the Secret, via the environment
