"""Draft token trees: structure, attention masks, merging candidate chains and pruning.

A tree holds the last committed token as node 0 (the root) and the drafted tokens as nodes 1..N. Parents always
come before their children, so every prefix of the node order is a valid tree. Siblings hold distinct tokens (the
acceptors rely on it): a chain from another candidate source is merged into the nodes it agrees with.

Trees are grown on the host (`HostTree`): a drafter reads each forward's candidates back once and grows, merges the
free candidates and prunes there, and the pruned tree reaches the device in one copy with its ancestor matrix
(`HostTree.to_device`); its `DraftTree` keeps the host copy, so later walks (pruning order, path scores) cost no
device op either. A tree grown on the device (`add_nodes`) makes no host round trip per node or per depth (on a GPU
each is a sync): walks up the tree use pointer jumping, ceil(log2(N+1)) steps bounded by a depth the host knows,
and `merge_chain` reads the tree back once (`host()`), not once per chain token.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy
import torch

from ..utils import additive_mask, to_device

UNKNOWN_ROOT = -1
"""A host tree's root token where only the device knows it (a drafter's tree: its root is the last committed token)."""

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
    depth_bound: an upper bound of every depth known on the host (None: N), so walks up the tree need no read
    """

    tokens: torch.LongTensor
    parents: torch.LongTensor
    depths: torch.LongTensor
    scores: torch.Tensor
    sources: torch.LongTensor | None = None  # None: every drafted node is the drafter's
    depth_bound: int | None = None
    _ancestors: torch.BoolTensor | None = field(default=None, init=False, repr=False)  # cache, reset on growth
    # the tree's host copy (`host()`), kept in step by `merge_chain`, reset by other growth: where it is known, walks
    # (`path_scores`, `pruning_order`, `prune`) run on the host and cost no device op
    _host: HostTree | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.sources is None:
            self.sources = torch.full_like(self.tokens, SOURCE_BITS["drafter"])
            self.sources[0] = 0
        if self.depth_bound is None:
            self.depth_bound = len(self) - 1

    @classmethod
    def root_only(cls, token: int | torch.Tensor, device: torch.device | str = "cpu") -> "DraftTree":
        """The tree of the root alone; `token` an int or a one-element tensor (read without a host sync)."""
        if isinstance(token, torch.Tensor):
            tokens = token.reshape(1).to(device=device, dtype=torch.long)
        else:
            tokens = torch.tensor([token], dtype=torch.long, device=device)
        return cls(
            tokens=tokens,
            parents=torch.full((1,), -1, dtype=torch.long, device=device),
            depths=torch.zeros(1, dtype=torch.long, device=device),
            scores=torch.zeros(1, dtype=torch.float32, device=device),
            sources=torch.zeros(1, dtype=torch.long, device=device),
            depth_bound=0,
        )

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_drafted(self) -> int:
        return len(self) - 1

    @property
    def max_depth(self) -> int:
        """The deepest node's depth (a host read of the device)."""
        return int(self.depths.max())

    def _jumps(self) -> int:
        """Pointer-jumping steps that cover every root path: 2^steps > `depth_bound`, known on the host."""
        return min(self.depth_bound, len(self) - 1).bit_length()

    def add_nodes(
        self, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, scores: torch.Tensor,
        source: str = "drafter", max_depth: int | None = None,
    ) -> torch.LongTensor:  # fmt: skip
        """Append nodes (each parent must already exist or come earlier in this call); returns their indices.
        `max_depth`: a bound of the new depths the caller knows (e.g. its parents' bound + 1), else N is assumed."""
        first = len(self)
        self._ancestors = self._host = None
        self.tokens = torch.cat([self.tokens, tokens.to(self.tokens)])
        self.parents = torch.cat([self.parents, parents.to(self.parents)])
        self.depths = torch.cat([self.depths, depths.to(self.depths)])
        self.scores = torch.cat([self.scores, scores.to(self.scores)])
        self.sources = torch.cat([self.sources, torch.full_like(tokens, SOURCE_BITS[source]).to(self.sources)])
        self.depth_bound = max(self.depth_bound, max_depth if max_depth is not None else len(self) - 1)
        return torch.arange(first, len(self), device=self.tokens.device)

    def host(self) -> HostTree:
        """The tree's host copy: one read of the device per tree, kept in step by `merge_chain` (a tree built by
        `HostTree.to_device` has it from the start)."""
        if self._host is None:
            rows = [self.tokens, self.parents, self.depths, self.sources, self.scores]
            tokens, parents, depths, sources, scores = torch.stack([row.double() for row in rows]).tolist()
            self._host = HostTree([int(t) for t in tokens], [int(p) for p in parents], [int(d) for d in depths],
                                  scores, [int(b) for b in sources])  # fmt: skip
        return self._host

    def merge_chain(self, tokens: list[int], scores: list[float], source: str, parent: int = 0) -> None:
        """Hang the chain `tokens` (each a child of the previous, the first a child of `parent`) into the tree.

        Where a node with the same token already sits under the same parent, the chain goes on from it: that node
        gains `source` and keeps the better of both scores. The rest of the chain is appended as new nodes, so
        siblings stay distinct. `scores[i]` is the cumulative score of `tokens[i]`. Matched on the host copy (one
        read per tree), the changes written to the device.
        """
        host = self.host()
        first = len(host)
        node, matched, better, i = host.merge_chain(tokens, scores, source, parent)
        device = self.tokens.device
        if matched:
            self.sources[torch.tensor(matched, device=device)] |= SOURCE_BITS[source]
        if better:
            self.scores[torch.tensor(list(better), device=device)] = torch.tensor(
                list(better.values()), dtype=self.scores.dtype, device=device
            )
        if len(host) == first:
            return
        self.add_nodes(
            torch.tensor(host.tokens[first:], dtype=torch.long, device=device),
            torch.tensor(host.parents[first:], device=device),
            torch.tensor(host.depths[first:], device=device),
            torch.tensor(host.scores[first:], dtype=self.scores.dtype, device=device),
            source,
            max_depth=host.depths[-1],
        )
        self._host = host  # `add_nodes` forgets the host copy; this one already holds the new nodes

    def ancestor_matrix(self) -> torch.BoolTensor:
        """[N+1, N+1] with `a[i, j]` True iff node j is node i or one of its ancestors (computed once per tree:
        the verification mask and greedy acceptance both read it)."""
        if self._ancestors is not None:
            return self._ancestors
        anc = torch.eye(len(self), dtype=torch.bool, device=self.tokens.device)
        jump = self.parents.clamp(min=0)  # the root is its own parent
        for _ in range(self._jumps()):  # anc[i] covers i and its first 2^step - 1 ancestors
            anc = anc | anc[jump]
            jump = jump[jump]
        self._ancestors = anc
        return anc

    def path_tokens(self) -> torch.LongTensor:
        """[N+1, max_depth] tokens on the path root->node at depths 1..depth (0-padded after the node's depth)."""
        n, d_max = len(self), self.max_depth
        drafted = self.ancestor_matrix() & (self.depths > 0)[None, :]  # [N+1, N+1] each node's drafted path
        columns = (self.depths - 1).clamp(min=0)[None, :].expand(n, -1)
        out = torch.zeros(n, max(d_max, 1), dtype=torch.long, device=self.tokens.device)
        out.scatter_add_(1, columns, torch.where(drafted, self.tokens[None, :], 0))  # one ancestor per depth
        return out[:, :d_max]

    def path_scores(self) -> torch.Tensor:
        """[N+1] each node's score capped by every ancestor's: the minimum score on the path root -> node.

        Drafters build a child's score as its parent's plus a log-prob <= 0, so this equals `scores`; the cap makes
        the ranking safe anyway (a NaN counts as -inf): a node never ranks above one of its ancestors.
        """
        if self._host is not None:
            return torch.tensor(self._host.path_scores(), device=self.tokens.device)
        capped = torch.nan_to_num(self.scores.float(), nan=float("-inf"))
        jump = self.parents.clamp(min=0)
        for _ in range(self._jumps()):  # capped[i]: the minimum over i and its first 2^step - 1 ancestors
            capped = torch.minimum(capped, capped[jump])
            jump = jump[jump]
        return capped

    def pruning_order(self) -> torch.LongTensor:
        """[N+1] node ids best first (root first): descending `path_scores`, ties in node order. Every node comes
        after all its ancestors, so every prefix of this order is a tree (what `prune` keeps)."""
        if self._host is not None:
            return torch.tensor(self._host.pruning_order(), device=self.tokens.device)
        scores = self.path_scores()
        scores[0] = float("inf")
        return torch.sort(scores, descending=True, stable=True).indices

    def prune(self, budget: int) -> "DraftTree":
        """Keep the root and the first `budget` drafted nodes of `pruning_order` (ancestors of kept nodes are kept)."""
        if self.num_drafted <= budget:
            return self
        if self._host is not None:  # on the host, then one copy (no device walk)
            root = self.tokens[:1] if self._host.tokens[0] == UNKNOWN_ROOT else None
            return self._host.prune(budget).to_device(self.tokens.device, root)
        kept = self.pruning_order()[: budget + 1].sort().values  # in node order: parents before children
        new_index = torch.full_like(self.parents, -1).scatter_(0, kept, torch.arange(budget + 1, device=kept.device))
        parents = self.parents[kept]
        parents = torch.where(parents >= 0, new_index[parents.clamp(min=0)], parents)
        return DraftTree(
            self.tokens[kept], parents, self.depths[kept], self.scores[kept], self.sources[kept], self.depth_bound
        )

    def children_of(self, node: int) -> torch.LongTensor:
        """Children of `node`, highest draft score first."""
        kids = (self.parents == node).nonzero().squeeze(1)
        return kids[torch.argsort(self.scores[kids], descending=True, stable=True)]


