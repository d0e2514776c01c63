"""Draft with an EAGLE-3 drafter: the dynamic top-k token tree of EAGLE-2 / EAGLE-3."""

from __future__ import annotations

import time

import numpy
import torch
from transformers import DynamicCache

from ...models.eagle3.modeling_eagle3 import Eagle3DraftModel, Eagle3Output
from ...models.tree_drafter.serving_state import ServingState
from ...utils import to_device
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
        state: ServingState | None = None,
    ) -> None:
        super().__init__(drafter, tree_budget, state)
        config, settings = drafter.config, drafter.generation_config
        top_k = top_k if top_k is not None else settings.tree_top_k
        self.depth = depth if depth is not None else settings.tree_depth
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
            to_device(mask[None], device),
            self.cache,
            logits_to_keep=1,
        )
        self.committed_entries = self.cache.get_seq_length()
        self.root_output = (out.logits[:, -1], out.hidden_states[0, -1])  # [1, Vd], [H]
        self.root_position = first_position + num_pos - 1
        self._account(start)

    # ---------------------------------------------------------------------------------------------------------
    def grow_tree(self, root_token: torch.LongTensor) -> HostTree:
        """The dynamic top-k tree from the last committed token, whose output `observe` computed (`draft_tree` prunes).

        Grown on the host: each forward's top-k candidates are read back once, so the frontier, the masks and the
        nodes cost no device op. The first round runs before the root's candidates are read (nothing is to decide
        before it: a tree of the root's children alone leaves room below them) and both are read together: one sync
        per drafter forward, the `observe` forward included."""
        if self.root_output is None:
            raise RuntimeError("observe() must feed the committed context before draft_tree().")
        start = time.perf_counter()
        device, k = self.drafter.device, self.top_k
        tree = HostTree.root_only()
        logits, hidden = self.root_output
        max_rounds = min(self.depth, self.tree_budget - 1)
        root_lp, root_ids = self._top_k(logits)  # [1, k] each, on the device
        frontier_hidden = hidden[None].expand(k, -1)  # every depth-1 node was produced by the root position
        visible = numpy.eye(k, dtype=bool)  # each depth-1 node sees itself among this iteration's entries
        positions = torch.full((1, k), self.root_position + 1, device=device)
        out = self._draft_round(frontier_hidden[None], root_ids, positions, visible) if max_rounds else None
        tops = [(root_lp, root_ids)] + ([self._top_k(out.logits[0])] if out is not None else [])
        root, *children_top = self._read(tops)
        frontier = [tree.add_node(token, 0, lp) for lp, token in zip(*root[0])]  # the root's children
        if self.keep_producers:  # the root output: slot 0
            root_slots = torch.zeros(k, dtype=torch.long, device=device)
            self.note_producers(torch.tensor(frontier, device=device), frontier_hidden, root_slots)
        rounds = 0
        while out is not None:
            rounds += 1
            children = [  # parent-major: node i's children come from frontier state i
                tree.add_node(token, parent, tree.scores[parent] + lp)
                for parent, (child_lp, child_ids) in zip(frontier, children_top[0])
                for lp, token in zip(child_lp, child_ids)
            ]
            if self.keep_producers:
                self.note_producers(torch.tensor(children, device=device), out.hidden_states[0].repeat_interleave(k, 0))
            best = sorted(range(len(children)), key=lambda i: -tree.scores[children[i]])[:k]  # ties: older first
            frontier = [children[i] for i in best]
            frontier_hidden = out.hidden_states[:, to_device([i // k for i in best], device)]  # [1, n, H]
            best_score = max(tree.scores[node] for node in frontier)
            if rounds == max_rounds or tree.room_below([best_score], self.tree_budget) == [0]:
                break  # children score below their parents: none could survive pruning
            # the frontier's ancestors' entries, then each node's own new entry
            visible = numpy.concatenate([visible[[i // k for i in best]], numpy.eye(len(frontier), dtype=bool)], 1)
            inputs = to_device([[tree.tokens[n] for n in frontier],
                                [self.root_position + tree.depths[n] for n in frontier]], device)  # fmt: skip
            out = self._draft_round(frontier_hidden, inputs[:1], inputs[1:], visible)
            children_top = self._read([self._top_k(out.logits[0])])
        truncate_cache(self.cache, self.committed_entries)
        self.stats.blocks_per_iteration.append(rounds)
        self._account(start, forwards=0)
        return tree

    def _draft_round(
        self, hidden: torch.Tensor, tokens: torch.LongTensor, positions: torch.LongTensor, visible: numpy.ndarray
    ) -> Eagle3Output:
        """One drafter forward over the n frontier nodes (their producing states [1, n, H], tokens [1, n], rotary
        positions [1, n]), each seeing the committed cache and `visible` [n, T] of this iteration's T drafter entries
        (its ancestors' and its own, the last n)."""
        mask = numpy.concatenate([numpy.ones((len(visible), self.committed_entries), dtype=bool), visible], axis=1)
        out = compiled_method(self.drafter, "draft_step")(
            hidden, tokens, positions, to_device(mask[None], hidden.device), self.cache
        )
        self.stats.drafter_forwards += 1
        return out

    def _top_k(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.LongTensor]:
        """[n, Vd] draft logits -> per row its top-k log-probs and their target-vocabulary ids ([n, k] each)."""
        top_lp, top_ids = logits.float().log_softmax(-1).topk(self.top_k, dim=-1)
        return top_lp, self.drafter.d2t[top_ids]

    @staticmethod
    def _read(tops: list[tuple[torch.Tensor, torch.LongTensor]]) -> list[list[tuple[list[float], list[int]]]]:
        """`_top_k` outputs -> per output, per row (log-probs, ids) on the host, all in ONE host read."""
        # float32 holds every id exactly (vocabularies < 2^24 tokens)
        rows = torch.cat([torch.stack([lp, ids.float()], dim=1) for lp, ids in tops]).tolist()  # [n][2][k]
        out, offset = [], 0
        for lp, _ in tops:
            out.append([(row_lp, [int(t) for t in row_ids]) for row_lp, row_ids in rows[offset : offset + lp.shape[0]]])
            offset += lp.shape[0]
        return out
