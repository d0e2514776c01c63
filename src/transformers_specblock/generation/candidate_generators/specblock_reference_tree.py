"""SpecBlock trees grown the way the method's reference implementation grows them (`tree_construction="reference"`).

The authors' inference harness (github shiweijiezero/SpecBlock, `benchmarks_hf/algorithms/_specblock_base.py`,
`_build_tree_from_block1` at `SpecBlockAlgorithm._PARETO_DEFAULTS`: slot widths `branch_widths` per rank class,
`ADAPTIVE_SLOT0=1`, `ADAPTIVE_ALL=1`, beam width 10, `tree_budget` tree tokens, `max_blocks` block steps) grows:

- block 1: the greedy chain of all K slots; slot 0 takes 3 / 5 / 8 / 10 candidates by its greedy probability
  (>= 0.9 / 0.8 / 0.6 / below) whatever its rank class, slot k >= 1 `branch_widths[class]`, at most 2 / 3 above
  greedy probability 0.95 / 0.85 (a give-up class of width 0 ends the branching there);
- a follow-up block from every branching slot's greedy node, every sibling, and the chain end unless the rank walk
  gives up (the first slot not of class 0 is of the last class); all in one drafter forward;
- in a follow-up block, the greedy chain of all K slots and at every slot the same narrowed widths (slot 0 too);
  further rounds start from the same kinds of nodes (the chain end where no slot gave up), the best
  min(10, (budget - nodes) // K) of them by score;
- then prunes to `tree_budget` nodes by cumulative draft log-probability, duplicates counted.

With `block_expansion="best_first"` the last round's blocks (block 1 where `max_blocks` is 1) are grown best first
instead, each slot offering the candidates these widths give it (at least its greedy one).

The last round drafts only the follow-up blocks, and slots, that could place a node in the pruned tree
(`HostTree.room_below`; the harness drafts them all and prunes them away): the same tree from fewer drafted blocks,
at 4 nodes 3 of the about 21 the harness drafts.

The harness's tree may hold a token twice under one parent (a follow-up block from a mid-chain greedy node repeats
block 1's next slot); here such siblings are merged after pruning (the accepted tokens are the same, the target
verifies fewer nodes).

With online adaptation on, each node of the pruned, merged tree is noted with the drafter state that proposed it
(`note_producers`), as the package's own construction notes them.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import numpy
import torch

from ..cache_utils import truncate_cache
from ..tree import HostTree

if TYPE_CHECKING:
    from .specblock import SpecBlockCandidateGenerator, _Round

REFERENCE_BEAM_WIDTH = 10  # the harness's beam width (run_eval's top-k): block 1's widest slot 0, blocks per round
SLOT0_WIDTHS = ((0.9, 3), (0.8, 5), (0.6, 8))  # block 1's slot 0: (greedy probability at least, candidates)
NARROWED_WIDTHS = ((0.95, 2), (0.85, 3))  # other slots: (greedy probability at least, candidates at most)


def slot_widths(
    probs: list[float], classes: list[int], branch_widths: list[int], first_block: bool
) -> tuple[list[int], bool]:
    """Candidates per slot of one block (greedy included; <= 1: the slot does not branch) and whether a give-up class
    of width 0 stopped the branching."""
    give_up = len(branch_widths) - 1
    widths = [0] * len(probs)
    for slot, (prob, rank_class) in enumerate(zip(probs, classes)):
        base = branch_widths[rank_class]
        if first_block and slot == 0:
            widths[0] = next((w for bound, w in SLOT0_WIDTHS if prob >= bound), REFERENCE_BEAM_WIDTH)
            continue
        if rank_class == give_up and base == 0:
            return widths, True
        widths[slot] = next((min(w, base) for bound, w in NARROWED_WIDTHS if prob >= bound), base)
    return widths, False


def grow_reference_tree(generator: SpecBlockCandidateGenerator) -> HostTree:
    """The reference harness's tree from the root's block 1 (`generator.root_block`), pruned to the generator's
    `tree_budget`, equal siblings merged."""
    start = time.perf_counter()
    k_slots, budget = generator.block_size, generator.tree_budget
    branch_widths = generator.branch_widths
    tree = HostTree.root_only()
    rnd = generator._read_round(*generator.root_block, [0], numpy.zeros((1, 0), dtype=bool))
    best_first = generator.block_expansion == "best_first"
    producers = _Producers(generator.keep_producers)
    if best_first and generator.max_blocks == 1:
        producers.note(rnd, _grow_best_first(generator, tree, rnd, 0, first_block=True), first_round=True)
        pending = []
    else:
        chain = _greedy_chain(tree, rnd, 0, 0)
        new = _add_alternatives(tree, rnd, 0, chain, branch_widths, first_block=True)[0]
        producers.note(rnd, _chain_nodes(chain, 0) + _alternative_nodes(new), first_round=True)
        pending = _order_pending(new)
        first_off_class = next((c for c in rnd.classes[0] if c != 0), 0)
        if first_off_class != len(branch_widths) - 1 and (chain[-1], 0, k_slots - 1) not in pending:
            pending.append((chain[-1], 0, k_slots - 1))  # the chain end, unless the rank walk gives up
    local_entries, blocks = k_slots, 1
    for depth in range(1, generator.max_blocks):
        num_slots = k_slots
        if depth == generator.max_blocks - 1:  # the last round: only the blocks and slots pruning could keep
            rooms = tree.room_below([tree.scores[node] for node, _, _ in pending], budget)
            pending = [start for start, room in zip(pending, rooms) if room > 0]
            num_slots = min(max(rooms, default=0), k_slots)
        if not pending:
            break
        rnd = generator._draft_followups(tree, rnd, pending, local_entries, num_slots)
        local_entries, blocks = local_entries + num_slots * len(pending), blocks + len(pending)
        if best_first and depth == generator.max_blocks - 1:
            for block in range(len(pending)):
                producers.note(rnd, _grow_best_first(generator, tree, rnd, block, first_block=False), first_round=False)
            break
        chains = [_greedy_chain(tree, rnd, block, node) for block, (node, _, _) in enumerate(pending)]
        pending, ends = [], []
        for block, chain in enumerate(chains):
            new, stopped = _add_alternatives(tree, rnd, block, chain, branch_widths, first_block=False)
            producers.note(rnd, _chain_nodes(chain, block) + _alternative_nodes(new), first_round=False)
            pending += new
            branching = {entry[2] for entry in new}
            if not stopped and k_slots - 1 not in branching:
                ends.append((chain[-1], block, k_slots - 1))
        pending = _order_pending(pending) + ends
        if depth + 1 < generator.max_blocks:
            pending = _best(tree, pending, min(REFERENCE_BEAM_WIDTH, max(1, (budget - len(tree) + 1) // k_slots)))
    truncate_cache(generator.cache, generator.committed_entries)
    generator.stats.blocks_per_iteration.append(blocks)
    kept = tree.kept_after_pruning(budget)
    merged, where = _merged_siblings(tree.prune(budget))
    producers.hand_to(generator, kept, where, len(tree))
    generator._account(start, forwards=0)
    return merged


class _Producers:
    """With online adaptation on, the drafter state behind every node grown (`note`), handed to the generator with
    the nodes' indices in the pruned, merged tree (`hand_to`)."""

    def __init__(self, active: bool) -> None:
        self.active = active
        self.noted: list[tuple[torch.LongTensor, torch.Tensor, torch.LongTensor | None]] = []

    def note(self, rnd: _Round, nodes: list[tuple[int, int, int]], first_round: bool) -> None:
        """`nodes`: (node, block, slot) of the round `rnd` (block 1's slots are the root position's own outputs)."""
        if not self.active or not nodes:
            return
        index = torch.tensor(nodes, device=rnd.hidden.device)
        states = rnd.hidden[index[:, 1], index[:, 2]]
        self.noted.append((index[:, 0], states, index[:, 2] if first_round else None))

    def hand_to(self, generator: SpecBlockCandidateGenerator, kept: list[int], where: list[int], grown: int) -> None:
        """Note the producers of the nodes that survived pruning (`kept`: grown indices, `where`: their index after
        merging), as `note_producers` takes them."""
        if not self.noted:
            return
        final = torch.full((grown,), -1, dtype=torch.long)
        final[torch.tensor(kept)] = torch.tensor(where)
        for nodes, states, slots in self.noted:
            new = final[nodes.cpu()].to(nodes.device)
            survived = new >= 0
            generator.note_producers(new[survived], states[survived], slots[survived] if slots is not None else None)


