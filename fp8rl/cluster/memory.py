"""Peak device memory per GPU for the RL step on Ray.

A Ray actor's ``torch.cuda.max_memory_allocated`` sees its own caching allocator only: not vLLM's
sleep-mode pool, not the other actor on a colocated GPU, not NCCL's buffers.  What a user sizes a cluster
by is the GPU's used memory as ``nvidia-smi`` shows it, so every GPU actor samples that (NVML, through
``torch.cuda.device_memory_used``) in a background thread and keeps the maximum; the driver takes the
maximum per GPU over the actors that share it.  NVML reads are not CUDA calls, so sampling is safe
beside CUDA-graph capture.  A transient shorter than the interval can be missed, but the caching
allocators keep what they reserved, so a peak lasts until memory is handed back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

DEFAULT_INTERVAL_S = 0.02


class PeakMemorySampler:
    """Polls ``read()`` (bytes in use) every ``interval_s`` in a daemon thread and keeps the maximum."""

    def __init__(self, read: Callable[[], int], interval_s: float = DEFAULT_INTERVAL_S) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._read, self._interval = read, interval_s
        self._lock = threading.Lock()
        self._peak = int(read())  # a reader that fails, fails here, in the caller's thread
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fp8rl-peak-memory", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                used = int(self._read())
            except BaseException as e:  # kept and raised by peak(): a sampler that stopped must not look idle
                self._error = e
                return
            with self._lock:
                self._peak = max(self._peak, used)

    def peak(self, reset: bool = False) -> int:
        """The most bytes in use seen since the start or the last reset; ``reset`` starts a new window
        at the current reading."""
        if self._error is not None:
            raise RuntimeError(f"the peak-memory sampler stopped: {self._error!r}") from self._error
        current = int(self._read())
        with self._lock:
            peak = max(self._peak, current)
            self._peak = current if reset else peak
        return peak

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self._interval + 1)


def gpu_sampler(device_index: int, interval_s: float = DEFAULT_INTERVAL_S) -> PeakMemorySampler | None:
    """A sampler of the whole GPU's used memory (every process on it), or None where NVML is missing
    (``nvidia-ml-py``: vLLM and the GPU images bring it)."""
    import torch

    try:
        import pynvml  # noqa: F401
    except ImportError:
        return None
    return PeakMemorySampler(lambda: torch.cuda.device_memory_used(device_index), interval_s)


def gpu_key(device_index: int) -> str:
    """The GPU's UUID: the same physical GPU under any ``CUDA_VISIBLE_DEVICES`` numbering."""
    import torch

    return str(torch.cuda.get_device_properties(device_index).uuid)


def merge_peaks(reports: list[dict[str, int] | None], names: list[str]) -> dict[str, int]:
    """Per GPU, the maximum over the actors that report it (actors sharing a GPU see the same device), keyed
    by the names of those actors joined with ``+`` (``trainer-0+rollout-0``); CPU actors report None."""
    peaks: dict[str, int] = {}
    on: dict[str, list[str]] = {}
    for name, report in zip(names, reports, strict=True):
        for gpu, used in (report or {}).items():
            peaks[gpu] = max(peaks.get(gpu, 0), used)
            on.setdefault(gpu, []).append(name)
    return {"+".join(on[gpu]): used for gpu, used in peaks.items()}
