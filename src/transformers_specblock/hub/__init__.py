"""Packaged models and prompt sets (offline assets), model loading by name / folder / Hub id on a device and dtype,
the shipped drafters and generated Hub model cards."""

from .assets import load_packaged_model
from .loading import load_model
from .modelcard import build_model_card
from .prompts import load_prompts
from .shipped import SHIPPED_DRAFTERS, resolve_drafter_path, shipped_drafter_path

__all__ = [
    "SHIPPED_DRAFTERS",
    "build_model_card",
    "load_model",
    "load_packaged_model",
    "load_prompts",
    "resolve_drafter_path",
    "shipped_drafter_path",
]
