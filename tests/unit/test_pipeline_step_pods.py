"""The pipeline steps' pods take the chart's ``pipelineSteps`` values (env, annotations, labels, tolerations, node
selector) and ``images.pullSecrets``: compiled into every step's executor of every pipeline from the values file given
to helm (``--values``), as KFP applies them to the pods it creates. Bad values name the file and the field, exit 2
and write nothing; without ``--values`` the IR is what it was."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from pipelines import PIPELINE_NAMES
from pipelines.compile import main as compile_main

ROOT = Path(__file__).resolve().parents[2]
PRODUCTION = ROOT / "charts" / "fp8rl" / "ci" / "production-values.yaml"


def executors(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the pipeline spec's executors: container specs, the kubernetes platform's executors) of a compiled IR."""
    docs = list(yaml.safe_load_all(path.read_text()))
    kube = docs[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"] if len(docs) > 1 else {}
    return docs[0]["deploymentSpec"]["executors"], kube


def test_every_step_of_every_pipeline_gets_the_charts_step_pod_values(tmp_path: Path) -> None:
    values = yaml.safe_load(PRODUCTION.read_text())
    steps = values["pipelineSteps"]
    assert compile_main(["--output-dir", str(tmp_path), "--values", str(PRODUCTION)]) == 0
    for name in PIPELINE_NAMES:
        containers, kube = executors(tmp_path / f"{name}.yaml")
        assert set(kube) == set(containers), f"{name}: steps without Kubernetes settings"
        for executor, spec in containers.items():
            where = f"{name} {executor}"
            env = {e["name"]: e["value"] for e in spec["container"].get("env", [])}
            assert env.items() >= {e["name"]: e["value"] for e in steps["env"]}.items(), where
            k = kube[executor]
            assert k["podMetadata"]["annotations"] == steps["podAnnotations"], where
            assert k["podMetadata"]["labels"] == steps["podLabels"], where
            assert k["nodeSelector"]["labels"] == steps["nodeSelector"], where
            for toleration in steps["tolerations"]:
                assert toleration in k["tolerations"], where
            assert [s["secretName"] for s in k["imagePullSecret"]] == [
                s["name"] for s in values["images"]["pullSecrets"]
            ]
            # the settings the steps had already are kept beside them
            assert k["securityContext"]["runAsNonRoot"] is True, where
    # the GPU steps keep their own toleration beside the chart's
    _, kube = executors(tmp_path / "fp8-rl.yaml")
    gpu = [k for k in kube.values() if any(t.get("key") == "nvidia.com/gpu" for t in k.get("tolerations", []))]
    assert gpu and all(len(k["tolerations"]) == 1 + len(steps["tolerations"]) for k in gpu)


def test_later_values_files_win_as_in_helm(tmp_path: Path) -> None:
    """Maps merge key by key, a later file's value wins, null removes a key (helm's merge of ``-f`` files)."""
    over = tmp_path / "over.yaml"
    over.write_text(yaml.safe_dump({"pipelineSteps": {"podLabels": {"team": "research", "cost": "rl"},
                                                      "podAnnotations": {}, "nodeSelector": None}}))  # fmt: skip
    out = tmp_path / "ir"
    assert compile_main(["fp8-rl", "--output-dir", str(out), "--values", str(PRODUCTION), "--values", str(over)]) == 0
    _, kube = executors(out / "fp8-rl.yaml")
    k = next(iter(kube.values()))
    assert k["podMetadata"]["labels"] == {"team": "research", "cost": "rl"}
    assert k["podMetadata"]["annotations"] == {"sidecar.istio.io/inject": "false"}
    assert "nodeSelector" not in k


@pytest.mark.parametrize(
    ("values", "names"),
    [
        ({"pipelineSteps": {"env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}},
         "pipelineSteps.env[0]"),
        ({"pipelineSteps": {"podAnnotations": {"replicas": 2}}}, "pipelineSteps.podAnnotations"),
        ({"pipelineSteps": {"tolerations": [{"key": "a", "effects": "NoSchedule"}]}}, "pipelineSteps.tolerations[0]"),
        ({"pipelineSteps": {"nodeSelector": ["pool=ml"]}}, "pipelineSteps.nodeSelector"),
        ({"pipelineSteps": "yes"}, "pipelineSteps"),
        ({"images": {"pullSecrets": ["my-registry"]}}, "images.pullSecrets"),
    ],
)  # fmt: skip
def test_bad_step_pod_values_name_the_file_and_field_and_write_nothing(
    tmp_path: Path, values: dict[str, Any], names: str, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad-values.yaml"
    bad.write_text(yaml.safe_dump(values))
    out = tmp_path / "ir"
    assert compile_main(["--output-dir", str(out), "--values", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and names in err, err
    assert not out.exists()


def test_a_missing_values_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.yaml"
    assert compile_main(["--output-dir", str(tmp_path / "ir"), "--values", str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err


def test_without_values_no_step_gets_any_of_it(tmp_path: Path) -> None:
    assert compile_main(["--output-dir", str(tmp_path)]) == 0
    for name in PIPELINE_NAMES:
        containers, kube = executors(tmp_path / f"{name}.yaml")
        assert not any("env" in spec["container"] for spec in containers.values()), name
        for k in kube.values():
            assert not {"podMetadata", "nodeSelector", "imagePullSecret"} & set(k), name
            assert all(t["key"] == "nvidia.com/gpu" for t in k.get("tolerations", [])), name
