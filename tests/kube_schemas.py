"""Offline Kubernetes and KubeRay JSON schemas: built by ``scripts/k8s_tools.sh``, used by tests.

Two halves, one file, so the code that writes the schema layout and the code that reads it
cannot disagree:

- ``python tests/kube_schemas.py build ...`` (called by ``scripts/k8s_tools.sh``) turns
  (1) the strict Kubernetes schemas that the PyPI package ``kubernetes-validate`` ships per
  Kubernetes version (JSON Schema 2020-12, ``additionalProperties: false`` everywhere, every
  ``$ref`` pointing into one shared ``_definitions.json``) into standalone files, one per kind,
  each carrying the ``$defs`` it needs; and (2) the ``openAPIV3Schema`` of the KubeRay CRDs
  into strict JSON schemas (an object that lists its properties rejects any other, which is
  what the API server's pruning would silently drop; the root ``metadata`` is the real
  ``ObjectMeta``; ``nullable`` becomes a ``null`` type; CEL rules are not evaluated).
- ``validate_manifest(doc)`` validates one parsed document against those files, and
  ``tools_dir()`` finds the installed tools or skips (fails under ``FP8RL_REQUIRE_K8S_TOOLS=1``).

The layout is kubeconform's, so the CLI reads the same files::

    <tools>/schemas/kubernetes/v<K8S>-standalone-strict/<kind>[-<group>]-<version>.json
    <tools>/schemas/crds/<group>/<kind>_<version>.json
    <tools>/schemas/MANIFEST.json     (versions; written last: its presence marks a complete build)
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

DEFS_REF_PREFIX = "/api/_definitions.json#/$defs/"  # how kubernetes-validate's kind files point at shared definitions
LOCAL_REF_PREFIX = "#/$defs/"  # how the shared definitions point at each other
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
DRAFT_2020_12 = "https://json-schema.org/draft/2020-12/schema"
MAX_MESSAGE_CHARS = 300  # one violation's message; a oneOf failure would otherwise print a whole pod template

Schema = dict[str, Any]


# --------------------------------------------------------------------------------------------- tools


def tools_dir() -> Path:
    """The tools cache (``$FP8RL_TOOLS_DIR`` or ``~/.cache/fp8rl/tools``) with helm, kubeconform and schemas.

    Skips the calling test when something is missing, or fails it when ``FP8RL_REQUIRE_K8S_TOOLS=1``
    (CI), so a machine without the tools can never report the Kubernetes checks as passed.
    """
    import pytest

    root = Path(os.environ.get("FP8RL_TOOLS_DIR") or Path.home() / ".cache" / "fp8rl" / "tools")
    needed = [root / "bin" / "helm", root / "bin" / "kubeconform", root / "schemas" / "MANIFEST.json"]
    missing = [str(p.relative_to(root)) for p in needed if not p.is_file()]
    if missing:
        message = f"Kubernetes tools missing under {root} ({', '.join(missing)}): run scripts/k8s_tools.sh"
        if os.environ.get("FP8RL_REQUIRE_K8S_TOOLS") == "1":
            pytest.fail(message + " (FP8RL_REQUIRE_K8S_TOOLS=1)", pytrace=False)
        pytest.skip(message)
    return root


def schemas_manifest(root: Path) -> dict[str, Any]:
    """MANIFEST.json of a schema build: the pinned versions it was made from."""
    return json.loads((root / "schemas" / "MANIFEST.json").read_text())


# --------------------------------------------------------------------------------------------- validate


def schema_file(root: Path, api_version: str, kind: str) -> Path:
    """Where kubeconform's templates put the schema of (apiVersion, kind); the file may not exist."""
    group, _, version = api_version.rpartition("/")
    schemas = root / "schemas"
    if group and "." in group and not group.endswith(".k8s.io"):  # a CRD group such as ray.io
        return schemas / "crds" / group / f"{kind.lower()}_{version}.json"
    k8s = schemas_manifest(root)["kubernetes_version"]
    suffix = f"-{group.split('.')[0]}-{version}" if group else f"-{version}"
    return schemas / "kubernetes" / f"v{k8s}-standalone-strict" / f"{kind.lower()}{suffix}.json"


