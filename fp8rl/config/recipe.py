"""Precision recipes: what is FP8 where, how it is scaled, how the mismatch is corrected; the built-in ones."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, model_validator

from fp8rl.config.base import ConfigError, Strict, read_yaml, validated

if TYPE_CHECKING:
    from fp8rl.quant import QuantSpec

RECIPE_DIR = Path(__file__).parent.parent / "recipes"
# the three recipes every comparison is made along (DESIGN: the axis); the pipelines' default
CORE_RECIPES = ("bf16", "fp8-rollout", "fp8-e2e")
# every recipe loadable by name: one per fp8rl/recipes/*.yaml (the file's stem), the core three first, then the rest
# in name order; a YAML file added there is a built-in recipe, nothing else lists them
BUILTIN_RECIPES = (*CORE_RECIPES, *sorted({p.stem for p in RECIPE_DIR.glob("*.yaml")} - set(CORE_RECIPES)))


class QuantConfig(Strict):
    """How FP8 is applied (shared by rollout and, for fp8-e2e, training)."""

    granularity: Literal["block", "row", "tensor"] = "block"
    fmt: Literal["e4m3"] = "e4m3"
    weight_block: tuple[int, int] = (128, 128)
    act_block: int = Field(128, ge=1)
    pow2_scales: bool = False
    bf16_first_layers: int = Field(0, ge=0)
    bf16_last_layers: int = Field(0, ge=0)

    @property
    def fixed_128_blocks(self) -> bool:
        """128x128 weight tiles and 1x128 activation groups: the one block layout TE and vLLM run."""
        return tuple(self.weight_block) == (128, 128) and self.act_block == 128

    def spec(self) -> QuantSpec:
        """These settings as the ``fp8rl.quant.QuantSpec`` the quantizers take (imports torch when called)."""
        from fp8rl.quant import QuantSpec

        return QuantSpec(
            granularity=self.granularity,
            fmt=self.fmt,
            weight_block=self.weight_block,
            act_block=self.act_block,
            pow2_scales=self.pow2_scales,
        )


class NoCorrection(Strict):
    """No mismatch correction: every token weighs 1 (``fp8rl.rl.mismatch_correction``)."""

    type: Literal["none"] = "none"


class TISCorrection(Strict):
    """Truncated importance sampling: w = min(rho, threshold), rho = exp(lp_train - lp_rollout).

    level:     "token" uses rho_t; "sequence" uses prod_t rho_t for every token of the sequence.
    threshold: C, the cap on the weight (Yao et al. use single-digit caps; 2 keeps the variance
               low while leaving room above 1).
    """

    type: Literal["tis"] = "tis"
    level: Literal["token", "sequence"] = "token"
    threshold: float = Field(2.0, gt=1.0)


class MISCorrection(Strict):
    """Masked importance sampling: drop tokens (or sequences) whose ratio leaves [low, high].

    level:     as TIS.
    low, high: the window of ratios kept; it contains 1, so an on-policy token is never dropped.
               0.5 and 2.0 make it symmetric in log space, |log rho| <= log 2.
    """

    type: Literal["mis"] = "mis"
    level: Literal["token", "sequence"] = "token"
    low: float = Field(0.5, gt=0.0, lt=1.0)
    high: float = Field(2.0, gt=1.0)


Correction = Annotated[NoCorrection | TISCorrection | MISCorrection, Field(discriminator="type")]


class Recipe(Strict):
    """A precision recipe: what is FP8 where, how it is scaled, and how mismatch is corrected."""

    name: str
    # what the recipe is for and what it was measured to cost or gain (``fp8rl recipes`` prints it)
    description: str = ""
    rollout_precision: Literal["bf16", "fp8"]
    train_precision: Literal["bf16", "fp8"]
    quant: QuantConfig = QuantConfig()
    correction: Correction = NoCorrection()
    # training backend: torch (fp8rl's own FP8 linear, portable, exact on CPU) or te (TransformerEngine, GPU)
    trainer: Literal["torch", "te"] = "torch"
    # te only: auto maps granularity block -> Float8BlockScaling, tensor -> Float8CurrentScaling;
    # delayed -> DelayedScaling (per tensor, amax history), for granularity tensor
    te_recipe: Literal["auto", "delayed"] = "auto"
    # KV cache of the rollout engine (vllm only): the model dtype, or FP8 with scales recalibrated every step
    kv_cache: Literal["bf16", "fp8"] = "bf16"

    @model_validator(mode="after")
    def _consistent(self) -> Recipe:
        if self.train_precision == "fp8" and self.rollout_precision != "fp8":
            raise ValueError("train_precision 'fp8' requires rollout_precision 'fp8' (end-to-end FP8)")
        q = self.quant
        if self.trainer == "te" and self.train_precision == "fp8":
            if q.granularity == "row":
                raise ValueError(
                    "trainer 'te' has no per-row FP8 recipe on Hopper (MXFP8 needs Blackwell); "
                    "use quant.granularity 'block' or 'tensor', or trainer 'torch'"
                )
            if q.granularity == "block" and not q.fixed_128_blocks:
                raise ValueError(
                    "trainer 'te' block scaling is fixed at 128x128 weight tiles and 1x128 activation groups; "
                    f"got quant.weight_block {list(q.weight_block)}, quant.act_block {q.act_block}"
                )
        if self.te_recipe == "delayed" and (self.trainer != "te" or q.granularity != "tensor"):
            raise ValueError("te_recipe 'delayed' needs trainer 'te' and quant.granularity 'tensor'")
        if self.te_recipe == "delayed" and q.pow2_scales:
            raise ValueError(
                "te_recipe 'delayed' (DelayedScaling) has no power-of-two scale option: set quant.pow2_scales "
                "false, or te_recipe 'auto' (Float8CurrentScaling) for power-of-two per-tensor scales"
            )
        return self


def vllm_recipe_problem(recipe: Recipe) -> str | None:
    """Why vLLM cannot serve ``recipe``, or None: it serves bf16, and FP8 as 128x128 / 1x128 block scaling or
    per-channel (``row``) weight scales with per-token activation scales (compressed-tensors W8A8)."""
    if recipe.rollout_precision != "fp8":
        return None
    q = recipe.quant
    if q.granularity == "row":
        return None
    if q.granularity != "block":
        return (
            f"rollout.engine 'vllm' serves FP8 as block or per-channel scaling; recipe {recipe.name!r} has "
            f"recipe.quant.granularity {q.granularity!r} (use 'block' or 'row', rollout.fp8_scaling 'channel', "
            "or rollout.engine 'torch')"
        )
    if not q.fixed_128_blocks:
        return (
            "rollout.engine 'vllm' runs block FP8 with 128x128 weight tiles and 1x128 activation groups; "
            f"recipe.quant.weight_block is {list(q.weight_block)}, recipe.quant.act_block {q.act_block}"
        )
    return None


def parse_recipe(data: Any, source: str = "recipe") -> Recipe:
    return validated(Recipe, data, source)


def load_recipe(name_or_path: str) -> Recipe:
    """A built-in recipe by name (``BUILTIN_RECIPES``) or a YAML file."""
    path = RECIPE_DIR / f"{name_or_path}.yaml" if name_or_path in BUILTIN_RECIPES else Path(name_or_path)
    if not path.is_file():
        raise ConfigError(f"recipe {name_or_path!r}: not a built-in recipe {list(BUILTIN_RECIPES)} nor a file")
    return parse_recipe(read_yaml(path), str(path))