def _match_chain(
    host_tokens: list[int], host_parents: list[int], host_scores: list[float], tokens: list[int], scores: list[float],
    parent: int,
) -> tuple[int, list[int], dict[int, float], int]:  # fmt: skip
    """Follow the chain `tokens` down from `parent` through the nodes that already hold them. Returns the last node
    it reached, the nodes it matched, those whose score it raised (-> their new float32 score, also written into
    `host_scores`) and how many of its tokens matched."""
    node, matched, better = parent, [], {}
    for i, (token, score) in enumerate(zip(tokens, scores)):
        same = next((j for j, (t, p) in enumerate(zip(host_tokens, host_parents)) if p == node and t == token), None)
        if same is None:
            return node, matched, better, i
        node = same
        matched.append(node)
        if score > host_scores[node]:  # stored in float32, as the tensor keeps it
            better[node] = host_scores[node] = float(numpy.float32(score))
    return node, matched, better, len(tokens)


@dataclass
class HostTree:
    """A draft tree built on the host, as `DraftTree` builds one (same merging, same pruning), for trees whose every
    node is known there (the free candidates, and the drafters' trees: they read each forward's candidates back
    once and grow the tree here): it reaches the device in one copy (`to_device`), ancestor matrix included. The
    root's token may be unknown on the host (`UNKNOWN_ROOT`): `to_device` then takes it from the device."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    scores: list[float]  # float32 values, as the device tree keeps them
    sources: list[int]

    @classmethod
    def root_only(cls, token: int = UNKNOWN_ROOT) -> "HostTree":
        return cls([token], [-1], [0], [0.0], [0])

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_drafted(self) -> int:
        return len(self) - 1

    def add_node(self, token: int, parent: int, score: float, source: str = "drafter") -> int:
        """Append one node under `parent` (already in the tree); `score` is rounded to float32. Returns its index."""
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.scores.append(float(numpy.float32(score)))
        self.sources.append(SOURCE_BITS[source])
        return len(self) - 1

    def grow_best_first(
        self, start: int, log_probs: list[list[float]], token_ids: list[list[int]], budget: int
    ) -> list[tuple[int, int]]:  # fmt: skip
        """Add under `start` the `budget` best nodes of the tree whose children at depth d below `start` are the
        candidates of position d (`log_probs[d - 1]` / `token_ids[d - 1]`, best first; positions may offer different
        numbers). A node's score is its parent's plus its candidate's log-probability; nodes are taken best first from a
        heap that holds, for every taken node, its best child and its next sibling. So they are the top-`budget`
        subtree by path score (DDTree, Ringel & Romano 2026), every node after its parent, siblings distinct where a
        position's candidates are (ties go to the node pushed first). Returns (node, position) of each new node."""
        exact = {start: float(self.scores[start])}  # scores summed in float64, as the heap ranks them
        heap = [(-(exact[start] + log_probs[0][0]), 0, start, 0, 0)] if log_probs else []
        pushed, new = 1, []  # heap entries: (-score, push order, parent node, position, rank at that position)
        while heap and len(new) < budget:
            neg_score, _, parent, position, rank = heapq.heappop(heap)
            node = self.add_node(token_ids[position][rank], parent, -neg_score)
            exact[node] = -neg_score
            new.append((node, position))
            if rank + 1 < len(log_probs[position]):  # next sibling: the parent's score plus the next candidate
                sibling_score = exact[parent] + log_probs[position][rank + 1]
                heapq.heappush(heap, (-sibling_score, pushed, parent, position, rank + 1))
                pushed += 1
            if position + 1 < len(log_probs):  # best child: this node's score plus the next position's best
                heapq.heappush(heap, (-(exact[node] + log_probs[position + 1][0]), pushed, node, position + 1, 0))
                pushed += 1
        return new

    def merge_chain(
        self, tokens: list[int], scores: list[float], source: str, parent: int = 0
    ) -> tuple[int, list[int], dict[int, float], int]:
        """As `DraftTree.merge_chain`; returns what `_match_chain` returns (the device tree mirrors it)."""
        bit = SOURCE_BITS[source]
        node, matched, better, i = _match_chain(self.tokens, self.parents, self.scores, tokens, scores, parent)
        for m in matched:
            self.sources[m] |= bit
        rest = tokens[i:]
        if rest:
            first, depth = len(self), self.depths[node] + 1
            self.tokens += rest
            self.parents += [node] + list(range(first, first + len(rest) - 1))
            self.depths += range(depth, depth + len(rest))
            self.scores += [float(numpy.float32(x)) for x in scores[i:]]
            self.sources += [bit] * len(rest)
        return node, matched, better, i

    def path_scores(self) -> list[float]:
        """As `DraftTree.path_scores`: each node's score capped by its ancestors' (NaN as -inf)."""
        capped = [0.0] * len(self)
        for i, (parent, score) in enumerate(zip(self.parents, self.scores)):  # parents come before their children
            score = float("-inf") if math.isnan(score) else score
            capped[i] = min(score, capped[parent]) if parent >= 0 else score
        return capped

    def pruning_order(self) -> list[int]:
        """As `DraftTree.pruning_order`: node ids best first, the root first, ties in node order."""
        capped = self.path_scores()
        capped[0] = float("inf")
        return sorted(range(len(self)), key=lambda i: -capped[i])

    def room_below(self, scores: list[float], budget: int) -> list[int]:
        """For new nodes scoring at most each of `scores` (each a chain start), how many `prune(budget)` could keep:
        `budget` minus the drafted nodes already ranking at or above that score (a tie goes to the older node), at
        least 0. A chain's j-th node needs its j ancestors kept too, so only its first `room` nodes can survive;
        merging free candidates later only raises or adds scores, never lowers one. A drafter drafts no deeper than
        that, and the pruned tree stays the same."""
        drafted = self.path_scores()[1:]
        return [max(0, budget - sum(1 for s in drafted if s >= score)) for score in scores]

    def prune(self, budget: int) -> "HostTree":
        """As `DraftTree.prune`: the root and the `budget` drafted nodes of the best path scores (the minimum score
        on the path from the root, NaN as -inf; ties to the older node)."""
        if len(self) - 1 <= budget:
            return self
        return self._subtree(self.kept_after_pruning(budget))

    def kept_after_pruning(self, budget: int) -> list[int]:
        """The nodes `prune(budget)` keeps, ascending (their indices in the pruned tree are their ranks here)."""
        return sorted(self.pruning_order()[: budget + 1]) if len(self) - 1 > budget else list(range(len(self)))

    def free_part(self) -> "HostTree":
        """The root and the nodes a free source proposed (any bit but the drafter's), in order: the tree the free
        candidates alone would have built (a free chain is merged from the root, so a free node's ancestors are free
        too); a node the drafter proposed as well keeps the higher of the two scores."""
        return self._subtree([0] + [i for i, bits in enumerate(self.sources) if i and bits & ~SOURCE_BITS["drafter"]])

    def _subtree(self, kept: list[int]) -> "HostTree":
        """The nodes `kept` (ascending, the root and every kept node's parent among them), renumbered."""
        new_index = {old: new for new, old in enumerate(kept)}
        return HostTree(
            [self.tokens[i] for i in kept], [new_index[self.parents[i]] if i else -1 for i in kept],
            [self.depths[i] for i in kept], [self.scores[i] for i in kept], [self.sources[i] for i in kept],
        )  # fmt: skip

    def ancestor_matrix(self) -> numpy.ndarray:
        """[N+1, N+1] bool, as `DraftTree.ancestor_matrix`."""
        anc = numpy.eye(len(self), dtype=bool)
        for i, parent in enumerate(self.parents[1:], start=1):
            anc[i] |= anc[parent]
        return anc

    def to_device(self, device: torch.device | str, root: torch.LongTensor | None = None) -> DraftTree:
        """The tree as a `DraftTree` on `device`, its ancestor matrix included, from one host -> device copy; it keeps
        this host copy (no read). `root` ([1] on the device): the root's token where the host does not know it."""
        if root is None and self.tokens[0] == UNKNOWN_ROOT:
            raise ValueError("This host tree's root token is known on the device only: pass it as `root`.")
        n = len(self)
        table = numpy.empty((5 + n, n), dtype=numpy.int64)
        table[:4] = [self.tokens, self.parents, self.depths, self.sources]
        table[4] = numpy.asarray(self.scores, dtype=numpy.float32).view(numpy.int32)
        table[5:] = self.ancestor_matrix()
        table = to_device(table, device)
        tokens, parents, depths, sources, score_bits = table[:5].unbind()
        if root is not None:
            tokens = torch.cat([root.reshape(1).to(tokens), tokens[1:]])
        tree = DraftTree(tokens, parents, depths, score_bits.int().view(torch.float32), sources, max(self.depths))
        tree._ancestors = table[5:].bool()
        tree._host = self
        return tree


def tree_verification_mask(tree: DraftTree, prefix_visible: torch.BoolTensor, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, N+1, S+N+1] additive mask for verifying `tree` after S cached target positions.

    Every node sees the visible cached prefix and its own ancestors (itself included).
    """
    n = len(tree)
    prefix = prefix_visible.to(tree.tokens.device)[None, :].expand(n, -1)
    visible = torch.cat([prefix, tree.ancestor_matrix()], dim=1)
    return additive_mask(visible, dtype)[None, None]