@functools.lru_cache(maxsize=64)
def _validator(path: Path) -> Any:
    import jsonschema

    schema = json.loads(path.read_text())
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    cls.check_schema(schema)
    return cls(schema)


def _short(message: str) -> str:
    return message if len(message) <= MAX_MESSAGE_CHARS else message[: MAX_MESSAGE_CHARS - 3] + "..."


def validate_manifest(doc: dict) -> None:
    """Validate one Kubernetes object (a parsed YAML document) strictly against its schema.

    Core kinds use the Kubernetes schemas, ``ray.io/v1`` kinds the KubeRay CRD schemas; unknown
    fields are rejected at every level. Raises AssertionError naming ``kind/name`` and the JSON
    path of each violation, or saying that no schema exists for the apiVersion/kind.
    """
    if not isinstance(doc, dict):
        raise AssertionError(f"a manifest must be a mapping, got {type(doc).__name__}")
    api_version, kind = doc.get("apiVersion"), doc.get("kind")
    metadata = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
    label = f"{kind}/{metadata.get('name') or metadata.get('generateName') or '<unnamed>'}"
    if not isinstance(api_version, str) or not isinstance(kind, str) or not api_version or not kind:
        raise AssertionError(f"{label}: apiVersion and kind must be non-empty strings")
    path = schema_file(tools_dir(), api_version, kind)
    if not path.is_file():
        raise AssertionError(f"{label}: no schema for apiVersion {api_version!r} kind {kind!r} (looked for {path})")
    problems = [f"  {e.json_path}: {_short(e.message)}" for e in _validator(path).iter_errors(doc)]
    if not (metadata.get("name") or metadata.get("generateName")):
        problems.append("  $.metadata.name: required (or metadata.generateName)")
    if problems:
        problems.sort()
        raise AssertionError(f"{label} ({api_version}) violates {path.name}:\n" + "\n".join(problems))


# --------------------------------------------------------------------------------------------- build


def _ref_name(ref: Any) -> str | None:
    for prefix in (DEFS_REF_PREFIX, LOCAL_REF_PREFIX):
        if isinstance(ref, str) and ref.startswith(prefix):
            return ref[len(prefix) :]
    return None


def _walk_refs(node: Any) -> list[str]:
    """Names of the shared definitions referenced anywhere under node."""
    found: list[str] = []
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if (name := _ref_name(item.get("$ref"))) is not None:
                found.append(name)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _local_refs(node: Any) -> Any:
    """A copy of node with every shared-definition $ref made local (#/$defs/...)."""
    if isinstance(node, dict):
        out = {k: _local_refs(v) for k, v in node.items()}
        if (name := _ref_name(out.get("$ref"))) is not None:
            out["$ref"] = LOCAL_REF_PREFIX + name
        return out
    if isinstance(node, list):
        return [_local_refs(v) for v in node]
    return node


def closure(definitions: dict[str, Schema], roots: list[str]) -> dict[str, Schema]:
    """The definitions reachable from roots, with local refs."""
    seen: dict[str, Schema] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        if name not in definitions:
            raise ValueError(f"definition {name!r} is referenced but not defined")
        seen[name] = definitions[name]
        todo.extend(_walk_refs(definitions[name]))
    return {name: _local_refs(seen[name]) for name in sorted(seen)}


def kind_file_name(group: str, version: str, kind: str) -> str:
    suffix = f"-{group.split('.')[0]}-{version}" if group else f"-{version}"
    return f"{kind.lower()}{suffix}.json"


def build_kubernetes(src: Path, out: Path) -> int:
    """Standalone strict schemas, one per top-level kind, from a kubernetes-validate ``-local-strict`` dir."""
    definitions: dict[str, Schema] = json.loads((src / "_definitions.json").read_text())["$defs"]
    out.mkdir(parents=True, exist_ok=True)
    written = 0
    for path in sorted(src.glob("*.json")):
        if path.name in ("_definitions.json", "all.json"):
            continue
        schema = json.loads(path.read_text())
        gvks = schema.get("x-kubernetes-group-version-kind") or []
        if len(gvks) != 1:  # not a top-level kind (or a meta type shared by every group, such as DeleteOptions)
            continue
        gvk = gvks[0]
        standalone = {k: v for k, v in schema.items() if k != "$id"}
        standalone = _local_refs(standalone)
        standalone["$schema"] = DRAFT_2020_12
        standalone["$defs"] = closure(definitions, _walk_refs(schema))
        (out / kind_file_name(gvk["group"], gvk["version"], gvk["kind"])).write_text(json.dumps(standalone))
        written += 1
    if written == 0:
        raise ValueError(f"no top-level kinds found under {src}")
    return written


