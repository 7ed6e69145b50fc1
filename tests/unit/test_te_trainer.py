"""The TransformerEngine backend without TE: recipe translation, the refusal paths, HF names and padding.

TE does not run on CPU.  What is tested here is everything around it: which TE recipe a
recipe becomes, that a ``trainer: te`` recipe fails loudly where TE cannot run (never
falling back to the torch backend), and -- with a stand-in for ``te.Linear`` that is a
plain ``nn.Linear`` with TE's constructor and ``_extra_state`` -- that the swap keeps every
HF name, that FP8 forwards pad to TE's alignment without changing the real tokens'
logprobs, and that checkpoints carry no TE metadata.  tests/gpu/test_te_trainer.py runs the
real TE.
"""

from __future__ import annotations

import enum
import itertools
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import fp8rl.train.te_trainer as te_trainer
from fp8rl.build import build_trainer
from fp8rl.config import ConfigError, GRPOConfig, OptimConfig, load_recipe, parse_recipe, parse_run_config
from fp8rl.errors import UserError
from fp8rl.models.loading import load_causal_lm
from fp8rl.quant import QuantizedTensor, QuantSpec, quantize_activation, quantize_weight
from fp8rl.train.old_logprobs import PolicyStep, RecomputedOld
from fp8rl.train.te_recipes import (
    BLOCK_FP32_SCALES_ENV,
    CURRENT_POW2_SCALES_ENV,
    TEDeviceError,
    TEFP8UnavailableError,
    TENotInstalledError,
    TERecipeError,
    TEUnavailableError,
    require_te,
    te_recipe_for,
)
from fp8rl.train.trainer import TorchTrainer, TrainerOptions, build_batch

PROMPTS = [[5, 6, 76, 7, 84], [8, 76, 9, 84], [5, 5, 76, 5, 5, 84]]


def _te_installed() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


# ---- recipe translation ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("granularity", "pow2", "te_recipe", "cls", "kwargs", "env"),
    [
        ("block", False, "auto", "Float8BlockScaling", {"use_f32_scales": True}, {BLOCK_FP32_SCALES_ENV: "1"}),
        ("block", True, "auto", "Float8BlockScaling", {"use_f32_scales": False}, {BLOCK_FP32_SCALES_ENV: "0"}),
        (
            "tensor",
            False,
            "auto",
            "Float8CurrentScaling",
            {"use_power_2_scales": False},
            {CURRENT_POW2_SCALES_ENV: "0"},
        ),
        ("tensor", True, "auto", "Float8CurrentScaling", {"use_power_2_scales": True}, {CURRENT_POW2_SCALES_ENV: "1"}),
        ("tensor", False, "delayed", "DelayedScaling", {"reduce_amax": False}, {}),
    ],
)
def test_recipe_translation(granularity: str, pow2: bool, te_recipe: str, cls: str, kwargs: dict, env: dict) -> None:
    r = te_recipe_for(QuantSpec(granularity=granularity, pow2_scales=pow2), te_recipe)  # type: ignore[arg-type]
    assert r.cls == cls
    assert r.kwargs["fp8_format"] == "E4M3"  # gradients too, as fp8rl.quant
    assert kwargs.items() <= r.kwargs.items()
    assert r.env == env
    assert r.pow2_scales == (None if cls == "DelayedScaling" else pow2)
    if cls == "Float8BlockScaling":
        assert r.block == ((128, 128), 128)
        assert (
            r.kwargs["x_block_scaling_dim"],
            r.kwargs["w_block_scaling_dim"],
            r.kwargs["grad_block_scaling_dim"],
        ) == (1, 2, 1)
    else:
        assert r.block is None
    assert cls in r.describe()


@pytest.mark.parametrize(
    ("spec", "te_recipe", "message"),
    [
        (QuantSpec(granularity="row"), "auto", "no per-row FP8 recipe"),
        (QuantSpec(granularity="row"), "delayed", "no per-row FP8 recipe"),
        (QuantSpec(granularity="block"), "delayed", "needs quant.granularity 'tensor'"),
        (QuantSpec(granularity="tensor", pow2_scales=True), "delayed", "no power-of-two scale option"),
        (QuantSpec(weight_block=(64, 64)), "auto", "fixed at 128x128"),
        (QuantSpec(act_block=64), "auto", "fixed at 128x128"),
        (QuantSpec(weight_block=(1, 128)), "auto", "fixed at 128x128"),
        (QuantSpec(fmt="e5m2"), "auto", "E4M3"),
        (QuantSpec(), "mxfp8", "te_recipe must be"),
    ],
)
def test_recipe_translation_refuses_what_te_cannot_do(spec: QuantSpec, te_recipe: str, message: str) -> None:
    with pytest.raises(TERecipeError, match=message) as e:
        te_recipe_for(spec, te_recipe)
    assert isinstance(e.value, UserError)


