"""Packaged models and prompt sets (offline assets), the shipped drafters and generated Hub model cards."""

from .assets import load_packaged_model, load_prompts
from .modelcard import build_model_card
from .shipped import SHIPPED_DRAFTERS, resolve_drafter_path, shipped_drafter_path

__all__ = [
    "SHIPPED_DRAFTERS",
    "build_model_card",
    "load_packaged_model",
    "load_prompts",
    "resolve_drafter_path",
    "shipped_drafter_path",
]
