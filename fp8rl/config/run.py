"""One RL run: a recipe and everything else the loop needs, in one process or on Ray."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from fp8rl.config.base import ConfigError, Strict, read_yaml, validated
from fp8rl.config.recipe import Recipe, vllm_recipe_problem
from fp8rl.config.rollout import RolloutConfig, rollout_recipe
from fp8rl.config.task import ArithmeticTaskConfig, ExactMatchRewardConfig, RewardConfig, TaskConfig
from fp8rl.config.training import GRPOConfig, OptimConfig, SamplingConfig

# the Ray weight-sync transports: one module each in fp8rl.sync (fp8rl.sync.transport)
SyncTransport = Literal["objectstore", "collective", "ipc"]


class RayConfig(Strict):
    """The RL step on Ray (``fp8rl.cluster``): workers, layout, where Ray is, and the fault limits."""

    trainer_workers: int = Field(1, ge=1)
    rollout_workers: int = Field(1, ge=1)
    # replicate: every trainer worker holds the whole model, fp32 masters and AdamW state (data parallel);
    # fsdp: FSDP2 shards the fp32 masters and AdamW state across the trainer workers (fp8rl.train.trainer)
    trainer_sharding: Literal["replicate", "fsdp"] = "replicate"
    # split: rollout and training on different devices; colocated: shared, time-sliced
    layout: Literal["split", "colocated"] = "split"
    # None: RAY_ADDRESS if set, else a local Ray started (and stopped) by the step
    address: str | None = None
    # every blocking wait on a worker gives up after this long, naming the worker
    actor_timeout_s: float = Field(600.0, gt=0)
    # a dead worker is replaced and the run resumes from its last checkpoint, at most this often
    max_restarts: int = Field(2, ge=0)
    object_store_mb: int = Field(512, ge=64)
    # weight sync trainer rank 0 -> rollout workers: through the Ray object store, a bucketed broadcast
    # over a process group of its own (NCCL on GPUs, gloo on CPUs; fp8rl.sync.collective), or CUDA IPC
    # (colocated on GPUs: rollout worker i maps trainer rank i's packed payload on their GPU; fp8rl.sync.ipc;
    # sharded, every rank gathers and ranks 0 .. rollout_workers-1 keep the full weights for their engine)
    sync: SyncTransport = "objectstore"
    sync_bucket_mb: int = Field(256, ge=1)
    # colocated: after loading new weights (and recalibrating an FP8 KV cache) the engines go back to sleep until the
    # next generation; false keeps them awake from the load to that generation: one sleep and one wake-up fewer a step
    # (vLLM's level-1 sleep copies the weights to host memory and its wake-up copies them back). The trainer's KV
    # calibration forward then runs beside the awake engines; they are put to sleep before a checkpoint gathers the
    # trainer state (which brings an offloaded optimizer state back to the GPU)
    sleep_after_sync: bool = True

    @model_validator(mode="after")
    def _ipc_needs_a_trainer_rank_per_engine(self) -> RayConfig:
        if self.sync != "ipc":
            return self
        if self.layout != "colocated":
            raise ValueError(
                "ray.sync 'ipc' maps the trainer's GPU memory into the rollout worker on the same GPU: "
                "it needs ray.layout 'colocated' (split layouts use 'collective' or 'objectstore')"
            )
        if self.rollout_workers > self.trainer_workers:
            raise ValueError(
                "ray.sync 'ipc' pairs rollout worker i with trainer rank i on one GPU: ray.rollout_workers "
                f"({self.rollout_workers}) must not exceed ray.trainer_workers ({self.trainer_workers})"
            )
        return self


class TrackingConfig(Strict):
    """What a run records in MLflow besides its parameters and step metrics (``fp8rl.tracking``)."""

    # MLflow's system metrics (system/*: CPU, memory, disk and network; GPU utilization and memory where the NVIDIA
    # management library is present), sampled every system_metrics_interval_s on the machine of the run's process
    system_metrics: bool = True
    system_metrics_interval_s: float = Field(10.0, gt=0)
    # the trained checkpoint as an MLflow model of the run (copied into the artifact store: fp8rl.tracking.models);
    # false: it stays only at its path (the run's tag fp8rl.checkpoint_uri)
    log_model: bool = True


class RunConfig(Strict):
    """One RL run: a recipe plus everything else the loop needs."""

    recipe: Recipe
    model: str | None = None  # None: the tiny model, warmed up by SFT
    preset: str = "tiny"
    task: TaskConfig = ArithmeticTaskConfig()
    reward: RewardConfig = ExactMatchRewardConfig()
    steps: int = Field(60, ge=1)
    seed: int = 0
    grpo: GRPOConfig = GRPOConfig()
    sampling: SamplingConfig = SamplingConfig()
    rollout: RolloutConfig = RolloutConfig()
    optim: OptimConfig = OptimConfig()
    eval_every: int = Field(5, ge=1)
    eval_examples: int = Field(200, ge=1)
    # held-out avg@k at the rollout temperature, besides greedy accuracy; 0 turns it off
    eval_samples: int = Field(4, ge=0)
    verify_sync: bool = True
    # save the loop state every N steps (and at the end) when the run has a checkpoint dir; 0: never
    checkpoint_every: int = Field(0, ge=0)
    # how many loop checkpoints a run keeps (a checkpoint is written whole before the older ones go, so 1 is safe;
    # the peak is this plus the one being written)
    checkpoint_keep: int = Field(2, ge=1)
    # where the one-process loop runs: auto is CUDA when a CUDA device is visible, else the CPU (fp8rl.devices);
    # Ray runs place their actors by ray.* instead
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # None: the loop runs in this process; set: on Ray actors
    ray: RayConfig | None = None
    work_dir: str = "work"
    experiment: str = "fp8rl"
    tracking: TrackingConfig = TrackingConfig()

    @model_validator(mode="after")
    def _engine_supports_recipe(self) -> RunConfig:
        if self.recipe.kv_cache == "fp8" and self.rollout.engine != "vllm":
            raise ValueError(
                "recipe.kv_cache 'fp8' needs rollout.engine 'vllm' (the torch engine keeps a bf16 KV cache)"
            )
        if self.recipe.te_recipe == "delayed" and self.optim.activation_checkpointing:
            raise ValueError(
                "recipe.te_recipe 'delayed' (DelayedScaling) cannot be combined with optim.activation_checkpointing: "
                "the recompute would update its amax history a second time (use te_recipe 'auto')"
            )
        if self.optim.reduce_grads_once and (self.ray is None or self.ray.trainer_sharding != "fsdp"):
            raise ValueError(
                "optim.reduce_grads_once applies to ray.trainer_sharding 'fsdp' (a replicated trainer already "
                "accumulates every micro-batch and reduces once a step)"
            )
        tp = self.rollout.tensor_parallel_size
        if tp > 1 and (self.rollout.engine != "vllm" or self.ray is None):
            raise ValueError(
                f"rollout.tensor_parallel_size {tp} splits a vLLM engine over Ray rollout workers: it needs "
                "rollout.engine 'vllm' and a ray section (the one-process loop and the torch engine run one device)"
            )
        if tp > 1 and self.ray is not None and self.ray.sync == "collective":
            raise ValueError(
                f"rollout.tensor_parallel_size {tp} needs ray.sync 'ipc' or 'objectstore': the bucketed broadcast "
                "('collective') may cut a fused module between buckets and checks full shapes, where each rank of a "
                "tensor-parallel engine holds its part"
            )
        if self.ray is not None and self.ray.rollout_workers % tp:
            raise ValueError(
                f"ray.rollout_workers ({self.ray.rollout_workers}) must be a multiple of rollout.tensor_parallel_size "
                f"({tp}): each engine takes that many workers"
            )
        served = rollout_recipe(self.recipe, self.rollout)
        problem = vllm_recipe_problem(served) if self.rollout.engine == "vllm" else None
        if problem:
            raise ValueError(problem)
        return self


def load_run_config_data(path: str | Path) -> dict[str, Any]:
    """The mapping in a run-config YAML file (validated later, once flags are merged over it)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: run config file not found")
    data: dict[str, Any] = read_yaml(path, mapping_of="a run config must be a mapping of RunConfig fields")
    return data


def parse_run_config(data: Any, source: str = "config") -> RunConfig:
    return validated(RunConfig, data, source)
