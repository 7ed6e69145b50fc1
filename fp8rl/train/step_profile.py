"""Where a policy step's device time goes, by kernel category: one step under ``torch.profiler``, on request.

``fp8rl bench step --profile-train`` arms it for one extra step after the timed ones (Ray: on every trainer rank),
and that step's metrics carry ``profile/train_ms/<category>``, and ``profile/train_calls/<category>`` how many
kernels that was: the device milliseconds of its kernels by what they are -- cuBLAS/CUTLASS GEMMs, attention, FP8 quantization, the optimizer, NCCL, and everything else (norms,
RoPE, activations, casts, copies, the head's softmax).  That is the breakdown the step-time table cannot give:
whether a recipe's train phase is bounded by its GEMMs (which FP8 speeds up) or by the rest (which it does not).
On the CPU the same categories are taken from the aten ops' own CPU time, so the plumbing is testable there.

Reading the numbers: they are sums of kernel time, not busy time -- NCCL kernels run beside compute on their own
streams and include the time a rank waits for the others; "optimizer" also holds the other ``foreach`` kernels
(under FSDP2 the all-gather's copy-in, and the gradient norm); the categories are name matches (``CATEGORIES``).
A Ray trainer group reports one rank's profile, the rank with the most non-NCCL kernel time.

On CUDA the profile also says when the compute stream waited (``stream_gaps``): its idle time between kernels by gap
size, and the long gaps by the kind of kernel that ended each.  Many short gaps point at the host launching slower than
the GPU runs; a few long ones at waits (a host read of a device value, another stream's collective), and how much of
the idle time a collective ran says which.  And it names the "other" kernels that took the most time (``top_kernels``).
"""

from __future__ import annotations

import functools
import heapq
import math
import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Concatenate, ParamSpec, Protocol

import torch

from fp8rl.quant import launch_config

METRIC_PREFIX = "profile/train_ms/"
CALLS_PREFIX = "profile/train_calls/"  # how many kernels (CPU: ops) of each category ran: ms / calls is the mean
# CUDA: the FP8 quantization kernels by what each quantized (``fp8rl.quant.launch_config.record_launches``' labels:
# granularity/rows x columns/copies), their ms and launches; QUANT_UNPAIRED: launches and kernel events disagreed
QUANT_MS_PREFIX, QUANT_CALLS_PREFIX, QUANT_UNPAIRED = (
    "profile/quant_ms/",
    "profile/quant_calls/",
    "profile/quant_unpaired",
)
WALL_KEY = "profile/wall_s"  # the profiled step's wall seconds (under the profiler, without its post-processing)
# CUDA: the compute stream's idle time between its kernels (the stream with the most non-NCCL kernel time), by gap size:
# ms and how many; and the gaps of 1 ms or more by the category of the kernel that ends each (what the stream waited to
# start: e.g. a micro-batch's first kernels after a host read, or a kernel waiting on another stream's collective)
GAP_MS_PREFIX, GAPS_PREFIX, GAP_BEFORE_PREFIX = "profile/gap_ms/", "profile/gaps/", "profile/gap_ms_before/"
# and by the ``kernel_label`` of the kernel that ends each, the labels with the most such time (what exactly waited)
GAP_BEFORE_KERNEL_PREFIX, GAP_BEFORE_KERNELS = "profile/gap_ms_before_kernel/", 5
# the part of that idle time during which a collective (an NCCL kernel, on any stream) was running: an upper bound on the
# compute stream waiting on communication (FSDP2's reduce-scatters and all-gathers) rather than on the host (a host
# launch gap while an asynchronous collective runs counts too)
GAP_DURING_COLLECTIVE = "profile/gap_ms_during/collective"
# CUDA: the kernels of the "other" category (what FP8 does not speed up: norms, RoPE, casts, copies, the loss) that took
# the most device time, ms and launches by ``kernel_label``: where fusing would pay
TOP_OTHER_MS_PREFIX, TOP_OTHER_CALLS_PREFIX, TOP_OTHER = "profile/top_other_ms/", "profile/top_other_calls/", 15
GAP_BUCKETS = ((0.01, "under_10us"), (0.1, "10us_to_0.1ms"), (1.0, "0.1_to_1ms"), (math.inf, "1ms_and_more"))

# (category, lowercase substrings of a kernel's or op's name); the first match wins, the rest is "other"
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "matmul", "sm90_", "aten::mm", "aten::addmm", "aten::bmm")),
    # fp8rl's Triton kernels, then TransformerEngine's (cast + transpose, block quantization, amax)
    ("fp8_quantize", ("_groups_kernel", "_tiles_kernel", "_rows_kernel", "_cast_tensor", "_amax_kernel",
                      "_row_one_pass", "_amax_rows_cols", "_cast_rows_cols",
                      "cast_transpose", "quantize_transpose", "block_scaled_1d", "compute_amax")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("nccl", ("nccl",)),
)  # fmt: skip


