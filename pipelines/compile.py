"""``python -m pipelines.compile [--output-dir DIR] [--registry REGISTRY] [--digest IMAGE=DIGEST] [--components]
[NAME ...]``: write pipeline IR YAML (and, with ``--components``, each component's YAML).

One file per pipeline, ``<DIR>/<pipeline name>.yaml`` (default ``dist/pipelines/``), each written
atomically; upload it in the KFP UI or with ``kfp pipeline upload``. ``--registry`` prefixes the
project's image names (``registry.example.com/ml`` -> ``registry.example.com/ml/fp8rl-component:<version>``);
``--digest fp8rl-component=sha256:<64 hex>`` refers to that image by the digest its push printed
(``.../fp8rl-component@sha256:...``), so that the run uses exactly the image that was pushed.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from fp8rl.atomic import atomic_write_text
from fp8rl.errors import UserError

DEFAULT_OUTPUT_DIR = Path("dist/pipelines")


CPU_ONLY_HELP = (
    "for a cluster without GPUs: the evaluation and benchmark steps request no GPU and run from the component image "
    "(pair with --param device=cpu)"
)
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def parse_digests(specs: Sequence[str]) -> dict[str, str]:
    """``["fp8rl-component=sha256:...", ...]`` -> {image name: digest}; a UserError names the bad one."""
    from components.images import IMAGES

    names = {image.split(":")[0] for image in IMAGES}
    digests: dict[str, str] = {}
    for spec in specs:
        name, _, digest = spec.partition("=")
        if name not in names:
            raise UserError(f"--digest {spec!r}: the image must be one of {sorted(names)}")
        if not DIGEST.fullmatch(digest):
            raise UserError(f"--digest {spec!r}: the digest must be sha256:<64 lowercase hex>")
        digests[name] = digest
    return digests


def pipeline_ir(
    pipeline: Any, registry: str | None = None, digests: Mapping[str, str] | None = None, cpu_only: bool = False
) -> list[dict[str, Any]]:
    """The compiled IR documents: the pipeline spec and, when a step has Kubernetes settings, the platform spec.
    The project's images get ``registry/`` in front and, where ``digests`` names them, ``@digest`` for the tag;
    ``cpu_only``: the GPU steps' runtime image becomes the component image (which carries fp8rl's CPU path)."""
    from kfp import compiler

    from components.images import COMPONENT_IMAGE, IMAGES, RUNTIME_IMAGE

    with tempfile.TemporaryDirectory(prefix="fp8rl-ir-") as tmp:
        path = Path(tmp) / "pipeline.yaml"
        compiler.Compiler().compile(pipeline, str(path))
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    prefix = registry.rstrip("/") + "/" if registry else ""
    for executor in docs[0]["deploymentSpec"]["executors"].values():
        container = executor.get("container", {})
        if cpu_only and container.get("image") == RUNTIME_IMAGE:
            container["image"] = COMPONENT_IMAGE
        if container.get("image") in IMAGES:
            name = container["image"].split(":")[0]
            digest = (digests or {}).get(name)
            container["image"] = prefix + (f"{name}@{digest}" if digest else container["image"])
    return docs


def disable_caching(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every task of the pipeline spec ``docs[0]``, in every DAG, never served from KFP's cache (kfp.Client's
    ``enable_caching=False`` reaches only the root DAG's tasks, not the steps inside the exit handler)."""
    spec = docs[0]
    for dag in [spec["root"], *spec.get("components", {}).values()]:
        for task in dag.get("dag", {}).get("tasks", {}).values():
            task.setdefault("cachingOptions", {})["enableCache"] = False
    return docs


