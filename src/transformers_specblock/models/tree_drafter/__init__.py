from .configuration_tree_drafter import TreeDrafterConfig
from .generation_config import (
    AUTO,
    DFlashGenerationConfig,
    Eagle3GenerationConfig,
    LookupTreeGenerationConfig,
    SpecBlockGenerationConfig,
    TreeGenerationConfig,
)
from .modeling_tree_drafter import TreeDraftModel

__all__ = [
    "AUTO",
    "DFlashGenerationConfig",
    "Eagle3GenerationConfig",
    "LookupTreeGenerationConfig",
    "SpecBlockGenerationConfig",
    "TreeDraftModel",
    "TreeDrafterConfig",
    "TreeGenerationConfig",
]