def category(name: str) -> str:
    low = name.lower()
    return next((c for c, keys in CATEGORIES if any(k in low for k in keys)), "other")


# words of a CUDA kernel's C++ name that say nothing about what it computes (namespaces, argument types)
_LABEL_NOISE = frozenset({
    "void", "at", "native", "c10", "std", "anonymous", "namespace", "detail", "ul", "array", "char", "int",
    "unsigned", "long", "const", "cuda", "impl", "gpu", "TensorIteratorBase", "OpaqueType",
})  # fmt: skip


def kernel_label(name: str, width: int = 120) -> str:
    """A kernel's name shortened to what tells kernels apart (PyTorch's templated elementwise kernels by their functor
    and dtypes), in letters, digits, '_' and '.' only (an MLflow metric name): its identifiers in order, each once,
    without namespaces and argument types."""
    words: list[str] = []
    for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", name):
        if w not in _LABEL_NOISE and w not in words:
            words.append(w)
    return ".".join(words)[:width] or "unnamed"


def top_kernels(prof: Any, cat: str = "other", n: int = TOP_OTHER) -> dict[str, float]:
    """The ``n`` labels (``kernel_label``) of category ``cat`` whose kernels took the most device time: their ms
    (``TOP_OTHER_MS_PREFIX``) and launches (``TOP_OTHER_CALLS_PREFIX``)."""
    ms: dict[str, float] = {}
    calls: dict[str, float] = {}
    for e in prof.key_averages():
        if e.self_device_time_total > 0 and category(e.key) == cat:
            label = kernel_label(e.key)
            ms[label] = ms.get(label, 0.0) + e.self_device_time_total / 1e3
            calls[label] = calls.get(label, 0.0) + float(e.count)
    top = heapq.nlargest(n, ms, key=ms.__getitem__)
    return {**{TOP_OTHER_MS_PREFIX + k: ms[k] for k in top}, **{TOP_OTHER_CALLS_PREFIX + k: calls[k] for k in top}}


def device_ms_by_category(prof: Any, on_cuda: bool) -> tuple[dict[str, float], dict[str, float]]:
    """Milliseconds and launch counts by category from a finished ``torch.profiler.profile``: the kernels' own
    device time on CUDA, the ops' own CPU time otherwise."""
    totals: dict[str, float] = {}
    calls: dict[str, float] = {}
    for e in prof.key_averages():
        us = e.self_device_time_total if on_cuda else e.self_cpu_time_total
        if us > 0:
            cat = category(e.key)
            totals[cat] = totals.get(cat, 0.0) + us / 1e3
            calls[cat] = calls.get(cat, 0.0) + float(e.count)
    return totals, calls


