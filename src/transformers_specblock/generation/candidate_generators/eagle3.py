"""Draft with an EAGLE-3 drafter: the dynamic top-k token tree of EAGLE-2 / EAGLE-3."""

from __future__ import annotations

import time

import numpy
import torch
from transformers import DynamicCache

from ...models.eagle3.modeling_eagle3 import Eagle3DraftModel
from ..cache_utils import truncate_cache
from ..tree import HostTree
from .base import TreeCandidateGenerator, compiled_method


class Eagle3CandidateGenerator(TreeCandidateGenerator):
    """Drafts an EAGLE-3 dynamic tree for the target to verify.

    The drafter's KV cache holds one entry per committed position and persists across iterations: `observe` feeds
    only the newly committed positions (one forward) and keeps the last position's output (its logits give the
    root's children, its hidden is their `hidden` input). `draft_tree` then:

    1. root: the top-k draft tokens of that output become depth-1 nodes (score = their log-prob) and the frontier;
    2. `depth` expansion rounds, ONE drafter forward each over the (at most k) frontier nodes: a node's input is its
       own token plus the pre-norm hidden of the drafter position that produced it (the parent's output), at rotary
       position root + node depth; it attends to the whole committed cache, its ancestors' temporary entries and
       itself (the cache grows by the frontier's entries every round). Each frontier node gets its top-k children
       with cumulative score = parent score + child log-prob; ALL k^2 children are added to the tree (as EAGLE-2's
       `scores_list` keeps every child for the final selection), and the top-k of the k^2 by cumulative score become
       the next frontier;
    3. prune to `tree_budget` drafted nodes by cumulative log-probability (`DraftTree.prune`, ancestors kept).

    The temporary entries are cropped from the drafter cache afterwards. Rounds that cannot survive pruning are
    skipped: a node at level L needs L kept nodes, so at most `tree_budget - 1` rounds run, and expansion stops once
    `tree_budget` nodes already score at least the best frontier node (children never score above their parent).
    Forwards per iteration: 1 (`observe`) + at most min(depth, tree_budget - 1).
    """

    def __init__(
        self,
        drafter: Eagle3DraftModel,
        tree_budget: int | None = None,
        top_k: int | None = None,
        depth: int | None = None,
    ) -> None:
        super().__init__(drafter, tree_budget)
        config = drafter.config
        top_k = top_k if top_k is not None else config.tree_top_k
        self.depth = depth if depth is not None else config.tree_depth
        if top_k < 1 or self.depth < 0 or self.tree_budget < 1:
            raise ValueError(
                f"Need top_k >= 1, depth >= 0 and tree_budget >= 1, got {top_k}, {self.depth}, {self.tree_budget}."
            )
        self.top_k = min(top_k, config.draft_vocab_size)
        self.cache = DynamicCache()
        self.committed_entries = 0
        self.root_output: tuple[torch.Tensor, torch.Tensor] | None = None
        self.root_position = 0

    # ---------------------------------------------------------------------------------------------------------
    def observe(self, target_features: torch.Tensor, next_tokens: torch.LongTensor, first_position: int) -> None:
        """Feed newly committed positions i (features f_i, token x_{i+1}); keep the last one's output.

        target_features: [P, 3 * H_target]; next_tokens: [P]; first_position: rotary position of next_tokens[0].
        """
        num_pos = next_tokens.shape[0]
        device = self.drafter.device
        start = time.perf_counter()
        mask = numpy.ones((num_pos, self.committed_entries + num_pos), dtype=bool)  # built on the host: one copy
        mask[:, self.committed_entries :] = numpy.tri(num_pos, dtype=bool)
        positions = torch.arange(first_position, first_position + num_pos, device=device)[None]
        out = compiled_method(self.drafter, "draft_step")(
            self.drafter.fuse_features(target_features)[None],
            next_tokens.to(device)[None],
            positions,
            torch.from_numpy(mask).to(device)[None],
            self.cache,
            logits_to_keep=1,
        )
        self.committed_entries = self.cache.get_seq_length()
        self.root_output = (out.logits[0, -1], out.hidden_states[0, -1])
        self.root_position = first_position + num_pos - 1
        self._account(start)

    # ---------------------------------------------------------------------------------------------------------
    def grow_tree(self, root_token: torch.LongTensor) -> HostTree:
        """The dynamic top-k tree from the last committed token, whose output `observe` computed (`draft_tree` prunes).

        Grown on the host: each forward's top-k candidates are read back once (one sync per drafter forward), so
        the frontier, the masks and the nodes cost no device op."""
        if self.root_output is None:
            raise RuntimeError("observe() must feed the committed context before draft_tree().")
        start = time.perf_counter()
        device, k = self.drafter.device, self.top_k
        tree = HostTree.root_only()
        logits, hidden = self.root_output
        [(root_lp, root_ids)] = self._read_top_k(logits[None])
        frontier = [tree.add_node(token, 0, lp) for token, lp in zip(root_ids, root_lp)]  # the root's children
        frontier_hidden = hidden[None].expand(k, -1)  # every depth-1 node was produced by the root position
        if self.keep_producers:  # the root output: slot 0
            root_slots = torch.zeros(k, dtype=torch.long, device=device)
            self.note_producers(torch.tensor(frontier, device=device), frontier_hidden, root_slots)
        frontier_visible = numpy.zeros((k, 0), dtype=bool)  # over this iteration's entries
        rounds = 0
        for _ in range(min(self.depth, self.tree_budget - 1)):
            if tree.room_below(max(tree.scores[node] for node in frontier), self.tree_budget) == 0:
                break  # children score below their parents: none could survive pruning
            rounds += 1
            n = len(frontier)
            # the committed cache, the frontier's ancestors' entries, then each node's own new entry
            visible = numpy.concatenate([frontier_visible, numpy.eye(n, dtype=bool)], axis=1)
            mask = numpy.concatenate([numpy.ones((n, self.committed_entries), dtype=bool), visible], axis=1)
            inputs = torch.tensor([[tree.tokens[node] for node in frontier], [tree.depths[node] for node in frontier]])
            inputs = inputs.to(device)
            out = compiled_method(self.drafter, "draft_step")(
                frontier_hidden[None],
                inputs[0][None],
                (self.root_position + inputs[1])[None],
                torch.from_numpy(mask).to(device)[None],
                self.cache,
            )
            self.stats.drafter_forwards += 1
            children = [  # parent-major: node i's children come from frontier state i
                tree.add_node(token, parent, tree.scores[parent] + lp)
                for parent, (child_lp, child_ids) in zip(frontier, self._read_top_k(out.logits[0]))
                for token, lp in zip(child_ids, child_lp)
            ]
            if self.keep_producers:
                self.note_producers(torch.tensor(children, device=device), out.hidden_states[0].repeat_interleave(k, 0))
            best = sorted(range(len(children)), key=lambda i: -tree.scores[children[i]])[:k]  # ties: older first
            frontier = [children[i] for i in best]
            frontier_hidden = out.hidden_states[0][torch.tensor([i // k for i in best], device=device)]
            frontier_visible = visible[[i // k for i in best]]
        truncate_cache(self.cache, self.committed_entries)
        self.stats.blocks_per_iteration.append(rounds)
        self._account(start, forwards=0)
        return tree

    def _read_top_k(self, logits: torch.Tensor) -> list[tuple[list[float], list[int]]]:
        """[n, Vd] draft logits -> per row its top-k log-probs and their target-vocabulary ids, in ONE host read."""
        top_lp, top_ids = logits.float().log_softmax(-1).topk(self.top_k, dim=-1)
        rows = torch.stack([top_lp.double(), self.drafter.d2t[top_ids].double()], dim=1).tolist()  # [n][2][k]
        return [(lp, [int(t) for t in ids]) for lp, ids in rows]
