"""The drafters: one configuration and one modeling file per drafter, on a shared tree-drafter base."""

from .eagle3 import Eagle3Config, Eagle3DraftModel, Eagle3Output
from .specblock import SpecBlockConfig, SpecBlockDraftModel, SpecBlockOutput
from .tree_drafter import TreeDrafterConfig, TreeDraftModel

__all__ = [
    "Eagle3Config",
    "Eagle3DraftModel",
    "Eagle3Output",
    "SpecBlockConfig",
    "SpecBlockDraftModel",
    "SpecBlockOutput",
    "TreeDraftModel",
    "TreeDrafterConfig",
]