def _chain_nodes(chain: list[int], block: int) -> list[tuple[int, int, int]]:
    return [(node, block, slot) for slot, node in enumerate(chain)]


def _alternative_nodes(new: list[tuple[int, int, int, bool]]) -> list[tuple[int, int, int]]:
    """The nodes `_add_alternatives` added (its greedy entries are the chain's)."""
    return [(node, block, slot) for node, block, slot, greedy in new if not greedy]


def _grow_best_first(generator: SpecBlockCandidateGenerator, tree: HostTree, rnd: _Round, block: int,
                     first_block: bool) -> list[tuple[int, int, int]]:  # fmt: skip
    """`block_expansion="best_first"`: the block's slots as a best-first tree, each slot offering the candidates the
    harness's widths give it, at least its greedy one (the chain goes on past a give-up slot, as the harness's does).
    Returns (node, block, slot) of each new node."""
    probs = [math.exp(slot[0]) for slot in rnd.log_probs[block]]
    widths, _ = slot_widths(probs, rnd.classes[block], generator.branch_widths, first_block)
    grown = generator.grow_block_best_first(tree, rnd, block, [max(1, width) for width in widths])
    return [(node, block, slot) for node, slot in grown]


def _greedy_chain(tree: HostTree, rnd: _Round, block: int, parent: int) -> list[int]:
    """The block's greedy token at every slot, a chain under `parent`; returns its nodes."""
    chain = []
    for slot in range(len(rnd.tokens[block])):
        score = tree.scores[parent] + min(rnd.log_probs[block][slot][0], 0.0)
        parent = tree.add_node(rnd.tokens[block][slot][0], parent, score)
        chain.append(parent)
    return chain


