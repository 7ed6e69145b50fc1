"""The RL step on Ray across two GPUs: split layout, NCCL weight sync, a 1.8B-parameter model.

One trainer actor on one GPU, one rollout actor on the other, the collective (NCCL) sync between
them; bf16 and fp8-e2e in one run, side by side. The model is random-initialised with the
shapes of a 1.5B-class Llama/Qwen2 (hidden 1536, 28 layers, vocab 151936; no weights can be
downloaded there) and the char tokenizer; the numbers are about moving and computing, not
learning. Writes $OUT/gpu_ray_split.json.
Usage on a 2-GPU machine: python3 experiments/gpu_ray_split.py
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import LlamaConfig, LlamaForCausalLM

from fp8rl.cluster.driver import run_rl_on_ray
from fp8rl.config import load_recipe, parse_run_config
from fp8rl.models.tiny import pin_tokenizer_class
from fp8rl.models.tokenizer import make_char_tokenizer
from fp8rl.tracking import MemorySink


def make_model(path: Path) -> int:
    tok = make_char_tokenizer()
    cfg = LlamaConfig(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, head_dim=128, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    pin_tokenizer_class(path)
    n = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    return n


def main() -> None:
    out = Path(os.environ.get("OUT", "."))
    model = Path("/tmp/fp8rl-1p8b")
    t0 = time.perf_counter()
    params = make_model(model)
    print(f"model: {params / 1e9:.2f}B parameters in {time.perf_counter() - t0:.0f}s", flush=True)
    summary: dict[str, object] = {"device": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(),
                                  "torch": torch.__version__, "parameters": params, "runs": {}}  # fmt: skip
    for recipe in ["bf16", "fp8-e2e"]:
        cfg = parse_run_config(
            {
                "recipe": load_recipe(recipe), "steps": 4, "eval_every": 100, "eval_examples": 8, "eval_samples": 0,
                "grpo": {"prompts_per_step": 8, "group_size": 4}, "sampling": {"max_tokens": 8},
                "optim": {"micro_batch_size": 32}, "verify_sync": False, "work_dir": "/tmp/fp8rl-ray",
                "ray": {"trainer_workers": 1, "rollout_workers": 1, "layout": "split", "sync": "collective"},
            }
        )  # fmt: skip
        lines: list[str] = []
        res = run_rl_on_ray(
            cfg, model, MemorySink(), log=lambda s, lines=lines: (lines.append(s), print(s, flush=True))
        )
        steps = res.history[1:]  # step 1 warms up
        summary["runs"][recipe] = {  # type: ignore[index]
            "layout_line": next((s for s in lines if s.startswith("ray:")), ""),
            "sync_bytes": res.history[-1]["sync/bytes"],
            "sync_bytes_vs_bf16": res.history[-1]["sync/bytes_vs_bf16"],
            "sync_s_median": statistics.median(h["time/sync_s"] for h in steps),
            "generate_s_median": statistics.median(h["time/generate_s"] for h in steps),
            "train_s_median": statistics.median(h["time/train_s"] for h in steps),
            "step_s_median": statistics.median(h["time/step_s"] for h in steps),
            "token_mult_prob_error": res.run_mean("mismatch/token_mult_prob_error"),
        }
        print(json.dumps(summary["runs"][recipe]), flush=True)  # type: ignore[index]
        (out / "gpu_ray_split.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
