"""Run-config fields from the command line, shared by ``fp8rl train`` and ``fp8rl bench step``: the Ray flags
(layout, workers, sharding, sync, address) and ``--set KEY=VALUE`` for any other field, applied over a run
config's data before it is validated."""

from __future__ import annotations

import argparse
from typing import Any

from fp8rl.errors import UserError


def apply_overrides(base: dict[str, Any], overrides: list[str] | None) -> None:
    """``--set KEY=VALUE`` over a run config's data: ``KEY`` a dotted field path (``rollout.kv_calibration_tokens``),
    ``VALUE`` read as YAML (``16384``, ``true``, ``null``, ``[0.9, 0.95]``).  The config's own validation then
    names a field that does not exist or a value of the wrong type."""
    import yaml

    for item in overrides or []:
        key, sep, raw = item.partition("=")
        path = key.strip().split(".")
        if not sep or not all(path):
            raise UserError(f"--set {item!r}: expected KEY=VALUE with KEY a dotted field path, e.g. optim.lr=1e-6")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise UserError(f"--set {key}: the value {raw!r} is not valid YAML: {e}") from None
        node = base
        for i, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise UserError(f"--set {key}: {'.'.join(path[: i + 1])} is {child!r}, not a section")
            node = child
        node[path[-1]] = value


def apply_ray_flags(base: dict[str, Any], args: argparse.Namespace) -> None:
    """The Ray flags given (``add_ray_arguments``) over the config's ``ray`` section; any of them turns Ray on."""
    ray_flags = {
        "trainer_workers": args.trainer_workers,
        "rollout_workers": args.rollout_workers,
        "address": args.ray_address,
        "layout": args.layout,
        "trainer_sharding": args.trainer_sharding,
        "sync": args.sync,
    }
    if any(v is not None for v in ray_flags.values()):
        base["ray"] = {**(base.get("ray") or {}), **{k: v for k, v in ray_flags.items() if v is not None}}


class _RecipeList(argparse.Action):
    """``--recipes A,B`` and ``--recipe A --recipe B`` fill one list, in the order given."""

    def __call__(
        self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: str | None = None
    ) -> None:
        names = [n for n in str(values).split(",") if n] if option_string == "--recipes" else [str(values)]
        if not names:
            parser.error(f"{option_string}: name at least one recipe")
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest) or []), *names])


def add_recipes_argument(p: argparse.ArgumentParser, default: str) -> None:
    """The recipes of a comparison: ``--recipes A,B`` (canonical, like ``--seeds``) or ``--recipe A`` repeated (the
    same list); ``args.recipes`` is ``None`` when neither is given (the caller's default, named in the help)."""
    helptext = (
        f"recipes to run, comma-separated: bf16 | fp8-rollout | fp8-e2e | fp8-e2e-kv | ... | recipe.yaml (default: "
        f"{default}); `fp8rl recipes` lists the built-in ones with their measured accuracy cost"
    )
    p.add_argument("--recipes", action=_RecipeList, dest="recipes", default=None, metavar="R[,R...]", help=helptext)
    p.add_argument(
        "--recipe", action=_RecipeList, dest="recipes", metavar="R", help="one recipe; repeatable (same as --recipes)"
    )


def add_device_argument(p: argparse.ArgumentParser, default: str | None = "auto") -> None:
    """``--device auto|cpu|cuda`` (fp8rl.devices): ``auto`` is CUDA when a CUDA device is visible."""
    from fp8rl.devices import DEVICE_CHOICES

    p.add_argument(
        "--device", choices=DEVICE_CHOICES, default=default,
        help="where this process computes: auto (CUDA when present, else the CPU), cpu or cuda"
        + (" (default: auto)" if default else " (default: the config's device, auto)"),
    )  # fmt: skip


def add_set_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--set", action="append", default=None, metavar="KEY=VALUE",
        help="override a run-config field after --config and the flags (repeatable), e.g. --set optim.lr=1e-6",
    )  # fmt: skip


def add_ray_arguments(p: argparse.ArgumentParser) -> None:
    ray = p.add_argument_group("Ray (any of these runs the loop on Ray actors; they override the config's ray)")
    ray.add_argument("--trainer-workers", type=int, default=None, metavar="N", help="data-parallel trainer actors")
    ray.add_argument("--rollout-workers", type=int, default=None, metavar="M", help="rollout engine actors")
    ray.add_argument("--ray-address", default=None, help="an existing Ray cluster (default: RAY_ADDRESS or local)")
    ray.add_argument(
        "--layout", choices=["split", "colocated"], default=None,
        help="split: a GPU per actor; colocated: trainer rank i and rollout worker i share one",
    )  # fmt: skip
    ray.add_argument(
        "--trainer-sharding", choices=["replicate", "fsdp"], default=None,
        help="fsdp: shard the fp32 masters and AdamW state across the trainer actors (FSDP2)",
    )  # fmt: skip
    ray.add_argument(
        "--sync", choices=["objectstore", "collective", "ipc"], default=None,
        help="weight sync: Ray's object store, an NCCL/gloo broadcast, or CUDA IPC (colocated GPUs)",
    )  # fmt: skip
