"""fp8rl recipes -> TransformerEngine FP8 recipes, and the checks that TE can run here.  Imports no TE.

Translation (``te_recipe_for``), for ``QuantSpec`` (granularity, fmt, blocks, pow2) and the
recipe's ``te_recipe``:

| granularity | te_recipe | TE recipe (``transformer_engine.common.recipe``)                  |
|-------------|-----------|-------------------------------------------------------------------|
| block       | auto      | ``Float8BlockScaling``: 1x128 activations and gradients, 128x128 weights |
| tensor      | auto      | ``Float8CurrentScaling``: one scale per tensor, from its own amax  |
| tensor      | delayed   | ``DelayedScaling``: one scale per tensor, from an amax history     |
| row         | any       | error: no per-row FP8 recipe in TE on Hopper (MXFP8 is Blackwell)  |

Every recipe uses E4M3 for activations, weights and gradients (``fp8_format=E4M3``), as
``fp8rl.quant`` does; TE's own default for the per-tensor recipes is HYBRID (E5M2 gradients).

Scales.  TE computes a scale per group as ``scale = 448 / amax`` (fp32, round to nearest),
stores ``scale_inv = 1 / scale`` and quantizes ``fp8(x * scale)``; with power-of-two scales
it truncates ``scale``'s mantissa, so ``scale_inv`` is rounded *up* to a power of two.
``fp8rl.quant`` computes ``scale_inv = max(amax, 1e-10) / 448`` and ``fp8(x * (1 / scale_inv))``,
pow2 rounding ``scale_inv`` up on its bit pattern.  The pow2 scales agree exactly; the
FP32 scales agree to about one float32 ulp, and a value can land on the other side of an
FP8 rounding boundary only within that ulp.  An all-zero group gets ``scale_inv = 1`` in TE
(``amax_epsilon = 0``) and ``1e-10 / 448`` here; both hold zero bytes.

Power-of-two option.  TE 2.20 reads it in two places: the recipe's fields
(``Float8BlockScaling.use_f32_scales``, ``Float8CurrentScaling.use_power_2_scales``) and
the class attributes ``fp8_quant_fwd_inp`` / ``fp8_quant_fwd_weight`` / ``fp8_quant_bwd_grad``
(``QParams(power_2_scale=...)``), which the quantizers actually use.  The latter are fixed
when TE is *imported*, from ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES`` (block; default pow2)
and ``NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES`` (current scaling; default not pow2).  So a
``TERecipe`` names both: the environment to set before TE is imported, and the ``QParams``
the trainer sets on the recipe instance, which settle the numerics whatever the
environment was (``fp8rl.train.te_trainer.build_te_recipe``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from fp8rl.errors import UserError
from fp8rl.quant import QuantSpec

TE_BLOCK = 128  # Float8BlockScaling's fixed block length (Float8BlockQuantizer.block_len)
BLOCK_FP32_SCALES_ENV = "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"
CURRENT_POW2_SCALES_ENV = "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES"
INSTALL_HINT = "pip install 'fp8rl[gpu]'"
CUDNN_HINT = (
    "if the error names cuDNN or an undefined symbol, put torch's cuDNN first: "
    "export CUDNN_HOME=$SITE/nvidia/cudnn LD_LIBRARY_PATH=$SITE/nvidia/cudnn/lib:$LD_LIBRARY_PATH "
    "(SITE: the site-packages holding torch), before Python starts (docs/te.md)"
)


class TERecipeError(UserError, ValueError):
    """The recipe's quantization has no TransformerEngine equivalent."""


class TEUnavailableError(UserError, RuntimeError):
    """A recipe asks for trainer 'te' where TransformerEngine cannot run it; nothing falls back."""


class TENotInstalledError(TEUnavailableError):
    """transformer_engine is not importable."""


class TEDeviceError(TEUnavailableError):
    """The trainer's device is not a CUDA GPU."""


class TEFP8UnavailableError(TEUnavailableError):
    """The GPU (or CUDA) cannot run the FP8 recipe: TE's own reason is in the message."""


@dataclass(frozen=True)
class TERecipe:
    """A TE recipe, described without TE: built by ``fp8rl.train.te_trainer.build_te_recipe``.

    ``cls``: class name in ``transformer_engine.common.recipe``; ``kwargs``: constructor
    fields, with ``fp8_format`` as the name of a ``Format`` member; ``pow2_scales``: the
    ``power_2_scale`` of the three ``QParams`` attributes (None: the recipe has none, as
    ``DelayedScaling``); ``env``: variables to set before TE is imported so that TE's class
    defaults agree; ``block``: (weight tile, activation group) or None for per-tensor scaling.
    """

    cls: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    pow2_scales: bool | None = None
    env: dict[str, str] = field(default_factory=dict)
    block: tuple[tuple[int, int], int] | None = None

    def describe(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.kwargs.items())
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        return (
            f"{self.cls}({args})"
            + (f" pow2={self.pow2_scales}" if self.pow2_scales is not None else "")
            + (f" env[{env}]" if env else "")
        )


