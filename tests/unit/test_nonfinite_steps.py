"""A gradient norm that is NaN (a real NaN, through the real backward of the tiny model) is counted and skips its
update; ``optim.max_nonfinite_steps`` of them in a row end the run with an error and the MLflow run FAILED."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from fp8rl.build import build_parts
from fp8rl.config import RunConfig, load_recipe
from fp8rl.loop import NonFiniteGradientError, run_rl
from fp8rl.tracking import MlflowSink


def _config(steps: int, max_nonfinite: int) -> RunConfig:
    return RunConfig.model_validate(
        {"recipe": load_recipe("bf16"), "steps": steps, "eval_every": steps, "eval_examples": 4, "eval_samples": 0,
         "device": "cpu", "grpo": {"prompts_per_step": 4, "group_size": 2}, "sampling": {"max_tokens": 8},
         "optim": {"max_nonfinite_steps": max_nonfinite}}
    )  # fmt: skip


class PoisonedSteps:
    """Multiplies one weight's gradient by NaN in the backwards of the steps in ``steps``; the loop's log line of
    step k says the next backward belongs to step k + 1."""

    def __init__(self, steps: set[int]) -> None:
        self.steps, self.current, self.lines = steps, 0, list[str]()

    def log(self, line: str) -> None:
        self.lines.append(line)
        hit = re.search(r"\] step (\d+)", line)
        if hit:
            self.current = int(hit.group(1)) + 1

    def hook(self, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan") if self.current in self.steps else grad


def _run(cfg: RunConfig, model: Path, work: Path, poison: PoisonedSteps) -> tuple[str, Exception | None]:
    parts = build_parts(cfg, model, "cpu")
    weight = next(p for p in parts.trainer.model.parameters() if p.requires_grad)
    weight.register_hook(poison.hook)
    sink = MlflowSink("nonfinite", "bf16", work)
    error = None
    try:
        with sink:
            run_rl(cfg, model, sink, log=poison.log, parts=parts)
    except NonFiniteGradientError as e:
        error = e
    return sink.run_id, error


def test_nonfinite_steps_are_counted_and_skipped_and_the_run_goes_on(
    tmp_path: Path, tiny_models: dict[str, Path]
) -> None:
    poison = PoisonedSteps({1, 3, 4})
    run_id, error = _run(_config(steps=5, max_nonfinite=3), tiny_models["tiny"], tmp_path, poison)
    assert error is None
    client = MlflowClient(MlflowSink.attach(run_id, tmp_path).tracking_uri)
    assert client.get_run(run_id).info.status == "FINISHED"
    counts = [m.value for m in sorted(client.get_metric_history(run_id, "train/nonfinite_steps"), key=lambda m: m.step)]
    assert counts == [1.0, 1.0, 2.0, 3.0, 3.0]  # steps 3 and 4 are two in a row, under the limit of 3
    norms = {m.step: m.value for m in client.get_metric_history(run_id, "train/grad_norm")}
    assert [s for s, v in sorted(norms.items()) if v != v] == [1, 3, 4]  # NaN != NaN


def test_consecutive_nonfinite_steps_stop_the_run_failed(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    poison = PoisonedSteps(set(range(1, 100)))
    run_id, error = _run(_config(steps=6, max_nonfinite=2), tiny_models["tiny"], tmp_path, poison)
    assert isinstance(error, NonFiniteGradientError)
    message = str(error)
    assert message.startswith("step 2:") and "optim.max_nonfinite_steps: 2" in message, message
    client = MlflowClient(MlflowSink.attach(run_id, tmp_path).tracking_uri)
    assert client.get_run(run_id).info.status == "FAILED"
    assert sorted(m.step for m in client.get_metric_history(run_id, "train/nonfinite_steps")) == [1, 2]
    assert not any("step 3/" in line for line in poison.lines)  # no step ran after the error


def test_max_nonfinite_steps_is_at_least_one() -> None:
    with pytest.raises(ValueError, match="max_nonfinite_steps"):
        _config(steps=2, max_nonfinite=0)
