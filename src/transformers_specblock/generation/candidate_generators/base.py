"""The base of the tree candidate generators: a drafter KV cache kept across iterations, context read lazily, free
candidates (prompt lookup, n-gram cache, suffix cache) merged into every tree before it is pruned to the budget."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ...models.tree_drafter.generation_config import AUTO
from ...models.tree_drafter.modeling_tree_drafter import TreeDraftModel
from ...models.tree_drafter.serving_state import ServingState
from ...utils import sync
from ..lookup import FreeShadow, free_candidates_for
from ..tree import SOURCE_BITS, UNKNOWN_ROOT, DraftTree, HostTree

PLAIN_SHADOW_INTERVAL = 4  # under "auto", every 4th plain step scores the free candidates' tree alone (`plain_step`)


_COMPILED: dict[tuple[type, str], Callable[..., Any]] = {}  # (drafter class, method) -> compiled function


def compiled_method(drafter: TreeDraftModel, name: str) -> Callable[..., Any]:
    """`drafter.<name>`, under `torch.compile` when `drafter.generation_config.compile_drafter` (inductor; CUDA graphs
    via mode="reduce-overhead" on a GPU; dynamic shapes): compiled once per drafter class and method, for every call."""
    if not drafter.generation_config.compile_drafter:
        return drafter if name == "forward" else getattr(drafter, name)  # a module's forward runs through its hooks
    key = (type(drafter), name)
    if key not in _COMPILED:
        mode = "reduce-overhead" if drafter.device.type == "cuda" else None
        _COMPILED[key] = torch.compile(getattr(type(drafter), name), dynamic=True, mode=mode)
    return functools.partial(_COMPILED[key], drafter)


@dataclass
class DraftingStats:
    """Drafter-side counters of one `generate` call."""

    drafter_forwards: int = 0
    drafter_time_s: float = 0.0
    blocks_per_iteration: list[int] = field(default_factory=list)
    accepted_per_source: list[int] = field(default_factory=lambda: [0] * len(SOURCE_BITS))

    def count_accepted(self, sources: list[int]) -> None:
        """Count accepted nodes per source (`sources`: their source bit masks, from the tree's host copy)."""
        for i, bit in enumerate(SOURCE_BITS.values()):
            self.accepted_per_source[i] += sum(1 for mask in sources if mask & bit)

    @property
    def accepted_by_source(self) -> dict[str, int]:
        """Accepted drafted tokens each source proposed."""
        return dict(zip(SOURCE_BITS, self.accepted_per_source))


class TreeCandidateGenerator:
    """Drafts token trees for the target to verify, keeping its own drafter KV cache across iterations.

    Not a transformers `CandidateGenerator`: that interface proposes one chain (`get_candidates`) for the stock
    loop to verify, and a tree cannot be passed through it; the package's loop (`generation.decoding`) drives this
    one.

    The loop `queue`s the target features of newly committed positions; `read_queued` feeds them to the drafter
    (`observe`, one call however many steps were queued) right before `draft_tree` grows a tree from the last
    committed token, so a drafter that skips steps (tree_budget="auto" choosing 0) reads nothing until it drafts.
    `draft_tree` merges the free candidates (`generation.lookup`) into the drafter's tree and prunes the whole to
    the budget; `record_verified` and `commit_tokens` (the step's tokens, as the loop read them back) tell them what
    the target accepted. Subclasses implement `observe` and `grow_tree`; drafter time and forwards are counted in
    `stats`.
    """

    reads_features = True  # whether `observe` needs the target's hidden states (else it gets [P, 0] features)
    grows_trees = True  # whether `grow_tree` drafts (else every tree is the free candidates' alone)

    def __init__(
        self, drafter: TreeDraftModel, tree_budget: int | None = None, state: ServingState | None = None
    ) -> None:
        self.drafter = drafter
        budget = tree_budget if tree_budget is not None else drafter.generation_config.tree_budget
        self.free_candidates = free_candidates_for(drafter, state)
        # under "auto" the loop sets how budget 0 sizes the free candidates' tree alone; each drafted step then also
        # scores that tree (`FreeShadow`) against the text the target commits next until the text leaves it, and the
        # loop takes what it would have committed (`take_free_alone`)
        self.size_free_alone: Callable[[HostTree], HostTree] | None = None
        self.shadows: list[FreeShadow] = []
        self.free_alone: list[FreeShadow] = []
        self.plain_steps = 0
        if budget == AUTO:  # the loop sets the budget every iteration; start from the largest candidate (candidates
            budget = max(1, *drafter.generation_config.auto_budget_candidates)  # [0]: never drafts, settings still check)
        self.tree_budget = budget
        self.stats = DraftingStats()
        self.queued: list[tuple[torch.Tensor, torch.LongTensor]] = []  # (features [P, 3H], next tokens [P])
        self.unread_positions = 0  # positions queued and not read yet: what the next draft first catches up on
        self.queued_first_position = 0
        self.has_read = False  # whether the drafter has read any context yet
        self.verified: DraftTree | None = None  # the last verified tree, until the loop commits its tokens
        eos = getattr(drafter.config, "eos_token_id", None)
        self.eos_token_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        # online adaptation (`generation.adaptation`) turns these on: which drafter state gave each drafted node's
        # distribution, the drafter's unpruned tree, and the last committed positions (for replaying them)
        self.keep_producers = False
        # (nodes [n], the states [n, H] they were drafted from, their block-1 slot [n] or None: see note_producers)
        self.producers: list[tuple[torch.LongTensor, torch.Tensor, torch.LongTensor | None]] = []
        self.drafted: DraftTree | None = None
        self.context_size = 0
        self.context: tuple[torch.Tensor, torch.LongTensor, torch.LongTensor] | None = None  # features, tokens, pos

    def queue(self, target_features: torch.Tensor, next_tokens: torch.LongTensor, first_position: int) -> None:
        """Remember committed positions for the drafter to read before its next draft (see `observe`)."""
        if not self.queued:
            self.queued_first_position = first_position
        self.queued.append((target_features, next_tokens))
        self.unread_positions += next_tokens.shape[0]
        if self.context_size:
            self._extend_context(target_features, next_tokens, first_position)

    def _extend_context(self, features: torch.Tensor, tokens: torch.LongTensor, first_position: int) -> None:
        """Keep the last `context_size` committed positions (features [C, 3H], tokens [C], rotary positions [C])."""
        positions = torch.arange(first_position, first_position + tokens.shape[0], device=tokens.device)
        if self.context is not None:
            features, tokens, positions = (
                torch.cat([old, new]) for old, new in zip(self.context, (features, tokens, positions))
            )
        self.context = (features[-self.context_size :], tokens[-self.context_size :], positions[-self.context_size :])


    def read_queued(self) -> int:
        """Feed every queued position to the drafter in one `observe`; returns how many steps were queued."""
        steps = len(self.queued)
        if steps:
            features = torch.cat([f for f, _ in self.queued]) if steps > 1 else self.queued[0][0]
            tokens = torch.cat([t for _, t in self.queued]) if steps > 1 else self.queued[0][1]
            self.observe(features, tokens, first_position=self.queued_first_position)
            self.queued.clear()
            self.unread_positions = 0
            self.has_read = True
        return steps

    def observe(self, target_features: torch.Tensor, next_tokens: torch.LongTensor, first_position: int) -> None:
        """Feed newly committed positions i (target features f_i [P, 3H], tokens x_{i+1} [P]); `first_position`
        is the rotary position of next_tokens[0]."""
        raise NotImplementedError

    def grow_tree(self, root_token: torch.LongTensor) -> HostTree:
        """The drafter's tree rooted at the last committed token `root_token` ([1], on the device: no host read),
        grown on the host (its root token `UNKNOWN_ROOT` there)."""
        raise NotImplementedError

    def draft_tree(self, sequence: torch.LongTensor, with_drafter: bool = True) -> DraftTree:
        """The drafter's tree for the committed tokens `sequence` [T] (the last one is the root), with the free
        candidates merged in, pruned to `tree_budget` drafted nodes; without the drafter (or where `grow_tree` does
        not draft), the free candidates alone, built on the host (`_free_tree`), or the root alone. Under
        tree_budget="auto", a suffix-cache chain following one the target accepted whole may go past the budget (up
        to the largest candidate): a long copy keeps being verified long."""
        self.producers = []
        if not (with_drafter and self.grows_trees):
            self.drafted = None
            if self.free_candidates is not None:
                return self._free_tree(sequence)
            return DraftTree.root_only(sequence[-1:], self.drafter.device)
        return self._finish_host_tree(self.grow_tree(sequence[-1:]), sequence)

    def plain_step(self, sequence: torch.LongTensor) -> None:
        """A plain step under "auto" (the root alone is verified) after the committed tokens `sequence` [T]: every
        `PLAIN_SHADOW_INTERVAL`-th one still builds the free candidates' tree alone on the host, sized as budget 0
        would verify it, and scores it against the text the target commits (`FreeShadow`), so the estimate that
        decides whether they pay stays fresh while plain steps are chosen (their lookups, not the drafter, cost time:
        counted as drafting)."""
        self.plain_steps += 1
        if self.free_candidates is None or self.size_free_alone is None or self.plain_steps % PLAIN_SHADOW_INTERVAL:
            return
        start = time.perf_counter()
        largest = max(self.drafter.generation_config.auto_budget_candidates)
        self.shadows.append(FreeShadow(self.size_free_alone(self._free_host_tree(sequence).prune(largest))))
        self._account(start, forwards=0)

    def _finish_host_tree(self, tree: HostTree, sequence: torch.LongTensor) -> DraftTree:
        """A drafter's host-grown tree with the free candidates merged in, pruned, on the device (one copy)."""
        start = time.perf_counter()
        device, root = self.drafter.device, sequence[-1:]
        budget = self.tree_budget
        if self.free_candidates is not None:
            text = self.free_candidates.follow(sequence)
            tree.tokens[0] = text[-1]
            self.free_candidates.add_to(tree, text)
            if self.size_free_alone is not None:  # budget 0's tree: pruned as `_free_tree` prunes it, then sized
                largest = max(self.drafter.generation_config.auto_budget_candidates)
                self.shadows.append(FreeShadow(self.size_free_alone(tree.free_part().prune(largest))))
            budget = self._free_budget()
        # online adaptation reads the unpruned tree's nodes (`note_producers` gave their indices)
        self.drafted = tree.to_device(device, root) if self.keep_producers else None
        pruned = tree.prune(budget).to_device(device, root if tree.tokens[0] == UNKNOWN_ROOT else None)
        self._account(start, forwards=0)
        return pruned

    def _free_tree(self, sequence: torch.LongTensor) -> DraftTree:
        """The free candidates' tree alone: built and pruned on the host, copied to the device once (no read)."""
        start = time.perf_counter()
        pruned = self._free_host_tree(sequence).prune(self._free_budget()).to_device(self.drafter.device)
        self._account(start, forwards=0)
        return pruned

    def _free_host_tree(self, sequence: torch.LongTensor) -> HostTree:
        """The free candidates' chains for the committed tokens `sequence` [T], merged into a host tree (unpruned)."""
        text = self.free_candidates.follow(sequence)
        tree = HostTree.root_only(text[-1])
        self.free_candidates.add_to(tree, text)
        return tree

    def _free_budget(self) -> int:
        """The budget; under tree_budget="auto" a stretch being copied is verified whole, past it (see
        `draft_tree`)."""
        if self.drafter.generation_config.tree_budget != AUTO:
            return self.tree_budget
        largest = max(self.drafter.generation_config.auto_budget_candidates)
        return max(self.tree_budget, min(self.free_candidates.long_chain, largest))

    def note_producers(
        self, nodes: torch.LongTensor, states: torch.Tensor, root_slots: torch.LongTensor | None = None
    ) -> None:
        """Record (when adaptation asks) that each of `nodes` [n] was drafted from the distribution of the drafter's
        pre-norm state `states[i]` [n, H] (siblings share one state; DFlash: its normed block output). `root_slots`
        [n]: the slot of the root position's own output that state is (SpecBlock's block 1; EAGLE-3's root output is
        slot 0; DFlash: the block position), which a replay of the committed context reproduces; None for states of
        follow-up blocks or expansion rounds."""
        if self.keep_producers:
            self.producers.append((nodes, states.detach(), root_slots))

    def record_verified(self, tree: DraftTree, path: list[int]) -> None:
        """What the target accepted of a verified tree (`path`: the accepted nodes): counted per source; the free
        candidates learn it once the step's tokens reach the host (`commit_tokens`)."""
        if path:  # (a root-only tree may not have a host copy: nothing to count)
            sources = tree.host().sources
            self.stats.count_accepted([sources[node] for node in path])
        self.verified = tree

    def commit_tokens(self, tokens: list[int], kept: int) -> None:
        """The step's new tokens as the loop read them back (the accepted drafted tokens, then the target's own
        token), of which the row kept the first `kept` (a stop may cut them): the free candidates learn what the
        last verified tree got accepted and extend their copy of the text."""
        if self.free_candidates is not None:
            if self.verified is not None:
                self.free_candidates.record(self.verified, tokens[:-1], self.eos_token_ids)
            self.free_candidates.extend(tokens[:kept])
        for shadow in self.shadows:
            if shadow.follow(tokens[:kept]):
                self.free_alone.append(shadow)
        self.shadows = [shadow for shadow in self.shadows if shadow.tau is None]
        self.verified = None

    def take_free_alone(self) -> list[FreeShadow]:
        """The free candidates' trees of drafted steps whose tau the committed text now tells (see `FreeShadow`)."""
        taken, self.free_alone = self.free_alone, []
        return taken

    def finish(self, sequence: torch.LongTensor) -> None:
        """The call is over: `sequence` [T] is its whole committed text (the suffix store remembers it)."""
        if self.free_candidates is not None:
            self.free_candidates.finish(sequence)

    def _account(self, start: float, forwards: int = 1) -> None:
        sync(self.drafter.device)
        self.stats.drafter_forwards += forwards
        self.stats.drafter_time_s += time.perf_counter() - start