class StepProfile:
    """``arm()``, then the next ``around()`` block runs under the profiler and fills the dict it yields with
    ``profile/train_ms/<category>``; unarmed, ``around()`` costs nothing and yields an empty dict."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.armed = device, False

    def arm(self) -> None:
        self.armed = True

    @contextmanager
    def around(self) -> Iterator[dict[str, float]]:
        out: dict[str, float] = {}
        if not self.armed:
            yield out
            return
        from torch.profiler import ProfilerActivity, profile

        self.armed = False
        on_cuda = self.device.type == "cuda"
        prof = profile(activities=[ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU], acc_events=True)
        if on_cuda:
            torch.cuda.synchronize(self.device)
        prof.start()
        t0 = time.perf_counter()
        try:
            with launch_config.record_launches() as launches:
                yield out
            if on_cuda:
                torch.cuda.synchronize(self.device)
            wall = time.perf_counter() - t0  # the step's own time, without the profiler's post-processing below
        finally:
            prof.stop()
        ms, calls = device_ms_by_category(prof, on_cuda)
        out.update({METRIC_PREFIX + k: v for k, v in ms.items()})
        out.update({CALLS_PREFIX + k: v for k, v in calls.items()})
        out[WALL_KEY] = wall
        if on_cuda:
            out.update(quantize_ms_by_launch(prof, launches))
            out.update(compute_stream_gaps(prof))
            out.update(top_kernels(prof))


def quantize_ms_by_launch(prof: Any, launches: list[tuple[str, str]]) -> dict[str, float]:
    """The FP8 quantization kernels' ms and launches by what each quantized: the profiler's ``fp8_quantize`` kernel
    events in start order, paired one to one with the launches (one stream, so launch order is run order), each
    event's name holding its launch's kernel name; when the counts or a name differ, only ``QUANT_UNPAIRED`` (the
    count difference, at least 1), no guess."""
    events = sorted(
        (
            e
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and category(e.name) == "fp8_quantize"
        ),
        key=lambda e: e.time_range.start,
    )
    if len(events) != len(launches) or any(k not in e.name for e, (k, _) in zip(events, launches, strict=True)):
        return {QUANT_UNPAIRED: float(max(abs(len(events) - len(launches)), 1))}
    out: dict[str, float] = {}
    for e, (_, label) in zip(events, launches, strict=True):
        out[QUANT_MS_PREFIX + label] = out.get(QUANT_MS_PREFIX + label, 0.0) + e.time_range.elapsed_us() / 1e3
        out[QUANT_CALLS_PREFIX + label] = out.get(QUANT_CALLS_PREFIX + label, 0.0) + 1.0
    return out


def stream_gaps(
    kernels: list[tuple[float, float, str]], collectives: Sequence[tuple[float, float]] = ()
) -> dict[str, float]:
    """The idle time between one stream's kernels ``(start_us, end_us, name)``: ``GAP_MS_PREFIX`` / ``GAPS_PREFIX`` by
    gap size (``GAP_BUCKETS``), the gaps of 1 ms or more summed by the category of the kernel after each
    (``GAP_BEFORE_PREFIX``) and by its label (``GAP_BEFORE_KERNEL_PREFIX``, the ``GAP_BEFORE_KERNELS`` labels with
    the most), and, given the ``(start_us, end_us)`` of the collectives on every stream, how much of
    the idle time one was running (``GAP_DURING_COLLECTIVE``).  Only between the first kernel's start and the last
    one's end."""
    out: dict[str, float] = {}
    busy: list[tuple[float, float]] = []  # the collectives' union, in order
    for start, end in sorted(collectives):
        if busy and start <= busy[-1][1]:
            busy[-1] = (busy[-1][0], max(busy[-1][1], end))
        else:
            busy.append((start, end))
    by_kernel: dict[str, float] = {}
    during, first = 0.0, 0  # busy[first:] may still overlap a later gap (gaps come in order)
    busy_until = None
    for start, end, name in sorted(kernels):
        if busy_until is not None and start > busy_until:
            ms = (start - busy_until) / 1e3
            bucket = next(label for bound, label in GAP_BUCKETS if ms < bound)
            out[GAP_MS_PREFIX + bucket] = out.get(GAP_MS_PREFIX + bucket, 0.0) + ms
            out[GAPS_PREFIX + bucket] = out.get(GAPS_PREFIX + bucket, 0.0) + 1.0
            if ms >= 1.0:
                key = GAP_BEFORE_PREFIX + category(name)
                out[key] = out.get(key, 0.0) + ms
                label = kernel_label(name)
                by_kernel[label] = by_kernel.get(label, 0.0) + ms
            while first < len(busy) and busy[first][1] <= busy_until:
                first += 1
            for b0, b1 in busy[first:]:
                if b0 >= start:
                    break
                during += min(b1, start) - max(b0, busy_until)
        busy_until = end if busy_until is None else max(busy_until, end)
    for label in heapq.nlargest(GAP_BEFORE_KERNELS, by_kernel, key=by_kernel.__getitem__):
        out[GAP_BEFORE_KERNEL_PREFIX + label] = by_kernel[label]
    if busy and out:
        out[GAP_DURING_COLLECTIVE] = during / 1e3
    return out


def compute_stream_gaps(prof: Any) -> dict[str, float]:
    """``stream_gaps`` of the stream (the profiler's ``device_resource_id`` of a kernel) whose non-NCCL kernels took
    the most time: the stream the step's compute runs on; the NCCL kernels of every stream as its collectives."""
    streams: dict[Any, list[tuple[float, float, str]]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            streams.setdefault(e.device_resource_id, []).append((e.time_range.start, e.time_range.end, e.name))
    if not streams:
        return {}
    busiest = max(streams.values(), key=lambda ks: sum(end - start for start, end, n in ks if category(n) != "nccl"))
    nccl = [(start, end) for ks in streams.values() for start, end, n in ks if category(n) == "nccl"]
    return stream_gaps(busiest, nccl)


class _Profiled(Protocol):
    step_profile: StepProfile


P = ParamSpec("P")


def profiled_step(
    step: Callable[Concatenate[Any, P], dict[str, float]],
) -> Callable[Concatenate[Any, P], dict[str, float]]:
    """A step method of an object with a ``step_profile``: when armed, the step runs under the profiler and its
    metrics gain ``profile/...``; unarmed, the step as it is."""

    @functools.wraps(step)
    def wrapper(self: _Profiled, *args: P.args, **kwargs: P.kwargs) -> dict[str, float]:
        with self.step_profile.around() as profiled:
            out = step(self, *args, **kwargs)
        return {**out, **profiled}

    return wrapper
