"""RL-step throughput of one precision recipe: rollout and training tokens/s, weight-sync time and bytes.

Method. The loop's own parts are built for the recipe (``fp8rl.build.build_parts``: rollout
engine, trainer, requantized weight sync) and ``fp8rl.loop.rl_step`` runs ``warmup_steps``
untimed steps (allocator, kernel selection and caches settle) and then ``steps`` timed ones.
Each step reports, from its own ``time.perf_counter`` stamps:

- rollout tokens/s = response tokens sampled / generate seconds;
- train tokens/s = response tokens / (training-logprob + optimizer-step seconds);
- sync seconds and bytes = requantize + load of the trainer's weights into the engine;
- step seconds = the whole step, and its parts: generate, logprob (the trainer's recompute),
  train (the optimizer step), sync, and idle (the rest: rewards, advantages, bookkeeping);
- padding waste = the share of the tokens the trainer's forwards ran that were padding;
- peak GPU memory, named for what it measures: the one-process loop, this process's peak CUDA allocation
  (``peak_allocated_gb``, torch's allocator: what the tensors held, not the allocator's cache nor other
  processes); on Ray, each GPU's used memory as nvidia-smi counts it (every process on it, caches included),
  sampled by the actors over the timed steps (``fp8rl.cluster.memory``): the fullest GPU's in
  ``peak_gpu_used_gb`` and each GPU's, named by the actors on it (``trainer-0+rollout-0``), in
  ``peak_gpu_used_gb_per_gpu``.

The result is the median over the timed steps of each (robust to one slow step). Response
tokens are counted from the response mask, so a recipe whose policy stops earlier gets fewer
tokens for the same prompts; tokens/s stays comparable, seconds per step does not.
Nothing is extrapolated: every number is measured on ``device`` in this process.
"""

from __future__ import annotations

import platform
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from fp8rl.build import build_parts, task_examples
from fp8rl.config import RunConfig
from fp8rl.devices import resolve_device
from fp8rl.loop import rl_step
from fp8rl.tasks import Example
from fp8rl.train.step_profile import CALLS_PREFIX as STEP_PROFILE_CALLS
from fp8rl.train.step_profile import (
    GAP_BEFORE_KERNEL_PREFIX,
    GAP_BEFORE_PREFIX,
    GAP_DURING_COLLECTIVE,
    GAP_MS_PREFIX,
    GAPS_PREFIX,
    QUANT_CALLS_PREFIX,
    QUANT_MS_PREFIX,
    QUANT_UNPAIRED,
    TOP_OTHER_CALLS_PREFIX,
    TOP_OTHER_MS_PREFIX,
)
from fp8rl.train.step_profile import METRIC_PREFIX as STEP_PROFILE_PREFIX
from fp8rl.train.step_profile import WALL_KEY as STEP_PROFILE_WALL

# metric key of fp8rl.loop.rl_step -> field of ThroughputResult
STEP_METRICS: dict[str, str] = {
    "throughput/rollout_tokens_per_s": "rollout_tokens_per_s",
    "throughput/train_tokens_per_s": "train_tokens_per_s",
    "time/sync_s": "sync_s",
    "sync/bytes": "sync_bytes",
    "time/step_s": "step_s",
    "response_length": "response_tokens",
    "time/generate_s": "generate_s",
    "time/logprob_s": "logprob_s",
    "time/train_s": "train_s",
    "train/padding_waste": "padding_waste",
    "time/sync_requantize_s": "sync_requantize_s",
    "time/sync_load_s": "sync_load_s",
}
# reported only by some engines and recipes (absent otherwise)
OPTIONAL_STEP_METRICS: dict[str, str] = {
    "time/kv_calibrate_s": "kv_calibrate_s",
    "memory/rollout_sleep_freed_gb": "rollout_sleep_freed_gb",
    "train/optimizer_offload_s": "optimizer_offload_s",
    "train/cuda_alloc_retries": "cuda_alloc_retries",
}


