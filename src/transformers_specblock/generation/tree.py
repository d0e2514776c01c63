"""Draft token trees: structure, attention masks, merging candidate chains and pruning.

A tree holds the last committed token as node 0 (the root) and the drafted tokens as nodes 1..N. Parents always
come before their children, so every prefix of the node order is a valid tree. Siblings hold distinct tokens (the
acceptors rely on it): a chain from another candidate source is merged into the nodes it agrees with.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..utils import additive_mask

SOURCE_BITS = {"drafter": 1, "prompt_lookup": 2, "ngram_cache": 4, "suffix_cache": 8, "suffix_local": 16}
"""Candidate sources a tree node can come from (a node several sources proposed carries several bits)."""


@dataclass
class DraftTree:
    """A token tree in topological order.

    tokens:  [N+1] target-vocabulary token ids (node 0 = last committed token)
    parents: [N+1] parent node index (-1 for the root)
    depths:  [N+1] distance to the root (root = 0)
    scores:  [N+1] cumulative draft log-probability (root = 0)
    sources: [N+1] bit mask of the candidate sources that proposed each node (`SOURCE_BITS`; root = 0)
    """

    tokens: torch.LongTensor
    parents: torch.LongTensor
    depths: torch.LongTensor
    scores: torch.Tensor
    sources: torch.LongTensor | None = None  # None: every drafted node is the drafter's
    _ancestors: torch.BoolTensor | None = field(default=None, init=False, repr=False)  # cache, reset on growth

    def __post_init__(self) -> None:
        if self.sources is None:
            self.sources = torch.full_like(self.tokens, SOURCE_BITS["drafter"])
            self.sources[0] = 0

    @classmethod
    def root_only(cls, token: int, device: torch.device | str = "cpu") -> "DraftTree":
        return cls(
            tokens=torch.tensor([token], dtype=torch.long, device=device),
            parents=torch.tensor([-1], dtype=torch.long, device=device),
            depths=torch.zeros(1, dtype=torch.long, device=device),
            scores=torch.zeros(1, dtype=torch.float32, device=device),
        )

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_drafted(self) -> int:
        return len(self) - 1

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())

    def add_nodes(
        self, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, scores: torch.Tensor,
        source: str = "drafter",
    ) -> torch.LongTensor:  # fmt: skip
        """Append nodes (each parent must already exist or come earlier in this call); returns their indices."""
        first = len(self)
        self._ancestors = None
        self.tokens = torch.cat([self.tokens, tokens.to(self.tokens)])
        self.parents = torch.cat([self.parents, parents.to(self.parents)])
        self.depths = torch.cat([self.depths, depths.to(self.depths)])
        self.scores = torch.cat([self.scores, scores.to(self.scores)])
        self.sources = torch.cat([self.sources, torch.full_like(tokens, SOURCE_BITS[source]).to(self.sources)])
        return torch.arange(first, len(self), device=self.tokens.device)

    def merge_chain(self, tokens: list[int], scores: list[float], source: str, parent: int = 0) -> None:
        """Hang the chain `tokens` (each a child of the previous, the first a child of `parent`) into the tree.

        Where a node with the same token already sits under the same parent, the chain goes on from it: that node
        gains `source` and keeps the better of both scores. The rest of the chain is appended as new nodes, so
        siblings stay distinct. `scores[i]` is the cumulative score of `tokens[i]`.
        """
        bit = SOURCE_BITS[source]
        node = parent
        for i, (token, score) in enumerate(zip(tokens, scores)):
            same = ((self.parents == node) & (self.tokens == token)).nonzero()
            if same.numel() == 0:
                rest = torch.tensor(tokens[i:], dtype=torch.long, device=self.tokens.device)
                first = len(self)
                chain_parents = torch.arange(first - 1, first - 1 + rest.numel(), device=rest.device)
                chain_parents[0] = node
                depth = int(self.depths[node]) + 1
                depths = torch.arange(depth, depth + rest.numel(), device=rest.device)
                self.add_nodes(rest, chain_parents, depths, torch.tensor(scores[i:]), source)
                return
            node = int(same[0, 0])
            self.sources[node] |= bit
            self.scores[node] = max(float(self.scores[node]), score)

    def ancestor_matrix(self) -> torch.BoolTensor:
        """[N+1, N+1] with `a[i, j]` True iff node j is node i or one of its ancestors (computed once per tree:
        the verification mask and greedy acceptance both read it)."""
        if self._ancestors is not None:
            return self._ancestors
        n = len(self)
        idx = torch.arange(n, device=self.tokens.device)
        anc = torch.eye(n, dtype=torch.bool, device=self.tokens.device)
        cur = idx
        for _ in range(self.max_depth):
            cur = self.parents.clamp(min=0)[cur]
            anc[idx, cur] = True
        self._ancestors = anc
        return anc

    def path_tokens(self) -> torch.LongTensor:
        """[N+1, max_depth] tokens on the path root->node at depths 1..depth (0-padded after the node's depth)."""
        n, d_max = len(self), self.max_depth
        out = torch.zeros(n, d_max, dtype=torch.long, device=self.tokens.device)
        cur = torch.arange(n, device=self.tokens.device)
        for _ in range(d_max):
            d = self.depths[cur]
            live = d > 0
            out[live, d[live] - 1] = self.tokens[cur[live]]
            cur = torch.where(live, self.parents[cur], cur)
        return out

    def path_scores(self) -> torch.Tensor:
        """[N+1] each node's score capped by every ancestor's: the minimum score on the path root -> node.

        Drafters build a child's score as its parent's plus a log-prob <= 0, so this equals `scores`; the cap makes
        the ranking safe anyway (a NaN counts as -inf): a node never ranks above one of its ancestors.
        """
        capped = torch.nan_to_num(self.scores.float(), nan=float("-inf"))
        parents = self.parents.clamp(min=0)
        for _ in range(self.max_depth):
            capped = torch.minimum(capped, capped[parents])
        return capped

    def room_below(self, scores: torch.Tensor, budget: int) -> torch.LongTensor:
        """[M] for new nodes scoring at most `scores` [M] (each a chain start), how many of them `prune(budget)`
        could keep: `budget` minus the drafted nodes already ranking at or above that score (a tie goes to the older
        node), at least 0. A chain's j-th node needs its j ancestors kept too, so only its first `room` nodes can
        survive; merging free candidates later only raises or adds scores, never lowers one. A drafter drafts no
        deeper than that, and the pruned tree stays the same."""
        above = (self.path_scores()[1:][None, :] >= scores.reshape(-1, 1)).sum(dim=1)
        return (budget - above).clamp(min=0)

    def cannot_reach(self, best_new_score: torch.Tensor, budget: int) -> bool:
        """Whether nodes scoring at most `best_new_score`, added now, would all fall outside `prune(budget)`."""
        return int(self.room_below(best_new_score, budget)[0]) == 0

    def pruning_order(self) -> torch.LongTensor:
        """[N+1] node ids best first (root first): descending `path_scores`, ties in node order. Every node comes
        after all its ancestors, so every prefix of this order is a tree (what `prune` keeps)."""
        scores = self.path_scores()
        scores[0] = float("inf")
        return torch.sort(scores, descending=True, stable=True).indices

    def prune(self, budget: int) -> "DraftTree":
        """Keep the root and the first `budget` drafted nodes of `pruning_order` (ancestors of kept nodes are kept)."""
        if self.num_drafted <= budget:
            return self
        keep = torch.zeros(len(self), dtype=torch.bool, device=self.tokens.device)
        keep[self.pruning_order()[: budget + 1]] = True
        new_index = torch.cumsum(keep, 0) - 1
        kept = keep.nonzero().squeeze(1)
        parents = self.parents[kept]
        parents = torch.where(parents >= 0, new_index[parents.clamp(min=0)], parents)
        return DraftTree(self.tokens[kept], parents, self.depths[kept], self.scores[kept], self.sources[kept])

    def children_of(self, node: int) -> torch.LongTensor:
        """Children of `node`, highest draft score first."""
        kids = (self.parents == node).nonzero().squeeze(1)
        return kids[torch.argsort(self.scores[kids], descending=True, stable=True)]


def tree_verification_mask(tree: DraftTree, prefix_visible: torch.BoolTensor, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, N+1, S+N+1] additive mask for verifying `tree` after S cached target positions.

    Every node sees the visible cached prefix and its own ancestors (itself included).
    """
    n = len(tree)
    prefix = prefix_visible.to(tree.tokens.device)[None, :].expand(n, -1)
    visible = torch.cat([prefix, tree.ancestor_matrix()], dim=1)
    return additive_mask(visible, dtype)[None, None]
