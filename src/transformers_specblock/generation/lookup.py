"""Free candidates: prompt lookup, an n-gram cache and the suffix cache propose chains that join the drafter's tree.

No source calls a model or reads the device: they follow each row's committed text on the host. `PromptLookup`
copies what followed earlier occurrences of the text's last n-gram (in the prompt or the generated text; several
matches give several branches); `NgramCache` walks a table of what followed every short n-gram of the committed
text so far. `FreeCandidates` merges their chains into the tree (`DraftTree.merge_chain`, or `HostTree`'s for the
free candidates alone: no duplicate siblings) with scores on the drafter's scale: a chain's node at depth d
scores the sum of the log acceptance rates `SourceScores` learnt for its kind (the source; for prompt lookup also
the matched n-gram length) at depths 1..d, so pruning to the tree budget (and `tree_budget="auto"`) ranks every
candidate by one rule, whichever source proposed it. The suffix cache (`generation.suffix_cache`: the longest
match of the text among every request the drafter served, and in this request) proposes a tree per match; its
most frequent branch scores as a chain of its kind (the match's length bucket), every other branch below that by
its frequency relative to its most frequent sibling. `FreeShadow` tells what their tree alone would have committed
at a step the drafter drafted, for `tree_budget="auto"`'s budget 0.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..models.tree_drafter.modeling_tree_drafter import TreeDraftModel
from ..models.tree_drafter.serving_state import ServingState
from .suffix_cache import Proposal, SuffixCandidates, SuffixSettings, suffix_store_of, vocabulary_fingerprint
from .tree import DraftTree, HostTree


class PromptLookup:
    """Where every n-gram (n in [min_ngram_size, max_ngram_size]) of one growing text starts, indexed on the host as
    the text grows, so the text's last n-gram is matched without scanning it (or reading the device)."""

    def __init__(self, max_ngram_size: int, min_ngram_size: int) -> None:
        self.sizes = range(min_ngram_size, max_ngram_size + 1)
        self.starts: dict[int, defaultdict[tuple[int, ...], list[int]]] = {n: defaultdict(list) for n in self.sizes}
        self.indexed = 0  # n-grams ending before this position are indexed

    def update(self, text: list[int]) -> None:
        """Index the n-grams of `text` (the whole committed text) ending before its last token, not indexed yet."""
        for end in range(self.indexed + 1, len(text)):  # the n-grams text[end - n : end]
            for n in self.sizes:
                if end >= n:
                    self.starts[n][tuple(text[end - n : end])].append(end - n)
        self.indexed = max(self.indexed, len(text) - 1)

    def chains(self, text: list[int], num_tokens: int, max_branches: int) -> list[tuple[int, list[int]]]:
        """(n, continuation) of the earlier occurrences of the text's last n-gram, longest n first, most recent first.

        Each match yields the (up to `num_tokens`) tokens that followed it; a continuation already proposed (or a
        prefix of one) is skipped, and at most `max_branches` are returned.
        """
        self.update(text)
        length = len(text)
        chains: list[tuple[int, list[int]]] = []
        for n in range(min(self.sizes.stop - 1, length - 1), self.sizes.start - 1, -1):
            for start in reversed(self.starts[n].get(tuple(text[length - n :]), ())):  # most recent first
                chain = text[start + n : start + n + num_tokens]
                if not any(other[: len(chain)] == chain for _, other in chains):
                    chains.append((n, chain))
                    if len(chains) == max_branches:
                        return chains
        return chains


def prompt_lookup_chains(
    sequence: Sequence[int] | torch.LongTensor, num_tokens: int, max_ngram_size: int, min_ngram_size: int,
    max_branches: int,
) -> list[tuple[int, list[int]]]:  # fmt: skip
    """`PromptLookup.chains` of one text [T] (prompt and generated tokens)."""
    text = sequence.tolist() if isinstance(sequence, torch.Tensor) else list(sequence)
    return PromptLookup(max_ngram_size, min_ngram_size).chains(text, num_tokens, max_branches)


