"""The conversion error report: per-tensor relative error and bytes before/after."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from fp8rl.quant import QuantizedTensor


@dataclass
class TensorReport:
    """Quantization error of one tensor.

    ``rel_error = ||deq(q) - w||_F / ||w||_F`` and ``max_abs_error = max |deq(q) - w|``,
    both computed in float64 against the source values.
    """

    name: str
    shape: list[int]
    dtype: str
    rel_error: float
    max_abs_error: float
    bytes_before: int
    bytes_after: int

    @classmethod
    def measure(cls, name: str, source: torch.Tensor, q: QuantizedTensor) -> TensorReport:
        ref = source.to(torch.float64)
        diff = q.dequantize(torch.float64) - ref
        norm = float(ref.norm())
        return cls(
            name=name,
            shape=list(source.shape),
            dtype=str(source.dtype).removeprefix("torch."),
            rel_error=float(diff.norm()) / norm if norm > 0 else 0.0,
            max_abs_error=float(diff.abs().max()) if diff.numel() else 0.0,
            bytes_before=source.numel() * source.element_size(),
            bytes_after=q.nbytes,
        )


@dataclass
class ConversionReport:
    source: str
    options: dict[str, Any]
    tensors: list[TensorReport] = field(default_factory=list)
    kept_layers: list[int] = field(default_factory=list)
    # modules left in their source dtype because their shape is not whole weight tiles: {module, shape, reason}
    kept_partial_tiles: list[dict[str, Any]] = field(default_factory=list)
    bytes_before: int = 0  # weight files on disk
    bytes_after: int = 0

    @property
    def quantized_bytes_before(self) -> int:
        return sum(t.bytes_before for t in self.tensors)

    @property
    def quantized_bytes_after(self) -> int:
        return sum(t.bytes_after for t in self.tensors)

    def summary(self) -> dict[str, float]:
        errs = [t.rel_error for t in self.tensors] or [0.0]
        return {
            "tensors_quantized": len(self.tensors),
            "rel_error_mean": sum(errs) / len(errs),
            "rel_error_max": max(errs),
            "quantized_bytes_before": self.quantized_bytes_before,
            "quantized_bytes_after": self.quantized_bytes_after,
            "file_bytes_before": self.bytes_before,
            "file_bytes_after": self.bytes_after,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "options": self.options,
            "kept_layers": self.kept_layers,
            "kept_partial_tiles": self.kept_partial_tiles,
            "summary": self.summary(),
            "tensors": [asdict(t) for t in self.tensors],
        }

    def to_markdown(self, worst: int = 10) -> str:
        s = self.summary()
        ratio = s["file_bytes_after"] / s["file_bytes_before"] if s["file_bytes_before"] else 0.0
        q_ratio = s["quantized_bytes_after"] / s["quantized_bytes_before"] if s["quantized_bytes_before"] else 0.0
        opts = ", ".join(f"{k}={v}" for k, v in self.options.items())
        lines = [
            "# FP8 conversion report",
            "",
            f"- source: `{self.source}`",
            f"- options: {opts}",
            f"- layers kept in original precision: {self.kept_layers or 'none'}",
            f"- modules kept in original precision because they are not whole weight tiles: "
            f"{len(self.kept_partial_tiles) or 'none'}",
            f"- tensors quantized: {s['tensors_quantized']}",
            f"- relative error (Frobenius), mean / max: {s['rel_error_mean']:.3e} / {s['rel_error_max']:.3e}",
            f"- quantized tensors: {_mib(s['quantized_bytes_before'])} -> {_mib(s['quantized_bytes_after'])} "
            f"({q_ratio:.3f}x)",
            f"- weight files: {_mib(s['file_bytes_before'])} -> {_mib(s['file_bytes_after'])} ({ratio:.3f}x)",
            "",
            f"## Largest errors (top {min(worst, len(self.tensors))})",
            "",
            "| tensor | shape | rel. error | max abs. error | bytes before | bytes after |",
            "|---|---|---|---|---|---|",
        ]
        for t in sorted(self.tensors, key=lambda t: t.rel_error, reverse=True)[:worst]:
            lines.append(
                f"| `{t.name}` | {'x'.join(map(str, t.shape))} | {t.rel_error:.3e} | {t.max_abs_error:.3e} "
                f"| {t.bytes_before} | {t.bytes_after} |"
            )
        if self.kept_partial_tiles:
            lines += ["", "## Kept in original precision: not whole weight tiles", "",
                      "| module | shape | why |", "|---|---|---|"]  # fmt: skip
            for m in self.kept_partial_tiles:
                lines.append(f"| `{m['module']}` | {'x'.join(map(str, m['shape']))} | {m['reason']} |")
        return "\n".join(lines) + "\n"


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"
