"""The RL loop on real local Ray actors: data-parallel trainers, rollout workers, faults and resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fp8rl.config import RayConfig, RunConfig, load_recipe
from fp8rl.loop import run_rl
from fp8rl.tracking import MemorySink
from fp8rl.train.sft import SFTOptions, sft_warmup

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray() -> object:
    # one local Ray for the module (starting one takes ~10 s on 2 cores); the driver reuses it
    ray.init(num_cpus=4, object_store_memory=256 * 1024 * 1024, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def warm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sft") / "model"
    sft_warmup(path, SFTOptions(steps=60, batch_size=64, lr=5e-3), log_every=60)
    return path


def _cfg(recipe: str, ray_cfg: RayConfig | None, tmp: Path, steps: int = 3, **kw: object) -> RunConfig:
    return RunConfig.model_validate(
        {
            "recipe": load_recipe(recipe),
            "steps": steps,
            "eval_every": steps,
            "eval_examples": 16,
            "eval_samples": 2,
            # 128 sequences per step: each of 2 ranks gets one 64-row micro-batch, as one process does
            "grpo": {"prompts_per_step": 16, "group_size": 8},
            "optim": {"lr": 1e-4, "micro_batch_size": 64},
            "work_dir": str(tmp),
            "ray": ray_cfg,
            **kw,
        }
    )


@pytest.mark.parametrize("recipe", ["bf16", "fp8-e2e"])
def test_two_trainers_one_rollout_reproduce_the_single_process_run(
    local_ray: object, warm_model: Path, tmp_path: Path, recipe: str
) -> None:
    from fp8rl.cluster.driver import run_rl_on_ray

    single = run_rl(_cfg(recipe, None, tmp_path), warm_model, MemorySink(), log=lambda _s: None)
    cfg = _cfg(recipe, RayConfig(trainer_workers=2, rollout_workers=1), tmp_path)
    lines: list[str] = []
    on_ray = run_rl_on_ray(cfg, warm_model, MemorySink(), log=lines.append)
    assert any("2 trainer worker(s), 1 rollout worker(s)" in line for line in lines)
    assert len(on_ray.history) == len(single.history) == 3
    for a, b in zip(single.history, on_ray.history, strict=True):
        # Same samples (one rollout worker, same seeds), same gradient: each rank's micro-batch is
        # one of the single process's, and the all-reduce adds the two the way accumulation does.
        # Documented tolerance: 1e-6 relative on the loss and the gradient norm.
        assert b["reward"] == a["reward"]
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-6, abs=1e-9)
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-6)
        assert b["mismatch/token_mult_prob_error"] == pytest.approx(a["mismatch/token_mult_prob_error"], rel=1e-6)
        assert b["sync/policy_version"] == a["sync/policy_version"]
        assert b["sync/bytes"] == a["sync/bytes"]
    assert on_ray.final == pytest.approx(single.final)


def test_collective_sync_matches_the_object_store_run(local_ray: object, warm_model: Path, tmp_path: Path) -> None:
    """The bucketed broadcast transport (gloo on CPU; NCCL on GPUs) gives the engines what the object store does."""
    from fp8rl.cluster.driver import run_rl_on_ray

    base = {"trainer_workers": 1, "rollout_workers": 2}
    lines: list[str] = []
    store = run_rl_on_ray(
        _cfg("fp8-e2e", RayConfig(**base), tmp_path, steps=2), warm_model, MemorySink(), log=lines.append
    )
    cfg = _cfg("fp8-e2e", RayConfig(**base, sync="collective", sync_bucket_mb=1), tmp_path, steps=2)
    collective = run_rl_on_ray(cfg, warm_model, MemorySink(), log=lines.append)
    assert any("sync collective" in line for line in lines)
    for a, b in zip(store.history, collective.history, strict=True):
        assert b["reward"] == a["reward"] and b["train/loss"] == a["train/loss"]
        assert b["sync/bytes"] == a["sync/bytes"] and b["sync/policy_version"] == a["sync/policy_version"]
    assert collective.final == store.final


def test_per_channel_rollouts_take_the_collective_sync(local_ray: object, warm_model: Path, tmp_path: Path) -> None:
    """``rollout.fp8_scaling: channel`` on Ray: the trainer rank requantizes per channel for the bucketed
    broadcast and every engine verifies what it received bit for bit (``verify_sync``); the same run through
    the object store gives the same steps."""
    from fp8rl.cluster.driver import run_rl_on_ray

    base = {"trainer_workers": 1, "rollout_workers": 2}
    channel = {"rollout": {"fp8_scaling": "channel"}}
    cfg = _cfg("fp8-e2e", RayConfig(**base, sync="collective", sync_bucket_mb=1), tmp_path, steps=2, **channel)
    collective = run_rl_on_ray(cfg, warm_model, MemorySink(), log=lambda _s: None)
    store = run_rl_on_ray(
        _cfg("fp8-e2e", RayConfig(**base), tmp_path, steps=2, **channel), warm_model, MemorySink(), log=lambda _s: None
    )
    assert cfg.verify_sync and [h["sync/policy_version"] for h in collective.history] == [1.0, 2.0]
    for a, b in zip(store.history, collective.history, strict=True):
        assert b["reward"] == a["reward"] and b["train/loss"] == a["train/loss"] and b["sync/bytes"] == a["sync/bytes"]
    assert collective.run_mean("mismatch/token_mult_prob_error") > 1.0001  # block training, per-channel rollout


def test_colocated_layout_sleeps_the_engines_between_generations(
    local_ray: object, warm_model: Path, tmp_path: Path
) -> None:
    from fp8rl.cluster.driver import create_ray_parts

    cfg = _cfg("fp8-rollout", RayConfig(trainer_workers=2, rollout_workers=2, layout="colocated"), tmp_path, steps=2)
    parts = create_ray_parts(cfg, warm_model, log=lambda _s: None)
    try:
        result = run_rl(cfg, warm_model, MemorySink(), log=lambda _s: None, parts=parts)
        assert [h["sync/policy_version"] for h in result.history] == [1.0, 2.0]
        asleep = ray.get([a.is_asleep.remote() for a in parts.engine.actors])
        versions = ray.get([a.policy_version.remote() for a in parts.engine.actors])
        assert asleep == [True, True] and versions == [2, 2]
        # FP8 rollout: every worker received FP8 bytes, about half of bf16
        assert result.history[-1]["sync/bytes_vs_bf16"] < 0.75
    finally:
        parts.shutdown()


def test_colocated_engines_can_stay_awake_from_the_sync_to_the_generation(
    local_ray: object, warm_model: Path, tmp_path: Path
) -> None:
    """``ray.sleep_after_sync: false``: the engines stay awake after a weight load (and the FP8 KV recalibration
    a bf16 KV cache skips) until the generation that follows, which puts them to sleep; a gather of the trainer
    state (a checkpoint) puts them to sleep first. The run computes what the default one computes."""
    from fp8rl.cluster.driver import create_ray_parts

    def run(awake: bool) -> tuple[list[dict[str, float]], list[bool], list[bool]]:
        rc = RayConfig(trainer_workers=2, rollout_workers=2, layout="colocated", sleep_after_sync=not awake)
        cfg = _cfg("fp8-e2e", rc, tmp_path / str(awake), steps=2)
        parts = create_ray_parts(cfg, warm_model, log=lambda _s: None)
        asleep = lambda: ray.get([a.is_asleep.remote() for a in parts.engine.actors])  # noqa: E731
        try:
            result = run_rl(cfg, warm_model, MemorySink(), log=lambda _s: None, parts=parts)
            parts.push_weights(3)
            after_push = asleep()
            parts.trainer.state_dict()
            after_gather = asleep()
        finally:
            parts.shutdown()
        return result.history, after_push, after_gather

    keys = ("reward", "train/loss", "train/grad_norm", "sync/bytes", "sync/policy_version")
    history, *states = run(awake=True)
    default, *default_states = run(awake=False)
    assert [[h[k] for k in keys] for h in history] == [[h[k] for k in keys] for h in default]
    assert states == [[False, False], [True, True]]
    assert default_states == [[True, True], [True, True]]


def test_a_killed_actor_is_replaced_and_the_run_resumes_with_every_step_logged_once(
    local_ray: object, warm_model: Path, tmp_path: Path
) -> None:
    from fp8rl.cluster.driver import run_rl_on_ray

    cfg = _cfg("fp8-e2e", RayConfig(trainer_workers=2, rollout_workers=1), tmp_path, steps=5, checkpoint_every=1)
    sink = MemorySink()
    killed: list[str] = []

    def kill_a_trainer_after_step_3(line: str) -> None:
        if "step 3/5" in line and not killed:
            # mid-run: step 3's checkpoint (taken from rank 0) is saved after this line; step 4 needs rank 1
            for name in ray.util.list_named_actors():
                if name.endswith("trainer-1"):
                    ray.kill(ray.get_actor(name), no_restart=True)
                    killed.append(name)

    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        kill_a_trainer_after_step_3(line)

    result = run_rl_on_ray(cfg, warm_model, sink, log=log, checkpoint_dir=tmp_path / "ckpt")
    assert killed, "the test did not kill an actor"
    assert any("actor died" in line and "resuming from the last checkpoint" in line for line in lines)
    assert any("resumed from the checkpoint of step" in line for line in lines)
    steps = [s for s, _ in sink.history("reward")]
    assert steps == [1, 2, 3, 4, 5]  # none lost, none repeated
    assert [s for s, _ in sink.history("eval/accuracy")] == [0, 5]
    assert len(result.history) == 5

    # the resumed run computes what an uninterrupted one computes
    clean = run_rl(_cfg("fp8-e2e", None, tmp_path / "clean", steps=5), warm_model, MemorySink(), log=lambda _s: None)
    assert [h["reward"] for h in result.history] == [h["reward"] for h in clean.history]


def test_worker_errors_name_the_actor_and_keep_the_original(
    local_ray: object, warm_model: Path, tmp_path: Path
) -> None:
    from fp8rl.cluster.driver import create_ray_parts
    from fp8rl.cluster.groups import WorkerError, WorkerTimeout
    from fp8rl.rollout.base import SamplingParams
    from fp8rl.train.trainer import build_batch

    cfg = _cfg("bf16", RayConfig(trainer_workers=1, rollout_workers=1, actor_timeout_s=60), tmp_path)
    parts = create_ray_parts(cfg, warm_model, log=lambda _s: None)
    try:
        with pytest.raises(WorkerError, match=r"rollout-0\.generate raised ValueError: generate needs"):
            parts.engine.generate([[]], SamplingParams())
        bad = build_batch([[1, 2]], torch.full((1, 2), 10_000, dtype=torch.long), torch.ones((1, 2)), 0)
        with pytest.raises(WorkerError, match=r"trainer-0\.compute_logprobs raised IndexError") as info:
            parts.trainer.compute_logprobs(bad, 1.0)
        assert info.value.__cause__ is not None
        parts.engine.calls.timeout_s = 1e-4
        with pytest.raises(WorkerTimeout, match=r"rollout-0\.generate did not answer within"):
            parts.engine.generate([[5, 6, 7]] * 64, SamplingParams(max_tokens=8))
    finally:
        parts.shutdown()


def test_a_users_task_and_python_reward_score_the_same_on_ray(
    local_ray: object, warm_model: Path, tmp_path: Path
) -> None:
    """A JSONL task with a Python reward: the Ray run (rollouts on a worker actor, the reward in the driver where
    the config was loaded) scores every step as the one-process run does."""
    from fp8rl.cluster.driver import run_rl_on_ray

    docs = Path(__file__).resolve().parents[2] / "docs"
    inputs = {
        "task": {
            "type": "jsonl",
            "train": str(docs / "data/sums-train.jsonl"),
            "test": str(docs / "data/sums-test.jsonl"),
        },
        "reward": {"type": "python", "function": f"{docs / 'examples/reward_last_number.py'}:score"},
    }
    single = run_rl(_cfg("bf16", None, tmp_path, steps=2, **inputs), warm_model, MemorySink(), log=lambda _s: None)
    cfg = _cfg("bf16", RayConfig(trainer_workers=1, rollout_workers=1), tmp_path, steps=2, **inputs)
    on_ray = run_rl_on_ray(cfg, warm_model, MemorySink(), log=lambda _s: None)
    for a, b in zip(single.history, on_ray.history, strict=True):
        assert b["reward"] == a["reward"] and b["reward/errors"] == a["reward/errors"] == 0
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-6, abs=1e-9)
    assert on_ray.final == pytest.approx(single.final)


def test_sharded_trainers_reproduce_the_single_process_run_and_resume_after_a_death(
    local_ray: object, warm_model: Path, tmp_path: Path
) -> None:
    """ray.trainer_sharding fsdp: 2 trainer ranks hold half the fp32 masters and AdamW state each (FSDP2 over
    gloo); the gather of the weights for the collective push, the trainer state for the checkpoint, and the
    resume after a rank dies all run as collectives, and the run computes what one process computes."""
    from fp8rl.cluster.driver import run_rl_on_ray

    rc = RayConfig(trainer_workers=2, rollout_workers=1, trainer_sharding="fsdp", sync="collective", sync_bucket_mb=1)
    cfg = _cfg("fp8-e2e", rc, tmp_path, steps=3, checkpoint_every=1)
    killed: list[str] = []
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        if "step 2/3" in line and not killed:
            for name in ray.util.list_named_actors():
                if name.endswith("trainer-1"):
                    ray.kill(ray.get_actor(name), no_restart=True)
                    killed.append(name)

    result = run_rl_on_ray(cfg, warm_model, MemorySink(), log=log, checkpoint_dir=tmp_path / "ckpt")
    assert any("trainer sharding fsdp" in line for line in lines)
    assert killed and any("resumed from the checkpoint of step" in line for line in lines)
    single = run_rl(_cfg("fp8-e2e", None, tmp_path / "one", steps=3), warm_model, MemorySink(), log=lambda _s: None)
    assert len(result.history) == 3
    for a, b in zip(single.history, result.history, strict=True):
        # documented tolerance as in test_sharded_trainer.py: the same gradients summed in another order
        assert b["reward"] == a["reward"]
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5, abs=1e-8)
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-5)
        assert b["sync/bytes"] == a["sync/bytes"]


def test_fp8_kv_scales_are_calibrated_by_the_trainer_and_written_into_every_engine(
    local_ray: object, warm_model: Path, tmp_path: Path
) -> None:
    """kv_cache fp8 on Ray: trainer rank 0 (a real TrainerWorker actor) computes the scales from its policy and
    the driver writes them into every rollout worker.  The rollout workers here are stand-ins that record what
    they are given: the FP8 KV cache is vLLM's, and vLLM cannot run on a CPU."""
    from fp8rl.build import build_trainer, task_examples
    from fp8rl.cluster.driver import RayParts
    from fp8rl.cluster.groups import ActorCalls as _Calls
    from fp8rl.cluster.groups import RolloutGroup, TrainerGroup
    from fp8rl.cluster.workers import TrainerWorker
    from fp8rl.loop import prompt_batch
    from fp8rl.models.loading import load_tokenizer
    from fp8rl.rollout.kv_calibration import kv_scale_metrics, timed_calibration
    from fp8rl.sync.objectstore import ObjectStoreSync

    @ray.remote
    class RecordingEngine:  # stand-in for RolloutWorker around a vLLM engine
        def __init__(self) -> None:
            self.scales: object = None

        def set_kv_scales(self, scales: object) -> None:
            self.scales = scales

        def wake_up(self) -> None: ...

        def sleep(self) -> None: ...

        def got(self) -> object:
            return self.scales

    recipe = load_recipe("fp8-e2e").model_copy(update={"kv_cache": "fp8"})
    cfg = RunConfig.model_validate(
        {**_cfg("fp8-e2e", RayConfig(trainer_workers=1), tmp_path).model_dump(), "recipe": recipe,
         "rollout": {"engine": "vllm"}}
    )  # fmt: skip
    calls = _Calls(120.0)
    trainer = ray.remote(TrainerWorker).remote(0, 1, "", cfg.model_dump(mode="json"), str(warm_model))
    engines = [RecordingEngine.remote() for _ in range(2)]
    group = TrainerGroup([trainer], calls, ["trainer-0"])
    engine = RolloutGroup(engines, calls, False, 0, 0, ["rollout-0", "rollout-1"])
    sync = ObjectStoreSync(engine, group, [], False, engine.sleep)
    parts = RayParts(
        load_tokenizer(warm_model), 0, engine, group, str(warm_model), None, sync, calibrate_kv_scales=True
    )
    train_pool, _ = task_examples(cfg)
    batch = prompt_batch(cfg, parts, train_pool[:8])
    metrics = parts.calibrate_kv(batch)
    model = build_trainer(cfg, warm_model, "cpu").model  # the policy under training numerics (FP8 linears)
    expected, _s = timed_calibration(model, batch.input_ids, batch.attention_mask, batch.position_ids, 0.999, 1.1)
    got = ray.get([e.got.remote() for e in engines])
    assert got[0] == got[1] == expected  # the scales of the trainer's policy (the one-process loop's), everywhere
    want = kv_scale_metrics(expected)
    assert {k: v for k, v in metrics.items() if k != "kv/calibration_s"} == want and metrics["kv/calibration_s"] > 0
    ray.kill(trainer)


def test_ipc_sync_is_refused_without_gpus(local_ray: object, warm_model: Path, tmp_path: Path) -> None:
    """CUDA IPC needs the trainer and the engine on one GPU: on a CPU Ray the step stops before any actor starts,
    and gives its placement group back (tests/gpu/test_ipc_sync.py runs the transport on a GPU)."""
    from fp8rl.cluster.driver import create_ray_parts
    from fp8rl.errors import UserError

    cfg = _cfg("fp8-e2e", RayConfig(layout="colocated", sync="ipc"), tmp_path, steps=1)
    with pytest.raises(UserError, match=r"ray.sync 'ipc' shares GPU memory .* use 'objectstore' or 'collective'"):
        create_ray_parts(cfg, warm_model, log=lambda _s: None)
    from ray.util import placement_group_table

    assert all(g["state"] == "REMOVED" for g in placement_group_table().values())
