"""From a run config to the objects a run drives: every runtime (one process, the Ray actors, the RayJob's driver)
builds its parts here.

- ``build_engine`` / ``build_torch_engine``: the rollout engine ``rollout.engine`` names, with the recipe's rollout
  precision and scaling (``rollout_quant_spec``);
- ``build_trainer`` (``trainer_options``: the trainer's settings from ``recipe`` and ``optim``, scaled by
  ``quant_spec``);
- ``build_parts``: engine, trainer and the in-process weight sync of the embedded default (``LocalParts``);
- ``task_examples``, ``prompt_format``, ``reward_for``: the task's training pool and held-out set, its prompt format
  and its reward; ``validate_inputs`` reads them before any model work.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from fp8rl.config import ConfigError, JsonlTaskConfig, RunConfig, WordProblemsTaskConfig, rollout_recipe
from fp8rl.fp8_coverage import fp8_linear_counts
from fp8rl.models.loading import load_tokenizer
from fp8rl.quant import QuantSpec
from fp8rl.rollout.base import LocalEngine
from fp8rl.rollout.torch_engine import TorchRolloutEngine
from fp8rl.sync import InProcessSync, SyncStats
from fp8rl.tasks import ArithmeticTask, Example, load_examples
from fp8rl.tasks.prompts import PromptFormat
from fp8rl.tasks.rewards import ExactMatch, PythonReward, Reward, load_reward_function
from fp8rl.tasks.word_problems import WordProblemTask
from fp8rl.train.trainer import SequenceBatch, TorchTrainer, TrainerOptions


def quant_spec(cfg: RunConfig) -> QuantSpec:
    """The trainer's FP8 scaling (``recipe.quant``)."""
    return cfg.recipe.quant.spec()


def rollout_quant_spec(cfg: RunConfig) -> QuantSpec:
    """The rollout engine's FP8 scaling, which every sync requantizes to (``rollout.fp8_scaling``)."""
    return rollout_recipe(cfg.recipe, cfg.rollout).quant.spec()


@dataclass
class LocalParts:
    """Engine, trainer and in-process sync in this process (the embedded default)."""

    tok: PreTrainedTokenizerBase
    engine: LocalEngine
    trainer: TorchTrainer
    sync: InProcessSync
    bf16_bytes: int
    fp8_linears: dict[str, int] = field(default_factory=dict)  # fp8rl.fp8_coverage.fp8_linear_counts

    def push_weights(self, version: int) -> SyncStats:
        return self.sync.push(version)

    def save_policy(self, output_dir: str | Path) -> None:
        self.trainer.save_checkpoint(output_dir, self.tok)

    def calibrate_kv(self, batch: SequenceBatch) -> dict[str, float]:
        return self.engine.calibrate_kv(self.trainer.model, batch.input_ids, batch.attention_mask, batch.position_ids)


def trainer_options(cfg: RunConfig) -> TrainerOptions:
    """The trainer's settings: the recipe's training precision and scaling, the run's length and sharding, and the
    run config's ``optim`` section as it is."""
    q = cfg.recipe.quant
    return TrainerOptions(
        precision=cfg.recipe.train_precision,
        spec=quant_spec(cfg),
        backend=cfg.recipe.trainer,
        te_recipe=cfg.recipe.te_recipe,
        bf16_first_layers=q.bf16_first_layers,
        bf16_last_layers=q.bf16_last_layers,
        total_steps=cfg.steps,
        sharding=cfg.ray.trainer_sharding if cfg.ray is not None else "replicate",
        optim=cfg.optim,
    )


def build_engine(cfg: RunConfig, model_dir: str | Path, device: str) -> LocalEngine:
    """The rollout engine ``cfg.rollout.engine`` names, serving the checkpoint at ``model_dir``."""
    if cfg.rollout.engine == "vllm":
        from fp8rl.rollout.vllm_engine import VLLMRolloutEngine  # vLLM is a GPU extra: imported only when asked for

        return VLLMRolloutEngine.from_run_config(cfg, model_dir, device)
    return build_torch_engine(cfg, model_dir, device)


