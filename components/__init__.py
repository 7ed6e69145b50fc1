"""KFP v2 components: one file per pipeline stage, each a thin wrapper that calls into ``fp8rl``.

Every component is a lightweight Python component (``@dsl.component``), so the same definition
runs on Kubeflow Pipelines (in the project's images, ``components.images``) and under
``kfp.local.SubprocessRunner`` (in the current environment). Component bodies import what they
use inside the function (KFP ships only the function's source); what several bodies share lives
in ``components.runtime``, imported from the installed ``components`` package. Kubernetes
settings (GPUs, tolerations, volumes, Secrets) are not here: the pipelines add them per task
with ``kfp.kubernetes``, and kfp.local ignores them.
"""
