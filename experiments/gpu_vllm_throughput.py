"""Section f of the vLLM GPU check (experiments/gpu_vllm.py has a-e): output tokens/s of a random Qwen2.5-3B-shaped
Llama in vLLM, BF16 vs block FP8 vs FP8 + FP8 KV cache, CUDA graphs on, per batch and response length, and the
time to requantize and reload the whole model.  Run one variant per process (``--variants``): an engine closed
in-process does not give all of vLLM's memory back.

    python experiments/gpu_vllm_throughput.py --variants fp8 [--batches 64,256] [--lengths 512,2048]

Writes $OUT/gpu_vllm_throughput_<variants>.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from gpu_vllm import OUT, WORK, engine, free_gpu, kernel_names, section, start_report

QWEN3B = {  # Qwen2.5-3B's shape, as a Llama (no qkv bias): 3.1B parameters
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "num_hidden_layers": 36,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}


def write_random_3b(dst: Path, fp8: bool) -> Path:
    """A random-weight Qwen2.5-3B-shaped Llama checkpoint, written from the GPU (BF16, or block FP8 in the
    ``fp8rl convert`` layout with scales from ``fp8rl.quant``)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from fp8rl.checkpoint.formats import quantization_config
    from fp8rl.quant import QuantSpec, quantize_weight

    if (dst / "config.json").exists():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    c = QWEN3B
    cfg = LlamaConfig(**c, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return (0.02 * torch.randn(shape, generator=g, device="cuda")).to(torch.bfloat16)

    h, inter, q, kv = c["hidden_size"], c["intermediate_size"], 16 * 128, 2 * 128
    shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, q), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
              "mlp.down_proj": (h, inter)}  # fmt: skip
    weight_map = {}
    for i in range(c["num_hidden_layers"]):
        shard: dict[str, torch.Tensor] = {}
        for mod, shape in shapes.items():
            name = f"model.layers.{i}.{mod}"
            w = rnd(*shape)
            if fp8:
                qw = quantize_weight(w, QuantSpec())
                shard[name + ".weight"], shard[name + ".weight_scale_inv"] = qw.data, qw.scale_inv
            else:
                shard[name + ".weight"] = w
        for norm in ("input_layernorm", "post_attention_layernorm"):
            shard[f"model.layers.{i}.{norm}.weight"] = torch.ones(h, dtype=torch.bfloat16, device="cuda")
        fname = f"layer-{i:03d}.safetensors"
        save_file({k: v.cpu().contiguous() for k, v in shard.items()}, str(dst / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    rest = {
        "model.embed_tokens.weight": rnd(c["vocab_size"], h),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
    }
    save_file(
        {k: v.cpu().contiguous() for k, v in rest.items()}, str(dst / "rest.safetensors"), metadata={"format": "pt"}
    )
    weight_map.update(dict.fromkeys(rest, "rest.safetensors"))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg_dict = {**cfg.to_dict(), "architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16"}
    if fp8:
        cfg_dict["quantization_config"] = quantization_config("block", (128, 128), ["lm_head"])
    (dst / "config.json").write_text(json.dumps(cfg_dict, indent=1))
    return dst


def section_throughput(batches: list[int], lengths: list[int], variants: list[str]) -> dict[str, Any]:
    import torch

    from fp8rl.config import RolloutConfig, load_recipe
    from fp8rl.rollout import KVScales, SamplingParams

    t0 = time.perf_counter()
    bf16_dir = write_random_3b(WORK / "qwen3b-bf16", fp8=False)
    fp8_dir = write_random_3b(WORK / "qwen3b-fp8", fp8=True) if any(v != "bf16" for v in variants) else None
    print(f"random 3B checkpoints written in {time.perf_counter() - t0:.0f}s", flush=True)
    rollout = RolloutConfig(engine="vllm", gpu_memory_utilization=0.7, enforce_eager=False, max_model_len=2304)
    results: dict[str, Any] = {"shape": QWEN3B, "prompt_len": 64, "variants": {}}
    gen = torch.Generator().manual_seed(0)
    for variant in variants:
        recipe = load_recipe("bf16" if variant == "bf16" else "fp8-rollout")
        if variant == "fp8-kv":
            recipe = recipe.model_copy(update={"kv_cache": "fp8"})
        e = engine(bf16_dir if variant == "bf16" else fp8_dir, recipe, WORK / "f", rollout=rollout)  # type: ignore[arg-type]
        entry: dict[str, Any] = {"kernels": kernel_names(e), "runs": []}
        try:
            e.generate([[5] * 64] * 8, SamplingParams(temperature=1.0, max_tokens=32))  # warm-up
            for batch in batches:
                for length in lengths:
                    ps = torch.randint(10, 150_000, (batch, 64), generator=gen).tolist()
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    r = e.generate(ps, SamplingParams(temperature=1.0, max_tokens=length, seed=1), ignore_eos=True)
                    seconds = time.perf_counter() - t
                    run = {"batch": batch, "response_len": length, "tokens": r.num_tokens, "seconds": seconds,
                           "output_tokens_per_s": r.num_tokens / seconds}  # fmt: skip
                    entry["runs"].append(run)
                    print(f"{variant}: {json.dumps(run)}", flush=True)
            if variant != "bf16":
                entry["sync"] = time_sync(e, bf16_dir)
            if variant == "fp8-kv":  # with CUDA graphs on, writing the scale buffers must change the outputs
                greedy, few = SamplingParams(temperature=0.0, max_tokens=32), [[5, 6, 7, 8] * 8] * 8
                a = e.generate(few, greedy)
                n = int(QWEN3B["num_hidden_layers"])
                e.set_kv_scales({i: KVScales(1e-3, 1e-3, 1e-3) for i in range(n)})
                e.llm.reset_prefix_cache()
                b = e.generate(few, greedy)
                entry["scales_are_live_with_cuda_graphs"] = not torch.equal(a.response_ids, b.response_ids)
        finally:
            e.close()
            free_gpu()
        results["variants"][variant] = entry
    return results


def time_sync(e: Any, bf16_dir: Path) -> dict[str, Any]:
    """Requantize the full BF16 model on the GPU and reload it into the engine: median of 3, verified once."""
    import torch
    from safetensors.torch import load_file

    from fp8rl.sync import payload_bytes, requantize_for_rollout, verify_engine_weights

    weights: dict[str, torch.Tensor] = {}
    for f in sorted(bf16_dir.glob("*.safetensors")):
        weights.update({k: v.to("cuda") for k, v in load_file(str(f)).items()})
    names = {m + ".weight" for m in e.fp8_modules}
    times = []
    for version in range(1, 4):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        payload = requantize_for_rollout(weights, names, e.spec)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        e.load_weights(payload, version)
        torch.cuda.synchronize()
        times.append((t1 - t0, time.perf_counter() - t1))
    verify_engine_weights(e, payload, 3)
    req = sorted(t[0] for t in times)[1]
    load = sorted(t[1] for t in times)[1]
    return {
        "requantize_s": req,
        "reload_s": load,
        "total_s": req + load,
        "bytes": payload_bytes(payload),
        "verified": True,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="64,256")
    p.add_argument("--lengths", default="512,2048")
    p.add_argument("--variants", default="bf16,fp8,fp8-kv", help="of bf16, fp8, fp8-kv; one per process is safest")
    args = p.parse_args()
    results = start_report()
    out = OUT / f"gpu_vllm_throughput_{args.variants.replace(',', '_')}.json"
    batches, lengths = ([int(x) for x in v.split(",")] for v in (args.batches, args.lengths))
    section(results, "throughput", 580, lambda: section_throughput(batches, lengths, args.variants.split(",")), out)


if __name__ == "__main__":
    main()
