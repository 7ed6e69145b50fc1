"""The RL step's RayJob pods (head, workers, submitter) take the chart's pod settings from the rendered
``rayjob.yaml``, as the chart's own pods do: pod and container securityContext (the image's uid/gid, a read-only
root filesystem with /tmp an emptyDir), ``ray.env``, ``ray.podAnnotations``, the image pull secrets, the head's
tolerations and node selector; each pod meets Pod Security Standards 'restricted'; the RayJob is valid against the
KubeRay CRD schema."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from kube_chart import CI_VALUES
from kube_schemas import validate_manifest

from fp8rl.kube.rayjob import build_rayjob, build_rayjob_for_cluster
from fp8rl.kube.rayjob_template import parse_template

PRODUCTION = next(f for f in CI_VALUES if f.name == "production-values.yaml")
ANNOTATIONS = {"example.com/team": "rl", "sidecar.istio.io/inject": "false"}


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What breaks Pod Security Standards 'restricted' (v1.33) in a pod spec: host namespaces and volumes,
    privilege, escalation, capabilities other than NET_BIND_SERVICE, root, a seccomp profile other than
    RuntimeDefault/Localhost (pod or every container)."""
    bad = [f"spec.{k}" for k in ("hostNetwork", "hostPID", "hostIPC") if pod.get(k)]
    allowed_volumes = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}  # fmt: skip
    bad += [f"volume {v['name']}" for v in pod.get("volumes", []) if not set(v) - {"name"} <= allowed_volumes]
    psc = pod.get("securityContext", {})
    for c in pod.get("initContainers", []) + pod["containers"]:
        sc, name = c.get("securityContext", {}), c["name"]
        if sc.get("privileged"):
            bad.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{name}: allowPrivilegeEscalation not false")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []) or set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            bad.append(f"{name}: capabilities")
        if not sc.get("runAsNonRoot", psc.get("runAsNonRoot")) or sc.get("runAsUser", psc.get("runAsUser")) == 0:
            bad.append(f"{name}: may run as root")
        seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{name}: seccompProfile {seccomp}")
    return bad


def _pods(job: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found = {"submitter": job["spec"]["submitterPodTemplate"]}
    cluster = job["spec"].get("rayClusterSpec")
    if cluster:
        found["head"] = cluster["headGroupSpec"]["template"]
        found["worker"] = cluster["workerGroupSpecs"][0]["template"]
    return found


@pytest.mark.parametrize("own_cluster", [True, False], ids=["own-cluster", "standing-cluster"])
def test_rayjob_pods_take_the_charts_pod_settings(render, own_cluster: bool) -> None:
    rendered = render(PRODUCTION, ray__podAnnotations=ANNOTATIONS)
    values = yaml.safe_load(PRODUCTION.read_text())
    template = parse_template(yaml.safe_load(rendered.one("ConfigMap", "-rayjob-defaults")["data"]["rayjob.yaml"]))
    if own_cluster:
        job = build_rayjob(template, "fp8rl-step", "python -m fp8rl.cluster.driver", "fp8rl")
    else:
        job = build_rayjob_for_cluster(template, "fp8rl-step", "python x.py", "rel-fp8rl-ray", "fp8rl")
    validate_manifest(job)
    standing = rendered.one("RayCluster")["spec"]
    chart_head = standing["headGroupSpec"]["template"]
    chart_container = chart_head["spec"]["containers"][0]
    for role, pod in _pods(job).items():
        spec = pod["spec"]
        assert spec["securityContext"] == chart_head["spec"]["securityContext"], role
        assert spec["securityContext"]["runAsUser"] == spec["securityContext"]["runAsGroup"] == 1000, role
        assert spec["imagePullSecrets"] == values["images"]["pullSecrets"], role
        assert pod["metadata"]["annotations"] == ANNOTATIONS == chart_head["metadata"]["annotations"], role
        assert restricted_violations(spec) == [], role
        tmp = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
        for c in spec["containers"]:
            assert c["securityContext"] == chart_container["securityContext"], (role, c["name"])
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            assert any(m["mountPath"] == "/tmp" and m["name"] in tmp for m in c["volumeMounts"]), (role, c["name"])
            env = {e["name"]: e for e in c["env"]}
            assert env["HOME"]["value"] == "/tmp"
            for extra in values["ray"]["env"]:  # ray.env, as on the standing cluster's containers
                assert env[extra["name"]] == extra, (role, c["name"])
    if own_cluster:
        head = _pods(job)["head"]["spec"]
        assert head["nodeSelector"] == values["ray"]["head"]["nodeSelector"] == chart_head["spec"]["nodeSelector"]
        worker = _pods(job)["worker"]["spec"]
        assert worker["tolerations"] == values["ray"]["worker"]["tolerations"]


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda v: "defaults" if v is None else v.stem)
def test_every_rayjob_pod_meets_restricted(render, values) -> None:
    rendered = render(*([values] if values else []))
    template = parse_template(yaml.safe_load(rendered.one("ConfigMap", "-rayjob-defaults")["data"]["rayjob.yaml"]))
    for role, pod in _pods(build_rayjob(template, "fp8rl-step", "python x.py")).items():
        assert restricted_violations(pod["spec"]) == [], role


def test_the_restricted_check_finds_what_restricted_forbids() -> None:
    """Guards the tests above: a checker that accepts anything would make them pass too."""
    pod = {
        "securityContext": {"runAsNonRoot": True},
        "volumes": [{"name": "host", "hostPath": {"path": "/"}}],
        "containers": [
            {
                "name": "c",
                "securityContext": {
                    "allowPrivilegeEscalation": True,
                    "capabilities": {"add": ["SYS_ADMIN"], "drop": ["ALL"]},
                },
            }
        ],
    }
    assert restricted_violations(pod) == [
        "volume host", "c: allowPrivilegeEscalation not false", "c: capabilities", "c: seccompProfile None",
    ]  # fmt: skip
