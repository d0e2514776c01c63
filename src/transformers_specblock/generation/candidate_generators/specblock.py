"""Draft: the SpecBlock candidate generator grows a token tree block by block."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy
import torch
from transformers import DynamicCache

from ...models.specblock.modeling_specblock import SpecBlockDraftModel, followup_block_mask, host_block_causal_mask
from ...models.tree_drafter.serving_state import ServingState
from ...utils import to_device
from ..cache_utils import truncate_cache
from ..tree import HostTree
from .base import TreeCandidateGenerator, compiled_method
from .specblock_reference_tree import REFERENCE_BEAM_WIDTH, grow_reference_tree


@dataclass
class _Round:
    """One round of blocks, read back to the host once: each block's top candidates per slot, how many each slot
    takes, where its slots sit among this iteration's drafter entries and which of those entries it saw, and the
    tree node it starts from. The slot states stay on the device (a follow-up block inherits one)."""

    log_probs: list[list[list[float]]]  # [B][K][W] top draft log-probs per slot, best first
    tokens: list[list[list[int]]]  # [B][K][W] their target-vocabulary ids
    widths: list[list[int]]  # [B][K] candidates per slot (0 ends the branch)
    classes: list[list[int]]  # [B][K] predicted rank class per slot
    hidden: torch.Tensor  # [B, K, H] pre-norm slot states, on the device
    entry_offsets: list[int]  # [B] first local cache entry of each block
    inherited: numpy.ndarray  # [B, T] bool: local entries each block saw
    start_nodes: list[int]  # [B]


class SpecBlockCandidateGenerator(TreeCandidateGenerator):
    """Drafts a SpecBlock token tree for the target to verify.

    The drafter's KV cache holds K slot entries per committed position and persists across iterations: only newly
    committed positions are fed (`observe`). A tree is drafted from the last committed token: block 1 from the
    root's slots, then up to `max_blocks - 1` rounds of follow-up blocks, each round in ONE batched forward whose
    entries are cropped away afterwards. A round whose nodes could not survive pruning (each scores at most its start
    leaf's score, and `tree_budget` nodes already score higher) is skipped. `draft_tree` prunes the tree to
    `tree_budget` nodes by cumulative draft log-prob. With `block_expansion="best_first"` the last round's blocks
    are grown best first (`_expand_best_first`) instead of as chains with siblings. With
    `tree_construction="reference"` the tree is grown as the SpecBlock reference harness grows it instead
    (`specblock_reference_tree.grow_reference_tree`); with `context_feeding="reference"` the committed positions are
    fed as that harness feeds them (`_as_harness_feeds`).
    """

    def __init__(
        self,
        drafter: SpecBlockDraftModel,
        tree_budget: int | None = None,
        max_blocks: int | None = None,
        tree_policy: str | None = None,
        state: ServingState | None = None,
    ) -> None:
        super().__init__(drafter, tree_budget, state)
        config, settings = drafter.config, drafter.generation_config
        self.block_size = config.block_size
        self.max_blocks = max_blocks if max_blocks is not None else settings.max_blocks
        self.tree_policy = tree_policy if tree_policy is not None else settings.tree_policy
        self.max_followups = settings.max_followups
        self.block_expansion = settings.block_expansion
        self.tree_construction = settings.tree_construction
        self.branch_widths = list(settings.branch_widths)
        self.fixed_width = settings.fixed_width
        self.branch_width_table = torch.tensor(self.branch_widths, device=drafter.device)  # [classes]
        # the most candidates a slot can get, known on the host (each block takes this many, then masks)
        widest = self.fixed_width if self.tree_policy == "fixed" else max(self.branch_widths)
        if self.tree_construction == "reference":  # slot 0 of block 1 may take the harness's beam width
            widest = max(max(self.branch_widths), REFERENCE_BEAM_WIDTH)
        self.max_width = max(1, min(widest, config.draft_vocab_size))
        self.cache = DynamicCache()
        self.committed_entries = 0
        self.root_block: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.root_position = 0
        self.context_feeding = drafter.generation_config.context_feeding
        self.harness_positions: int | None = None  # context_feeding="reference": the harness's position counter

    # ---------------------------------------------------------------------------------------------------------
    def observe(self, target_features: torch.Tensor, next_tokens: torch.LongTensor, first_position: int) -> None:
        """Feed newly committed positions i (features f_i, token x_{i+1}) and draft block 1 from the last one.

        target_features: [P, 3 * H_target]; next_tokens: [P]; first_position: rotary position of next_tokens[0].
        A long prompt is fed `prefill_chunk_size` positions per forward (same result, bounded mask and activations).
        """
        start = time.perf_counter()
        if self.context_feeding == "reference":
            target_features, next_tokens, first_position = self._as_harness_feeds(target_features, next_tokens)
        num_pos = next_tokens.shape[0]
        chunk = self.drafter.config.prefill_chunk_size
        for offset in range(0, num_pos, chunk):
            out = self._feed(
                target_features[offset : offset + chunk], next_tokens[offset : offset + chunk], first_position + offset
            )
        self.root_block = (out.logits[:, -1], out.hidden_states[:, -1], out.rank_logits[:, -1])  # [1, K, ...]
        self.root_position = first_position + num_pos - 1
        self._account(start, forwards=-(-num_pos // chunk))

    def _as_harness_feeds(
        self, target_features: torch.Tensor, next_tokens: torch.LongTensor
    ) -> tuple[torch.Tensor, torch.LongTensor, int]:
        """One step's positions (f_r .. f_{r+a}, x_{r+1} .. x_{r+a+1}; the prompt first) as the SpecBlock reference
        harness feeds them (`_generate_once_streaming`, `prefill_and_draft`, `update_cache_and_draft`): (features,
        tokens, rotary position of the first). Its counter D of drafter positions starts at the prompt's length + 1:
        the prompt's last position is fed twice, the copy at D. A step that accepted nothing drops the last position
        fed and feeds its one position at D + 1 (D kept); one that accepted a tokens pairs f_r .. f_{r+a} with
        x_{r+2} .. x_{r+a+1}, x_{r+a+1} at D + 2 onwards (D grows by a + 2)."""
        if self.harness_positions is None:
            self.harness_positions = next_tokens.shape[0] + 1
            return torch.cat([target_features, target_features[-1:]]), torch.cat([next_tokens, next_tokens[-1:]]), 1
        if next_tokens.shape[0] == 1:
            truncate_cache(self.cache, self.committed_entries - self.block_size)
            self.committed_entries = self.cache.get_seq_length()
            return target_features, next_tokens, self.harness_positions + 1
        first_position = self.harness_positions + 2
        self.harness_positions += next_tokens.shape[0] + 1
        return target_features, torch.cat([next_tokens[1:], next_tokens[-1:]]), first_position

    def _feed(self, target_features: torch.Tensor, next_tokens: torch.LongTensor, first_position: int):
        """One drafter forward appending K slot entries per position to the drafter cache; the head runs on the last
        position only (the one whose block 1 starts the next tree)."""
        num_pos, device = next_tokens.shape[0], self.drafter.device
        mask = to_device(host_block_causal_mask(num_pos, self.block_size, self.committed_entries)[None], device)
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
    def grow_tree(self, root_token: torch.LongTensor) -> HostTree:
        """The block tree from the last committed token, whose block 1 `observe` drafted (`draft_tree` prunes).

        Grown on the host: each round's candidates are read back once (one sync per drafter forward), so choosing
        the follow-up blocks, their masks and the nodes cost no device op."""
        if self.root_block is None:
            raise RuntimeError("observe() must feed the committed context before draft_tree().")
        if self.tree_construction == "reference":
            return grow_reference_tree(self)
        start = time.perf_counter()
        k_slots = self.block_size
        tree = HostTree.root_only()
        logits, hidden, rank_logits = self.root_block
        rnd = self._read_round(logits, hidden, rank_logits, [0], numpy.zeros((1, 0), dtype=bool))
        local_entries = k_slots  # block 1 = the root position's K cached slots
        blocks = 1
        for round_idx in range(self.max_blocks):
            last_round = round_idx == self.max_blocks - 1
            nodes = self._expand_best_first(tree, rnd) if last_round and self.block_expansion == "best_first" \
                else self._expand(tree, rnd)  # fmt: skip
            if self.keep_producers:  # online adaptation: block 1's slots are the root position's own outputs
                self._note_round(nodes, rnd, first_round=round_idx == 0)
            if last_round or not nodes:  # the last round, or every branch ended (width 0)
                break
            # follow-up blocks start from the best-scoring leaves of this round (chain ends and siblings), best first
            # (ties to the older node); a block's nodes score below its start leaf: draft only the blocks, and the
            # slots, that could survive pruning to the budget (the pruned tree is the same, the forward cheaper).
            # The room falls as the score does, so those blocks are a prefix of the best leaves.
            leaves = sorted((n for n in nodes if n[3]), key=lambda n: -tree.scores[n[0]])[: self.max_followups]
            rooms = tree.room_below([tree.scores[node] for node, _, _, _ in leaves], self.tree_budget)
            chosen = [leaf for leaf, room in zip(leaves, rooms) if room > 0]
            if not chosen:
                break
            num_slots = min(max(rooms), k_slots)
            rnd = self._draft_followups(tree, rnd, [leaf[:3] for leaf in chosen], local_entries, num_slots)
            local_entries += num_slots * len(chosen)
            blocks += len(chosen)
        truncate_cache(self.cache, self.committed_entries)
        self.stats.blocks_per_iteration.append(blocks)
        self._account(start, forwards=0)
        return tree

    def _draft_followups(
        self, tree: HostTree, rnd: _Round, chosen: list[tuple[int, int, int]], local_entries: int, num_slots: int
    ) -> _Round:
        """One batched drafter forward of follow-up blocks, each (start node, its block in `rnd`, its slot) starting
        from that slot's state and the node's token, seeing what its block saw and that block's slots 0..slot;
        `local_entries` drafter entries of this iteration precede them. Returns their round."""
        k_slots = self.block_size
        parent_slots = len(rnd.widths[0])
        inherited = numpy.zeros((len(chosen), local_entries), dtype=bool)
        for row, (_, block, slot) in enumerate(chosen):  # what the parent block saw, and its slots 0..s
            inherited[row, : rnd.inherited.shape[1]] = rnd.inherited[block]
            inherited[row, rnd.entry_offsets[block] : rnd.entry_offsets[block] + slot + 1] = True
        start_nodes = [node for node, _, _ in chosen]
        device = self.drafter.device
        positions = self.drafter.followup_start_positions(self.root_position, [tree.depths[n] for n in start_nodes])
        # one copy: the start slots among the round's [B * K] states, the start tokens, their positions
        inputs = to_device([[block * parent_slots + slot for _, block, slot in chosen],
                            [tree.tokens[n] for n in start_nodes], positions], device)  # fmt: skip
        mask = followup_block_mask(inherited, num_slots, self.committed_entries - k_slots, device)  # [1, R, S]
        out = compiled_method(self.drafter, "draft_blocks")(
            rnd.hidden.flatten(0, 1)[inputs[:1]],  # [1, blocks, H]
            inputs[1:2],
            inputs[2:],
            mask,
            self.cache,
            num_slots=num_slots,
        )
        self.stats.drafter_forwards += 1
        offsets = [local_entries + num_slots * i for i in range(len(chosen))]
        return self._read_round(out.logits[0], out.hidden_states[0], out.rank_logits[0], start_nodes, inherited,
                                offsets)  # fmt: skip

    def _read_round(
        self, logits: torch.Tensor, hidden: torch.Tensor, rank_logits: torch.Tensor, start_nodes: list[int],
        inherited: numpy.ndarray, entry_offsets: list[int] | None = None,
    ) -> _Round:  # fmt: skip
        """A round's outputs (logits [B, K, Vd], slot states [B, K, H], rank logits [B, K, C]) with each slot's top
        candidates, their target-vocabulary ids and the slot widths read back in ONE host read."""
        top_lp, top_ids = logits.float().log_softmax(-1).topk(self.max_width, dim=-1)  # [B, K, W]
        # float32 holds every id exactly (vocabularies < 2^24 tokens)
        classes = rank_logits.argmax(-1, keepdim=True)
        columns = [top_lp, self.drafter.d2t[top_ids].float(), self._widths(rank_logits)[..., None].float(), classes]
        table = torch.cat(columns, dim=-1).tolist()  # [B][K][2W + 2]
        width = self.max_width
        return _Round(
            log_probs=[[slot[:width] for slot in block] for block in table],
            tokens=[[[int(t) for t in slot[width : 2 * width]] for slot in block] for block in table],
            widths=[[int(slot[-2]) for slot in block] for block in table],
            classes=[[int(slot[-1]) for slot in block] for block in table],
            hidden=hidden,
            entry_offsets=entry_offsets or [0],
            inherited=inherited,
            start_nodes=start_nodes,
        )

    def _widths(self, rank_logits: torch.Tensor) -> torch.Tensor:
        """[B, K, C] rank logits -> [B, K] candidates per slot (0 = end the branch here)."""
        if self.tree_policy == "fixed":
            return torch.full(rank_logits.shape[:2], self.fixed_width, device=rank_logits.device)
        return self.branch_width_table.to(rank_logits.device)[rank_logits.argmax(-1)]

    def _expand(self, tree: HostTree, rnd: _Round) -> list[tuple[int, int, int, bool]]:
        """Add every block's nodes: per slot its top `width` candidates while every earlier slot had one (a width-0
        slot ends the block's chain), the greedy one continuing the chain, in slot-major order (slot, block, rank)
        so parents come first. Slot k's parent is the greedy node of slot k-1 (slot 0's: the block's start node).

        Returns the new nodes as (node, block, slot, whether it is a leaf of its block: a sibling or the last slot).
        """
        k_slots = len(rnd.widths[0])
        chain_end = list(rnd.start_nodes)  # per block: the greedy node of the previous slot, or None once ended
        new = []
        for slot in range(k_slots):
            for block, parent in enumerate(chain_end):
                width = rnd.widths[block][slot] if parent is not None else 0
                if width == 0:
                    chain_end[block] = None
                    continue
                for rank in range(min(width, self.max_width)):
                    # its parent's score plus its own log-prob, capped at 0: never above its parent's, even in float
                    score = tree.scores[parent] + min(rnd.log_probs[block][slot][rank], 0.0)
                    node = tree.add_node(rnd.tokens[block][slot][rank], parent, score)
                    new.append((node, block, slot, rank > 0 or slot == k_slots - 1))
                chain_end[block] = new[-min(width, self.max_width)][0]  # the greedy node
        return new

    def _expand_best_first(self, tree: HostTree, rnd: _Round) -> list[tuple[int, int, int, bool]]:
        """Add every block's nodes best first (`block_expansion="best_first"`): slot k's top `width` candidates under
        every node of slot k - 1, up to the block's first width-0 slot. Returns them as `_expand` does (all leaves)."""
        new = []
        for block in range(len(rnd.start_nodes)):
            widths = list(itertools.takewhile(lambda width: width > 0, rnd.widths[block]))
            new += [(node, block, slot, True) for node, slot in self.grow_block_best_first(tree, rnd, block, widths)]
        return new

    def grow_block_best_first(
        self, tree: HostTree, rnd: _Round, block: int, widths: list[int]
    ) -> list[tuple[int, int]]:  # fmt: skip
        """Grow a block's slots under its start node as a best-first tree (`HostTree.grow_best_first`), slot k
        offering its top `widths[k]` candidates to every node of slot k - 1: the `tree_budget` best nodes by summed
        draft log-probability (each capped at 0). Returns (node, slot) of each new node."""
        log_probs = [[min(lp, 0.0) for lp in rnd.log_probs[block][slot][:width]] for slot, width in enumerate(widths)]
        tokens = [rnd.tokens[block][slot][:width] for slot, width in enumerate(widths)]
        return tree.grow_best_first(rnd.start_nodes[block], log_probs, tokens, self.tree_budget)

    def _note_round(self, nodes: list[tuple[int, int, int, bool]], rnd: _Round, first_round: bool) -> None:
        """Online adaptation: each new node's producing slot state (block 1's slots are the root position's own)."""
        device = rnd.hidden.device
        index = torch.tensor([[node, block, slot] for node, block, slot, _ in nodes], device=device).reshape(-1, 3)
        slots = index[:, 2]
        self.note_producers(index[:, 0], rnd.hidden[index[:, 1], slots], slots if first_round else None)
