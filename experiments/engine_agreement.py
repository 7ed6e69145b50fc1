"""Greedy held-out accuracy of one checkpoint under the built-in engine and under vLLM (BF16 both), and where
their responses differ: the RL loop evaluates with the run's engine (vLLM in the accuracy studies), ``fp8rl sft``
with the built-in one.

    python experiments/engine_agreement.py MODEL_DIR --config docs/configs/accuracy/gemma3-270m-sft.yaml

Prints both accuracies, the share of identical responses and the first differing ones; ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8rl.build import build_engine, build_torch_engine, prompt_format, reward_for, task_examples
from fp8rl.config import load_recipe, load_run_config_data, parse_run_config
from fp8rl.evaluation import decode_responses
from fp8rl.models.loading import load_tokenizer
from fp8rl.rollout.base import SamplingParams


def _responses(engine: object, tok: object, prompts: list[list[int]], max_tokens: int) -> list[str]:
    out: list[str] = []
    for s in range(0, len(prompts), 256):
        rollout = engine.generate(prompts[s : s + 256], SamplingParams(temperature=0.0, max_tokens=max_tokens))  # type: ignore[attr-defined]
        out += decode_responses(tok, rollout)  # type: ignore[arg-type]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--config", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    data = load_run_config_data(args.config)
    data["recipe"] = load_recipe("bf16").model_dump()
    cfg = parse_run_config(data, args.config)
    _, heldout = task_examples(cfg)
    tok = load_tokenizer(args.model)
    prompts = prompt_format(cfg).encode_all(tok, heldout)
    reward = reward_for(cfg)
    result: dict[str, object] = {"model": args.model, "examples": len(heldout)}
    answers: dict[str, list[str]] = {}
    for name, make in (("torch", build_torch_engine), ("vllm", build_engine)):
        engine = make(cfg, args.model, args.device)
        answers[name] = _responses(engine, tok, prompts, cfg.sampling.max_tokens)
        acc = sum(reward.score(answers[name], heldout).rewards) / len(heldout)
        result[f"accuracy_{name}"] = acc
        print(f"{name}: greedy held-out accuracy {acc:.3f}", flush=True)
        del engine
    same = [a == b for a, b in zip(answers["torch"], answers["vllm"], strict=True)]
    result["identical"] = sum(same) / len(same)
    result["differing"] = [
        {"prompt": e.prompt[-80:], "answer": e.answer, "torch": a, "vllm": b}
        for e, a, b, s in zip(heldout, answers["torch"], answers["vllm"], same, strict=True)
        if not s
    ][:20]
    for d in result["differing"][:5]:  # type: ignore[index]
        print(d)
    print(f"identical responses: {result['identical']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
