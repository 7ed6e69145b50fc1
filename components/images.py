"""The images the components run in on Kubeflow Pipelines (built from ``images/``, see images/README.md).

Unqualified names at the project's version; ``python -m pipelines.compile --registry R`` puts
``R/`` in front in the compiled IR. kfp.local's SubprocessRunner ignores images.
"""

from fp8rl import __version__

# CPU steps (model preparation, conversion, RayJob submission, reports): the light image.
COMPONENT_IMAGE = f"fp8rl-component:{__version__}"
# GPU steps (evaluation, throughput benchmark): the runtime image with CUDA torch, vLLM and TransformerEngine.
RUNTIME_IMAGE = f"fp8rl-runtime:{__version__}"
IMAGES = (COMPONENT_IMAGE, RUNTIME_IMAGE)