class NgramCache:
    """What followed every `order`-gram of one sequence's committed text, with counts; grows as text is committed."""

    def __init__(self, order: int) -> None:
        self.order = order
        self.table: defaultdict[tuple[int, ...], Counter[int]] = defaultdict(Counter)
        self.indexed = 0  # tokens of the sequence already in the table

    def update(self, sequence: list[int]) -> None:
        """Count the n-grams of `sequence` (the whole committed text) that end after the last update."""
        for end in range(max(self.order, self.indexed), len(sequence)):
            self.table[tuple(sequence[end - self.order : end])][sequence[end]] += 1
        self.indexed = len(sequence)

    def chain(self, sequence: list[int], num_tokens: int) -> list[int]:
        """Walk the table from the text's last n-gram, taking the most frequent next token each time."""
        context, out = list(sequence[-self.order :]), []
        for _ in range(num_tokens):
            followers = self.table.get(tuple(context[-self.order :]))
            if not followers:
                break
            token = followers.most_common(1)[0][0]
            out.append(token)
            context.append(token)
        return out


@dataclass
class SourceScores:
    """Per kind of proposal (a source, and for prompt lookup the matched n-gram length) and per depth: how often a
    proposed token was accepted when the tokens before it were (a Beta(1, 1) prior). Counts fade once a depth has
    more than `memory` tries (both are scaled back to it), so the rates follow recent text. Kinds starting with one
    of `pooled` (the suffix cache's, whose kind already tells the match length) keep two rates: depth 1, and one for
    every deeper depth (the chance a token is accepted once the ones before it were), so a long copied stretch scores
    high at every depth after a few accepted chains instead of learning each depth apart; their prior is two tries
    with a mean of m / (m + 1) for a match of m tokens (a long match is likely a copy) instead of Beta(1, 1)."""

    max_depth: int = 16
    memory: float = 64.0
    pooled: tuple[str, ...] = ("suffix",)
    accepted: dict[str, list[float]] = field(default_factory=dict)
    attempted: dict[str, list[float]] = field(default_factory=dict)

    def _counts(self, kind: str) -> tuple[list[float], list[float]]:
        return (
            self.accepted.setdefault(kind, [0.0] * self.max_depth),
            self.attempted.setdefault(kind, [0.0] * self.max_depth),
        )

    def log_rates(self, kind: str, depth: int) -> list[float]:
        """Cumulative log acceptance rate of a chain of this kind at depths 1..depth: the chain's node scores."""
        hits, tries = self._counts(kind)
        total, out, last = 0.0, [], 1 if kind.startswith(self.pooled) else self.max_depth - 1
        prior = self._prior_hits(kind)
        for d in range(depth):
            k = min(d, last)
            total += math.log((hits[k] + prior) / (tries[k] + 2.0))
            out.append(total)
        return out

    def _prior_hits(self, kind: str) -> float:
        """Accepted tries of the prior's two: 1, or 2m / (m + 1) for a pooled kind "<source>:<m>"."""
        if not kind.startswith(self.pooled):
            return 1.0
        match = int(kind.rpartition(":")[2])
        return 2.0 * match / (match + 1.0)

    def record(self, kind: str, chain: list[int], children: dict[tuple[int, int], int], accepted: list[int]) -> None:
        """Count how far the verified tree tried and accepted one proposed chain.

        children: (parent node, token) -> node of the verified tree; accepted: the accepted tokens in order. A chain
        token is tried when every token before it was accepted and it survived pruning.
        """
        hits, tries = self._counts(kind)
        node, last = 0, 1 if kind.startswith(self.pooled) else self.max_depth - 1
        for d, token in enumerate(chain):
            node = children.get((node, token), -1)
            if node < 0:  # pruned away: never shown to the target
                return
            k = min(d, last)
            if tries[k] >= self.memory:  # fade the old counts
                hits[k] *= (self.memory - 1.0) / tries[k]
                tries[k] = self.memory - 1.0
            tries[k] += 1.0
            if d >= len(accepted) or accepted[d] != token:
                return
            hits[k] += 1.0


@dataclass(frozen=True)
class LookupSettings:
    """The free-candidate settings of a drafter's generation config (see `TreeGenerationConfig`)."""

    prompt_lookup_num_tokens: int = 0
    prompt_lookup_max_ngram_size: int = 3
    prompt_lookup_min_ngram_size: int = 1
    prompt_lookup_branches: int = 4
    ngram_cache_num_tokens: int = 0
    ngram_cache_order: int = 2
    suffix: SuffixSettings = SuffixSettings()

    @classmethod
    def from_config(cls, config) -> "LookupSettings":
        own = {name: getattr(config, name) for name in cls.__dataclass_fields__ if name != "suffix"}
        suffix = {name: getattr(config, name) for name in SuffixSettings.__dataclass_fields__}
        return cls(**own, suffix=SuffixSettings(**suffix))

    @property
    def enabled(self) -> bool:
        return (
            self.prompt_lookup_num_tokens > 0 or self.ngram_cache_num_tokens > 0
            or self.suffix.suffix_cache_num_tokens > 0 or self.suffix.suffix_local_num_tokens > 0
        )  # fmt: skip