@dataclass(frozen=True)
class ThroughputResult:
    """Medians over ``steps`` timed RL steps of ``recipe`` on ``device_name``."""

    recipe: str
    device: str
    device_name: str
    steps: int
    warmup_steps: int
    rollout_tokens_per_s: float
    train_tokens_per_s: float
    sync_s: float
    sync_bytes: float
    step_s: float
    response_tokens: float  # mean response length (tokens) per sampled response
    generate_s: float = 0.0
    logprob_s: float = 0.0
    train_s: float = 0.0
    padding_waste: float = 0.0
    # parts of sync_s as the transport timed them: requantize (+ pack), transfer + load (+ verify)
    sync_requantize_s: float = 0.0
    sync_load_s: float = 0.0
    # one process on CUDA: this process's peak allocation (torch's allocator; None elsewhere)
    peak_allocated_gb: float | None = None
    # Ray on GPUs: the fullest GPU's peak used memory (NVML: every process, caches included; None elsewhere)
    peak_gpu_used_gb: float | None = None
    # Ray on GPUs: the peak used memory of each GPU over the timed steps, keyed by the actors on it
    peak_gpu_used_gb_per_gpu: dict[str, float] | None = None
    # part of sync_s: the FP8 KV-cache recalibration after the push (None: a bf16 KV cache)
    kv_calibrate_s: float | None = None
    # colocated vLLM rollout workers: device memory their engines freed by sleeping (None: not measured)
    rollout_sleep_freed_gb: float | None = None
    # part of train_s: AdamW's state copied to the host and back (optim.offload_optimizer_state; the slowest rank)
    optimizer_offload_s: float | None = None
    # CUDA: times a trainer's caching allocator freed its cache to retry an allocation in a policy step (the most
    # of any rank): memory at its limit, each retry a synchronising cudaFree/cudaMalloc round
    cuda_alloc_retries: float | None = None
    # --profile-train: one policy step after the timed ones under the profiler, its kernel milliseconds by category
    # (gemm, attention, fp8_quantize, optimizer, nccl, other; on Ray the rank with the most non-NCCL kernel time;
    # sums of kernel time, not busy time: fp8rl.train.step_profile)
    train_device_ms: dict[str, float] | None = None
    # the same step's kernel launches by category (train_device_ms / these: the mean kernel's milliseconds)
    train_kernel_calls: dict[str, float] | None = None
    # the same step's FP8 quantization kernels by what each quantized (granularity/rows x columns/copies): ms and
    # launches (fp8rl.train.step_profile.quantize_ms_by_launch); None where not profiled or not paired
    train_quant_ms: dict[str, float] | None = None
    train_quant_calls: dict[str, float] | None = None
    # the profiled policy step's wall seconds (under the profiler, which adds some: compare within the profile)
    profiled_train_s: float | None = None
    # CUDA: that step's compute-stream idle between kernels by gap size (ms, and how many gaps), and the gaps of 1 ms
    # or more by the category of the kernel that ends each (fp8rl.train.step_profile.stream_gaps)
    train_gap_ms: dict[str, float] | None = None
    train_gaps: dict[str, float] | None = None
    train_gap_ms_before: dict[str, float] | None = None
    train_gap_ms_before_kernel: dict[str, float] | None = None  # the same by the kernel's label, the top few
    # of that idle time, the ms during which a collective (NCCL) ran on another stream: at most what the compute stream
    # waited on communication rather than on the host (several trainer ranks only)
    train_gap_ms_during_collective: float | None = None
    # CUDA: the "other" kernels (neither GEMM, attention, FP8 quantization, optimizer nor NCCL) that took the most time
    # in that step, ms and launches by fp8rl.train.step_profile.kernel_label
    train_top_other_ms: dict[str, float] | None = None
    train_top_other_calls: dict[str, float] | None = None
    # --profile-train: why the profiled step failed (its recipe's timed numbers stand; the CLI exits non-zero)
    train_profile_error: str | None = None

    @property
    def idle_s(self) -> float:
        """The step's time outside generate, logprob, train and sync."""
        return max(self.step_s - self.generate_s - self.logprob_s - self.train_s - self.sync_s, 0.0)

    def metrics(self, prefix: str = "bench/") -> dict[str, float]:
        """The numbers as MLflow/KFP metrics (``bench/rollout_tokens_per_s``, ...; peak memory where measured,
        ``bench/peak_allocated_gb`` in one process, ``bench/peak_gpu_used_gb`` and each Ray GPU's as
        ``bench/peak_gpu_used_gb/<actors on it>``)."""
        out = {f"{prefix}{name}": float(getattr(self, name)) for name in STEP_METRICS.values()}
        if self.peak_allocated_gb is not None:
            out[f"{prefix}peak_allocated_gb"] = self.peak_allocated_gb
        if self.peak_gpu_used_gb is not None:
            out[f"{prefix}peak_gpu_used_gb"] = self.peak_gpu_used_gb
        for actors, gb in (self.peak_gpu_used_gb_per_gpu or {}).items():  # MLflow metric names have no '+'
            out[f"{prefix}peak_gpu_used_gb/{actors.replace('+', '_')}"] = gb
        for cat, ms in (self.train_device_ms or {}).items():
            out[f"{prefix}train_device_ms/{cat}"] = ms
        for cat, n in (self.train_kernel_calls or {}).items():
            out[f"{prefix}train_kernel_calls/{cat}"] = n
        return out

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def device_name(device: str) -> str:
    """A human-readable name of the device the numbers were measured on."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def step_medians(timed: list[dict[str, float]]) -> dict[str, Any]:
    """The timed steps' medians as ``ThroughputResult`` fields: every ``STEP_METRICS`` key (0 where a step lacks it),
    each ``OPTIONAL_STEP_METRICS`` key that every step has."""
    medians: dict[str, Any] = {
        field: statistics.median(m.get(key, 0.0) for m in timed) for key, field in STEP_METRICS.items()
    }
    for key, field in OPTIONAL_STEP_METRICS.items():
        if all(key in m for m in timed):
            medians[field] = statistics.median(m[key] for m in timed)
    return medians


def benchmark_recipe(
    cfg: RunConfig,
    model_dir: str | Path,
    device: str = "cpu",
    steps: int = 3,
    warmup_steps: int = 1,
    log: Callable[[str], None] = print,
    verify_sync: bool = False,
    profile_train: bool = False,
) -> ThroughputResult:
    """Time ``steps`` RL steps of ``cfg`` (after ``warmup_steps`` untimed ones) from the checkpoint ``model_dir``.

    Uses ``cfg.grpo`` (prompts per step x group size), ``cfg.sampling`` and the recipe; the policy is
    updated as in training, so the timed steps are real steps. The bit-exact sync check
    (``cfg.verify_sync``) is turned off unless ``verify_sync``: it is a test of the sync, not part of its cost
    (with it, a mismatch fails the step and the check's time is part of the sync's).  ``profile_train``: one more
    step after the timed ones, its policy step under the profiler (``train_device_ms``; not in the medians); if
    that step fails, the error is in ``train_profile_error`` and the timed numbers are returned.
    """
    if steps < 1 or warmup_steps < 0:
        raise ValueError(f"need steps >= 1 and warmup_steps >= 0, got {steps} and {warmup_steps}")
    device = resolve_device(device, "device")
    cfg = cfg.model_copy(update={"verify_sync": verify_sync})
    torch.manual_seed(cfg.seed)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    parts, started_ray = _start(cfg, model_dir, device, log)
    gpu_peaks = getattr(parts, "gpu_peaks", None)  # Ray: each GPU's used memory, sampled by the actors
    try:
        train_pool, _ = task_examples(cfg)
        timed = _run_steps(cfg, parts, train_pool, steps, warmup_steps, cuda, log, gpu_peaks)
        per_gpu = {gpu: used / 2**30 for gpu, used in gpu_peaks().items()} if gpu_peaks else {}
        local_peak = torch.cuda.max_memory_allocated() / 2**30 if cuda and cfg.ray is None else None
        profiled = _profiled_step(cfg, parts, train_pool, warmup_steps + steps + 1, log) if profile_train else {}
    finally:
        _close_all(parts, started_ray)
    return ThroughputResult(
        recipe=cfg.recipe.name, device=device, device_name=device_name(device), steps=steps, warmup_steps=warmup_steps,
        peak_allocated_gb=local_peak,  # of the timed steps (read before a profiled step)
        peak_gpu_used_gb=max(per_gpu.values()) if per_gpu else None, peak_gpu_used_gb_per_gpu=per_gpu or None,
        **profiled, **step_medians(timed),
    )  # fmt: skip


def _close_all(parts: Any, started_ray: bool) -> None:
    """Close the run's parts, then stop the local Ray this benchmark started (also when closing fails)."""
    try:
        _close(parts)
    finally:
        _stop_ray(started_ray)


