"""fp8rl.tracking against a real MLflow (SQLite store in a temp dir), no mocks.

One store per module: creating an MLflow SQLite database runs its migrations (~1.5 s),
so tests share it and keep apart by experiment name.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
from mlflow import MlflowClient

from fp8rl.tracking import (
    MAX_PARAM_VALUE_LENGTH,
    TOKEN_MULT_PROB_ERROR,
    MemorySink,
    MetricsSink,
    MlflowSink,
    NullSink,
    comparison_table,
    configure_mlflow,
    default_tracking_uri,
    fetch_recipe_runs,
    flatten_params,
    plot_metric_history,
    recipe_tags,
    start_parent_run,
)
from fp8rl.tracking.mlflow_sink import TELEMETRY_ENV, TRACKING_URI_ENV

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# MLflow's own SQL store trips a SQLAlchemy deprecation on first use; nothing of ours.
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tracking")


@pytest.fixture(autouse=True)
def local_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tracking URI from the caller's environment must not redirect these tests."""
    monkeypatch.delenv(TRACKING_URI_ENV, raising=False)
    monkeypatch.setenv(TELEMETRY_ENV, "false")  # restored after each test; configure_mlflow must override


@pytest.fixture
def experiment(request: pytest.FixtureRequest) -> str:
    return f"exp-{request.node.name}"


def client_for(work_dir: Path) -> MlflowClient:
    return MlflowClient(tracking_uri=default_tracking_uri(work_dir))


def test_flatten_params_nests_with_dots_and_respects_the_value_limit() -> None:
    flat = flatten_params({"optim": {"lr": 1e-5, "betas": (0.9, 0.95)}, "recipe": "bf16", "x": None})
    assert flat == {"optim.lr": "1e-05", "optim.betas": "(0.9, 0.95)", "recipe": "bf16", "x": "None"}
    long = flatten_params({"prompt": "a" * 10_000})["prompt"]
    assert len(long) == MAX_PARAM_VALUE_LENGTH and long.endswith("[truncated]")
    with pytest.raises(ValueError, match=r"'a\.b' appears twice"):
        flatten_params({"a.b": 1, "a": {"b": 2}})


def test_memory_and_null_sinks_follow_the_protocol() -> None:
    assert isinstance(MemorySink(), MetricsSink) and isinstance(NullSink(), MetricsSink)
    sink = MemorySink()
    sink.log_params({"model": {"hidden": 64}})
    sink.log_params({"model": {"hidden": 64}})  # same value again is fine, as in MLflow
    with pytest.raises(ValueError, match="set once"):
        sink.log_params({"model.hidden": 128})
    sink.log_metrics({"reward": 0.5}, step=0)
    sink.log_metrics({"reward": 0.7}, step=1)
    assert sink.history("reward") == [(0, 0.5), (1, 0.7)]
    with pytest.raises(RuntimeError), sink:
        raise RuntimeError("boom")
    assert sink.status == "FAILED"


def test_params_are_flattened_and_recipe_is_param_and_tag(work_dir: Path, experiment: str) -> None:
    with MlflowSink(experiment, "r", work_dir, tags=recipe_tags("fp8-e2e")) as sink:
        sink.log_params({**recipe_tags("fp8-e2e"), "optim": {"lr": 1e-5, "warmup": 10}, "note": "x" * 7000})
        sink.set_tags({"git_sha": "abc123"})
    run = client_for(work_dir).get_run(sink.run_id)
    assert run.data.params["recipe"] == "fp8-e2e" and run.data.tags["recipe"] == "fp8-e2e"
    assert run.data.params["optim.lr"] == "1e-05" and run.data.params["optim.warmup"] == "10"
    assert len(run.data.params["note"]) == MAX_PARAM_VALUE_LENGTH
    assert run.data.tags["git_sha"] == "abc123"
    assert run.info.run_name == "r" and run.info.status == "FINISHED"


