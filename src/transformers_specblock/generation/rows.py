"""The rows of a batch: what each sequence committed, when it stops, and the outputs put back in the user's order."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, GenerationConfig, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria

from ..utils import CACHE_ARGUMENT
from .candidate_generators import TreeCandidateGenerator
from .stats import SpecBlockStats, TreeGenerateOutput


@dataclass
class Row:
    """One sequence of the batch.

    index: its row in the user's batch; sequence: [T] its (left-padded) prompt and committed tokens; left_padding:
    where its text starts (what the free candidates read); next_position: the rotary position of its next token;
    hidden: target cache columns it does not see (its left padding, the holes of ragged acceptance);
    scores / logits: one processed / raw [V] row per committed token (`return_dict_in_generate`).
    """

    index: int
    sequence: torch.LongTensor
    left_padding: int
    next_position: int
    generator: TreeCandidateGenerator
    hidden: int = 0
    done: bool = False
    scores: list[torch.Tensor] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def committed(self) -> torch.LongTensor:
        """[T'] the prompt's tokens and the committed ones, padding excluded."""
        return self.sequence[self.left_padding :]


HostStopRule = Callable[[int, int], bool]
"""(sequence length, its last token) -> whether generation stops there."""

_HOST_CRITERIA = (MaxLengthCriteria, MaxTimeCriteria, EosTokenCriteria)


def host_stop_rule(stopping_criteria: StoppingCriteriaList) -> HostStopRule | None:
    """The stopping criteria as a host rule where each of them is one the host can answer from a sequence's length,
    its last token and the clock (transformers' max length, max time and EOS criteria: what `generate` builds unless
    stop strings or custom criteria are passed); else None, and they run on the device. Reads the EOS ids once."""
    if not all(type(criterion) in _HOST_CRITERIA for criterion in stopping_criteria):
        return None
    max_lengths = [c.max_length for c in stopping_criteria if type(c) is MaxLengthCriteria]
    timers = [c for c in stopping_criteria if type(c) is MaxTimeCriteria]
    eos_criteria = [c for c in stopping_criteria if type(c) is EosTokenCriteria]
    eos = {int(t) for c in eos_criteria for t in c.eos_token_id.reshape(-1).tolist()}

    def stops(length: int, token: int) -> bool:
        return (
            any(length >= limit for limit in max_lengths)
            or token in eos
            or any(time.time() - timer.initial_timestamp > timer.max_time for timer in timers)
        )

    return stops


def commit(
    rows: list[Row],
    new_tokens: list[torch.LongTensor],
    processed: list[torch.Tensor],
    stopping_criteria: StoppingCriteriaList,
    host_tokens: list[list[int]] | None = None,
    host_rule: HostStopRule | None = None,
) -> list[int]:
    """Append each row's accepted tokens [n_r], stopping a row at the first token a stopping criterion fires on.

    Where the new tokens are known on the host (`host_tokens`, as greedy acceptance has them) and the criteria have a
    `host_rule`, the rule decides and nothing is read back. Otherwise the criteria see [g, T] sequences: rows of
    equal length are asked together, once per token position, and all their answers are read back at once, with
    the new tokens (one host read per step). Each row's generator gets its tokens
    (`TreeCandidateGenerator.commit_tokens`). processed: each row's [n_r, V] scores. Returns how many tokens each row
    kept; sets `Row.done`."""
    new_tokens = [new.to(row.sequence.device) for row, new in zip(rows, new_tokens)]
    extended = [torch.cat([row.sequence, new]) for row, new in zip(rows, new_tokens)]
    if host_tokens is not None and host_rule is not None:
        kept = _stops_on_host(rows, host_tokens, host_rule)
    else:
        kept, host_tokens = _stops_on_device(rows, new_tokens, extended, processed, stopping_criteria)
    for row, sequence, count, tokens in zip(rows, extended, kept, host_tokens):
        row.sequence = sequence[: row.sequence.numel() + count]
        row.generator.commit_tokens(tokens, count)
    return kept


def _stops_on_host(rows: list[Row], host_tokens: list[list[int]], host_rule: HostStopRule) -> list[int]:
    """How many of its new tokens each row keeps, the rule asked per token (no device read); sets `Row.done`."""
    kept = [len(tokens) for tokens in host_tokens]
    for r, (row, tokens) in enumerate(zip(rows, host_tokens)):
        length = row.sequence.numel()
        stop = next((i for i, token in enumerate(tokens) if host_rule(length + i + 1, token)), None)
        if stop is not None:
            kept[r], row.done = stop + 1, True
    return kept


def _stops_on_device(
    rows: list[Row], new_tokens: list[torch.LongTensor], extended: list[torch.LongTensor],
    processed: list[torch.Tensor], stopping_criteria: StoppingCriteriaList,
) -> tuple[list[int], list[list[int]]]:  # fmt: skip
    """How many of its new tokens each row keeps, the criteria asked on the device ([g, T] sequences of equal length
    together, per token position), with every row's new tokens: all read back at once. Sets `Row.done`."""
    kept = [new.numel() for new in new_tokens]
    offsets = [sum(kept[:r]) for r in range(len(rows) + 1)]  # each row's tokens in the host read
    asked: list[tuple[int, list[int]]] = []  # (token position, rows asked together)
    answers = []
    for i in range(max(kept, default=0)):
        groups: defaultdict[int, list[int]] = defaultdict(list)
        for r, row in enumerate(rows):
            if i < kept[r]:
                groups[row.sequence.numel() + i + 1].append(r)
        for length, members in groups.items():
            ids = torch.stack([extended[r][:length] for r in members])
            scores = torch.stack([processed[r][i] for r in members])
            asked.append((i, members))
            answers.append(stopping_criteria(ids, scores).to(torch.bool).reshape(-1))
    host = torch.cat(answers + new_tokens).tolist() if answers else []  # the flags, then every row's new tokens
    flags = iter(host[: len(host) - offsets[-1]])
    tokens = host[len(host) - offsets[-1] :]
    for i, members in asked:  # positions in increasing order: a row's first stop wins
        for r in members:
            if next(flags) and not rows[r].done:
                kept[r], rows[r].done = i + 1, True
    return kept, [tokens[offsets[r] : offsets[r + 1]] for r in range(len(rows))]


def record(row: Row, generation_config: GenerationConfig, processed: torch.Tensor, raw: torch.Tensor, count: int):
    """Keep the first `count` rows of this step's [n, V] processed scores and raw logits where they are asked for."""
    if generation_config.return_dict_in_generate and generation_config.output_scores:
        row.scores += list(processed[:count].clone())  # a copy: not a view keeping the step's whole tree alive
    if generation_config.return_dict_in_generate and generation_config.output_logits:
        row.logits += list(raw[:count].clone())


def batch_output(
    rows: list[Row], generation_config: GenerationConfig, cache: DynamicCache | None, stats: SpecBlockStats
) -> TreeGenerateOutput | torch.LongTensor:
    """The rows' sequences in the user's order, padded as transformers pads finished rows (`pad_token_id`, else
    the EOS token, else 0); with `return_dict_in_generate`, one [B, V] score / logit entry per generated position
    (zeros for rows that had already finished) and the call's `drafting_stats`."""
    rows = sorted(rows, key=lambda row: row.index)
    length = max(row.sequence.numel() for row in rows)
    pad = generation_config._pad_token_tensor
    pad = int(pad.reshape(-1)[0]) if pad is not None else 0
    sequences = torch.stack([torch.nn.functional.pad(row.sequence, (0, length - row.sequence.numel()), value=pad)
                             for row in rows])  # fmt: skip
    if not generation_config.return_dict_in_generate:
        return sequences
    return TreeGenerateOutput(
        sequences=sequences,
        drafting_stats=stats,
        scores=_per_position([row.scores for row in rows]) if generation_config.output_scores else None,
        logits=_per_position([row.logits for row in rows]) if generation_config.output_logits else None,
        **{CACHE_ARGUMENT: cache},
    )


def _per_position(per_row: list[list[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """Each row's [V] entries -> one [B, V] tensor per generated position."""
    steps = max(len(entries) for entries in per_row)
    reference = next(entries[0] for entries in per_row if entries)
    blank = torch.zeros_like(reference)
    return tuple(torch.stack([e[t] if t < len(e) else blank for e in per_row]) for t in range(steps))
