"""Recipes and run configs: valid built-ins, clear errors naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from fp8rl.config import BUILTIN_RECIPES, ConfigError, load_recipe, parse_recipe, parse_run_config


def test_builtin_recipes() -> None:
    recipes = {name: load_recipe(name) for name in BUILTIN_RECIPES}
    assert (recipes["bf16"].rollout_precision, recipes["bf16"].train_precision) == ("bf16", "bf16")
    assert (recipes["fp8-rollout"].rollout_precision, recipes["fp8-rollout"].train_precision) == ("fp8", "bf16")
    assert (recipes["fp8-e2e"].rollout_precision, recipes["fp8-e2e"].train_precision) == ("fp8", "fp8")
    assert recipes["fp8-e2e"].quant.granularity == "block"


def test_invalid_values_name_field_and_allowed_values(tmp_path: Path) -> None:
    bad = tmp_path / "r.yaml"
    bad.write_text("name: x\nrollout_precision: fp8\ntrain_precision: bf16\nquant: {granularity: channel}\n")
    with pytest.raises(ConfigError, match=r"quant.granularity: Input should be 'block', 'row' or 'tensor'"):
        load_recipe(str(bad))
    with pytest.raises(ConfigError, match=r"correction: Input tag 'foo'.*'none', 'tis', 'mis'"):
        parse_recipe(
            {"name": "x", "rollout_precision": "fp8", "train_precision": "bf16", "correction": {"type": "foo"}}
        )
    with pytest.raises(ConfigError, match="requires rollout_precision 'fp8'"):
        parse_recipe({"name": "x", "rollout_precision": "bf16", "train_precision": "fp8"})
    with pytest.raises(ConfigError, match=r"correction.tis.threshold: Input should be greater than 1"):
        parse_recipe(
            {
                "name": "x",
                "rollout_precision": "fp8",
                "train_precision": "fp8",
                "correction": {"type": "tis", "threshold": 0.5},
            }
        )
    with pytest.raises(ConfigError, match="not a built-in recipe"):
        load_recipe("fp4")
    with pytest.raises(ConfigError, match="grpo.group_size"):
        parse_run_config({"recipe": load_recipe("bf16").model_dump(), "grpo": {"group_size": 1}})
    with pytest.raises(ConfigError, match="bogus: Extra inputs are not permitted"):
        parse_run_config({"recipe": load_recipe("bf16").model_dump(), "bogus": 1})


E2E = {"name": "x", "rollout_precision": "fp8", "train_precision": "fp8"}


def test_engine_and_backend_knobs_default_to_the_portable_path() -> None:
    cfg = parse_run_config({"recipe": load_recipe("fp8-e2e").model_dump()})
    assert (cfg.rollout.engine, cfg.recipe.trainer, cfg.recipe.kv_cache, cfg.recipe.te_recipe) == (
        "torch",
        "torch",
        "bf16",
        "auto",
    )


@pytest.mark.parametrize(
    ("recipe", "message"),
    [
        ({**E2E, "trainer": "te", "quant": {"granularity": "row"}}, "trainer 'te' has no per-row FP8 recipe"),
        ({**E2E, "trainer": "te", "quant": {"act_block": 64}}, r"fixed at 128x128 .* quant.act_block 64"),
        ({**E2E, "trainer": "te", "quant": {"weight_block": [64, 128]}}, r"quant.weight_block \[64, 128\]"),
        (
            {**E2E, "trainer": "te", "te_recipe": "delayed"},
            "te_recipe 'delayed' needs trainer 'te' and quant.granularity 'tensor'",
        ),
        ({**E2E, "te_recipe": "delayed", "quant": {"granularity": "tensor"}}, "te_recipe 'delayed' needs trainer 'te'"),
        ({**E2E, "trainer": "cuda"}, r"trainer: Input should be 'torch' or 'te'"),
        (
            {**E2E, "trainer": "te", "te_recipe": "delayed", "quant": {"granularity": "tensor", "pow2_scales": True}},
            r"te_recipe 'delayed' \(DelayedScaling\) has no power-of-two scale option: set quant.pow2_scales false",
        ),
    ],
)
def test_te_recipe_errors_name_the_field(recipe: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_recipe(recipe)


def test_valid_te_recipes() -> None:
    # bf16 training through TE modules needs no FP8 scaling, so any granularity is fine for its rollout side
    assert parse_recipe({**E2E, "train_precision": "bf16", "trainer": "te", "quant": {"granularity": "row"}})
    delayed = parse_recipe({**E2E, "trainer": "te", "te_recipe": "delayed", "quant": {"granularity": "tensor"}})
    assert delayed.te_recipe == "delayed"


def test_fp8_kv_cache_needs_the_vllm_engine() -> None:
    recipe = {**E2E, "kv_cache": "fp8"}
    with pytest.raises(ConfigError, match=r"kv_cache 'fp8' needs rollout.engine 'vllm'"):
        parse_run_config({"recipe": recipe})
    cfg = parse_run_config({"recipe": recipe, "rollout": {"engine": "vllm", "gpu_memory_utilization": 0.3}})
    assert (cfg.recipe.kv_cache, cfg.rollout.engine, cfg.rollout.gpu_memory_utilization) == ("fp8", "vllm", 0.3)
    head = parse_run_config({"recipe": recipe, "rollout": {"engine": "vllm", "kv_scaling": "token_head"}})
    assert head.rollout.vllm_attention_backend(fp8_cache=True) == "TRITON_ATTN"
    with pytest.raises(ConfigError, match=r"kv_scaling 'token_head' is read by vLLM's TRITON_ATTN attention only"):
        parse_run_config({"recipe": recipe, "rollout": {"kv_scaling": "token_head", "attention_backend": "FLASH_ATTN"}})
    with pytest.raises(ConfigError, match=r"rollout.attention_backend: String should match pattern"):
        parse_run_config({"recipe": E2E, "rollout": {"attention_backend": "flash attn"}})
    with pytest.raises(ConfigError, match=r"rollout.engine: Input should be 'torch' or 'vllm'"):
        parse_run_config({"recipe": E2E, "rollout": {"engine": "sglang"}})
    with pytest.raises(ConfigError, match=r"rollout.gpu_memory_utilization: Input should be less than or equal to 1"):
        parse_run_config({"recipe": E2E, "rollout": {"gpu_memory_utilization": 1.5}})


def test_vllm_engine_recipes_are_checked_before_anything_runs() -> None:
    vllm = {"engine": "vllm"}
    row = {**E2E, "quant": {"granularity": "row"}}
    tensor = {**E2E, "quant": {"granularity": "tensor"}}
    with pytest.raises(ConfigError, match=r"serves FP8 as block or per-channel.*recipe.quant.granularity 'tensor'"):
        parse_run_config({"recipe": tensor, "rollout": vllm})
    assert parse_run_config({"recipe": row, "rollout": vllm})  # per-channel weights, per-token activations
    with pytest.raises(ConfigError, match=r"recipe.quant.weight_block is \[64, 64\]"):
        parse_run_config({"recipe": {**E2E, "quant": {"weight_block": [64, 64]}}, "rollout": vllm})
    # bf16 rollout needs no FP8 layout; the torch engine serves every granularity
    assert parse_run_config(
        {"recipe": {**row, "rollout_precision": "bf16", "train_precision": "bf16"}, "rollout": vllm}
    )
    assert parse_run_config({"recipe": row})
    # FP8 KV cache on Ray: the trainer calibrates, the driver writes the scales into every engine
    assert parse_run_config({"recipe": {**E2E, "kv_cache": "fp8"}, "rollout": vllm, "ray": {}}).ray is not None


def test_trainer_sharding_is_a_ray_setting_for_either_trainer() -> None:
    from fp8rl.build import trainer_options

    cfg = parse_run_config({"recipe": E2E, "ray": {"trainer_workers": 2, "trainer_sharding": "fsdp"}})
    assert cfg.ray is not None and cfg.ray.trainer_sharding == "fsdp"
    assert parse_run_config({"recipe": E2E}).optim.activation_checkpointing is False
    # the TransformerEngine trainer shards the same way (tests/gpu/test_sharded_trainer_cuda.py's te case)
    te = parse_run_config({"recipe": {**E2E, "trainer": "te"}, "ray": {"trainer_sharding": "fsdp"}})
    opts = trainer_options(te)
    assert (opts.backend, opts.sharding) == ("te", "fsdp")
    # one reduce-scatter a step: FSDP2's option (a replicated trainer reduces once a step already)
    once = {"reduce_grads_once": True}
    assert trainer_options(
        parse_run_config({"recipe": E2E, "optim": once, "ray": {"trainer_sharding": "fsdp"}})
    ).optim.reduce_grads_once
    for ray in ({}, {"ray": {}}):
        with pytest.raises(ConfigError, match=r"optim.reduce_grads_once applies to ray.trainer_sharding 'fsdp'"):
            parse_run_config({"recipe": E2E, "optim": once, **ray})
    # TE's DelayedScaling keeps an amax history, which a checkpointed layer's recompute would update twice
    delayed = {**E2E, "trainer": "te", "te_recipe": "delayed", "quant": {"granularity": "tensor"}}
    assert parse_run_config({"recipe": delayed}).recipe.te_recipe == "delayed"
    with pytest.raises(ConfigError, match=r"te_recipe 'delayed' .* optim.activation_checkpointing"):
        parse_run_config({"recipe": delayed, "optim": {"activation_checkpointing": True}})
    with pytest.raises(ConfigError, match=r"trainer_sharding"):
        parse_run_config({"recipe": E2E, "ray": {"trainer_sharding": "zero3"}})


def test_ipc_sync_pairs_each_rollout_worker_with_a_trainer_rank_on_its_gpu() -> None:
    ok = parse_run_config({"recipe": E2E, "ray": {"trainer_workers": 2, "rollout_workers": 2, "layout": "colocated",
                                                   "sync": "ipc"}})  # fmt: skip
    assert ok.ray is not None and ok.ray.sync == "ipc"
    with pytest.raises(ConfigError, match=r"ray.sync 'ipc' .* needs ray.layout 'colocated'"):
        parse_run_config({"recipe": E2E, "ray": {"sync": "ipc"}})
    with pytest.raises(ConfigError, match=r"must not exceed ray.trainer_workers \(1\)"):
        parse_run_config({"recipe": E2E, "ray": {"rollout_workers": 2, "layout": "colocated", "sync": "ipc"}})
    # sharded: every rank gathers, and each rank with an engine on its GPU keeps the weights for it
    fsdp = parse_run_config({"recipe": E2E, "ray": {"trainer_workers": 2, "rollout_workers": 2, "layout": "colocated",
                                                     "trainer_sharding": "fsdp", "sync": "ipc"}})  # fmt: skip
    assert fsdp.ray is not None and fsdp.ray.rollout_workers == 2


def test_every_shipped_config_file_parses() -> None:
    """docs/configs holds run configs (the benchmarks' and examples') and recipe files: each must load as what it
    is, so a command in the docs does not fail on its own config."""
    from pathlib import Path

    from fp8rl.config import load_recipe, parse_run_config, read_yaml

    files = sorted((Path(__file__).parents[2] / "docs" / "configs").glob("*.yaml"))
    assert len(files) >= 10
    for path in files:
        data = read_yaml(path)
        if "rollout_precision" in data:  # a recipe file
            assert load_recipe(str(path)).name
            continue
        data.setdefault("recipe", load_recipe("fp8-e2e"))
        assert parse_run_config(data, str(path)) is not None


def test_compiled_elementwise_combines_with_activation_checkpointing() -> None:
    """Refused until the compiled parts (autograd.Functions) passed under checkpointing on a GPU
    (tests/gpu/test_compiled_trainer_cuda.py, two H200s on 2026-11-26); now a config and the trainer's options
    take both, and the run config carries them to the trainer."""
    from fp8rl.build import trainer_options
    from fp8rl.config import OptimConfig

    optim = OptimConfig(compile_elementwise=True, activation_checkpointing=True)
    assert optim.compile_elementwise and optim.activation_checkpointing
    cfg = parse_run_config({"recipe": E2E, "optim": {"compile_elementwise": True, "activation_checkpointing": True}})
    opts = trainer_options(cfg)
    assert opts.optim.compile_elementwise and opts.optim.activation_checkpointing


def test_rollout_fp8_scaling_channel_serves_per_channel_weights_whatever_the_trainer_uses() -> None:
    """``rollout.fp8_scaling: channel``: the engine's recipe has quant granularity ``row`` (what its checkpoint,
    FP8 modules and sync requantization follow); the trainer's recipe is untouched."""
    from fp8rl.config import rollout_recipe

    cfg = parse_run_config({"recipe": E2E, "rollout": {"engine": "vllm", "fp8_scaling": "channel"}})
    served = rollout_recipe(cfg.recipe, cfg.rollout)
    assert served.quant.granularity == "row" and cfg.recipe.quant.granularity == "block"
    assert served.quant.bf16_first_layers == cfg.recipe.quant.bf16_first_layers and served.name == cfg.recipe.name
    # a tensor-granularity recipe is served per channel too (vLLM refuses per-tensor scaling from fp8rl)
    tensor = {**E2E, "quant": {"granularity": "tensor"}}
    assert parse_run_config({"recipe": tensor, "rollout": {"engine": "vllm", "fp8_scaling": "channel"}})
    assert rollout_recipe(cfg.recipe, parse_run_config({"recipe": E2E}).rollout) is cfg.recipe
    # BF16 rollouts ignore it: one config serves a comparison of bf16 and FP8 recipes
    bf16 = parse_run_config({"recipe": load_recipe("bf16").model_dump(), "rollout": {"fp8_scaling": "channel"}})
    assert rollout_recipe(bf16.recipe, bf16.rollout) is bf16.recipe
    with pytest.raises(ConfigError, match=r"rollout.fp8_scaling"):
        parse_run_config({"recipe": E2E, "rollout": {"fp8_scaling": "tensor"}})


def test_every_builtin_recipe_says_what_it_is_and_fp8rl_recipes_lists_them(capsys: pytest.CaptureFixture[str]) -> None:
    from fp8rl.cli import main

    assert all(len(load_recipe(name).description) > 40 for name in BUILTIN_RECIPES)
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    listed = [line.split(":")[0] for line in out.splitlines() if not line.startswith((" ", "Any"))]
    assert listed == list(BUILTIN_RECIPES)
    assert "fp8-e2e-row: rollout fp8, training fp8, row scaling, KV cache bf16, correction tis" in out
    assert "17 points under" in out  # the row recipe's measured cost, where a user picks a recipe
