"""The trees of a batch, padded to one size so the target verifies every row's tree in one forward.

Row r's tree fills nodes 0..len(tree_r)-1; the rest are dummy nodes (the root's token at the root's position) that
see only themselves and are never accepted. With the per-row visibility of the cached prefix (left padding and the
holes that ragged acceptance leaves, `cache_utils.compact_cache`) this gives the batch's 4D attention mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..utils import additive_mask, to_device
from .tree import DraftTree


@dataclass
class TreeBatch:
    """B trees padded to N+1 nodes.

    tokens:    [B, N+1] token ids (dummy nodes: the root's token)
    parents:   [B, N+1] parent node (-1 for roots and dummy nodes)
    depths:    [B, N+1] distance to the root (dummy nodes: 0)
    ancestors: [B, N+1, N+1] `a[b, i, j]` iff node j is node i or one of its ancestors in row b
    real:      [B, N+1] False for dummy nodes
    trees:     the B unpadded trees
    """

    tokens: torch.LongTensor
    parents: torch.LongTensor
    depths: torch.LongTensor
    ancestors: torch.BoolTensor
    real: torch.BoolTensor
    trees: list[DraftTree]

    @classmethod
    def pad(cls, trees: list[DraftTree]) -> "TreeBatch":
        if len(trees) == 1:  # nothing to pad
            tree = trees[0]
            real = torch.ones(1, len(tree), dtype=torch.bool, device=tree.tokens.device)
            return cls(tree.tokens[None], tree.parents[None], tree.depths[None], tree.ancestor_matrix()[None], real,
                       trees)  # fmt: skip
        size = max(len(tree) for tree in trees)
        device = trees[0].tokens.device
        if size == 1:  # roots alone: a plain batched step
            ones = torch.ones(len(trees), 1, dtype=torch.bool, device=device)
            tokens = torch.stack([tree.tokens for tree in trees])
            return cls(tokens, torch.full_like(tokens, -1), torch.zeros_like(tokens), ones[:, :, None], ones, trees)
        tokens = torch.stack([tree.tokens[:1].expand(size) for tree in trees]).clone()
        parents = torch.full((len(trees), size), -1, dtype=torch.long, device=device)
        depths = torch.zeros(len(trees), size, dtype=torch.long, device=device)
        ancestors = torch.eye(size, dtype=torch.bool, device=device).repeat(len(trees), 1, 1)
        real = torch.zeros(len(trees), size, dtype=torch.bool, device=device)
        for row, tree in enumerate(trees):
            n = len(tree)
            tokens[row, :n], parents[row, :n], depths[row, :n] = tree.tokens, tree.parents, tree.depths
            ancestors[row, :n, :n] = tree.ancestor_matrix()
            real[row, :n] = True
        return cls(tokens, parents, depths, ancestors, real, trees)

    @property
    def size(self) -> int:
        """N+1: nodes per row, dummy nodes included."""
        return self.tokens.shape[1]

    def attention_mask(self, prefix_visible: torch.BoolTensor, dtype: torch.dtype) -> torch.Tensor:
        """[B, 1, N+1, S+N+1] additive mask: every node sees its row's visible cached prefix (`prefix_visible`
        [B, S]) and its own ancestors, itself included."""
        prefix = prefix_visible.to(self.tokens.device)[:, None, :].expand(-1, self.size, -1)
        return additive_mask(torch.cat([prefix, self.ancestors], dim=2), dtype)[:, None]

    def new_tokens(self, index: torch.LongTensor, lengths: list[int], bonus: torch.LongTensor) -> torch.LongTensor:
        """[B, K] each row's new tokens: its accepted nodes' tokens, then its bonus token (at position lengths[r] - 1;
        entries past it are never read). index: `kept_index` of the kept nodes; bonus: [B]."""
        if self.size == 1:  # roots alone: the target's pick is each row's new token
            return bonus[:, None]
        last = to_device(lengths, index.device)[:, None] - 1
        new_tokens = torch.cat([self.tokens.gather(1, index)[:, 1:], bonus[:, None]], 1)
        return new_tokens.scatter_(1, last, bonus[:, None])


def kept_index(kept: list[list[int]], device: torch.device | str = "cpu") -> torch.LongTensor:
    """[B, K] each row's kept nodes (K = the longest row; a shorter row repeats its last node)."""
    width = max(len(nodes) for nodes in kept)
    return to_device([nodes + nodes[-1:] * (width - len(nodes)) for nodes in kept], device)
