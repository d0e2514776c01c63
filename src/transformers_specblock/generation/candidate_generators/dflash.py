"""Draft with a DFlash drafter: one block forward, then a best-first tree over its per-position candidates
(DDTree, Ringel & Romano 2026), verified by the target in one forward."""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from ...models.dflash.configuration_dflash import max_tree_nodes
from ...models.dflash.modeling_dflash import DFlashDraftModel
from ...models.tree_drafter.serving_state import ServingState
from ..cache_utils import truncate_cache
from ..tree import HostTree
from .base import TreeCandidateGenerator, compiled_method


def best_first_tree(log_probs: torch.Tensor, token_ids: torch.LongTensor, budget: int) -> HostTree:
    """The `budget` best nodes of the tree whose depth-d children are the candidates of block position d
    (`HostTree.grow_best_first`). log_probs / token_ids: [D, K] per-position candidates sorted by descending
    log-probability, read back to the host once (one sync); the tree is grown there (its root token, the last
    committed one, stays on the device)."""
    lp, ids = torch.stack([log_probs.double(), token_ids.double()]).tolist()  # token ids are exact in float64
    tree = HostTree.root_only()
    tree.grow_best_first(0, lp, [[int(i) for i in row] for row in ids], budget)
    return tree


class DFlashCandidateGenerator(TreeCandidateGenerator):
    """Drafts a DDTree-style tree from one DFlash block forward per iteration.

    `observe` only keeps the newly committed positions' target features; `grow_tree` runs ONE drafter forward over
    them (their keys / values join the drafter cache for good) and the block [root, mask, ..., mask] at rotary
    positions root .. root + block_size - 1 (its entries are cropped afterwards), takes the `top_k` candidates of
    every masked position down to depth `tree_budget` (no deeper node can be kept) from the target's `lm_head` and builds
    the best-first tree of `tree_budget` nodes.
    The block is drafted once, without seeing the tree: every node at depth d draws on position d's candidates.
    """

    def __init__(
        self, drafter: DFlashDraftModel, tree_budget: int | None = None, top_k: int | None = None,
        state: ServingState | None = None,
    ) -> None:  # fmt: skip
        super().__init__(drafter, tree_budget, state)
        config = drafter.config
        self.top_k = top_k if top_k is not None else drafter.generation_config.tree_top_k
        self.depth = config.block_size - 1
        if self.top_k < 1 or self.tree_budget < 1:
            raise ValueError(f"Need top_k >= 1 and tree_budget >= 1, got {self.top_k} and {self.tree_budget}.")
        largest = max_tree_nodes(self.depth, self.top_k)
        if self.tree_budget > largest:
            raise ValueError(
                f"tree_budget={self.tree_budget} exceeds the {largest} nodes a DFlash block of {config.block_size} "
                f"with top_k={self.top_k} can hold: raise block_size or tree_top_k, or lower tree_budget."
            )
        self.cache = DynamicCache()
        self.pending: list[torch.Tensor] = []  # context features not read by the drafter yet, [P, L * H_target] each
        self.pending_first_position = 0

    def observe(self, target_features: torch.Tensor, next_tokens: torch.LongTensor, first_position: int) -> None:
        """Keep the features f_i of newly committed positions i = first_position - 1 ..; the next block reads them."""
        if not self.pending:
            self.pending_first_position = first_position - 1
        self.pending.append(target_features)

    def grow_tree(self, root_token: torch.LongTensor) -> HostTree:
        """One block forward from the last committed token, then the best-first tree (`draft_tree` prunes)."""
        start = time.perf_counter()
        drafter, device = self.drafter, self.drafter.device
        cached = self.cache.get_seq_length()
        context = torch.cat(self.pending) if self.pending else torch.zeros(0, drafter.fc.in_features, device=device)
        if self.pending and self.pending_first_position != cached:
            raise RuntimeError(
                f"DFlash context positions are out of step: the drafter cache holds {cached} positions, the new "
                f"context starts at {self.pending_first_position}."
            )
        self.pending.clear()
        root_position = cached + context.shape[0]
        positions = torch.arange(cached, root_position + drafter.config.block_size, device=device)
        out = compiled_method(drafter, "forward")(
            noise_embeds=drafter.embed_block(torch.as_tensor(root_token, device=device).reshape(1)),
            context_hidden_states=context[None],
            position_ids=positions[None],
            past_key_values=self.cache,
        )
        truncate_cache(self.cache, root_position)  # keep the context, drop the block
        depth = min(self.depth, self.tree_budget)  # a tree of n nodes is at most n deep: deeper logits go unused
        log_probs = drafter.draft_logits(out.last_hidden_state[0, 1 : depth + 1]).float().log_softmax(-1)  # [D, V]
        top_lp, top_ids = log_probs.topk(min(self.top_k, log_probs.shape[-1]), dim=-1)
        tree = best_first_tree(top_lp, top_ids, self.tree_budget)
        if self.keep_producers:  # online adaptation: a depth-d node came from block position d's output, which a
            # replay of the committed context reproduces (its slot: the block position)
            depths = torch.tensor(tree.depths[1:], dtype=torch.long, device=device)  # [n]
            nodes = torch.arange(1, len(tree), device=device)
            self.note_producers(nodes, out.last_hidden_state[0, depths], depths)
        self.stats.blocks_per_iteration.append(1)
        self._account(start)
        return tree
