"""Reference PyTorch models: one readable file per model, one shared attention, one registry."""

from .registry import MODELS, build, describe, get_config, get_family, param_count

__all__ = ["MODELS", "build", "describe", "get_config", "get_family", "param_count"]
