"""``fp8rl bench rollout``: generation throughput of the rollout engine per precision recipe.

Method.  For one checkpoint and each recipe, the rollout engine is built as an RL run builds it
(``fp8rl.build.build_engine``: vLLM serving the recipe's FP8 checkpoint and KV cache, or the built-in torch
engine with FP8 linears), given ``warmup`` untimed batches and then ``repeats`` timed ones: ``prompts`` prompts
of ``prompt_len`` random token ids (the special tokens left out), every response sampled at temperature 1 to
``max_tokens`` tokens (EOS ignored: the same work for every recipe).  Per batch:

    output tokens/s = response tokens of the batch / its wall seconds (CUDA synchronised before and after)

and the result is the median over the timed batches; the speedup is over the ``bf16`` recipe (BF16 KV cache)
of the same run.  The engine's start (loading, the FP8 conversion, CUDA graphs) is reported apart and not
counted.  With ``fp8_kv`` every FP8 recipe whose KV cache is BF16 is measured a second time with an FP8 KV cache
(vLLM only: the torch engine keeps a BF16 cache; with no trainer here its scales are not recalibrated, which
changes no work).  Speed does not depend on the weights' values, so random weights of a model's shape
(``fp8rl import-model shape:NAME``) measure it as well as trained ones.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from fp8rl.atomic import atomic_write_text
from fp8rl.bench.throughput import device_name
from fp8rl.build import build_engine
from fp8rl.config import Recipe, RunConfig, load_recipe, parse_run_config
from fp8rl.errors import UserError
from fp8rl.models.loading import read_model_config
from fp8rl.rollout import SamplingParams
from fp8rl.rollout.base import LocalEngine

# vLLM's share of the GPU where the run config sets none: in a rollout-only benchmark no trainer shares the GPU
GPU_MEMORY_UTILIZATION = 0.8


@dataclass(frozen=True)
class RolloutBench:
    """What ``fp8rl bench rollout`` runs for every recipe."""

    prompts: int = 64
    prompt_len: int = 64
    max_tokens: int = 512
    repeats: int = 3
    warmup: int = 1
    device: str = "cpu"  # cpu | cuda (fp8rl.devices.resolve_device)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prompts", "prompt_len", "max_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise UserError(f"--warmup must be >= 0, got {self.warmup}")


@dataclass
class RolloutResult:
    """One recipe's generation throughput: medians over the timed batches, and each batch."""

    recipe: str
    kv_cache: str
    engine: str
    fp8_linears: int  # decoder linears the engine holds in FP8
    tokens_per_s: float  # output tokens/s, median over the timed batches
    seconds: float  # wall seconds of a batch, median
    tokens: int  # response tokens of a batch, median
    start_s: float  # building the engine: loading, the FP8 conversion, CUDA graphs (not in the above)
    device_name: str
    batches: list[dict[str, float]] = field(default_factory=list)  # {"tokens", "seconds"} of each timed batch

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def bench_recipes(names: Sequence[str], fp8_kv: bool) -> list[Recipe]:
    """The recipes named (built-in names or YAML files), each FP8 one with a BF16 KV cache followed, with
    ``fp8_kv``, by the same recipe with an FP8 KV cache."""
    recipes = []
    for name in names:
        recipe = load_recipe(name)
        recipes.append(recipe)
        if fp8_kv and recipe.rollout_precision == "fp8" and recipe.kv_cache == "bf16":
            recipes.append(recipe.model_copy(update={"kv_cache": "fp8"}))
    return recipes


def rollout_config(base: dict[str, Any], recipe: Recipe, engine: str, bench: RolloutBench, work_dir: str) -> RunConfig:
    """The run config the engine of ``recipe`` is built from: ``base`` (a run config's fields; its ``rollout``
    settings win over the benchmark's vLLM defaults, ``GPU_MEMORY_UTILIZATION`` and a context of one prompt and
    its response) with the engine and the recipe."""
    data = {k: v for k, v in base.items() if k not in ("recipe", "ray")}  # one engine, in this process
    vllm = {"gpu_memory_utilization": GPU_MEMORY_UTILIZATION, "max_model_len": bench.prompt_len + bench.max_tokens}
    data["rollout"] = {**(vllm if engine == "vllm" else {}), **(data.get("rollout") or {}), "engine": engine}
    data["recipe"] = recipe
    data.setdefault("work_dir", work_dir)
    return parse_run_config(data, f"bench rollout ({recipe.name}, KV cache {recipe.kv_cache})")