def te_recipe_for(spec: QuantSpec, te_recipe: str = "auto") -> TERecipe:
    """The TE recipe that quantizes like ``spec`` (module docstring table); ``TERecipeError`` if none does."""
    if te_recipe not in ("auto", "delayed"):
        raise TERecipeError(f"te_recipe must be 'auto' or 'delayed', got {te_recipe!r}")
    if spec.fmt != "e4m3":
        raise TERecipeError(
            f"quant.fmt {spec.fmt!r}: trainer 'te' trains in E4M3 (TE refuses pure E5M2 training); use fmt 'e4m3'"
        )
    if spec.granularity == "row":
        raise TERecipeError(
            "quant.granularity 'row': trainer 'te' has no per-row FP8 recipe on Hopper (MXFP8 needs Blackwell); "
            "use granularity 'block' or 'tensor', or trainer 'torch'"
        )
    if te_recipe == "delayed":
        return _delayed_scaling(spec)
    if spec.granularity == "tensor":
        pow2 = spec.pow2_scales
        return TERecipe(
            "Float8CurrentScaling",
            {**_E4M3, "use_power_2_scales": pow2},
            pow2_scales=pow2,
            env={CURRENT_POW2_SCALES_ENV: "1" if pow2 else "0"},
        )
    return _block_scaling(spec)


_E4M3 = {"fp8_format": "E4M3"}


def _delayed_scaling(spec: QuantSpec) -> TERecipe:
    """``DelayedScaling``: per-tensor scales from an amax history (plain scales only)."""
    if spec.granularity != "tensor":
        raise TERecipeError(
            f"te_recipe 'delayed' is per-tensor scaling: it needs quant.granularity 'tensor', got {spec.granularity!r}"
        )
    if spec.pow2_scales:
        raise TERecipeError(
            "te_recipe 'delayed' has no power-of-two scale option; use te_recipe 'auto' "
            "(Float8CurrentScaling) or quant.pow2_scales false"
        )
    # reduce_amax False: no amax all-reduce across data-parallel ranks at autocast exit (the
    # trainer's ranks synchronise only through their gradient reducer); each keeps its history
    return TERecipe(
        "DelayedScaling", {**_E4M3, "amax_history_len": 1024, "amax_compute_algo": "max", "reduce_amax": False}
    )


def _block_scaling(spec: QuantSpec) -> TERecipe:
    """``Float8BlockScaling``: 128x128 weight tiles and 1x128 activation and gradient groups, TE's only layout."""
    if tuple(spec.weight_block) != (TE_BLOCK, TE_BLOCK) or spec.act_block != TE_BLOCK:
        raise TERecipeError(
            "trainer 'te' block scaling is fixed at 128x128 weight tiles and 1x128 activation groups; "
            f"got quant.weight_block {list(spec.weight_block)}, quant.act_block {spec.act_block}"
        )
    pow2 = spec.pow2_scales
    return TERecipe(
        "Float8BlockScaling",
        {
            **_E4M3,
            "use_f32_scales": not pow2,
            "x_block_scaling_dim": 1,
            "w_block_scaling_dim": 2,
            "grad_block_scaling_dim": 1,
        },
        pow2_scales=pow2,
        env={BLOCK_FP32_SCALES_ENV: "0" if pow2 else "1"},
        block=((TE_BLOCK, TE_BLOCK), TE_BLOCK),
    )


def require_te(device: str, recipe: TERecipe | None) -> Any:
    """``transformer_engine.pytorch``, once TE imports, ``device`` is a CUDA GPU and it can run ``recipe``.

    ``recipe`` None is te-BF16 (no FP8 needed).  Raises a ``TEUnavailableError`` subclass
    whose message says what is missing; there is no fallback to another backend.
    """
    try:
        te = importlib.import_module("transformer_engine.pytorch")
    except ImportError as e:
        if getattr(e, "name", None) in ("transformer_engine", "transformer_engine.pytorch"):
            raise TENotInstalledError(f"recipe trainer 'te' needs transformer_engine: {INSTALL_HINT}") from None
        raise TENotInstalledError(
            f"recipe trainer 'te': transformer_engine is installed but failed to import ({e}); {CUDNN_HINT}"
        ) from e
    except Exception as e:  # TE's import also loads CUDA libraries: OSError, RuntimeError, AssertionError
        raise TENotInstalledError(
            f"recipe trainer 'te': transformer_engine failed to import ({type(e).__name__}: {e}); {CUDNN_HINT}"
        ) from e
    import torch

    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        where = "no CUDA GPU is visible" if not torch.cuda.is_available() else f"the device is {device!r}"
        raise TEDeviceError(
            f"recipe trainer 'te' runs only on a CUDA GPU, but {where}; use trainer 'torch' (FP8 emulated "
            "exactly on CPU) or run on a GPU"
        )
    if recipe is None:
        return te
    if recipe.cls == "Float8BlockScaling":
        ok, reason = te.is_fp8_block_scaling_available(return_reason=True)
        what = "FP8 block scaling (Float8BlockScaling, needs compute capability 9.0+ and CUDA 12.9+)"
    else:
        ok, reason = te.is_fp8_available(return_reason=True)
        what = f"FP8 ({recipe.cls}, needs compute capability 8.9+)"
    if not ok:
        raise TEFP8UnavailableError(
            f"recipe trainer 'te' with {recipe.cls}: TransformerEngine reports {what} unavailable on "
            f"{device!r}: {reason or 'no reason given'}; use train_precision 'bf16' or trainer 'torch'"
        )
    return te
