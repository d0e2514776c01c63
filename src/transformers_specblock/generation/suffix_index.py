"""A suffix automaton over token sequences: the index behind the suffix-cache candidates (`generation.suffix_cache`).

`SuffixAutomaton` indexes several sequences at once (a generalized suffix automaton: every sequence starts from the
root, so no match crosses from one into the next) with the number of occurrences of every state's strings.
`Matcher` follows a growing context through it: after each token it holds the longest suffix of the context that
occurs in the index (amortised O(1) per token, so O(match) per step at most). `draft_below` grows a
frequency-scored tree from a matched state, best first, as SuffixDecoding (Oliaro et al., 2025) does from its
suffix trees: a node's probability is the product of the count ratios count(child) / count(parent) on its path.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

# Occurrence counts are raised along the suffix-link path of each new state, at most this many states deep: on
# natural text the path is short; on a long run of one token it would grow with the run (quadratic time), and only
# the counts of the run's short substrings stop growing.
MAX_COUNT_WALK = 256


class SuffixAutomaton:
    """Every substring of the indexed sequences, with its occurrence count, in at most 2 states per token."""

    def __init__(self) -> None:
        self.next: list[dict[int, int]] = [{}]  # token -> state
        self.link: list[int] = [-1]  # suffix link: the state of the longest suffix with more occurrences
        self.length: list[int] = [0]  # the longest string of each state
        self.count: list[int] = [0]  # occurrences (end positions) of each state's strings
        self.last = 0  # the state of the whole sequence being appended to
        self.tokens = 0  # tokens indexed

    def __len__(self) -> int:
        return len(self.length)

    def start_sequence(self) -> None:
        """Begin a new sequence: it is indexed from the root, apart from the ones before."""
        self.last = 0

    def add_sequence(self, tokens: list[int]) -> None:
        self.start_sequence()
        for token in tokens:
            self.append(token)

    def _new_state(self, length: int, link: int, transitions: dict[int, int], count: int) -> int:
        self.next.append(transitions)
        self.link.append(link)
        self.length.append(length)
        self.count.append(count)
        return len(self.length) - 1

    def _split(self, p: int, q: int, token: int) -> int:
        """A copy of `q` holding its strings no longer than length(p) + 1, which p's suffix path now leads to."""
        clone = self._new_state(self.length[p] + 1, self.link[q], dict(self.next[q]), self.count[q])
        self.link[q] = clone
        while p != -1 and self.next[p].get(token) == q:
            self.next[p][token] = clone
            p = self.link[p]
        return clone

    def append(self, token: int) -> None:
        """Extend the current sequence by one token."""
        last, self.tokens = self.last, self.tokens + 1
        q = self.next[last].get(token)
        if q is not None:  # the extended sequence already occurs (in an earlier sequence)
            self.last = q if self.length[q] == self.length[last] + 1 else self._split(last, q, token)
        else:
            cur = self._new_state(self.length[last] + 1, 0, {}, 0)
            p = last
            while p != -1 and token not in self.next[p]:
                self.next[p][token] = cur
                p = self.link[p]
            if p != -1:
                q = self.next[p][token]
                self.link[cur] = q if self.length[p] + 1 == self.length[q] else self._split(p, q, token)
            self.last = cur
        state, walked = self.last, 0
        while state > 0 and walked < MAX_COUNT_WALK:  # every suffix of the sequence occurs once more
            self.count[state] += 1
            state, walked = self.link[state], walked + 1


@dataclass
class Matcher:
    """The longest suffix of a growing context that occurs in an automaton: its state and length."""

    state: int = 0
    length: int = 0

    def feed(self, index: SuffixAutomaton, token: int) -> None:
        state, length = self.state, self.length
        while state and token not in index.next[state]:
            state = index.link[state]
            length = index.length[state]
        following = index.next[state].get(token)
        self.state, self.length = (following, length + 1) if following is not None else (0, 0)


@dataclass
class DraftNode:
    """A node of a drafted tree: its token, parent (-1 below the matched state), depth and log-probability."""

    token: int
    parent: int
    depth: int
    log_prob: float


def draft_below(
    index: SuffixAutomaton, state: int, max_nodes: int, min_prob: float, exclude_end: int = 0
) -> list[tuple[int, int, float]]:
    """Up to `max_nodes` continuations of the matched `state`, best first: (token, parent, probability) in an order
    where parents come first (parent -1 = a child of the match). A node's probability is the product of
    count(child) / count(parent) along its path; nodes below `min_prob` are left out. `exclude_end`: occurrences of
    the match that end the indexed text and have no continuation yet (the local index's own end), not counted."""
    out: list[tuple[int, int, float]] = []
    heap: list[tuple[float, int, int, int, int]] = []  # (-probability, tie, state, parent node, token)

    def push_children(parent_state: int, node: int, prob: float, ends: int) -> None:
        total = index.count[parent_state] - ends
        if total <= 0:
            return
        for token, child in index.next[parent_state].items():
            p = prob * index.count[child] / total
            if p >= min_prob:
                heapq.heappush(heap, (-p, len(out) + len(heap), child, node, token))

    push_children(state, -1, 1.0, exclude_end)
    while heap and len(out) < max_nodes:
        neg_p, _, child, parent, token = heapq.heappop(heap)
        out.append((token, parent, -neg_p))
        push_children(child, len(out) - 1, -neg_p, 0)
    return out