def random_prompts(n: int, length: int, vocab_size: int, special: set[int], seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids drawn uniformly from the vocabulary without the ``special`` ids."""
    allowed = torch.tensor([i for i in range(vocab_size) if i not in special], dtype=torch.long)
    if allowed.numel() == 0:
        raise UserError(f"the vocabulary ({vocab_size} ids) holds only special tokens: no prompt to make")
    gen = torch.Generator().manual_seed(seed)
    return allowed[torch.randint(0, allowed.numel(), (n, length), generator=gen)].tolist()


def _vocab_size(model_dir: str | Path) -> int:
    cfg = read_model_config(model_dir)
    size = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    if not isinstance(size, int) or size < 1:
        raise UserError(f"{Path(model_dir) / 'config.json'}: no vocab_size to draw prompt tokens from")
    return size


def _timed_generate(engine: LocalEngine, prompts: list[list[int]], sampling: SamplingParams) -> tuple[int, float]:
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(engine.device)
    t0 = time.perf_counter()
    rollout = engine.generate(prompts, sampling)
    if cuda:
        torch.cuda.synchronize(engine.device)
    return rollout.num_tokens, time.perf_counter() - t0


def measure_rollout(
    cfg: RunConfig, model_dir: str | Path, bench: RolloutBench, log: Callable[[str], None] = print
) -> RolloutResult:
    """Build ``cfg``'s engine on ``bench.device``, warm it up and time its batches (module docstring)."""
    label = f"[{cfg.recipe.name}, KV cache {cfg.recipe.kv_cache}] bench rollout"
    t0 = time.perf_counter()
    engine = build_engine(cfg, model_dir, bench.device)
    start_s = time.perf_counter() - t0
    log(f"{label}: {cfg.rollout.engine} engine started in {start_s:.1f}s, {len(engine.fp8_modules)} FP8 linears")
    try:
        special = {int(engine.pad_token_id), int(engine.eos_token_id)}
        prompts = random_prompts(bench.prompts, bench.prompt_len, _vocab_size(model_dir), special, bench.seed)
        sampling = SamplingParams(temperature=1.0, max_tokens=bench.max_tokens, seed=bench.seed, ignore_eos=True)
        for _ in range(bench.warmup):
            engine.generate(prompts, sampling)
        batches = []
        for i in range(bench.repeats):
            tokens, seconds = _timed_generate(engine, prompts, replace(sampling, seed=bench.seed + 1 + i))
            batches.append({"tokens": tokens, "seconds": seconds})
            log(f"{label}: batch {i + 1}/{bench.repeats}: {tokens} tokens in {seconds:.2f}s")
        return RolloutResult(
            recipe=cfg.recipe.name, kv_cache=cfg.recipe.kv_cache, engine=cfg.rollout.engine,
            fp8_linears=len(engine.fp8_modules), start_s=start_s, device_name=device_name(bench.device),
            tokens_per_s=statistics.median(b["tokens"] / b["seconds"] for b in batches),
            seconds=statistics.median(b["seconds"] for b in batches),
            tokens=int(statistics.median(b["tokens"] for b in batches)), batches=batches,
        )  # fmt: skip
    finally:
        close = getattr(engine, "close", None)  # vLLM gives its GPU memory back; the torch engine is collected
        if close is not None:
            close()
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_rollout_bench(
    model_dir: str | Path, configs: Sequence[RunConfig], bench: RolloutBench,
    log: Callable[[str], None] = print, isolate: bool = False,
) -> list[RolloutResult]:  # fmt: skip
    """Each config's engine measured in turn; ``isolate`` measures each in a process of its own (vLLM cannot start
    a second engine in a process whose first one it closed)."""
    results = []
    for i, cfg in enumerate(configs, start=1):
        what = f"{cfg.recipe.name} (KV cache {cfg.recipe.kv_cache})"
        log(f"bench rollout: {i}/{len(configs)} {what}" + (" (own process)" if isolate else ""))
        measure = _in_subprocess if isolate else measure_rollout
        results.append(measure(cfg, model_dir, bench, log))
    return results


def _in_subprocess(
    cfg: RunConfig, model_dir: str | Path, bench: RolloutBench, log: Callable[[str], None]
) -> RolloutResult:
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cfg_path, bench_path, out = Path(tmp) / "run.json", Path(tmp) / "bench.json", Path(tmp) / "result.json"
        cfg_path.write_text(cfg.model_dump_json())
        bench_path.write_text(json.dumps(asdict(bench)))
        cmd = [sys.executable, "-m", "fp8rl.bench.rollout", str(cfg_path), str(model_dir), str(bench_path), str(out)]
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
            assert proc.stdout is not None
            tail: list[str] = []
            for line in proc.stdout:
                tail = [*tail[-40:], line.rstrip()]
                if line.startswith(f"[{cfg.recipe.name}, KV cache"):
                    log(line.rstrip())
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(
                f"bench rollout of recipe {cfg.recipe.name} (KV cache {cfg.recipe.kv_cache}) failed "
                f"(exit {proc.returncode}):\n" + "\n".join(tail)
            )
        return RolloutResult(**json.loads(out.read_text()))


def _subprocess_main(argv: Sequence[str]) -> None:
    """``python -m fp8rl.bench.rollout RUN_JSON MODEL BENCH_JSON OUT_JSON``: one recipe, for ``isolate``."""
    cfg_path, model_dir, bench_path, out = argv
    cfg = RunConfig.model_validate_json(Path(cfg_path).read_text())
    bench = RolloutBench(**json.loads(Path(bench_path).read_text()))
    result = measure_rollout(cfg, model_dir, bench, log=lambda line: print(line, flush=True))
    atomic_write_text(out, json.dumps(result.to_dict()))


def run_metadata(model: str, bench: RolloutBench, cfg: RunConfig, results: Sequence[RolloutResult]) -> dict[str, Any]:
    """What the run was: the model, the sizes, the engine's settings (``cfg``: one recipe's), device, versions."""
    meta: dict[str, Any] = {
        "model": model, **asdict(bench), "recipes": [f"{r.recipe}/{r.kv_cache}" for r in results],
        "rollout": cfg.rollout.model_dump(mode="json"), "device_name": results[0].device_name if results else None,
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0, "torch": torch.__version__,
        "python": platform.python_version(),
    }  # fmt: skip
    try:
        meta["vllm"] = __import__("vllm").__version__
    except Exception:
        meta["vllm"] = None
    return meta


def report(results: Sequence[RolloutResult], meta: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The JSON document and the Markdown table of a rollout benchmark; speedups over bf16 with a BF16 KV cache."""
    base = next((r for r in results if r.recipe == "bf16" and r.kv_cache == "bf16"), None)
    ups = [r.tokens_per_s / base.tokens_per_s if base and base.tokens_per_s else None for r in results]
    doc = {
        "meta": meta,
        "results": [{**r.to_dict(), "speedup_vs_bf16": up} for r, up in zip(results, ups, strict=True)],
    }
    lines = [
        f"Rollout throughput: {meta['model']} on {meta['device_name']}, {meta['rollout']['engine']} engine, "
        f"{meta['prompts']} prompts x {meta['prompt_len']} tokens, {meta['max_tokens']} tokens a response (EOS "
        f"ignored), median of {meta['repeats']} batches after {meta['warmup']} warm-up",
        "",
        "| recipe | KV cache | FP8 linears | output tok/s | vs bf16 | s a batch | engine start s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r, up in zip(results, ups, strict=True):
        speedup = f"{up:.2f}x" if up is not None else "-"
        lines.append(
            f"| {r.recipe} | {r.kv_cache} | {r.fp8_linears} | {r.tokens_per_s:,.0f} | {speedup} | {r.seconds:.2f} "
            f"| {r.start_s:.1f} |"
        )
    return doc, "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    _subprocess_main(sys.argv[1:])
