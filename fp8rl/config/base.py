"""What every config model shares: strict frozen models, the error type, YAML reading, error formatting."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from fp8rl.errors import UserError

M = TypeVar("M", bound=BaseModel)


class ConfigError(UserError, ValueError):
    """A config or recipe file is invalid; the message names the field(s)."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def format_validation_errors(e: ValidationError, source: str, what: str = "configuration") -> str:
    """``<source>: invalid <what>`` and one indented ``field.path: message`` line per error."""
    lines = [f"{source}: invalid {what}"]
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"])
        lines.append(f"  {loc or '(root)'}: {err['msg']}")
    return "\n".join(lines)


def read_yaml(path: Path, mapping_of: str | None = None) -> Any:
    """The YAML document in ``path`` (which exists); a ``ConfigError`` naming the file if it is not valid YAML or,
    with ``mapping_of``, not a mapping (``mapping_of`` says of what, for the message)."""
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if mapping_of is not None and not isinstance(data, dict):
        raise ConfigError(f"{path}: {mapping_of}, got {type(data).__name__}")
    return data


def validated(model: type[M], data: Any, source: str) -> M:
    """``model`` validated from ``data``; a ``ConfigError`` naming ``source`` and each invalid field otherwise."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_errors(e, source)) from None