def _add_alternatives(
    tree: HostTree, rnd: _Round, block: int, chain: list[int], branch_widths: list[int], first_block: bool
) -> tuple[list[tuple[int, int, int, bool]], bool]:
    """A block's candidates after the greedy one at each branching slot, slot by slot, under the previous slot's
    greedy node. Returns the follow-up starts this adds - (node, block, slot, is_greedy): the branching slot's greedy
    node, then its alternatives - and whether a give-up slot stopped the branching."""
    probs = [math.exp(slot[0]) for slot in rnd.log_probs[block]]
    widths, stopped = slot_widths(probs, rnd.classes[block], branch_widths, first_block)
    new = []
    for slot, width in enumerate(widths):
        if width <= 1:
            continue
        parent = chain[slot - 1] if slot else rnd.start_nodes[block]
        new.append((chain[slot], block, slot, True))
        for rank in range(1, min(width, len(rnd.tokens[block][slot]))):
            score = tree.scores[parent] + min(rnd.log_probs[block][slot][rank], 0.0)
            new.append((tree.add_node(rnd.tokens[block][slot][rank], parent, score), block, slot, False))
    return new, stopped


def _order_pending(new: list[tuple[int, int, int, bool]]) -> list[tuple[int, int, int]]:
    """The harness's order of follow-up starts: the branching slots' greedy nodes, then the alternatives."""
    return [entry[:3] for entry in new if entry[3]] + [entry[:3] for entry in new if not entry[3]]


def _best(tree: HostTree, pending: list[tuple[int, int, int]], keep: int) -> list[tuple[int, int, int]]:
    """The `keep` best-scoring follow-up starts, in their order."""
    if len(pending) <= keep:
        return pending
    chosen = sorted(range(len(pending)), key=lambda i: -tree.scores[pending[i][0]])[:keep]
    return [pending[i] for i in sorted(chosen)]


def merge_equal_siblings(tree: HostTree) -> HostTree:
    """`tree` with siblings of one token merged into the first (its score the best of theirs; children moved)."""
    return _merged_siblings(tree)[0]


def _merged_siblings(tree: HostTree) -> tuple[HostTree, list[int]]:
    """`merge_equal_siblings`, and where each node of `tree` went."""
    out = HostTree.root_only(tree.tokens[0])
    where, children = [0], {}
    for node in range(1, len(tree)):
        parent = where[tree.parents[node]]
        key = (parent, tree.tokens[node])
        if key in children:
            out.scores[children[key]] = max(out.scores[children[key]], tree.scores[node])
        else:
            children[key] = out.add_node(tree.tokens[node], parent, tree.scores[node])
        where.append(children[key])
    return out, where
