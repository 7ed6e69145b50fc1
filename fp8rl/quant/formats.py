"""The two OCP FP8 formats and their numeric limits."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FP8Format:
    """An FP8 format: its torch dtype and the limits the error bounds derive from."""

    name: str
    dtype: torch.dtype
    max: float
    mantissa_bits: int
    min_normal: float

    @property
    def min_subnormal(self) -> float:
        """Smallest positive subnormal: the spacing of values below ``min_normal``."""
        return self.min_normal * 2.0**-self.mantissa_bits

    @property
    def relative_step(self) -> float:
        """Spacing of representable values relative to the value, in the normal range (2^-m)."""
        return 2.0**-self.mantissa_bits


E4M3 = FP8Format("e4m3", torch.float8_e4m3fn, 448.0, 3, 2.0**-6)
E5M2 = FP8Format("e5m2", torch.float8_e5m2, 57344.0, 2, 2.0**-14)

_FORMATS = {f.name: f for f in (E4M3, E5M2)}


def get_format(name: str | FP8Format) -> FP8Format:
    """Return the format called ``name`` (``e4m3`` or ``e5m2``)."""
    if isinstance(name, FP8Format):
        return name
    try:
        return _FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown FP8 format {name!r}; expected one of {sorted(_FORMATS)}") from None
