"""validate_manifest bites, and the schema build is what scripts/k8s_tools.sh pins."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import pytest
from kube_chart import REPO
from kube_schemas import schema_file, schemas_manifest, strict_crd_schema, validate_manifest

SCRIPT = REPO / "scripts" / "k8s_tools.sh"


def script_pin(name: str) -> str:
    found = re.search(rf"^{name}=(\S+)", SCRIPT.read_text(), re.M)
    assert found, f"{name} is not pinned in {SCRIPT}"
    return found.group(1)


def rayjob() -> dict:
    """A RayJob as the RL-step component builds one (entrypoint, runtime env, a GPU worker group)."""
    pod = {
        "spec": {
            "containers": [
                {
                    "name": "ray-worker",
                    "image": "fp8rl-runtime:0.1.0",
                    "resources": {"limits": {"nvidia.com/gpu": 8, "cpu": "96", "memory": "1000Gi"}},
                    "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                }
            ],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "rel-fp8rl-data"}}],
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        }
    }
    head = copy.deepcopy(pod)
    head["spec"]["containers"][0]["name"] = "ray-head"
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": "rl-step-abc", "namespace": "ml", "labels": {"app.kubernetes.io/part-of": "fp8rl"}},
        "spec": {
            "entrypoint": "python -m fp8rl.cluster.driver --recipe fp8-e2e",
            "runtimeEnvYAML": "env_vars:\n  HF_HOME: /data/huggingface\n",
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": 3600,
            "activeDeadlineSeconds": 86400,
            "rayClusterSpec": {
                "rayVersion": "2.60.0",
                "authOptions": {"mode": "token", "secretName": "rel-fp8rl-ray-token"},
                "headGroupSpec": {"rayStartParams": {"num-cpus": "0"}, "template": head},
                "workerGroupSpecs": [
                    {"groupName": "gpu", "replicas": 2, "minReplicas": 2, "maxReplicas": 2, "template": pod}
                ],
            },
        },
    }


def test_a_valid_rayjob_passes(tools: Path) -> None:
    validate_manifest(rayjob())


@pytest.mark.parametrize(
    ("mutate", "path", "words"),
    [
        (lambda j: j["spec"].update(entrypointt="x"), "$.spec", "'entrypointt' was unexpected"),
        (
            lambda j: j["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].update(replicas="two"),
            "$.spec.rayClusterSpec.workerGroupSpecs[0].replicas",
            "'two' is not of type 'integer'",
        ),
        (
            lambda j: j["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"].update({"num-cpus": 0}),
            "$.spec.rayClusterSpec.headGroupSpec.rayStartParams['num-cpus']",
            "0 is not of type 'string'",
        ),
        (
            lambda j: j["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0].update(
                imagePullPolice="Always"
            ),
            "$.spec.rayClusterSpec.workerGroupSpecs[0].template.spec.containers[0]",
            "'imagePullPolice' was unexpected",
        ),
        (
            lambda j: j["spec"]["rayClusterSpec"]["authOptions"].update(mode="password"),
            "$.spec.rayClusterSpec.authOptions.mode",
            "'password' is not one of",
        ),
        (lambda j: j["metadata"].update(label={"a": "b"}), "$.metadata", "'label' was unexpected"),
    ],
    ids=["unknown-spec-field", "replicas-type", "ray-start-param-type", "container-typo", "auth-mode", "metadata-typo"],
)
def test_a_bad_rayjob_is_rejected_with_its_path(tools: Path, mutate, path, words) -> None:
    job = rayjob()
    mutate(job)
    with pytest.raises(AssertionError) as excinfo:
        validate_manifest(job)
    message = str(excinfo.value)
    assert message.startswith("RayJob/rl-step-abc (ray.io/v1) violates rayjob_v1.json")
    assert f"  {path}: " in message and words in message, message


def test_core_kinds_are_strict_too(tools: Path) -> None:
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "data": {"a": "b"}}
    validate_manifest(cm)
    with pytest.raises(AssertionError, match=r"ConfigMap/x .*\n  \$\.data\.a: 1 is not of type 'string'"):
        validate_manifest({**cm, "data": {"a": 1}})
    deploy = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d"},
        "spec": {
            "selector": {"matchLabels": {"a": "b"}},
            "template": {"metadata": {"labels": {"a": "b"}}, "spec": {"containers": [{"name": "c", "imag": "x"}]}},
        },
    }
    with pytest.raises(AssertionError, match=r"\$\.spec\.template\.spec\.containers\[0\]: .*'imag' was unexpected"):
        validate_manifest(deploy)


def test_unknown_kinds_versions_and_names_are_refused(tools: Path) -> None:
    with pytest.raises(AssertionError, match="no schema for apiVersion 'ray.io/v1alpha2' kind 'RayJob'"):
        validate_manifest({**rayjob(), "apiVersion": "ray.io/v1alpha2"})
    with pytest.raises(AssertionError, match="no schema for apiVersion 'apps/v1' kind 'Deploymnt'"):
        validate_manifest({"apiVersion": "apps/v1", "kind": "Deploymnt", "metadata": {"name": "d"}})
    with pytest.raises(AssertionError, match=r"metadata\.name: required"):
        validate_manifest({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {}})
    with pytest.raises(AssertionError, match="apiVersion and kind must be non-empty strings"):
        validate_manifest({"kind": "ConfigMap", "metadata": {"name": "x"}})


def test_converted_rayjob_schema_is_valid_json_schema(tools: Path) -> None:
    schema = json.loads(schema_file(tools, "ray.io/v1", "RayJob").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["properties"]["apiVersion"]["enum"] == ["ray.io/v1"]
    assert schema["properties"]["metadata"] == {"$ref": "#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}


def test_strict_crd_schema_conversion() -> None:
    crd = {
        "type": "object",
        "properties": {
            "port": {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]},
            "note": {"type": "string", "nullable": True},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            "empty": {"type": "object"},
            "items": {"type": "array", "items": {"type": "object", "properties": {"a": {"type": "integer"}}}},
        },
    }
    schema = strict_crd_schema(crd)
    validator = jsonschema.Draft202012Validator(schema)
    ok = {"port": "http", "note": None, "labels": {"x": "y"}, "free": {"any": 1}, "empty": {}, "items": [{"a": 1}]}
    assert not list(validator.iter_errors(ok))
    assert not list(validator.iter_errors({"port": 8080}))
    for bad in ({"port": 1.5}, {"labels": {"x": 1}}, {"empty": {"x": 1}}, {"items": [{"b": 1}]}, {"extra": 1}):
        assert list(validator.iter_errors(bad)), bad


def test_schemas_are_built_from_the_pinned_versions(tools: Path) -> None:
    manifest = schemas_manifest(tools)
    assert manifest["kubernetes_version"] == script_pin("KUBERNETES_VERSION")
    assert manifest["kuberay_version"] == script_pin("KUBERAY_VERSION")
    assert manifest["kubernetes_validate_version"] == script_pin("KUBERNETES_VALIDATE_VERSION")
    for kind in ("RayCluster", "RayJob", "RayService"):
        assert schema_file(tools, "ray.io/v1", kind).is_file(), kind
    for api_version, kind in (("v1", "Pod"), ("apps/v1", "Deployment"), ("rbac.authorization.k8s.io/v1", "Role")):
        assert schema_file(tools, api_version, kind).is_file(), kind


def test_tools_script_is_strict_bash() -> None:
    text = SCRIPT.read_text()
    assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text
    assert SCRIPT.stat().st_mode & 0o111, "scripts/k8s_tools.sh is not executable"


def test_tools_dir_skips_or_fails_when_tools_are_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kube_schemas import tools_dir

    monkeypatch.setenv("FP8RL_TOOLS_DIR", str(tmp_path))
    monkeypatch.delenv("FP8RL_REQUIRE_K8S_TOOLS", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"bin/helm, bin/kubeconform, schemas/MANIFEST.json.*k8s_tools.sh"):
        tools_dir()
    monkeypatch.setenv("FP8RL_REQUIRE_K8S_TOOLS", "1")
    with pytest.raises(pytest.fail.Exception, match="FP8RL_REQUIRE_K8S_TOOLS=1"):
        tools_dir()
