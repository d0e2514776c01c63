"""Suffix-cache candidates: continuations of the longest earlier occurrence of the context, within this request and
across every request a drafter served.

`SuffixStore` is a drafter object's memory of the prompts and answers it served (`suffix_cache_for(drafter)`),
shared by all its `generate` calls (and batch rows): a suffix automaton (`generation.suffix_index`) over the last
requests, bounded by `suffix_cache_max_tokens` and `suffix_cache_max_requests` (oldest requests evicted first, and
the index rebuilt from the rest). It is guarded by a lock, so threads serving one drafter may share it; it lives on
the drafter object only, `save_pretrained` never writes it (it holds users' text): `save` / `load` do, when asked.
The store holds token ids, so it belongs to a vocabulary, not to one set of weights: any target of the vocabulary it
first served (the same size and special-token ids: the same model in another dtype, a fine-tune of the same tokenizer)
shares it; a target of another vocabulary, whose ids mean other text, is refused until `reset`. Which targets share
one tokenizer the models cannot tell (two tokenizers may have the same size): the memory is shared by exactly the
targets the user serves with one drafter object.

`SuffixCandidates` is one request's side: a matcher following its committed text through the store, and (with
`suffix_local_num_tokens`) its own automaton over its prompt and answer so far. Each step it proposes the
frequency-scored tree below the longest match, sized by the match length (as SuffixDecoding: at most
`suffix_cache_spec_factor` x match length nodes); the request joins the store when it ends.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from .suffix_index import Matcher, SuffixAutomaton, draft_below

STORE_FORMAT = "transformers-specblock-suffix-cache/2"
OLDER_FORMATS = ("transformers-specblock-suffix-cache/1",)  # their fingerprint: [vocabulary size, embedding signs]
RESYNC_TOKENS = 256  # a matcher re-matches at most this much of its context when the store's index changes
MATCH_BUCKETS = (1, 2, 3, 4, 8, 16)  # a proposal's kind: the largest bucket <= match length


@dataclass(frozen=True)
class SuffixSettings:
    """The suffix-cache settings of a drafter config (see `TreeDrafterConfig`)."""

    suffix_cache_num_tokens: int = 0
    suffix_local_num_tokens: int = 0
    suffix_cache_spec_factor: float = 4.0
    suffix_cache_min_token_prob: float = 0.1
    suffix_cache_max_tokens: int = 65536
    suffix_cache_max_requests: int = 256


@dataclass
class Proposal:
    """A tree below one match: `kind` (where and how long the match was), nodes as (token, parent, probability)
    with parents first (parent -1 = a child of the root)."""

    kind: str
    nodes: list[tuple[int, int, float]]


def match_bucket(length: int) -> int:
    return max(b for b in MATCH_BUCKETS if b <= length)


def vocabulary_fingerprint(vocab_size: int, config: Any) -> list[int | None]:
    """What identifies a vocabulary: its size and the ids of its special tokens (from the target's `config`, or the
    drafter's, which copies them); a lone id list gives its first."""
    ids = [getattr(config, f"{name}_token_id", None) for name in ("bos", "eos", "pad")]
    return [vocab_size, *(i[0] if isinstance(i, list) and i else i if isinstance(i, int) else None for i in ids)]


def same_vocabulary(stored: list[int | None], fingerprint: list[int | None]) -> bool:
    """Whether two fingerprints name one vocabulary (an id a fingerprint lacks, None, matches any)."""
    return all(a is None or b is None or a == b for a, b in zip(stored, fingerprint)) and stored[0] == fingerprint[0]


class SuffixStore:
    """A drafter object's bounded memory of served requests (prompt + answer token ids), indexed for matching."""

    def __init__(self, max_tokens: int, max_requests: int) -> None:
        self.max_tokens, self.max_requests = max_tokens, max_requests
        self.lock = threading.Lock()  # every public method takes it (not re-entrant: see `_submit`)
        self.requests: deque[list[int]] = deque()
        self.tokens = 0
        self.index = SuffixAutomaton()
        self.version = 0  # bumped whenever the index changes (matchers re-synchronise)
        self.fingerprint: list[int | None] | None = None
        self.pending: deque[list[int]] = deque()  # finished requests not indexed yet (see SuffixCandidates)

    def __len__(self) -> int:
        return len(self.requests)

    def bind(self, fingerprint: list[int | None] | None) -> None:
        """Tie the store to a vocabulary (`vocabulary_fingerprint`); refuse a store that holds another vocabulary's
        text."""
        with self.lock:
            self._flush()
            if fingerprint is None or fingerprint == self.fingerprint:
                return
            if self.requests and self.fingerprint is not None and not same_vocabulary(self.fingerprint, fingerprint):
                size, bos, eos, pad = self.fingerprint
                raise ValueError(
                    f"This drafter's suffix cache holds {len(self.requests)} requests served to a target of another "
                    f"vocabulary ({size} tokens, bos/eos/pad ids {bos}/{eos}/{pad}) than this one ({fingerprint[0]} "
                    f"tokens, {fingerprint[1]}/{fingerprint[2]}/{fingerprint[3]}): its token ids mean other text here. "
                    "Call `suffix_cache_for(drafter).reset()` to serve this target, or use another drafter object."
                )
            self.fingerprint = fingerprint

    def add(self, tokens: list[int]) -> None:
        """Remember one finished request (its last `max_tokens` tokens), evicting the oldest requests over the
        bounds: down to 3/4 of each, so the index is rebuilt once per quarter of the store, not per request."""
        with self.lock:
            self._flush()
            self._add(tokens)

    def _add(self, tokens: list[int]) -> None:
        tokens = list(tokens[-self.max_tokens :])
        if not tokens:
            return
        self.requests.append(tokens)
        self.tokens += len(tokens)
        self.version += 1
        if self.tokens <= self.max_tokens and len(self.requests) <= self.max_requests:
            self.index.add_sequence(tokens)
            return
        low_tokens, low_requests = self.max_tokens - self.max_tokens // 4, self.max_requests - self.max_requests // 4
        while len(self.requests) > 1 and (self.tokens > low_tokens or len(self.requests) > low_requests):
            self.tokens -= len(self.requests.popleft())
        self._rebuild()

    def _rebuild(self) -> None:
        self.index = SuffixAutomaton()
        for request in self.requests:
            self.index.add_sequence(request)
        self.version += 1

    def flush(self) -> None:
        """Index the requests that finished while the store was busy (they were queued)."""
        with self.lock:
            self._flush()

    def _flush(self) -> None:
        while self.pending:
            self._add(self.pending.popleft())

    def reset(self) -> None:
        """Forget every request (and the target the store was tied to)."""
        with self.lock:
            self.pending.clear()
            self.requests.clear()
            self.tokens, self.fingerprint = 0, None
            self._rebuild()

    def save(self, path: str | os.PathLike) -> None:
        """Write the remembered requests to a JSON file (atomically). Only on request: it holds users' text."""
        with self.lock:
            self._flush()
            data = {"format": STORE_FORMAT, "fingerprint": self.fingerprint, "requests": list(self.requests)}
        folder = os.path.dirname(os.path.abspath(path))
        with tempfile.NamedTemporaryFile("w", dir=folder, delete=False, suffix=".tmp") as handle:
            json.dump(data, handle)
        os.replace(handle.name, path)

    def load(self, path: str | os.PathLike) -> None:
        """Replace the memory with a file written by `save` (the bounds stay this store's)."""
        with open(path) as handle:
            data = json.load(handle)
        if data.get("format") not in (STORE_FORMAT, *OLDER_FORMATS):
            raise ValueError(f"{path} is not a suffix cache written by SuffixStore.save (format {STORE_FORMAT}).")
        self.reset()
        fingerprint = data["fingerprint"]
        if data["format"] in OLDER_FORMATS and fingerprint is not None:  # its vocabulary's size; no special ids
            fingerprint = [fingerprint[0], None, None, None]
        with self.lock:
            for request in data["requests"]:
                self._add(request)
            self.fingerprint = fingerprint


def _submit(store: SuffixStore, text: list[int], tail: list[int]) -> None:
    """A finished request joins the store: indexed now if the store is free, else queued for the next look (a
    finaliser may run inside a locked section of this very thread, where waiting would never end)."""
    store.pending.append(text + tail)
    if store.lock.acquire(blocking=False):
        try:
            store._flush()
        finally:
            store.lock.release()


def suffix_cache_for(drafter) -> SuffixStore:
    """The suffix store of a drafter object (made on first use with its config's bounds), which its `generate` calls
    share: kept in `drafter.serving_states`, never saved with the drafter (`save` / `load` write and read it)."""
    names = SuffixSettings.__dataclass_fields__
    settings = SuffixSettings(**{name: getattr(drafter.generation_config, name) for name in names})
    return suffix_store_of(drafter.serving_states, settings)


def suffix_store_of(states, settings: SuffixSettings) -> SuffixStore:
    """The suffix store of a drafter's serving states (`ServingStates`), made on first use; the bounds of
    `settings` apply from the next request on (they may have changed since, e.g. under `tree_settings`)."""
    if states.suffix_store is None:
        states.suffix_store = SuffixStore(settings.suffix_cache_max_tokens, settings.suffix_cache_max_requests)
    store = states.suffix_store
    with store.lock:
        store.max_tokens, store.max_requests = settings.suffix_cache_max_tokens, settings.suffix_cache_max_requests
    return store


class SuffixCandidates:
    """One request's suffix-cache proposals: the longest match of its committed text in the drafter's store and
    (with local matching on) in its own prompt and answer so far. The request joins the store when this object is
    dropped (the end of its `generate` call): its committed text up to the last draft and what the target accepted
    of that draft (all but the step's last token, unless the loop calls `finish` with the whole text)."""

    def __init__(
        self, settings: SuffixSettings, store: SuffixStore | None, fingerprint: list[int | None] | None
    ) -> None:
        self.settings = settings
        self.store = store if settings.suffix_cache_num_tokens else None
        if self.store is not None:
            self.store.bind(fingerprint)
        self.local = SuffixAutomaton() if settings.suffix_local_num_tokens else None
        self.matcher = Matcher()
        self.version = -1  # the store version the matcher follows
        self.text: list[int] = []  # the committed text seen so far (the store gets it at the end)
        self.tail: list[int] = []  # tokens accepted since the last proposal (see `accepted`)
        if self.store is not None:  # a finaliser never waits for the lock (see `_submit`); none at interpreter exit
            weakref.finalize(self, _submit, self.store, self.text, self.tail).atexit = False

    def propose(self, sequence: list[int]) -> list[Proposal]:
        """Trees below the longest matches of the committed `sequence` (prompt and answer, the last token is the
        root): from the store (kind "suffix_cache:<match bucket>") and from this request (kind "suffix_local:...")."""
        seen = len(self.text)
        if not seen and self.store is not None and len(sequence) > self.store.max_tokens:
            raise ValueError(
                f"suffix_cache_max_tokens={self.store.max_tokens} cannot hold one request: this prompt alone has "
                f"{len(sequence) - 1} tokens. Raise suffix_cache_max_tokens, or set suffix_cache_num_tokens=0."
            )
        if len(sequence) < seen or (seen and sequence[seen - 1] != self.text[-1]):
            raise ValueError("SuffixCandidates follows one growing sequence; the committed text changed.")
        new = sequence[seen:]
        self.text.extend(new)
        self.tail.clear()
        proposals = []
        if self.local is not None:
            for token in new:
                self.local.append(token)
            state = self.local.link[self.local.last]  # the longest suffix that also occurs earlier
            proposals += self._tree(self.local, state, self.local.length[state], "suffix_local", exclude_end=1)
        if self.store is not None:
            with self.store.lock:
                self.store._flush()
                if self.store.version != self.version:  # the index changed: match again
                    self.matcher, self.version, new = Matcher(), self.store.version, self.text[-RESYNC_TOKENS:]
                for token in new:
                    self.matcher.feed(self.store.index, token)
                proposals += self._tree(self.store.index, self.matcher.state, self.matcher.length, "suffix_cache")
        return proposals

    def accepted(self, tokens: list[int], eos_token_ids: set[int]) -> None:
        """The tokens the target accepted of the latest proposal's tree: the request's text if the call ends now
        (cut after an end-of-sequence token; the loop's `finish` gives the exact end)."""
        cut = next((i + 1 for i, token in enumerate(tokens) if token in eos_token_ids), len(tokens))
        self.tail[:] = tokens[:cut]

    def finish(self, sequence: list[int]) -> None:
        """The request's whole committed text, when the decoding loop knows it."""
        self.text.extend(sequence[len(self.text) :])
        self.tail.clear()

    def _tree(self, index: SuffixAutomaton, state: int, length: int, where: str, exclude_end: int = 0) -> list[Proposal]:
        if length == 0:
            return []
        s = self.settings
        limit = s.suffix_local_num_tokens if where == "suffix_local" else s.suffix_cache_num_tokens
        size = min(limit, int(s.suffix_cache_spec_factor * length))
        nodes = draft_below(index, state, size, s.suffix_cache_min_token_prob, exclude_end) if size else []
        return [Proposal(f"{where}:{match_bucket(length)}", nodes)] if nodes else []