def component_ir(
    component: Any, registry: str | None = None, digests: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """A component's compiled YAML (what ``kfp.components.load_component_from_file`` reads), images as in
    ``pipeline_ir``."""
    return pipeline_ir(component, registry, digests)[0]


def write_ir(docs: list[dict[str, Any]], path: Path) -> Path:
    atomic_write_text(path, yaml.safe_dump_all(docs, sort_keys=False))
    return path


def medium_step_size(text: str | None) -> Any:
    """``--step-requests CPU,MEMORY`` -> a ``StepSize`` (``None``: the default); errors name the option."""
    from pipelines.cluster import parse_step_size

    if text is None:
        return None
    try:
        return parse_step_size(text)
    except ValueError as e:
        raise UserError(f"--step-requests {e}") from None


def values_step_pods(values: Sequence[str]) -> Any:
    """``--values FILE`` (repeatable, merged as helm merges them) -> the ``StepPods`` of the chart's
    ``pipelineSteps``; errors name the file and the field."""
    from pipelines.cluster import read_step_pods

    try:
        return read_step_pods(values)
    except ValueError as e:
        raise UserError(f"--values {e}") from None


VALUES_HELP = (
    "a values file of the fp8rl chart (as `helm install -f`; repeatable, later wins): its pipelineSteps section "
    "(env, podAnnotations, podLabels, tolerations, nodeSelector) and images.pullSecrets go into every step's pod"
)


def compile_all(
    output_dir: Path,
    names: Sequence[str] = (),
    registry: str | None = None,
    digests: Mapping[str, str] | None = None,
    step_requests: str | None = None,
    cpu_only: bool = False,
    caching: bool = True,
    values: Sequence[str] = (),
) -> list[Path]:
    from pipelines import get_pipelines

    available = get_pipelines(medium=medium_step_size(step_requests), gpus=not cpu_only, pods=values_step_pods(values))
    unknown = [n for n in names if n not in available]
    if unknown:
        raise UserError(f"unknown pipeline(s) {unknown}; available: {', '.join(available)}")
    paths = []
    for name in names or available:
        docs = pipeline_ir(available[name], registry, digests, cpu_only)
        paths.append(write_ir(docs if caching else disable_caching(docs), output_dir / f"{name}.yaml"))
    return paths


def compile_components(
    output_dir: Path, registry: str | None = None, digests: Mapping[str, str] | None = None
) -> list[Path]:
    """Every component as ``<output_dir>/<name>.yaml``, for pipelines of your own."""
    from components import all_components

    return [
        write_ir([component_ir(c, registry, digests)], output_dir / f"{name}.yaml")
        for name, c in all_components().items()
    ]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipelines.compile", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help="pipelines to compile (default: all)")
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR, help="default: %(default)s")
    parser.add_argument("--registry", default=None, help="image registry prefix, e.g. registry.example.com/ml")
    parser.add_argument(
        "--digest",
        action="append",
        default=[],
        metavar="IMAGE=DIGEST",
        help="refer to IMAGE (fp8rl-component, fp8rl-runtime) by digest, e.g. fp8rl-runtime=sha256:<64 hex> as "
        "`images/build.sh --push` prints it; repeatable",
    )
    parser.add_argument(
        "--step-requests",
        default=None,
        metavar="CPU,MEMORY",
        help="requests of the CPU steps that hold a model (prepare, SFT, convert, the RL step's driver; default "
        "2,8Gi), e.g. 500m,2Gi for small nodes",
    )
    parser.add_argument("--cpu-only", action="store_true", help=CPU_ONLY_HELP)
    parser.add_argument("--values", action="append", default=[], metavar="FILE", help=VALUES_HELP)
    parser.add_argument(
        "--disable-caching",
        dest="caching",
        action="store_false",
        help="compile every step with KFP's execution caching off (as `kfp dsl compile "
        "--disable-execution-caching-by-default`): a run started from this file, in the UI say, runs every step",
    )
    parser.add_argument(
        "--components",
        action="store_true",
        help="also every component, as <output-dir>/components/<name>.yaml, to reuse in pipelines of your own",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        digests = parse_digests(args.digest)
        paths = compile_all(
            args.output_dir,
            args.names,
            args.registry,
            digests,
            args.step_requests,
            args.cpu_only,
            args.caching,
            args.values,
        )
        if args.components:
            paths += compile_components(args.output_dir / "components", args.registry, digests)
        for path in paths:
            print(f"wrote {path}")
    except UserError as e:
        print(f"pipelines.compile: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
