"""How many linears a run holds in FP8, checked before its first step.

An FP8 recipe whose rollout engine or trainer ends up holding no FP8 linear (every width a partial tile, every
layer kept in BF16) would run, log and be compared as FP8 while computing in BF16: it is refused here, with the
count of each side, and the counts are logged with the run (``fp8_linears_engine``, ``fp8_linears_trainer``).
"""

from __future__ import annotations

from fp8rl.config import Recipe
from fp8rl.errors import UserError

# what makes the linears of a model with partial 128x128 tiles FP8 (block scaling refuses partial tiles in vLLM)
FIX_HINT = (
    "per-channel scaling quantizes any width: recipe.quant.granularity 'row' (fp8-e2e) or rollout.fp8_scaling "
    "'channel' (the engine); or keep fewer layers in BF16 (recipe.quant.bf16_first_layers / bf16_last_layers, optim.fp8_min_gemm_gflop)"
)


def fp8_linear_counts(recipe: Recipe, engine_fp8: int, trainer_fp8: int) -> dict[str, int]:
    """``{"fp8_linears_engine": n, "fp8_linears_trainer": m}``; a :class:`UserError` when a side the recipe puts in
    FP8 holds none (``recipe.rollout_precision`` / ``recipe.train_precision``)."""
    empty = []
    if recipe.rollout_precision == "fp8" and engine_fp8 == 0:
        empty.append("the rollout engine holds no FP8 linear (rollout_precision 'fp8')")
    if recipe.train_precision == "fp8" and trainer_fp8 == 0:
        empty.append("the trainer holds no FP8 linear (train_precision 'fp8')")
    if empty:
        raise UserError(f"recipe {recipe.name!r}: " + "; ".join(empty) + f". Nothing would run in FP8: {FIX_HINT}")
    return {"fp8_linears_engine": engine_fp8, "fp8_linears_trainer": trainer_fp8}