def _start(cfg: RunConfig, model_dir: str | Path, device: str, log: Callable[[str], None]) -> tuple[Any, bool]:
    """The run's parts (Ray actors when ``cfg.ray``; a local Ray started if none runs) and whether Ray was started."""
    if cfg.ray is None:
        return build_parts(cfg, model_dir, device), False
    from fp8rl.cluster.driver import create_ray_parts, ensure_ray

    t0 = time.perf_counter()
    started_ray = ensure_ray(cfg.ray, cfg.ray.trainer_workers + cfg.ray.rollout_workers)
    try:
        parts = create_ray_parts(cfg, model_dir, log=log)
        # in the bench's "[recipe] bench step" form, which an isolated recipe's process passes on
        log(f"[{cfg.recipe.name}] bench step 0 (start): Ray, the trainers and the engines up in "
            f"{time.perf_counter() - t0:.1f}s")  # fmt: skip
        return parts, started_ray
    except BaseException:
        _stop_ray(started_ray)
        raise


def _run_steps(
    cfg: RunConfig,
    parts: Any,
    train_pool: Sequence[Example],
    steps: int,
    warmup_steps: int,
    cuda: bool,
    log: Callable[[str], None],
    gpu_peaks: Callable[..., dict[str, int]] | None,
) -> list[dict[str, float]]:
    """The warm-up and timed RL steps, each logged; the timed steps' metrics (the GPU peaks reset before them)."""
    rng = random.Random(cfg.seed)
    timed: list[dict[str, float]] = []
    for step in range(1, warmup_steps + steps + 1):
        if step == warmup_steps + 1 and gpu_peaks is not None:
            gpu_peaks(reset=True)
        metrics = rl_step(cfg, parts, rng.sample(train_pool, cfg.grpo.prompts_per_step), step)
        if cuda:
            torch.cuda.synchronize()
        phase = "warm-up" if step <= warmup_steps else "timed"
        log(
            f"[{cfg.recipe.name}] bench step {step}/{warmup_steps + steps} ({phase}): "
            f"step {metrics['time/step_s']:.2f}s (generate {metrics['time/generate_s']:.2f}, "
            f"logprob {metrics['time/logprob_s']:.2f}, train {metrics['time/train_s']:.2f}, "
            f"sync {metrics['time/sync_s']:.3f}), rollout {metrics['throughput/rollout_tokens_per_s']:.0f} tok/s, "
            f"train {metrics['throughput/train_tokens_per_s']:.0f} tok/s"
        )
        if step > warmup_steps:
            timed.append(metrics)
    return timed


