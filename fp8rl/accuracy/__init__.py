"""The accuracy study: does an FP8 recipe train a model as well as BF16?  Recipes x seeds, held-out accuracy.

``study`` runs it (every recipe and seed as its own ``fp8rl train`` process under one MLflow comparison run,
resumable, with its disk check), ``report`` reads the runs back and checks the published claims, ``cli`` is
``fp8rl accuracy``.  Importing the package imports neither torch nor MLflow.
"""

from fp8rl.accuracy.study import (
    CHECKPOINT_BYTES_PER_PARAMETER,
    disk_needed,
    model_parameters,
    run_study,
    study_dir,
)

__all__ = ["CHECKPOINT_BYTES_PER_PARAMETER", "disk_needed", "model_parameters", "run_study", "study_dir"]
