"""One device rule for the commands and components that run in this process (``--device``, ``RunConfig.device``).

``auto`` is CUDA when a CUDA device is visible, else the CPU; ``cuda`` without one is a clear error rather than a
silent fall back to the CPU.  Ray runs place their actors by ``ray.*`` and ignore it.
"""

from __future__ import annotations

from typing import Literal

from fp8rl.errors import UserError

DeviceChoice = Literal["auto", "cpu", "cuda"]
DEVICE_CHOICES: tuple[str, ...] = ("auto", "cpu", "cuda")


def resolve_device(choice: str, field: str = "device") -> str:
    """``"cpu"`` or ``"cuda"`` for ``choice`` (``auto | cpu | cuda``, or an explicit ``cuda:N``); ``field`` names
    where the choice came from in the error."""
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cpu":
        return "cpu"
    if choice == "cuda" or choice.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise UserError(f"{field} {choice!r}: no CUDA device is visible to this process (use 'auto' or 'cpu')")
        return choice
    raise UserError(f"{field} must be one of {', '.join(DEVICE_CHOICES)}, got {choice!r}")


def describe_device(device: str) -> str:
    """``cpu`` or ``cuda:0 (NVIDIA H200)``: what a run prints on its first line and tags in MLflow."""
    if not device.startswith("cuda"):
        return device
    import torch

    index = torch.device(device).index or 0
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