def _profiled_step(
    cfg: RunConfig, parts: Any, train_pool: Sequence[Example], step: int, log: Callable[[str], None]
) -> dict[str, Any]:
    """One more RL step with the trainer's policy step under the profiler: ``ThroughputResult``'s profile fields,
    its kernel ms by category and wall seconds or, when it fails, the error (the timed steps before it stand)."""

    def under(prefix: str) -> dict[str, float]:  # the trainer's metrics come back under train/
        return {k.removeprefix("train/" + prefix): v for k, v in metrics.items() if k.startswith("train/" + prefix)}

    try:
        parts.trainer.profile_next_policy_step()
        prompts = random.Random(cfg.seed + step).sample(train_pool, cfg.grpo.prompts_per_step)
        metrics = rl_step(cfg, parts, prompts, step)
        by_cat, calls = under(STEP_PROFILE_PREFIX), under(STEP_PROFILE_CALLS)
        quant_ms, quant_calls = under(QUANT_MS_PREFIX), under(QUANT_CALLS_PREFIX)
        if "train/" + QUANT_UNPAIRED in metrics:
            log(f"[{cfg.recipe.name}] quantization launches and kernel events did not pair; no per-shape times")
        if not by_cat:
            raise RuntimeError(f"[{cfg.recipe.name}] the profiled step reported no kernel times")
        wall = metrics["train/" + STEP_PROFILE_WALL]  # the policy step's own time, not the profiler's post-processing
    except Exception as e:  # the timed steps are measured: keep them; the error goes in the result
        error = f"{type(e).__name__}: {e}"[:2000]
        log(f"[{cfg.recipe.name}] the profiled step failed (the timed steps are kept): {error}")
        return {"train_profile_error": error}
    log(
        f"[{cfg.recipe.name}] bench step {step} (profiled, not timed): policy step {wall:.2f}s, "
        "kernel ms " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(by_cat.items(), key=lambda t: -t[1]))
    )
    return {
        "train_device_ms": by_cat, "train_kernel_calls": calls or None, "profiled_train_s": wall,
        "train_quant_ms": quant_ms or None, "train_quant_calls": quant_calls or None,
        "train_gap_ms": under(GAP_MS_PREFIX) or None, "train_gaps": under(GAPS_PREFIX) or None,
        "train_gap_ms_before": under(GAP_BEFORE_PREFIX) or None,
        "train_gap_ms_before_kernel": under(GAP_BEFORE_KERNEL_PREFIX) or None,
        "train_gap_ms_during_collective": metrics.get("train/" + GAP_DURING_COLLECTIVE),
        "train_top_other_ms": under(TOP_OTHER_MS_PREFIX) or None,
        "train_top_other_calls": under(TOP_OTHER_CALLS_PREFIX) or None,
    }  # fmt: skip


def _stop_ray(started: bool) -> None:
    """Shut down the local Ray this benchmark started (one it connected to stays up)."""
    if started:
        from fp8rl.cluster.driver import stop_ray

        stop_ray()


def _close(parts: Any) -> None:
    """Give the engines' and actors' resources back (a vLLM engine holds most of the GPU until closed)."""
    if hasattr(parts, "shutdown"):
        parts.shutdown()
    elif hasattr(parts.engine, "close"):
        parts.engine.close()
