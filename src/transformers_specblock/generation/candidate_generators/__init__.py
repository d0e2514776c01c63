"""Candidate generators of the tree drafters, found by the drafter config's `model_type` (as transformers maps
configs to model classes), so the models never import decoding code."""

from __future__ import annotations

from typing import Any

from ...models.tree_drafter.modeling_tree_drafter import TreeDraftModel
from .base import DraftingStats, TreeCandidateGenerator
from .dflash import DFlashCandidateGenerator
from .eagle3 import Eagle3CandidateGenerator
from .lookup_tree import LookupTreeCandidateGenerator
from .specblock import SpecBlockCandidateGenerator

CANDIDATE_GENERATOR_MAPPING: dict[str, type[TreeCandidateGenerator]] = {
    "specblock": SpecBlockCandidateGenerator,
    "eagle3_drafter": Eagle3CandidateGenerator,
    "lookup_tree": LookupTreeCandidateGenerator,
    "dflash_drafter": DFlashCandidateGenerator,
}


def get_candidate_generator(drafter: TreeDraftModel, **overrides: Any) -> TreeCandidateGenerator:
    """A fresh candidate generator (with its own drafter KV cache) for one `generate` call; `overrides` are the
    generator's settings (tree_budget, max_blocks, top_k, ...)."""
    model_type = drafter.config.model_type
    if model_type not in CANDIDATE_GENERATOR_MAPPING:
        raise ValueError(
            f"No candidate generator is registered for drafters of model_type '{model_type}'; known: "
            f"{sorted(CANDIDATE_GENERATOR_MAPPING)}. Add one to `CANDIDATE_GENERATOR_MAPPING`."
        )
    return CANDIDATE_GENERATOR_MAPPING[model_type](drafter, **overrides)


__all__ = [
    "CANDIDATE_GENERATOR_MAPPING",
    "DFlashCandidateGenerator",
    "DraftingStats",
    "Eagle3CandidateGenerator",
    "LookupTreeCandidateGenerator",
    "SpecBlockCandidateGenerator",
    "TreeCandidateGenerator",
    "get_candidate_generator",
]