def build_torch_engine(cfg: RunConfig, model_dir: str | Path, device: str) -> TorchRolloutEngine:
    """The built-in engine serving ``model_dir`` with the recipe's rollout precision and the rollout's scaling."""
    q = cfg.recipe.quant
    return TorchRolloutEngine(
        model_dir, cfg.recipe.rollout_precision, rollout_quant_spec(cfg), q.bf16_first_layers, q.bf16_last_layers,
        device,
    )  # fmt: skip


def build_trainer(cfg: RunConfig, model_dir: str | Path, device: str) -> TorchTrainer:
    """The training backend ``cfg.recipe.trainer`` names, initialised from ``model_dir``."""
    opts = trainer_options(cfg)
    if opts.backend == "te":
        from fp8rl.train.te_trainer import TETrainer  # TransformerEngine is a GPU extra

        return TETrainer(model_dir, opts, device=device)
    return TorchTrainer(model_dir, opts, device=device)


def build_parts(cfg: RunConfig, model_dir: str | Path, device: str) -> LocalParts:
    engine = build_engine(cfg, model_dir, device)
    trainer = build_trainer(cfg, model_dir, device)
    names = {m + ".weight" for m in engine.fp8_modules}
    fp8 = fp8_linear_counts(cfg.recipe, len(engine.fp8_modules), len(trainer.fp8_modules))
    sync = InProcessSync(engine, trainer.hf_state_dict, names, rollout_quant_spec(cfg), verify=cfg.verify_sync)
    bf16_bytes = sum(p.numel() * 2 for p in trainer.model.parameters())
    return LocalParts(load_tokenizer(model_dir), engine, trainer, sync, bf16_bytes, fp8)


def task_examples(cfg: RunConfig, train_size: int = 20_000) -> tuple[list[Example], list[Example]]:
    """The training pool and the held-out examples of ``cfg.task`` (distinct, at most ``cfg.eval_examples``).

    The arithmetic task's held-out set does not depend on the run's seed, so every seed and
    recipe is evaluated on the same problems.
    """
    t = cfg.task
    if isinstance(t, JsonlTaskConfig):
        fields = t.fields.model_dump()
        train, test = load_examples(t.train, fields, t.type), load_examples(t.test, fields, t.type)
    elif isinstance(t, WordProblemsTaskConfig):
        words = WordProblemTask(t.difficulty, t.seed)
        train, test = words.examples("train", t.train_size), words.examples("test", cfg.eval_examples)
    else:
        task = ArithmeticTask(max_operand=t.max_operand, operators=t.operators, num_operands=t.num_operands)
        train, test = task.examples("train", train_size), task.examples("test", cfg.eval_examples)
    if len(train) < cfg.grpo.prompts_per_step:
        raise ConfigError(
            f"grpo.prompts_per_step: {cfg.grpo.prompts_per_step} prompts per step, but the task has "
            f"{len(train)} training examples"
        )
    heldout = list({e.prompt: e for e in test}.values())[: cfg.eval_examples]
    if not heldout:
        raise ConfigError("task: no held-out examples to evaluate on")
    return train, heldout


def prompt_format(cfg: RunConfig) -> PromptFormat:
    """How ``cfg.task``'s examples become prompt token ids (chat template, system prompt)."""
    return PromptFormat(cfg.task.chat_template, cfg.task.system_prompt)


@functools.lru_cache(maxsize=8)
def _reward(reward_cfg: Any) -> Reward:
    if reward_cfg.type == "python":
        fn = load_reward_function(reward_cfg.function)
        return PythonReward(fn, reward_cfg.function, reward_cfg.timeout_s, reward_cfg.workers)
    return ExactMatch(reward_cfg.extract)


def reward_for(cfg: RunConfig) -> Reward:
    """``cfg.reward`` built once per process (a Python reward's file is imported once); errors name the file."""
    return _reward(cfg.reward)


def validate_inputs(cfg: RunConfig) -> None:
    """Read the task files and load the reward before any model work: bad data fails in seconds, not after SFT."""
    task_examples(cfg)
    reward_for(cfg)
