"""Package names that load their module on first use (PEP 562's module ``__getattr__``)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(package: str, home: Mapping[str, str]) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``package``: a name of ``home`` (name -> submodule) is imported from
    ``package.<submodule>`` when first asked for, and kept in the package's namespace from then on."""

    def __getattr__(name: str) -> Any:
        module = home.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