def test_metrics_keep_their_steps_and_large_batches_are_split(work_dir: Path, experiment: str) -> None:
    rewards = [0.1, 0.4, float("nan"), 0.8]
    with MlflowSink(experiment, "r", work_dir) as sink:
        for step, reward in enumerate(rewards):
            sink.log_metrics({"reward": reward, TOKEN_MULT_PROB_ERROR: 1.0 + step / 100}, step=step)
        # more keys than MLflow accepts in one log_batch (1000): MlflowClient.log_batch splits them
        sink.log_metrics({f"layer{i}/amax": float(i) for i in range(1200)}, step=0)
    client = client_for(work_dir)
    history = sorted((m.step, m.value) for m in client.get_metric_history(sink.run_id, "reward"))
    assert [s for s, _ in history] == [0, 1, 2, 3]
    assert [v for _, v in history if not math.isnan(v)] == [0.1, 0.4, 0.8]
    assert math.isnan(history[2][1])  # NaN is logged as-is, not dropped
    assert client.get_run(sink.run_id).data.metrics["layer1199/amax"] == 1199.0


def test_child_runs_point_at_their_parent(work_dir: Path, experiment: str) -> None:
    parent_id = start_parent_run(experiment, "compare", work_dir)
    for recipe in ("bf16", "fp8-rollout"):
        with MlflowSink(experiment, recipe, work_dir, parent_run_id=parent_id, tags=recipe_tags(recipe)):
            pass
    with MlflowSink(experiment, "unrelated", work_dir):
        pass
    client = client_for(work_dir)
    exp_id = client.get_experiment_by_name(experiment).experiment_id
    children = client.search_runs([exp_id], f"tags.mlflow.parentRunId = '{parent_id}'")
    assert sorted(r.data.tags["recipe"] for r in children) == ["bf16", "fp8-rollout"]
    assert client.get_run(parent_id).info.status == "RUNNING"  # owned by the comparison step
    MlflowSink.attach(parent_id, work_dir).close()
    assert client.get_run(parent_id).info.status == "FINISHED"


def test_a_failing_body_marks_the_run_failed_and_propagates(work_dir: Path, experiment: str) -> None:
    with pytest.raises(FloatingPointError, match="loss is NaN"), MlflowSink(experiment, "bad", work_dir) as failed:
        failed.log_metrics({"loss": float("nan")}, step=0)
        raise FloatingPointError("loss is NaN")
    with pytest.raises(KeyboardInterrupt), MlflowSink(experiment, "stopped", work_dir) as killed:
        raise KeyboardInterrupt
    client = client_for(work_dir)
    assert client.get_run(failed.run_id).info.status == "FAILED"
    assert client.get_run(killed.run_id).info.status == "KILLED"


def test_artifacts_land_in_the_runs_artifact_dir(work_dir: Path, experiment: str, tmp_path: Path) -> None:
    report = tmp_path / "report.md"
    report.write_text("# report\n")
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    (cfg / "recipe.yaml").write_text("name: bf16\n")
    with MlflowSink(experiment, "r", work_dir) as sink:
        sink.log_artifact(report)
        sink.log_artifact(report, "reports")
        sink.log_artifact(cfg, "config")
    assert sink.artifact_uri.startswith((work_dir / "mlruns-artifacts").resolve().as_uri())
    root = work_dir.resolve() / "mlruns-artifacts" / sink.run_id / "artifacts"
    assert (root / "report.md").read_text() == "# report\n"
    assert (root / "reports" / "report.md").is_file()
    assert (root / "config" / "recipe.yaml").read_text() == "name: bf16\n"
    listed = {a.path for a in client_for(work_dir).list_artifacts(sink.run_id)}
    assert listed == {"report.md", "reports", "config"}


