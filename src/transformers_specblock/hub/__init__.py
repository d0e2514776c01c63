"""Packaged models and prompt sets (offline assets) and generated Hub model cards."""

from .assets import load_packaged_model, load_prompts
from .modelcard import build_model_card

__all__ = ["build_model_card", "load_packaged_model", "load_prompts"]