def strict_crd_schema(node: Any) -> Any:
    """A CRD structural schema as strict JSON Schema (see the module docstring)."""
    if isinstance(node, list):
        return [strict_crd_schema(v) for v in node]
    if not isinstance(node, dict):
        return node
    out: Schema = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: strict_crd_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = strict_crd_schema(value)
        elif key in ("anyOf", "oneOf", "allOf"):
            out[key] = [strict_crd_schema(v) for v in value]
        elif key == "nullable":
            continue
        else:
            out[key] = value
    if node.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)  # anyOf [integer, string] carries the type
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    is_object = node.get("type") == "object"
    if is_object and not node.get("x-kubernetes-preserve-unknown-fields") and "additionalProperties" not in node:
        out["additionalProperties"] = False  # an object without properties then only accepts {}: pruned otherwise
    return out


def build_crds(crd_files: list[Path], definitions: dict[str, Schema], out: Path, kinds: set[str]) -> int:
    """Strict schemas for the v1 versions of the given CRD kinds, root metadata as ObjectMeta."""
    import yaml

    meta_defs = closure(definitions, [OBJECT_META])
    written: set[str] = set()
    for crd_file in crd_files:
        crd = yaml.safe_load(crd_file.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        if kind not in kinds:
            continue
        for version in crd["spec"]["versions"]:
            if not version.get("served") or version["name"] != "v1":
                continue
            schema = strict_crd_schema(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
            props = schema.setdefault("properties", {})
            props["apiVersion"] = {"type": "string", "enum": [f"{group}/{version['name']}"]}
            props["kind"] = {"type": "string", "enum": [kind]}
            props["metadata"] = {"$ref": f"#/$defs/{OBJECT_META}"}
            schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind"})
            schema["additionalProperties"] = False
            schema["$schema"] = DRAFT_2020_12
            schema["$defs"] = meta_defs
            target = out / group / f"{kind.lower()}_{version['name']}.json"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(schema))
            written.add(kind)
    if missing := kinds - written:
        raise ValueError(f"no served v1 schema for {sorted(missing)} in {[str(f) for f in crd_files]}")
    return len(written)


def build(args: argparse.Namespace) -> None:
    """Build the whole schemas/ tree in a temporary sibling, then swap it in (never half-written)."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".schemas-", dir=out.parent))
    try:
        k8s_dir = tmp / "kubernetes" / f"v{args.kubernetes_version}-standalone-strict"
        n_core = build_kubernetes(Path(args.kubernetes_src), k8s_dir)
        definitions = json.loads((Path(args.kubernetes_src) / "_definitions.json").read_text())["$defs"]
        n_crd = build_crds([Path(f) for f in args.crd], definitions, tmp / "crds", set(args.crd_kind))
        manifest = {
            "kubernetes_version": args.kubernetes_version,
            "kubernetes_validate_version": args.kubernetes_validate_version,
            "kuberay_version": args.kuberay_version,
            "stamp": args.stamp,
            "kinds": {"kubernetes": n_core, "crds": n_crd},
        }
        (tmp / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    print(f"schemas: {n_core} Kubernetes v{args.kubernetes_version} kinds, {n_crd} KubeRay CRD kinds -> {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build the schemas/ tree (see scripts/k8s_tools.sh)")
    b.add_argument("--kubernetes-src", required=True, help="kubernetes-validate's v<K8S>-local-strict directory")
    b.add_argument("--kubernetes-version", required=True)
    b.add_argument("--kubernetes-validate-version", required=True)
    b.add_argument("--kuberay-version", required=True)
    b.add_argument("--crd", action="append", required=True, help="a CRD YAML file (repeat)")
    b.add_argument("--crd-kind", action="append", required=True, help="a CRD kind to convert (repeat)")
    b.add_argument("--stamp", required=True, help="opaque string recorded in MANIFEST.json")
    b.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        build(args)
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: building schemas failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
