"""Shared helpers of the chart tests: the chart's location, a parsed render, containers of a document."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "charts" / "fp8rl"
RELEASE = "rel"
NAMESPACE = "fp8rl-test"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))


@dataclass(frozen=True)
class Render:
    text: str
    docs: list[dict]

    def kinds(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind: str, name_suffix: str = "") -> dict:
        found = [d for d in self.kinds(kind) if d["metadata"]["name"].endswith(name_suffix)]
        assert len(found) == 1, (
            f"expected one {kind} named *{name_suffix}, got {[d['metadata']['name'] for d in found]}"
        )
        return found[0]

    def names(self, kind: str) -> set[str]:
        return {d["metadata"]["name"] for d in self.kinds(kind)}


def stage_chart(dest: Path) -> Path:
    """A copy of the chart, for tests that write files next to it."""
    target = dest / "fp8rl"
    shutil.copytree(CHART, target)
    return target


def pod_specs(doc: dict) -> list[tuple[str, dict]]:
    """(where, pod spec) of every pod template a document carries (Pod, Deployment, RayCluster)."""
    kind, name = doc["kind"], doc["metadata"]["name"]
    if kind == "Pod":
        return [(f"Pod/{name}", doc["spec"])]
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return [(f"{kind}/{name}", doc["spec"]["template"]["spec"])]
    if kind == "RayCluster":
        spec = doc["spec"]
        found = [(f"RayCluster/{name}/head", spec["headGroupSpec"]["template"]["spec"])]
        found += [
            (f"RayCluster/{name}/{g['groupName']}", g["template"]["spec"]) for g in spec.get("workerGroupSpecs", [])
        ]
        return found
    return []


def containers(doc: dict) -> list[tuple[str, dict]]:
    """(where, container) for every container and init container, plus KubeRay's autoscaler sidecar."""
    found = []
    for where, spec in pod_specs(doc):
        for c in spec.get("initContainers", []) + spec.get("containers", []):
            found.append((f"{where}/{c['name']}", c))
    if doc["kind"] == "RayCluster" and doc["spec"].get("enableInTreeAutoscaling"):
        # KubeRay injects this container into the head pod from autoscalerOptions.
        found.append((f"RayCluster/{doc['metadata']['name']}/autoscaler", doc["spec"].get("autoscalerOptions", {})))
    return found
