"""fp8rl: end-to-end FP8 reinforcement learning for LLMs (library layer; knows nothing of KFP or Kubernetes)."""

__version__ = "0.1.0"