def test_every_valid_te_recipe_translates() -> None:
    """Config validation and the translation agree: every recipe the config accepts with ``trainer: te`` builds."""
    accepted = 0
    for gran, pow2, te_recipe, block, act in itertools.product(
        ["block", "row", "tensor"], [False, True], ["auto", "delayed"], [(128, 128), (64, 64)], [128, 32]
    ):
        data = {
            "name": "x",
            "rollout_precision": "fp8",
            "train_precision": "fp8",
            "trainer": "te",
            "te_recipe": te_recipe,
            "quant": {"granularity": gran, "pow2_scales": pow2, "weight_block": list(block), "act_block": act},
        }
        try:
            recipe = parse_recipe(data)
        except ConfigError:
            continue
        te_recipe_for(recipe.quant.spec(), recipe.te_recipe)
        accepted += 1
    assert accepted >= 5  # block x pow2 with any tensor blocks, tensor x pow2, delayed


# ---- require_te: no silent fallback ------------------------------------------------------------------
@pytest.mark.skipif(_te_installed(), reason="TransformerEngine is installed here")
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_require_te_without_te_says_how_to_install(device: str) -> None:
    with pytest.raises(TENotInstalledError, match=r"needs transformer_engine: pip install 'fp8rl\[gpu\]'"):
        require_te(device, te_recipe_for(QuantSpec()))


def test_require_te_reports_a_broken_install_with_the_cudnn_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(name: str) -> Any:
        raise OSError("libcudnn_graph.so.9: undefined symbol: cudnnGetLibConfig")

    monkeypatch.setattr("fp8rl.train.te_recipes.importlib.import_module", broken)
    with pytest.raises(TENotInstalledError, match="failed to import.*undefined symbol.*LD_LIBRARY_PATH"):
        require_te("cuda", None)


def _fake_te(fp8: tuple[bool, str], block: tuple[bool, str]) -> types.ModuleType:
    te = types.ModuleType("transformer_engine.pytorch")
    te.is_fp8_available = lambda return_reason=False: fp8 if return_reason else fp8[0]  # type: ignore[attr-defined]
    te.is_fp8_block_scaling_available = lambda return_reason=False: block if return_reason else block[0]  # type: ignore[attr-defined]
    return te


