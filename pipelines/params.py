"""``--param key=value`` parsing against a pipeline's declared parameters and their KFP types."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import yaml

from components.runtime import BACKENDS
from fp8rl.errors import UserError

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def parameter_types(pipeline: Any) -> dict[str, str]:
    """``{name: KFP type}`` (``String``, ``Integer``, ``Float``, ``Boolean``, ``List``, ``Dict``) of a pipeline's inputs."""
    return {name: str(spec.type) for name, spec in (pipeline.component_spec.inputs or {}).items()}


def parse_value(name: str, kind: str, text: str) -> Any:
    """``text`` as a value of KFP type ``kind``; a ``UserError`` naming the parameter otherwise.

    Lists are YAML/JSON (``[bf16, fp8-e2e]``) or comma-separated (``bf16,fp8-e2e``); dicts are
    YAML/JSON flow mappings (``{grpo: {prompts_per_step: 8}}``).
    """
    try:
        if kind == "String":
            return text
        if kind == "Integer":
            return int(text)
        if kind == "Float":
            return float(text)
        if kind == "Boolean":
            if text.lower() in _TRUE | _FALSE:
                return text.lower() in _TRUE
            raise ValueError
        if kind == "List":
            value = yaml.safe_load(text) if text.lstrip().startswith("[") else [s.strip() for s in text.split(",")]
            if not isinstance(value, list):
                raise ValueError
            return value
        if kind == "Dict":
            value = yaml.safe_load(text)
            if not isinstance(value, dict):
                raise ValueError
            json.dumps(value)  # must be JSON data to travel in the IR
            return value
    except (ValueError, TypeError, yaml.YAMLError):
        pass
    else:
        raise UserError(f"--param {name}: parameters of type {kind} are not supported")
    examples = {"Integer": "20", "Float": "0.5", "Boolean": "true", "List": "bf16,fp8-e2e", "Dict": "'{a: 1}'"}
    hint = f" (e.g. {name}={examples[kind]})" if kind in examples else ""
    raise UserError(f"--param {name}={text}: expected {kind.lower()}{hint}")


def parse_params(pipeline_name: str, pipeline: Any, items: Sequence[str]) -> dict[str, Any]:
    """``["k=v", ...]`` -> ``{k: typed v}``; unknown names, missing ``=`` and bad values are ``UserError``s."""
    types = parameter_types(pipeline)
    out: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise UserError(f"--param {item!r}: expected key=value")
        if name not in types:
            raise UserError(
                f"--param {name}: pipeline {pipeline_name!r} has no parameter {name!r}; "
                f"its parameters: {', '.join(sorted(types))}"
            )
        out[name] = parse_value(name, types[name], text)
    return out


RECIPE_PARAMS = ("recipe", "recipes", "convert_recipe")


def null_path(value: Any, path: str = "") -> str | None:
    """Where in ``value`` a ``None`` sits (``""`` for ``value`` itself, ``.ray`` / ``[2]`` below it), else ``None``."""
    if value is None:
        return path
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        found = null_path(child, f"{path}.{key}" if isinstance(key, str) else f"{path}[{key}]")
        if found is not None:
            return found
    return None


def check_values(arguments: dict[str, Any]) -> None:
    """Catch what would only fail in a step later: unknown built-in recipe names, an unknown backend.

    A recipe given as a YAML path is left to the step (it may live on a volume only the step sees).
    """
    from fp8rl.config import BUILTIN_RECIPES

    for key, value in arguments.items():
        where = null_path(value)
        if where is not None:
            raise UserError(
                f"--param {key}{where}: null; a KFP parameter cannot carry a null value: leave the key out "
                "to take its default"
            )
    for key in RECIPE_PARAMS:
        values = arguments.get(key)
        for name in values if isinstance(values, list) else [] if values is None else [values]:
            is_path = "/" in str(name) or str(name).endswith((".yaml", ".yml"))
            if not is_path and name not in BUILTIN_RECIPES:
                raise UserError(f"--param {key}: unknown recipe {name!r}; built-in: {', '.join(BUILTIN_RECIPES)}")
    if "recipes" in arguments and not arguments["recipes"]:
        raise UserError("--param recipes: the list is empty")
    if "backend" in arguments and arguments["backend"] not in BACKENDS:
        raise UserError(f"--param backend: expected {' or '.join(BACKENDS)}, got {arguments['backend']!r}")
