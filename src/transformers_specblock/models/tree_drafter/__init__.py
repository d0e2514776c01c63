from .configuration_tree_drafter import AUTO, TreeDrafterConfig
from .modeling_tree_drafter import TreeDraftModel

__all__ = ["AUTO", "TreeDraftModel", "TreeDrafterConfig"]
