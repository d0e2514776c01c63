"""The drafters: one configuration and one modeling file per drafter, on a shared tree-drafter base (the lookup
tree is the weightless one: free candidates only)."""

from .dflash import DFlashConfig, DFlashDraftModel
from .eagle3 import Eagle3Config, Eagle3DraftModel, Eagle3Output
from .lookup_tree import LookupTreeConfig, LookupTreeModel
from .specblock import SpecBlockConfig, SpecBlockDraftModel, SpecBlockOutput
from .tree_drafter import TreeDrafterConfig, TreeDraftModel

__all__ = [
    "DFlashConfig",
    "DFlashDraftModel",
    "Eagle3Config",
    "Eagle3DraftModel",
    "Eagle3Output",
    "LookupTreeConfig",
    "LookupTreeModel",
    "SpecBlockConfig",
    "SpecBlockDraftModel",
    "SpecBlockOutput",
    "TreeDraftModel",
    "TreeDrafterConfig",
]
