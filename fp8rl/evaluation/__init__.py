"""Held-out evaluation: ``heldout`` (a rollout engine's greedy accuracy and response statistics on held-out
examples, used by the RL loop and the SFT warm-ups) and ``checkpoint`` (a saved checkpoint evaluated as a recipe's
rollout engine serves it: the pipelines' evaluation stage, ``evaluate_checkpoint``).  ``checkpoint`` builds an
engine and uses the loop, which uses ``heldout``: import it from its module."""

from fp8rl.evaluation.heldout import decode_responses, evaluate

__all__ = ["decode_responses", "evaluate"]
