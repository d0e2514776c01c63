"""Draft with no drafter: the lookup tree's candidates are the free ones (`generation.lookup`) only."""

from __future__ import annotations

import torch

from .base import TreeCandidateGenerator


class LookupTreeCandidateGenerator(TreeCandidateGenerator):
    """Trees of the free candidates alone (built on the host by `draft_tree`); reads no target features."""

    reads_features = False
    grows_trees = False

    def observe(self, target_features: torch.Tensor, next_tokens: torch.LongTensor, first_position: int) -> None:
        """Nothing to read: the free candidates look at the committed tokens `draft_tree` is given."""
