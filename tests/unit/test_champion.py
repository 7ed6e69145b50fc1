"""Which model the comparison registers as ``champion``, and what the registry then holds (real MLflow on SQLite;
the runs' accuracies are set here, the selection and registration are the code under test)."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient

from fp8rl.errors import UserError
from fp8rl.tracking import MlflowSink, recipe_tags, start_parent_run
from fp8rl.tracking.models import (
    CHAMPION_TAG,
    MODEL_ID_TAG,
    log_checkpoint_model,
    register_champion,
    registered_model_name,
)

pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")


@pytest.fixture(autouse=True)
def local_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _run(work: Path, parent: str, recipe: str, seed: int, accuracy: float, tmp: Path) -> str:
    """A recipe run with ``evaluate/accuracy`` and a logged model of a checkpoint that names its run."""
    with MlflowSink("champ", f"{recipe}-seed{seed}", work, parent, {**recipe_tags(recipe), "seed": seed}) as sink:
        sink.log_params({"recipe": recipe, "task": {"type": "arithmetic"}, "fp8_linears_engine": 4})
        sink.log_metrics({"evaluate/accuracy": accuracy, "summary/final_accuracy": accuracy}, step=1)
        ckpt = tmp / f"{recipe}-{seed}"
        ckpt.mkdir()
        (ckpt / "config.json").write_text(json.dumps({"recipe": recipe, "seed": seed}))
        log_checkpoint_model(sink.tracking_uri, sink.run_id, ckpt, accuracy)
        return sink.run_id


def test_the_best_recipe_on_the_mean_wins_and_its_best_run_is_registered(tmp_path: Path) -> None:
    """fp8-e2e has the single best run (0.9) but bf16 the better mean (0.7 vs 0.5): bf16's better seed wins; a second
    comparison adds version 2 and moves the alias."""
    work = tmp_path / "work"
    parent = start_parent_run("champ", "cmp", work)
    ids = {
        ("bf16", 0): _run(work, parent, "bf16", 0, 0.6, tmp_path),
        ("bf16", 1): _run(work, parent, "bf16", 1, 0.8, tmp_path),
        ("fp8-e2e", 0): _run(work, parent, "fp8-e2e", 0, 0.9, tmp_path),
        ("fp8-e2e", 1): _run(work, parent, "fp8-e2e", 1, 0.1, tmp_path),
    }
    uri = f"sqlite:///{work / 'mlflow.db'}"
    champion = register_champion(uri, parent)
    assert champion is not None and (champion.recipe, champion.run_id) == ("bf16", ids[("bf16", 1)])
    assert (champion.name, champion.version, champion.accuracy) == ("fp8rl-arithmetic", "1", 0.8)
    client = MlflowClient(uri)
    assert client.get_run(parent).data.tags[CHAMPION_TAG] == "models:/fp8rl-arithmetic@champion"
    model = client.get_logged_model(client.get_run(ids[("bf16", 1)]).data.tags[MODEL_ID_TAG])
    assert model.tags["recipe"] == "bf16" and model.tags["fp8_linears_engine"] == "4"
    mlflow.set_tracking_uri(uri)
    got = Path(mlflow.artifacts.download_artifacts(champion.uri, dst_path=str(tmp_path / "dl")))
    assert json.loads((got / "config.json").read_text()) == {"recipe": "bf16", "seed": 1}

    again = register_champion(uri, parent, [ids[("fp8-e2e", 0)]])  # only fp8-e2e's run: it wins this one
    assert again is not None and again.version == "2"
    assert str(client.get_model_version_by_alias("fp8rl-arithmetic", "champion").version) == "2"


def test_no_model_no_champion_and_a_checkpoint_must_be_one(tmp_path: Path) -> None:
    work = tmp_path / "work"
    parent = start_parent_run("champ", "bench", work)
    with MlflowSink("champ", "bf16-benchmark", work, parent, recipe_tags("bf16")) as sink:
        sink.log_metrics({"bench/step_s": 1.0}, step=0)
        with pytest.raises(UserError, match="not a trained checkpoint"):
            log_checkpoint_model(sink.tracking_uri, sink.run_id, tmp_path, 0.5)
    assert register_champion(f"sqlite:///{work / 'mlflow.db'}", parent) is None


def test_the_registered_model_is_named_for_the_task() -> None:
    assert registered_model_name({"task.type": "arithmetic"}) == "fp8rl-arithmetic"
    assert registered_model_name({"task.type": "word-problems"}) == "fp8rl-word-problems"
    assert registered_model_name({"task.type": "jsonl", "task.train": "/data/gsm 8k.jsonl"}) == "fp8rl-jsonl-gsm-8k"
