"""Draft: the SpecBlock candidate generator grows a token tree block by block."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ...models.specblock.modeling_specblock import SpecBlockDraftModel, block_causal_mask, followup_block_mask
from ..cache_utils import truncate_cache
from ..tree import DraftTree
from .base import TreeCandidateGenerator, compiled_method


@dataclass
class _Round:
    """One round of blocks: their outputs, where each block's slots sit among this iteration's drafter entries,
    which of those entries each block sees, the tree node each block starts from and that node's depth."""

    log_probs: torch.Tensor  # [B, K, Vd]
    hidden: torch.Tensor  # [B, K, H] pre-norm slot states
    widths: torch.Tensor  # [B, K] candidates per slot (0 ends the branch)
    entry_offset: torch.Tensor  # [B] first local cache entry of each block
    inherited: torch.BoolTensor  # [B, T] local entries each block saw
    start_nodes: torch.LongTensor  # [B]


class SpecBlockCandidateGenerator(TreeCandidateGenerator):
    """Drafts a SpecBlock token tree for the target to verify.

    The drafter's KV cache holds K slot entries per committed position and persists across iterations: only newly
    committed positions are fed (`observe`). A tree is drafted from the last committed token: block 1 from the
    root's slots, then up to `max_blocks - 1` rounds of follow-up blocks, each round in ONE batched forward whose
    entries are cropped away afterwards. A round whose nodes could not survive pruning (each scores at most its start
    leaf's score, and `tree_budget` nodes already score higher) is skipped. `draft_tree` prunes the tree to
    `tree_budget` nodes by cumulative draft log-prob.
    """

    def __init__(
        self,
        drafter: SpecBlockDraftModel,
        tree_budget: int | None = None,
        max_blocks: int | None = None,
        tree_policy: str | None = None,
    ) -> None:
        super().__init__(drafter, tree_budget)
        config = drafter.config
        self.block_size = config.block_size
        self.max_blocks = max_blocks if max_blocks is not None else config.max_blocks
        self.tree_policy = tree_policy if tree_policy is not None else config.tree_policy
        self.max_followups = config.max_followups
        self.branch_widths = torch.tensor(config.branch_widths, device=drafter.device)
        # the most candidates a slot can get, known on the host (each block takes this many, then masks)
        widest = config.fixed_width if self.tree_policy == "fixed" else max(config.branch_widths)
        self.max_width = max(1, min(widest, config.draft_vocab_size))
        self.cache = DynamicCache()
        self.committed_entries = 0
        self.root_block: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.root_position = 0

    # ---------------------------------------------------------------------------------------------------------
    def observe(self, target_features: torch.Tensor, next_tokens: torch.LongTensor, first_position: int) -> None:
        """Feed newly committed positions i (features f_i, token x_{i+1}) and draft block 1 from the last one.

        target_features: [P, 3 * H_target]; next_tokens: [P]; first_position: rotary position of next_tokens[0].
        A long prompt is fed `prefill_chunk_size` positions per forward (same result, bounded mask and activations).
        """
        num_pos = next_tokens.shape[0]
        chunk = self.drafter.config.prefill_chunk_size
        start = time.perf_counter()
        for offset in range(0, num_pos, chunk):
            out = self._feed(
                target_features[offset : offset + chunk], next_tokens[offset : offset + chunk], first_position + offset
            )
        self.root_block = (out.logits[0, -1], out.hidden_states[0, -1], out.rank_logits[0, -1])
        self.root_position = first_position + num_pos - 1
        self._account(start, forwards=-(-num_pos // chunk))

    def _feed(self, target_features: torch.Tensor, next_tokens: torch.LongTensor, first_position: int):
        """One drafter forward appending K slot entries per position to the drafter cache; the head runs on the last
        position only (the one whose block 1 starts the next tree)."""
        num_pos, device = next_tokens.shape[0], self.drafter.device
        mask = block_causal_mask(num_pos, self.block_size, self.committed_entries, device)[None]
        positions = torch.arange(first_position, first_position + num_pos, device=device)[None]
        out = compiled_method(self.drafter, "draft_blocks")(
            self.drafter.project_condition(target_features)[None],
            next_tokens.to(device)[None],
            positions,
            mask,
            self.cache,
            logits_to_keep=1,
        )
        self.committed_entries = self.cache.get_seq_length()
        return out

    # ---------------------------------------------------------------------------------------------------------
    def grow_tree(self, root_token: torch.LongTensor) -> DraftTree:
        """The block tree from the last committed token, whose block 1 `observe` drafted (`draft_tree` prunes)."""
        if self.root_block is None:
            raise RuntimeError("observe() must feed the committed context before draft_tree().")
        start = time.perf_counter()
        device = self.drafter.device
        k_slots = self.block_size
        tree = DraftTree.root_only(root_token, device)
        logits, hidden, rank_logits = self.root_block
        rnd = _Round(
            log_probs=logits.float().log_softmax(-1)[None],
            hidden=hidden[None],
            widths=self._widths(rank_logits[None]),
            entry_offset=torch.zeros(1, dtype=torch.long, device=device),
            inherited=torch.zeros(1, 0, dtype=torch.bool, device=device),
            start_nodes=torch.zeros(1, dtype=torch.long, device=device),
        )
        local_entries = k_slots  # block 1 = the root position's K cached slots
        blocks = 1
        for round_idx in range(self.max_blocks):
            nodes, block_of, slot_of, leaf = self._expand(tree, rnd)
            if self.keep_producers:  # online adaptation: block 1's slots are the root position's own outputs
                self.note_producers(nodes, rnd.hidden[block_of, slot_of], slot_of if round_idx == 0 else None)
            if round_idx == self.max_blocks - 1:
                break
            if nodes.numel() == 0:  # every slot ended its branch (width 0): nothing to follow up
                break
            # follow-up blocks start from the best-scoring leaves of this round (chain ends and siblings)
            leaf_scores = torch.where(leaf, tree.scores[nodes], float("-inf"))
            top = leaf_scores.topk(min(self.max_followups, nodes.numel())).indices  # leaves first, best first
            # a block's nodes score below its start leaf: draft only the blocks, and the slots, that could survive
            # pruning to the budget (the pruned tree is the same; fewer rows make the forward cheaper). The room
            # falls as the score does, so those blocks are a prefix of `top`: decided on the device, read back once
            room = torch.where(leaf[top], tree.room_below(leaf_scores[top], self.tree_budget), 0)
            num_blocks, num_slots = torch.stack([(room > 0).sum(), room.max().clamp(max=k_slots)]).tolist()
            if num_blocks == 0:
                break
            top = top[:num_blocks]
            chosen = nodes[top]
            b, s = block_of[top], slot_of[top]
            inherited = torch.zeros(chosen.numel(), local_entries, dtype=torch.bool, device=device)
            inherited[:, : rnd.inherited.shape[1]] = rnd.inherited[b]
            parent_slots = torch.arange(rnd.hidden.shape[1], device=device)
            own = rnd.entry_offset[b, None] + parent_slots  # the parent block's entries, slots 0..s visible
            inherited.scatter_(1, own, parent_slots[None, :] <= s[:, None])
            out = compiled_method(self.drafter, "draft_blocks")(
                rnd.hidden[b, s][None],
                tree.tokens[chosen][None],
                self.drafter.followup_start_positions(self.root_position, tree.depths[chosen])[None],
                followup_block_mask(inherited, num_slots, self.committed_entries - k_slots)[None],
                self.cache,
                num_slots=num_slots,
            )
            self.stats.drafter_forwards += 1
            num_new = chosen.numel()
            rnd = _Round(
                log_probs=out.logits[0].float().log_softmax(-1),
                hidden=out.hidden_states[0],
                widths=self._widths(out.rank_logits[0]),
                entry_offset=local_entries + num_slots * torch.arange(num_new, device=device),
                inherited=inherited,
                start_nodes=chosen,
            )
            local_entries += num_slots * num_new
            blocks += num_new
        truncate_cache(self.cache, self.committed_entries)
        self.stats.blocks_per_iteration.append(blocks)
        self._account(start, forwards=0)
        return tree

    def _widths(self, rank_logits: torch.Tensor) -> torch.Tensor:
        """[B, K, C] rank logits -> [B, K] candidates per slot (0 = end the branch here)."""
        if self.tree_policy == "fixed":
            return torch.full(rank_logits.shape[:2], self.drafter.config.fixed_width, device=rank_logits.device)
        return self.branch_widths.to(rank_logits.device)[rank_logits.argmax(-1)]

    def _expand(
        self, tree: DraftTree, rnd: _Round
    ) -> tuple[torch.LongTensor, torch.LongTensor, torch.LongTensor, torch.BoolTensor]:
        """Add every block's nodes: a greedy chain plus per-slot siblings, ordered slot-major so parents come first.

        Returns the new nodes with their block, slot and whether they are leaves of their block.
        """
        num_blocks, k_slots, _ = rnd.log_probs.shape
        alive = torch.cumprod(rnd.widths > 0, dim=1).bool()  # a width-0 slot ends the chain there
        top_lp, top_ids = rnd.log_probs.topk(self.max_width, dim=-1)  # [B, K, W]
        rank = torch.arange(self.max_width, device=top_ids.device)
        take = alive[..., None] & (rank < rnd.widths[..., None])  # [B, K, W]
        # slot-major order: (slot, block, rank)
        take_sk = take.transpose(0, 1)
        slot, block, rk = take_sk.nonzero(as_tuple=True)
        node_ids = torch.full(take_sk.shape, -1, dtype=torch.long, device=top_ids.device)
        node_ids[slot, block, rk] = torch.arange(len(tree), len(tree) + slot.numel(), device=top_ids.device)
        greedy_prev = node_ids[(slot - 1).clamp(min=0), block, 0]
        parents = torch.where(slot == 0, rnd.start_nodes[block], greedy_prev)
        tokens = self.drafter.d2t[top_ids[block, slot, rk]]
        # a node's score is its parent's plus its own log-prob (<= 0), so it never exceeds its parent's in float;
        # the parent of slot k is the greedy node of slot k-1 (or the block's start node for slot 0)
        top_lp = top_lp.clamp(max=0.0)
        parent_scores = [tree.scores[rnd.start_nodes]]  # [B] per slot
        for k in range(1, k_slots):
            parent_scores.append(parent_scores[-1] + top_lp[:, k - 1, 0])
        parent_score = torch.stack(parent_scores, dim=1)  # [B, K]
        depths = tree.depths[rnd.start_nodes[block]] + slot + 1
        scores = parent_score[block, slot] + top_lp[block, slot, rk]
        new = tree.add_nodes(tokens, parents, depths, scores, max_depth=tree.depth_bound + k_slots)
        leaf = (rk > 0) | (slot == k_slots - 1)  # siblings, and chains that reached the block's last slot
        return new, block, slot, leaf