def test_tracking_uri_env_var_wins_over_the_work_dir(
    work_dir: Path, experiment: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert default_tracking_uri(tmp_path) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    shared_uri = default_tracking_uri(work_dir)
    monkeypatch.setenv(TRACKING_URI_ENV, shared_uri)
    assert default_tracking_uri(tmp_path / "elsewhere") == shared_uri
    with MlflowSink(experiment, "r", tmp_path / "elsewhere") as sink:
        sink.log_metrics({"reward": 1.0}, step=0)
    assert not (tmp_path / "elsewhere" / "mlflow.db").exists()
    assert MlflowClient(tracking_uri=shared_uri).get_run(sink.run_id).data.metrics == {"reward": 1.0}


def test_configure_mlflow_turns_telemetry_off(work_dir: Path) -> None:
    from mlflow.telemetry import get_telemetry_client
    from mlflow.telemetry.utils import is_telemetry_disabled

    assert os.environ[TELEMETRY_ENV] == "false"
    assert configure_mlflow(work_dir) == default_tracking_uri(work_dir)
    assert os.environ[TELEMETRY_ENV] == "true"
    assert is_telemetry_disabled() and get_telemetry_client() is None


def test_plot_metric_history_writes_a_png(tmp_path: Path) -> None:
    histories = {
        "bf16": [(s, 0.2 + 0.05 * s) for s in range(20)],
        "fp8-e2e": [(s, 0.2 + 0.045 * s) for s in reversed(range(20))],  # any order
        "fp8-rollout": [(0, 0.2), (1, float("nan")), (2, 0.3)],
    }
    out = plot_metric_history(histories, "reward", tmp_path / "plots" / "reward.png")
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000
    assert [p.name for p in out.parent.iterdir()] == ["reward.png"]  # no temporary left behind
    with pytest.raises(ValueError, match="no runs"):
        plot_metric_history({}, "reward", tmp_path / "empty.png")


def test_comparison_table_has_each_recipe_and_its_final_values(work_dir: Path, experiment: str) -> None:
    reward = {"bf16": [0.1, 0.5, 0.75], "fp8-e2e": [0.1, 0.4, 0.7], "fp8-rollout": [0.2, 0.45, 0.72]}
    tmpe = {"bf16": [1.0, 1.0, 1.0], "fp8-e2e": [1.02, 1.05, 1.08], "fp8-rollout": [1.01, 1.03, 1.02]}
    parent_id = start_parent_run(experiment, "compare", work_dir)
    for recipe in ("fp8-rollout", "bf16", "fp8-e2e"):
        with MlflowSink(experiment, recipe, work_dir, parent_id, tags=recipe_tags(recipe)) as sink:
            sink.log_params(recipe_tags(recipe))
            for step in range(3):
                sink.log_metrics({"reward": reward[recipe][step], TOKEN_MULT_PROB_ERROR: tmpe[recipe][step]}, step)
    with MlflowSink(experiment, "other-comparison", work_dir, tags=recipe_tags("bf16")):
        pass
    uri = default_tracking_uri(work_dir)

    runs = fetch_recipe_runs(experiment, parent_id, uri)
    assert [r.recipe for r in runs] == ["bf16", "fp8-e2e", "fp8-rollout"]
    table = comparison_table(runs, ["reward", "accuracy"])
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()]
    header = ["recipe", "run", "status", "reward (final)", "accuracy (final)", "token_mult_prob_error (mean)"]
    assert rows[0] == header
    by_recipe = {row[0]: row for row in rows[2:]}
    assert set(by_recipe) == set(reward)
    for recipe, row in by_recipe.items():
        assert row[1] == recipe  # the run name
        assert row[2] == "FINISHED"
        assert float(row[3]) == reward[recipe][-1]
        assert row[4] == "n/a"
        assert float(row[5]) == pytest.approx(math.fsum(tmpe[recipe]) / 3, rel=1e-5)

    everything = fetch_recipe_runs(experiment, None, uri)
    assert [r.recipe for r in everything] == ["bf16", "bf16", "fp8-e2e", "fp8-rollout"]  # parent has no recipe


def test_unknown_experiment_is_a_user_error(work_dir: Path) -> None:
    from fp8rl.errors import UserError

    with pytest.raises(UserError, match="no-such-experiment"):
        fetch_recipe_runs("no-such-experiment", None, default_tracking_uri(work_dir))


def test_each_work_dir_gets_its_own_store_though_mlflow_exports_the_uri(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # mlflow.set_tracking_uri exports $MLFLOW_TRACKING_URI; that must not pin later work dirs to the first
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    first = configure_mlflow(tmp_path / "a")
    second = configure_mlflow(tmp_path / "b")
    assert first != second and second.endswith("/b/mlflow.db")
    # a URI the user set is still respected, every time
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking.example:5000")
    assert configure_mlflow(tmp_path / "c") == configure_mlflow(tmp_path / "d") == "http://tracking.example:5000"
