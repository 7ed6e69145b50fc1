"""Where a call synchronises the host with the GPU, counted with PyTorch's sync debug mode.

A host read of a device value (``float(t)``, ``.tolist()``, ``.cpu()``) or a copy from pageable host memory
(``.to("cuda")``) makes the host wait for everything queued; the GPU then idles while the host prepares and
launches what follows.  Used by the GPU tests (``tests/gpu/test_trainer_syncs_cuda.py``) and the FSDP2 worker
(``sharded_trainer_worker.py --count-syncs``); it needs CUDA.
"""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

TORCH, WARNINGS = str(Path(torch.__file__).parent), warnings.__file__


def record_syncs(fn: Callable[[], object]) -> list[str]:
    """Run ``fn``; return where each synchronisation it made was called from: its innermost frames outside torch
    (file:line, innermost first)."""
    torch.cuda.synchronize()
    where: list[str] = []
    inside = [False]  # setting the mode can report a synchronisation of its own (seen on its first use)

    def record(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
        if inside[0] and "synchronizing" in str(message):
            frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.startswith((TORCH, WARNINGS))]
            where.append(" <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames[-5:])))

    with warnings.catch_warnings():  # restores showwarning and the filters
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            inside[0] = True
            fn()
        finally:
            inside[0] = False
            torch.cuda.set_sync_debug_mode("default")
    return where