def free_candidates_for(drafter: TreeDraftModel, state: ServingState | None = None) -> "FreeCandidates | None":
    """The free candidates of one `generate` call of `drafter` (None where its config turns none on), with the
    source scores learnt so far in `state` (the drafter's serving state for its target, so what one call learnt,
    which kinds of match the target accepts, carries over to the next; fresh scores without one) and the suffix
    store of the drafter that state belongs to (bound to the vocabulary of the target the drafter is bound to)."""
    settings = LookupSettings.from_config(drafter.generation_config)
    if not settings.enabled:
        return None
    suffix = settings.suffix
    states = state.owner if state is not None else drafter.serving_states
    store = suffix_store_of(states, suffix) if suffix.suffix_cache_num_tokens else None
    embedding = drafter.bound_embedding
    special_ids = state.target.config.get_text_config() if state is not None else drafter.config
    fingerprint = vocabulary_fingerprint(embedding.num_embeddings, special_ids) if embedding is not None else None
    local = suffix.suffix_cache_num_tokens or suffix.suffix_local_num_tokens
    suffix_candidates = SuffixCandidates(suffix, store, fingerprint) if local else None
    scores = state.source_scores.setdefault(settings, SourceScores()) if state is not None else SourceScores()
    return FreeCandidates(settings, scores, suffix_candidates)