@pytest.fixture
def fake_te_present(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Install a fake ``transformer_engine.pytorch`` reporting the given support, on a 'visible' GPU."""

    def install(fp8: tuple[bool, str] = (True, ""), block: tuple[bool, str] = (True, "")) -> types.ModuleType:
        te = _fake_te(fp8, block)
        pkg = types.ModuleType("transformer_engine")
        pkg.pytorch = te  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "transformer_engine", pkg)
        monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        return te

    return install


def test_require_te_refuses_a_gpu_without_fp8(fake_te_present: Any) -> None:
    reason = "Device compute capability 8.9 or higher required for FP8 execution."
    fake_te_present(fp8=(False, reason), block=(False, "FP8 block scaled GEMM requires compute capability 9.0"))
    with pytest.raises(TEFP8UnavailableError, match="Float8CurrentScaling.*8.9 or higher required"):
        require_te("cuda", te_recipe_for(QuantSpec(granularity="tensor")))
    with pytest.raises(TEFP8UnavailableError, match="Float8BlockScaling.*block scaled GEMM requires"):
        require_te("cuda:0", te_recipe_for(QuantSpec()))
    # te-BF16 needs no FP8
    assert require_te("cuda", None) is sys.modules["transformer_engine.pytorch"]


def test_require_te_refuses_block_scaling_where_only_per_tensor_fp8_runs(fake_te_present: Any) -> None:
    te = fake_te_present(fp8=(True, ""), block=(False, "FP8 block scaled GEMM requires CUDA >= 12.9."))
    with pytest.raises(TEFP8UnavailableError, match="CUDA >= 12.9"):
        require_te("cuda", te_recipe_for(QuantSpec()))
    assert require_te("cuda", te_recipe_for(QuantSpec(granularity="tensor"), "delayed")) is te


def test_require_te_refuses_a_cpu_device(fake_te_present: Any) -> None:
    fake_te_present()
    with pytest.raises(TEDeviceError, match="only on a CUDA GPU.*'cpu'"):
        require_te("cpu", te_recipe_for(QuantSpec()))


@pytest.mark.skipif(_te_installed(), reason="TransformerEngine is installed here")
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_build_trainer_with_te_on_cpu_fails_instead_of_falling_back(
    tiny_models: dict[str, Path], precision: str
) -> None:
    recipe = load_recipe("fp8-e2e").model_dump()
    recipe.update(trainer="te", train_precision=precision)
    cfg = parse_run_config({"recipe": parse_recipe(recipe), "steps": 1})
    with pytest.raises(TEUnavailableError, match="trainer 'te'"):
        build_trainer(cfg, tiny_models["tiny"], "cpu")


# ---- the module swap, with a stand-in for te.Linear ----------------------------------------------------
class _Autocast:
    active: ClassVar[list[Any]] = []

    def __init__(self, enabled: bool = True, recipe: Any = None) -> None:
        self.enabled, self.recipe = enabled, recipe

    def __enter__(self) -> _Autocast:
        _Autocast.active.append(self.recipe)
        return self

    def __exit__(self, *exc: object) -> None:
        _Autocast.active.pop()


class _FakeTELinear(nn.Linear):
    """``nn.Linear`` with te.Linear's constructor, its FP8 shape check and a TE-like ``_extra_state``."""

    calls: ClassVar[list[tuple[int, bool]]] = []

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, params_dtype: Any = None,
                 device: Any = None, init_method: Any = None, name: str | None = None) -> None:  # fmt: skip
        super().__init__(in_features, out_features, bias=bias, dtype=params_dtype, device=device)
        self.te_name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.numel() // x.shape[-1]
        fp8 = bool(_Autocast.active)
        if fp8 and (tokens % 8 or x.shape[-1] % 16):  # transformer_engine.pytorch.utils.assert_dim_for_fp8_exec
            raise ValueError(f"FP8 execution requires ... got {list(x.shape)}")
        _FakeTELinear.calls.append((tokens, fp8))
        return super().forward(x)

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state: Any) -> None:
        pass


@pytest.fixture
def fake_te_trainer(monkeypatch: pytest.MonkeyPatch) -> Any:
    te = types.SimpleNamespace(Linear=_FakeTELinear, autocast=_Autocast)
    monkeypatch.setattr(te_trainer, "require_te", lambda device, recipe: te)
    monkeypatch.setattr(te_trainer, "build_te_recipe", lambda desc: ("recipe", desc.cls))
    monkeypatch.setattr(te_trainer, "apply_te_env", lambda desc: None)
    _FakeTELinear.calls.clear()
    return te


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_te_swap_keeps_hf_names_and_order(tiny_models: dict[str, Path], fake_te_trainer: Any, precision: str) -> None:
    opts = TrainerOptions(
        precision=precision, backend="te", bf16_first_layers=1, optim=OptimConfig(lr=2e-5, warmup_steps=0)
    )
    te = te_trainer.TETrainer(tiny_models["tiny"], opts, device="cpu")
    ref = TorchTrainer(
        tiny_models["tiny"],
        TrainerOptions(precision=precision, bf16_first_layers=1, optim=OptimConfig(lr=2e-5, warmup_steps=0)),
    )
    assert list(te.hf_state_dict()) == list(ref.hf_state_dict())
    for name, value in ref.hf_state_dict().items():
        assert torch.equal(te.hf_state_dict()[name], value), name
    assert [m.shape for m in te.optimizer.master] == [m.shape for m in ref.optimizer.master]
    swapped = {n for n, m in te.model.named_modules() if isinstance(m, _FakeTELinear)}
    assert swapped == set(te.te_modules)
    assert all(m.te_name == n for n, m in te.model.named_modules() if isinstance(m, _FakeTELinear))
    # bf16: every decoder linear runs in TE (te-BF16); fp8: layer 0 (a BF16 layer) stays torch
    assert len(swapped) == (14 if precision == "bf16" else 7)
    assert te.fp8_modules == ([] if precision == "bf16" else sorted(swapped, key=te.te_modules.index))
    assert isinstance(te.model.get_submodule("model.layers.0.mlp.down_proj"), _FakeTELinear) == (precision == "bf16")
    assert type(te.model.get_submodule("lm_head")) is nn.Linear
    # resumable state crosses backends: masters line up one to one
    te.load_state_dict(ref.state_dict())


