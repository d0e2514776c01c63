"""The adaptation signal: the target distribution a verification already computed, at the positions of the
accepted path where the drafter proposed something, paired with the drafter state that proposed it.

No second target forward: the rows come from the verified tree's logits. Memory is bounded: a sample keeps the
target's top-k (not a [V] row), one drafter state [H] and, for states a replay of the committed context reproduces,
a shared reference to the last `adaptation_context` committed positions; the buffer keeps the newest samples.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from ..candidate_generators.base import TreeCandidateGenerator
from ..tree import SOURCE_BITS, DraftTree

Context = tuple[torch.Tensor, torch.LongTensor, torch.LongTensor]  # features [C, 3H], tokens [C], positions [C]


@dataclass
class SignalSample:
    """One position of an accepted path where the drafter had proposed tokens."""

    state: torch.Tensor  # [H] pre-norm drafter state whose distribution proposed this position's tokens
    target_ids: torch.LongTensor  # [k] draft-vocabulary ids of the target's top-k (-1: outside the draft vocabulary)
    target_probs: torch.Tensor  # [k] their target probabilities (float32)
    wrong: bool  # the drafter's best proposal here was not the token the target committed
    body_version: int  # which drafter body computed `state` (a whole-drafter update makes older states stale)
    depth: int = 1  # depth of the position in its tree (1: right after the root, whatever was accepted)
    slot: int = -1  # the root position's output slot a replay of `context` reproduces (DFlash: the block position;
    # -1: not replayable)
    context: Context | None = None  # committed positions ending at the root's drafter position
    covered: bool = False  # a free candidate source had proposed the committed token here (it was accepted whatever
    # the drafter proposed): a better head would not have changed this position


class SignalBuffer:
    """The newest `capacity` samples (older ones fall out: the signal follows the stream)."""

    def __init__(self, capacity: int) -> None:
        self.samples: deque[SignalSample] = deque(maxlen=capacity)

    def __len__(self) -> int:
        return len(self.samples)

    def add(self, samples: list[SignalSample]) -> None:
        self.samples.extend(samples)

    def resize(self, capacity: int) -> None:
        if capacity != self.samples.maxlen:
            self.samples = deque(self.samples, maxlen=capacity)

    def for_head(self, body_version: int, limit: int) -> list[SignalSample]:
        """The newest `limit` samples whose states the current drafter body computed."""
        return [s for s in self.samples if s.body_version == body_version][-limit:]

    def for_replay(self, limit: int) -> list[SignalSample]:
        """The newest `limit` samples a replay of their committed context reproduces."""
        return [s for s in self.samples if s.slot >= 0][-limit:]

    def clear(self) -> None:
        self.samples.clear()


def target_to_draft_ids(d2t: torch.LongTensor, vocab_size: int) -> torch.LongTensor:
    """[V] draft-vocabulary id of every target id, -1 where the draft vocabulary lacks it."""
    mapping = torch.full((vocab_size,), -1, dtype=torch.long, device=d2t.device)
    mapping[d2t] = torch.arange(d2t.numel(), device=d2t.device)
    return mapping


def collect_signal(
    generator: TreeCandidateGenerator,
    verified: DraftTree,
    path: torch.LongTensor,
    bonus: torch.LongTensor,
    target_logits: torch.Tensor,
    to_draft: torch.LongTensor,
    top_k: int,
    body_version: int,
) -> list[SignalSample]:
    """The samples of one verified tree: for depth j = 1 .. d+1 of the accepted path (d accepted nodes, then the
    first rejected position, whose committed token is the bonus), the drafter state that proposed depth j after the
    accepted prefix, with the target's top-k there (the row of the path node at depth j-1). The walk follows the
    drafter's own (unpruned) tree and stops where the drafter proposed nothing after the accepted prefix.

    verified: the tree the target verified; path [d] its accepted nodes; bonus [1]; target_logits [N+1, V] raw.
    """
    drafted = generator.drafted
    if drafted is None or not generator.producers:
        return []
    device = drafted.tokens.device
    nodes = torch.cat([n for n, _, _ in generator.producers]).to(device)
    states = torch.cat([s for _, s, _ in generator.producers])  # [S, H]
    slots = torch.cat(
        [slot if slot is not None else torch.full_like(n, -1) for n, _, slot in generator.producers]
    ).to(device)
    producer = torch.full((len(drafted),), -1, dtype=torch.long, device=device)
    producer[nodes] = torch.arange(nodes.numel(), device=device)

    committed = torch.cat([verified.tokens[path.to(verified.tokens.device)], bonus.to(verified.tokens.device)])
    rows = target_logits[torch.cat([path.new_zeros(1), path]).to(target_logits.device)].float()  # [d+1, V]
    probs, ids = rows.softmax(-1).topk(min(top_k, rows.shape[-1]), dim=-1)
    context = generator.context
    replayable = context is not None and int(context[1][-1]) == int(drafted.tokens[0])  # ends at the root
    free = ~SOURCE_BITS["drafter"]
    covered = [bool(bits & free) for bits in verified.sources[path.to(verified.sources.device)].tolist()]

    samples: list[SignalSample] = []
    node = 0
    for depth, token in enumerate(committed.tolist()):
        kids = ((drafted.parents == node) & (producer >= 0)).nonzero().squeeze(1)
        if kids.numel() == 0:
            break
        index = int(producer[kids[0]])
        best = kids[drafted.scores[kids].argmax()]
        slot = int(slots[index]) if replayable else -1
        samples.append(
            SignalSample(
                state=states[index].clone(),  # not a view: the tree's other states are freed
                target_ids=to_draft[ids[depth].to(to_draft.device)],
                target_probs=probs[depth],
                wrong=int(drafted.tokens[best]) != token,
                body_version=body_version,
                depth=depth + 1,
                slot=slot,
                context=context if slot >= 0 else None,
                covered=depth < len(covered) and covered[depth],
            )
        )
        same = kids[drafted.tokens[kids] == token]
        if same.numel() == 0:
            break
        node = int(same[0])
    return samples