class FreeCandidates:
    """The free candidate sources of one `generate` call's row: proposes their chains into a tree, learns their
    scores (`scores`, shared between calls through the drafter's serving state). They read the row's committed text
    on the host (`text`): read from the device once, then extended with the tokens the loop reads back each step."""

    def __init__(
        self, settings: LookupSettings, scores: SourceScores | None = None, suffix: SuffixCandidates | None = None
    ) -> None:
        self.settings = settings
        self.text: list[int] | None = None  # the row's committed text on the host (see `follow`)
        self.prompt_lookup = (
            PromptLookup(settings.prompt_lookup_max_ngram_size, settings.prompt_lookup_min_ngram_size)
            if settings.prompt_lookup_num_tokens else None
        )  # fmt: skip
        self.scores = scores if scores is not None else SourceScores()
        self.ngram_cache = NgramCache(settings.ngram_cache_order) if settings.ngram_cache_num_tokens else None
        self.suffix = suffix
        self.proposed: list[tuple[str, list[int]]] = []  # (kind, chain) merged into the latest tree (and learnt)
        self.streak = False  # whether the last verified tree accepted a suffix-cache chain whole
        self.long_chain = 0  # then: the longest suffix-cache chain of this tree (see `TreeCandidateGenerator`)

    def follow(self, sequence: torch.LongTensor) -> list[int]:
        """The committed text `sequence` [T] on the host: the copy `extend` keeps in step, else (the first draft of
        the call, or a text the loop did not extend) one read of the device. The sources follow one growing text."""
        if self.text is None or len(self.text) != sequence.shape[0]:
            self.text = sequence.tolist()
        return self.text

    def extend(self, tokens: list[int]) -> None:
        """Tokens committed after the text `follow` last gave (the loop reads them back with its stopping flags)."""
        if self.text is not None:
            self.text += tokens

    def add_to(self, tree: DraftTree | HostTree, text: list[int]) -> None:
        """Merge every source's chains for the committed `text` [T] (its last token is the root) into `tree`."""
        s = self.settings
        self.proposed = []
        if self.prompt_lookup is not None:
            chains = self.prompt_lookup.chains(text, s.prompt_lookup_num_tokens, s.prompt_lookup_branches)
            self.proposed += [(f"prompt_lookup:{n}", chain) for n, chain in chains]
        if self.ngram_cache is not None:
            self.ngram_cache.update(text)
            chain = self.ngram_cache.chain(text, s.ngram_cache_num_tokens)
            self.proposed += [("ngram_cache", chain)] if chain else []
        for kind, chain in self.proposed:
            tree.merge_chain(chain, self.scores.log_rates(kind, len(chain)), kind.partition(":")[0])
        for proposal in self.suffix.propose(text) if self.suffix is not None else []:
            self._merge_tree(tree, proposal)
        suffix_chains = [len(chain) for kind, chain in self.proposed if kind.startswith("suffix")]
        self.long_chain = max(suffix_chains, default=0) if self.streak else 0

    def _merge_tree(self, tree: DraftTree | HostTree, proposal: Proposal) -> None:
        """Merge a suffix-cache tree: its most frequent branch is learnt (and scored) as a chain of its kind; a
        node off it scores its parent's score, plus the kind's learnt log rate at its depth, plus the log of its
        frequency relative to its most frequent sibling."""
        nodes = proposal.nodes
        depth, score, ratio, top_child = [0] * len(nodes), [0.0] * len(nodes), [1.0] * len(nodes), {}
        for i, (_, parent, prob) in enumerate(nodes):
            depth[i] = depth[parent] + 1 if parent >= 0 else 1
            ratio[i] = prob / (nodes[parent][2] if parent >= 0 else 1.0)
            top_child.setdefault(parent, i)  # nodes come best first: a parent's first child is its most frequent
        rates = self.scores.log_rates(proposal.kind, max(depth))
        leaves = set(range(len(nodes))) - {parent for _, parent, _ in nodes}
        for i, (_, parent, _) in enumerate(nodes):
            gain = rates[depth[i] - 1] - (rates[depth[i] - 2] if depth[i] > 1 else 0.0)
            relative = ratio[i] / ratio[top_child[parent]]
            score[i] = (score[parent] if parent >= 0 else 0.0) + gain + math.log(relative)
        source = proposal.kind.partition(":")[0]
        for leaf in sorted(leaves):
            path = [leaf]
            while nodes[path[-1]][1] >= 0:
                path.append(nodes[path[-1]][1])
            path.reverse()
            tree.merge_chain([nodes[i][0] for i in path], [score[i] for i in path], source)
        main, node = [], top_child.get(-1)
        while node is not None:
            main.append(nodes[node][0])
            node = top_child.get(node)
        self.proposed.append((proposal.kind, main))

    def record(self, tree: DraftTree, accepted: list[int], eos_token_ids: set[int] = frozenset()) -> None:
        """Learn from the verified (pruned) tree and the drafted tokens the target accepted of it (in order) how far
        each proposed chain got."""
        if self.suffix is not None:
            self.suffix.accepted(accepted, eos_token_ids)
        if not self.proposed:
            return
        host = tree.host()
        children = {(p, t): i for i, (p, t) in enumerate(zip(host.parents, host.tokens))}
        self.streak = False
        for kind, chain in self.proposed:
            self.scores.record(kind, chain, children, accepted)
            self.streak |= kind.startswith("suffix") and accepted[: len(chain)] == chain

    def finish(self, sequence: torch.LongTensor) -> None:
        """The call's whole committed text [T], for the suffix store (else it keeps the text up to the last draft)."""
        if self.suffix is not None:
            self.suffix.finish(self.follow(sequence))


@dataclass
class FreeShadow:
    """The tree the free candidates alone would have verified at a drafted step (budget 0: no drafter call), scored
    against the text the target went on to commit: followed token by token (`follow`) until the text leaves it, the
    step would have committed the path it matched and the target's own next token. For greedy decoding that is
    exactly what verifying it would have committed; under sampling the same in distribution (a drafted token is
    accepted with the target's probability of it, the chance the sampled text has it). A tree the text has not left
    yet waits for the next step's tokens."""

    tree: HostTree
    node: int = 0  # the deepest node the committed text has matched so far
    matched: int = 0
    tau: float | None = None  # tokens the step would have committed, once known

    @property
    def size(self) -> int:
        return self.tree.num_drafted

    def follow(self, tokens: Sequence[int]) -> bool:
        """Follow newly committed `tokens`; returns whether the tree's tau is known now."""
        for token in tokens:
            child = next((i for i in range(self.node + 1, len(self.tree)) if self.tree.parents[i] == self.node
                          and self.tree.tokens[i] == token), None)  # fmt: skip
            if child is None:
                self.tau = self.matched + 1.0
                return True
            self.node, self.matched = child, self.matched + 1
        return False