def test_fp8_forwards_pad_to_te_alignment_without_changing_logprobs(
    tiny_models: dict[str, Path], fake_te_trainer: Any
) -> None:
    """The stand-in is a plain linear, so the padded FP8 path must give the unpadded logprobs: in float32
    (cast after construction) to summation order, which in bf16 alone moves them by ~2e-3."""
    te = te_trainer.TETrainer(
        tiny_models["tiny"],
        TrainerOptions(precision="fp8", backend="te", optim=OptimConfig(lr=2e-5, warmup_steps=0)),
        device="cpu",
    )
    ref = TorchTrainer(
        tiny_models["tiny"], TrainerOptions(precision="bf16", optim=OptimConfig(lr=2e-5, warmup_steps=0))
    )
    te.model.float()
    ref.model.float()
    response = torch.tensor([[10, 11, 12, 2], [13, 14, 2, 0], [15, 16, 17, 18]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float32)
    batch = build_batch(PROMPTS, response, mask, 0)
    assert batch.input_ids.shape[1] % te_trainer.TOKEN_ALIGN  # the test needs a misaligned width
    lp = te.compute_logprobs(batch, 1.0)
    assert _FakeTELinear.calls and all(fp8 and tokens % 8 == 0 for tokens, fp8 in _FakeTELinear.calls)
    assert lp.shape == mask.shape
    torch.testing.assert_close(lp, ref.compute_logprobs(batch, 1.0), rtol=0, atol=1e-5)
    # the update runs through the same padded path, and every FP8 layer's weight moves
    before = {k: v.clone() for k, v in te.hf_state_dict().items()}
    m = te.policy_step(
        PolicyStep(batch, torch.tensor([1.0, -1.0, 0.5]), RecomputedOld(lp, None, mask), GRPOConfig(), 1.0)
    )
    assert torch.isfinite(torch.tensor(m["loss"]))
    after = te.hf_state_dict()
    assert all(not torch.equal(before[n + ".weight"], after[n + ".weight"]) for n in te.fp8_modules)


def test_bf16_forwards_skip_autocast_and_padding(tiny_models: dict[str, Path], fake_te_trainer: Any) -> None:
    te = te_trainer.TETrainer(
        tiny_models["tiny"],
        TrainerOptions(precision="bf16", backend="te", optim=OptimConfig(lr=2e-5, warmup_steps=0)),
        device="cpu",
    )
    batch = build_batch(PROMPTS, torch.tensor([[10], [11], [12]]), torch.ones(3, 1), 0)
    te.compute_logprobs(batch, 1.0)
    assert _FakeTELinear.calls and not any(fp8 for _, fp8 in _FakeTELinear.calls)
    assert {tokens for tokens, _ in _FakeTELinear.calls} == {batch.input_ids.numel()}


def test_te_checkpoint_has_hf_names_only(tiny_models: dict[str, Path], fake_te_trainer: Any, tmp_path: Path) -> None:
    te = te_trainer.TETrainer(
        tiny_models["tiny"],
        TrainerOptions(precision="fp8", backend="te", optim=OptimConfig(lr=2e-5, warmup_steps=0)),
        device="cpu",
    )
    assert any(k.endswith("._extra_state") for k in te.model.state_dict())  # what TE modules add
    te.save(tmp_path / "ckpt")
    back = load_causal_lm(tmp_path / "ckpt", dtype=torch.bfloat16)
    assert set(back.state_dict()) == {k for k in te.model.state_dict() if not k.endswith("._extra_state")}
    for name, p in back.named_parameters():
        assert torch.equal(p, te.hf_state_dict()[name]), name


def test_te_refuses_fp8_layers_te_cannot_multiply(monkeypatch: pytest.MonkeyPatch, fake_te_trainer: Any) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=72, intermediate_size=136, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, pad_token_id=0)  # fmt: skip
    model = LlamaForCausalLM(cfg)
    with pytest.raises(TERecipeError, match=r"q_proj: \[72, 72\].*divisible by 16"):
        te_trainer.TETrainer(
            model,
            TrainerOptions(precision="fp8", backend="te", optim=OptimConfig(lr=2e-5, warmup_steps=0)),
            device="cpu",
        )


