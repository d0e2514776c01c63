from .configuration_tree_drafter import TreeDrafterConfig
from .generation_config import AUTO, TreeGenerationConfig
from .modeling_tree_drafter import TreeDraftModel

__all__ = ["AUTO", "TreeDraftModel", "TreeDrafterConfig", "TreeGenerationConfig"]
