"""Free candidates: prompt lookup and an n-gram cache propose chains that join the drafter's tree.

Neither source calls a model. `prompt_lookup_chains` copies what followed earlier occurrences of the text's last
n-gram (in the prompt or the generated text; several matches give several branches); `NgramCache` walks a table of
what followed every short n-gram of the committed text so far. `FreeCandidates` merges their chains into the tree
(`DraftTree.merge_chain`: no duplicate siblings) with scores on the drafter's scale: a source's node at depth d
scores the sum of the log acceptance rates `SourceScores` learnt for that source at depths 1..d, so pruning to the
tree budget (and `tree_budget="auto"`) ranks every candidate by one rule, whichever source proposed it.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch

from .tree import SOURCE_BITS, DraftTree

LOOKUP_SOURCES = ("prompt_lookup", "ngram_cache")


def prompt_lookup_chains(
    sequence: torch.LongTensor, num_tokens: int, max_ngram_size: int, min_ngram_size: int, max_branches: int
) -> list[list[int]]:
    """Continuations of the earlier occurrences of the text's last n-gram, longest n first, most recent first.

    sequence: [T] committed tokens (prompt and generated). Each match at n in [min_ngram_size, max_ngram_size] yields
    the (up to `num_tokens`) tokens that followed it; a continuation already proposed (or a prefix of one) is
    skipped, and at most `max_branches` are returned.
    """
    length = sequence.shape[0]
    chains: list[list[int]] = []
    for n in range(min(max_ngram_size, length - 1), min_ngram_size - 1, -1):
        windows = sequence[: length - 1].unfold(0, n, 1)  # [T-n, n]: every n-gram ending before the last token
        starts = (windows == sequence[length - n :]).all(dim=1).nonzero().squeeze(1).flip(0)  # most recent first
        for start in starts.tolist():
            chain = sequence[start + n : start + n + num_tokens].tolist()
            if chain and not any(other[: len(chain)] == chain for other in chains):
                chains.append(chain)
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
    """Per source and depth, how often a proposed node was accepted when its parent was (a Beta(1, 1) prior)."""

    max_depth: int = 16
    accepted: dict[str, list[float]] = field(default_factory=dict)
    attempted: dict[str, list[float]] = field(default_factory=dict)

    def log_rates(self, source: str, depth: int) -> list[float]:
        """Cumulative log acceptance rate of a chain node at depths 1..depth: the chain's node scores."""
        hits = self.accepted.setdefault(source, [0.0] * self.max_depth)
        tries = self.attempted.setdefault(source, [0.0] * self.max_depth)
        total, out = 0.0, []
        for d in range(depth):
            k = min(d, self.max_depth - 1)
            total += math.log((hits[k] + 1.0) / (tries[k] + 2.0))
            out.append(total)
        return out

    def record(self, tree: DraftTree, path: torch.LongTensor) -> None:
        """Count, for every lookup source, its nodes whose parent was accepted (tried) and those accepted."""
        on_path = torch.zeros(len(tree), dtype=torch.bool, device=tree.tokens.device)
        on_path[0] = True
        on_path[path.to(on_path.device)] = True
        tried = on_path[tree.parents.clamp(min=0)]
        tried[0] = False
        for source in LOOKUP_SOURCES:
            mine = tried & ((tree.sources & SOURCE_BITS[source]) > 0)
            if not bool(mine.any()):
                continue
            depth = (tree.depths[mine] - 1).clamp(max=self.max_depth - 1)
            hits = self.accepted.setdefault(source, [0.0] * self.max_depth)
            tries = self.attempted.setdefault(source, [0.0] * self.max_depth)
            for d, accepted in zip(depth.tolist(), on_path[mine].tolist()):
                tries[d] += 1.0
                hits[d] += float(accepted)


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


class FreeCandidates:
    """The free candidate sources of one `generate` call: proposes their chains into a tree, learns their scores."""

    def __init__(self, settings: LookupSettings) -> None:
        self.settings = settings
        self.scores = SourceScores()
        self.ngram_cache = NgramCache(settings.ngram_cache_order) if settings.ngram_cache_num_tokens else None

    def add_to(self, tree: DraftTree, sequence: torch.LongTensor) -> None:
        """Merge every source's chains for the committed `sequence` [T] (its last token is the root) into `tree`."""
        s = self.settings
        if s.prompt_lookup_num_tokens:
            chains = prompt_lookup_chains(
                sequence, s.prompt_lookup_num_tokens, s.prompt_lookup_max_ngram_size, s.prompt_lookup_min_ngram_size,
                s.prompt_lookup_branches,
            )  # fmt: skip
            for chain in chains:
                tree.merge_chain(chain, self.scores.log_rates("prompt_lookup", len(chain)), "prompt_lookup")
        if self.ngram_cache is not None:
            text = sequence.tolist()
            self.ngram_cache.update(text)
            chain = self.ngram_cache.chain(text, s.ngram_cache_num_tokens)
            if chain:
                tree.merge_chain(chain, self.scores.log_rates("ngram_cache", len(chain)), "ngram_cache")

    def record(self, tree: DraftTree, path: torch.LongTensor) -> None:
        self.scores.record(tree, path)
