"""Free candidates: prompt lookup and an n-gram cache propose chains that join the drafter's tree.

Neither source calls a model. `prompt_lookup_chains` copies what followed earlier occurrences of the text's last
n-gram (in the prompt or the generated text; several matches give several branches); `NgramCache` walks a table of
what followed every short n-gram of the committed text so far. `FreeCandidates` merges their chains into the tree
(`DraftTree.merge_chain`: no duplicate siblings) with scores on the drafter's scale: a chain's node at depth d
scores the sum of the log acceptance rates `SourceScores` learnt for its kind (the source; for prompt lookup also
the matched n-gram length) at depths 1..d, so pruning to the tree budget (and `tree_budget="auto"`) ranks every
candidate by one rule, whichever source proposed it.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch

from ..models.tree_drafter.modeling_tree_drafter import TreeDraftModel
from .tree import DraftTree

def prompt_lookup_chains(
    sequence: torch.LongTensor, num_tokens: int, max_ngram_size: int, min_ngram_size: int, max_branches: int
) -> list[tuple[int, list[int]]]:
    """(n, continuation) of the earlier occurrences of the text's last n-gram, longest n first, most recent first.

    sequence: [T] committed tokens (prompt and generated). Each match at n in [min_ngram_size, max_ngram_size] yields
    the (up to `num_tokens`) tokens that followed it; a continuation already proposed (or a prefix of one) is
    skipped, and at most `max_branches` are returned.
    """
    length = sequence.shape[0]
    chains: list[tuple[int, list[int]]] = []
    for n in range(min(max_ngram_size, length - 1), min_ngram_size - 1, -1):
        windows = sequence[: length - 1].unfold(0, n, 1)  # [T-n, n]: every n-gram ending before the last token
        starts = (windows == sequence[length - n :]).all(dim=1).nonzero().squeeze(1).flip(0)  # most recent first
        for start in starts.tolist():
            chain = sequence[start + n : start + n + num_tokens].tolist()
            if chain and not any(other[: len(chain)] == chain for _, other in chains):
                chains.append((n, chain))
                if len(chains) == max_branches:
                    return chains
    return chains


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
    more than `memory` tries (both are scaled back to it), so the rates follow recent text."""

    max_depth: int = 16
    memory: float = 64.0
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
        total, out = 0.0, []
        for d in range(depth):
            k = min(d, self.max_depth - 1)
            total += math.log((hits[k] + 1.0) / (tries[k] + 2.0))
            out.append(total)
        return out

    def record(self, kind: str, chain: list[int], children: dict[tuple[int, int], int], accepted: list[int]) -> None:
        """Count how far the verified tree tried and accepted one proposed chain.

        children: (parent node, token) -> node of the verified tree; accepted: the accepted tokens in order. A chain
        token is tried when every token before it was accepted and it survived pruning.
        """
        hits, tries = self._counts(kind)
        node = 0
        for d, token in enumerate(chain):
            node = children.get((node, token), -1)
            if node < 0:  # pruned away: never shown to the target
                return
            k = min(d, self.max_depth - 1)
            if tries[k] >= self.memory:  # fade the old counts
                hits[k] *= (self.memory - 1.0) / tries[k]
                tries[k] = self.memory - 1.0
            tries[k] += 1.0
            if d >= len(accepted) or accepted[d] != token:
                return
            hits[k] += 1.0


@dataclass(frozen=True)
class LookupSettings:
    """The free-candidate settings of a drafter config (see `TreeDrafterConfig`)."""

    prompt_lookup_num_tokens: int = 0
    prompt_lookup_max_ngram_size: int = 3
    prompt_lookup_min_ngram_size: int = 1
    prompt_lookup_branches: int = 4
    ngram_cache_num_tokens: int = 0
    ngram_cache_order: int = 2

    @classmethod
    def from_config(cls, config) -> "LookupSettings":
        return cls(**{name: getattr(config, name) for name in cls.__dataclass_fields__})

    @property
    def enabled(self) -> bool:
        return self.prompt_lookup_num_tokens > 0 or self.ngram_cache_num_tokens > 0


def source_scores_for(drafter: TreeDraftModel, settings: LookupSettings) -> SourceScores:
    """The learnt source scores of `drafter` for these free-candidate settings, kept on the drafter so what one
    `generate` call learnt (which kinds of match the target accepts) carries over to the next."""
    per_settings = drafter.__dict__.setdefault("_source_scores", {})
    return per_settings.setdefault(settings, SourceScores())


class FreeCandidates:
    """The free candidate sources of one `generate` call: proposes their chains into a tree, learns their scores
    (`scores`, shared between calls through `source_scores_for`)."""

    def __init__(self, settings: LookupSettings, scores: SourceScores | None = None) -> None:
        self.settings = settings
        self.scores = scores if scores is not None else SourceScores()
        self.ngram_cache = NgramCache(settings.ngram_cache_order) if settings.ngram_cache_num_tokens else None
        self.proposed: list[tuple[str, list[int]]] = []  # (kind, chain) merged into the latest tree

    def add_to(self, tree: DraftTree, sequence: torch.LongTensor) -> None:
        """Merge every source's chains for the committed `sequence` [T] (its last token is the root) into `tree`."""
        s = self.settings
        self.proposed = []
        if s.prompt_lookup_num_tokens:
            chains = prompt_lookup_chains(
                sequence, s.prompt_lookup_num_tokens, s.prompt_lookup_max_ngram_size, s.prompt_lookup_min_ngram_size,
                s.prompt_lookup_branches,
            )  # fmt: skip
            self.proposed += [(f"prompt_lookup:{n}", chain) for n, chain in chains]
        if self.ngram_cache is not None:
            text = sequence.tolist()
            self.ngram_cache.update(text)
            chain = self.ngram_cache.chain(text, s.ngram_cache_num_tokens)
            self.proposed += [("ngram_cache", chain)] if chain else []
        for kind, chain in self.proposed:
            tree.merge_chain(chain, self.scores.log_rates(kind, len(chain)), kind.partition(":")[0])

    def record(self, tree: DraftTree, path: torch.LongTensor) -> None:
        """Learn from the verified (pruned) tree and its accepted path how far each proposed chain got."""
        if not self.proposed:
            return
        children = {(p, t): i for i, (p, t) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist()))}
        accepted = tree.tokens[path].tolist()
        for kind, chain in self.proposed:
            self.scores.record(kind, chain, children, accepted)