# ---- building the TE recipe object, against a stand-in of transformer_engine.common.recipe ----------------
def test_build_te_recipe_sets_the_qparams_te_fixed_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    @dataclass(frozen=True)
    class QParams:
        power_2_scale: bool = False
        amax_epsilon: float = 0.0

    @dataclass
    class Float8BlockScaling:
        fp8_format: Any = None
        use_f32_scales: bool = False
        x_block_scaling_dim: int = 1
        w_block_scaling_dim: int = 2
        grad_block_scaling_dim: int = 1
        # what TE 2.20 does: a class attribute computed once from the environment at import
        fp8_quant_fwd_inp = QParams(power_2_scale=True)
        fp8_quant_fwd_weight = QParams(power_2_scale=True)
        fp8_quant_bwd_grad = QParams(power_2_scale=True)

    mod = types.ModuleType("transformer_engine.common.recipe")
    mod.Format = enum.Enum("Format", ["E4M3", "HYBRID"])  # type: ignore[attr-defined]
    mod.QParams = QParams  # type: ignore[attr-defined]
    mod.Float8BlockScaling = Float8BlockScaling  # type: ignore[attr-defined]
    common = types.ModuleType("transformer_engine.common")
    common.recipe = mod  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    monkeypatch.setitem(sys.modules, "transformer_engine.common", common)
    monkeypatch.setitem(sys.modules, "transformer_engine.common.recipe", mod)

    r = te_trainer.build_te_recipe(te_recipe_for(QuantSpec(pow2_scales=False)))
    assert r.fp8_format is mod.Format.E4M3 and r.use_f32_scales
    assert all(getattr(r, a) == QParams(power_2_scale=False) for a in te_trainer.QPARAM_ATTRS)
    assert Float8BlockScaling.fp8_quant_fwd_inp.power_2_scale  # the class default is untouched


# ---- the consistency helpers ---------------------------------------------------------------------------
class _TELayoutQuantizer:
    """Produces fp8rl.quant's result in TE's storage layout (uint8 bytes, padded / transposed FP32 scales),
    as transformer_engine/pytorch/tensor/float8_blockwise_tensor.py ``get_scale_shape`` describes it."""

    def __init__(self, block_scaling_dim: int) -> None:
        self.block_scaling_dim = block_scaling_dim
        self.columnwise = True

    def copy(self) -> _TELayoutQuantizer:
        return _TELayoutQuantizer(self.block_scaling_dim)

    def set_usage(self, *, rowwise: bool | None = None, columnwise: bool | None = None) -> None:
        assert rowwise is True
        self.columnwise = bool(columnwise)

    def __call__(self, x: torch.Tensor) -> Any:
        m = x.shape[0]
        spec = QuantSpec()
        if self.block_scaling_dim == 2:
            q = quantize_weight(x, spec)
            pad = (-q.scale_inv.shape[1]) % 4
            scale = torch.nn.functional.pad(q.scale_inv, (0, pad), value=-1.0)
        else:
            q = quantize_activation(x, spec)
            scale = torch.nn.functional.pad(q.scale_inv.t(), (0, (-m) % 4), value=-1.0)
        return types.SimpleNamespace(_rowwise_data=q.data.view(torch.uint8), _rowwise_scale_inv=scale)


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("shape", [(256, 384), (130, 300), (7, 128)])
def test_te_layout_maps_back_to_fp8rl_layout(dim: int, shape: tuple[int, int]) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    got = te_trainer.te_quantize_as_fp8rl(_TELayoutQuantizer(dim), x)
    want = (quantize_weight if dim == 2 else quantize_activation)(x, QuantSpec())
    assert got.block == want.block and got.scale_inv.shape == want.scale_inv.shape
    agree = te_trainer.quantization_agreement(want, got)
    assert agree["bytes_exact_fraction"] == 1.0 and agree["scale_max_rel_diff"] == 0.0


def test_quantization_agreement_counts_bytes_and_skips_zero_groups() -> None:
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    x[0, :128] = 0
    a = quantize_activation(x, QuantSpec())
    agree = te_trainer.quantization_agreement(a, a)
    assert agree == {**agree, "bytes_exact_fraction": 1.0, "scale_max_abs_diff": 0.0, "zero_groups": 1.0}
    b = quantize_activation(x, QuantSpec(pow2_scales=True))
    other = te_trainer.quantization_agreement(a, b)
    assert other["bytes_exact_fraction"] < 1.0 and 0 < other["scale_max_rel_diff"] < 1.0
    assert other["max_fp8_steps_apart"] >= 1
    neg = (a.data.view(torch.uint8) ^ 0x80).view(torch.float8_e4m3fn)  # same magnitudes, other sign
    flipped = QuantizedTensor(neg, a.scale_inv, a.granularity, a.fmt, a.block)
    signs = te_trainer.quantization_agreement(a, flipped)
    assert signs["bytes_mismatched"] == a.data.numel()  # +0 and -0 differ in bytes too
    assert signs["max_fp8_steps_apart"] == 2 * int((a.data.view(torch.uint8) & 0x7F).max())
