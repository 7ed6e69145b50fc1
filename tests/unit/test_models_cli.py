"""``fp8rl models list | download`` on a real MLflow store (SQLite) whose champion the comparison code registered:
the list names every version with its alias, recipe and accuracy; a download is the checkpoint, whole, in a new
directory; bad names and an existing directory are errors that name them and leave nothing behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fp8rl.cli import main
from fp8rl.tracking import MlflowSink, recipe_tags, start_parent_run
from fp8rl.tracking.models import log_checkpoint_model, model_uri, register_champion

pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A work dir with one comparison of bf16 (0.7) and fp8-e2e (0.4) registered twice: versions 1 and 2 of
    fp8rl-arithmetic, the alias on 2."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    work = tmp_path / "work"
    parent = start_parent_run("fp8rl", "cmp", work)
    for recipe, accuracy in (("bf16", 0.7), ("fp8-e2e", 0.4)):
        with MlflowSink("fp8rl", f"{recipe}-seed0", work, parent, recipe_tags(recipe)) as sink:
            sink.log_params({"recipe": recipe, "task": {"type": "arithmetic"}})
            sink.log_metrics({"evaluate/accuracy": accuracy}, step=1)
            ckpt = tmp_path / recipe
            ckpt.mkdir()
            (ckpt / "config.json").write_text(json.dumps({"recipe": recipe}))
            (ckpt / "model.safetensors").write_bytes(b"\0" * 1024)
            log_checkpoint_model(sink.tracking_uri, sink.run_id, ckpt, accuracy)
    uri = f"sqlite:///{work / 'mlflow.db'}"
    assert register_champion(uri, parent) is not None
    assert register_champion(uri, parent) is not None
    return work


def test_list_shows_every_version_with_its_alias_recipe_and_accuracy(
    work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["models", "list", "--work-dir", str(work)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| fp8rl-")]
    assert len(rows) == 2, rows
    newest, oldest = ([c.strip() for c in r.strip("|").split("|")] for r in rows)
    assert newest[:5] == ["fp8rl-arithmetic", "2", "champion", "bf16", "0.7"]
    assert newest[-1] == "models:/fp8rl-arithmetic@champion"
    assert oldest[:3] == ["fp8rl-arithmetic", "1", "-"] and oldest[-1] == "models:/fp8rl-arithmetic/1"


def test_download_writes_the_champions_checkpoint_into_a_new_directory(
    work: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "served" / "champion"
    assert main(["models", "download", "fp8rl-arithmetic", str(dest), "--work-dir", str(work)]) == 0
    assert json.loads((dest / "config.json").read_text()) == {"recipe": "bf16"}
    assert (dest / "model.safetensors").stat().st_size == 1024
    assert sorted(p.name for p in dest.parent.iterdir()) == ["champion"]  # no temporary directory left
    assert f"vllm serve {dest}" in capsys.readouterr().out
    # an existing directory is refused, untouched
    assert main(["models", "download", "fp8rl-arithmetic/1", str(dest), "--work-dir", str(work)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert json.loads((dest / "config.json").read_text()) == {"recipe": "bf16"}


@pytest.mark.parametrize("spec", ["fp8rl-arithmetic@nobody", "no-such-model", "fp8rl-arithmetic/9"])
def test_a_model_the_registry_lacks_is_named_and_nothing_is_written(
    work: Path, tmp_path: Path, spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "out"
    assert main(["models", "download", spec, str(dest), "--work-dir", str(work)]) == 2
    assert model_uri(spec) in capsys.readouterr().err
    assert list(tmp_path.glob("*out*")) == []


def test_model_specs() -> None:
    assert model_uri("fp8rl-arithmetic") == "models:/fp8rl-arithmetic@champion"
    assert model_uri("m@latest-good") == "models:/m@latest-good"
    assert model_uri("m/3") == "models:/m/3"
    assert model_uri("models:/m/3") == "models:/m/3"
    with pytest.raises(Exception, match="expected NAME"):
        model_uri("bad name!")


def test_download_reads_the_store_it_is_given_not_the_global_one(
    work: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow's global store and registry point elsewhere (a store without the model): the library call still reads
    the one it is given."""
    from fp8rl.tracking.models import download_model

    other = f"sqlite:///{tmp_path / 'other.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", other)
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", other)
    dest = download_model(f"sqlite:///{work / 'mlflow.db'}", "models:/fp8rl-arithmetic/1", tmp_path / "v1")
    assert json.loads((dest / "config.json").read_text()) == {"recipe": "bf16"}
