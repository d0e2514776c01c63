"""Draft with no drafter: the lookup tree's candidates are the free ones (`generation.lookup`) only."""

from __future__ import annotations

import torch

from ..tree import DraftTree
from .base import TreeCandidateGenerator


class LookupTreeCandidateGenerator(TreeCandidateGenerator):
    """Trees of prompt-lookup and n-gram-cache chains (merged by `draft_tree`); reads no target features."""

    reads_features = False

    def observe(self, target_features: torch.Tensor, next_tokens: torch.LongTensor, first_position: int) -> None:
        """Nothing to read: the free candidates look at the committed tokens `draft_tree` is given."""

    def grow_tree(self, root_token: torch.LongTensor) -> DraftTree:
        return DraftTree.root_only(root_token, self.drafter.device)
