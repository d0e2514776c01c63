"""Logits processing on a token tree: the user's `LogitsProcessorList` applied to every node on its own path (row-wise
processors this package knows), or to the nodes of the accepted path only, in order (any other processor)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation import logits_process as lp

from .acceptance import walk_accept
from .tree import DraftTree


# Processors whose output row i depends only on (input_ids[i], scores[i]) and that keep no state between calls:
# safe to call on many tree nodes at once.
ROW_WISE_PROCESSORS: tuple[type[LogitsProcessor], ...] = (
    lp.MinLengthLogitsProcessor, lp.MinNewTokensLengthLogitsProcessor, lp.TemperatureLogitsWarper,
    lp.RepetitionPenaltyLogitsProcessor, lp.TopPLogitsWarper, lp.TopKLogitsWarper, lp.TopHLogitsWarper,
    lp.MinPLogitsWarper, lp.TypicalLogitsWarper, lp.EpsilonLogitsWarper, lp.EtaLogitsWarper,
    lp.NoRepeatNGramLogitsProcessor, lp.SequenceBiasLogitsProcessor, lp.ForcedBOSTokenLogitsProcessor,
    lp.ForcedEOSTokenLogitsProcessor, lp.InfNanRemoveLogitsProcessor, lp.ExponentialDecayLengthPenalty,
    lp.LogitNormalization, lp.SuppressTokensAtBeginLogitsProcessor, lp.SuppressTokensLogitsProcessor,
    lp.WatermarkLogitsProcessor,
)  # fmt: skip
# Processors that keep state across calls (their own model cache, a watermark context, a call counter) or whose
# rows must pair with the user's batch (encoder inputs, guidance halves): calling them on tree nodes, rejected ones
# included, would corrupt them.
STATEFUL_PROCESSORS: tuple[type[LogitsProcessor], ...] = (
    lp.UnbatchedClassifierFreeGuidanceLogitsProcessor, lp.ClassifierFreeGuidanceLogitsProcessor,
    lp.SynthIDTextWatermarkLogitsProcessor, lp.EncoderRepetitionPenaltyLogitsProcessor,
    lp.EncoderNoRepeatNGramLogitsProcessor, lp.WhisperTimeStampLogitsProcessor, lp.WhisperNoSpeechDetection,
    lp.AlternatingCodebooksLogitsProcessor, lp.BarkEosPrioritizerLogitsProcessor,
    lp.DiaClassifierFreeGuidanceLogitsProcessor, lp.DiaEOSChannelFilterLogitsProcessor,
    lp.DiaEOSDelayPatternLogitsProcessor,
)  # fmt: skip


class TreeLogitsProcessor(LogitsProcessor):
    """Applies a standard `LogitsProcessorList` to the nodes of a draft tree, each on its own path prefix.

    Where every processor is row-wise (`ROW_WISE_PROCESSORS`: penalties, n-gram bans, minimum lengths, warpers) the
    whole tree is processed at once, nodes of equal depth as one batch (`__call__`). Any other processor, e.g.
    `PrefixConstrainedLogitsProcessor` (which passes the row index as `batch_id`) or a user's own, which may keep
    state, is called only on the nodes of the path the target accepts, in order, once per committed token as in
    plain decoding (`walk`), one row at a time, as the row of the user's batch that node belongs to. Processors known
    to keep state that tree decoding cannot honour at all (`STATEFUL_PROCESSORS`) are refused.
    """

    def __init__(self, processors: LogitsProcessorList) -> None:
        stateful = [type(p).__name__ for p in processors if isinstance(p, STATEFUL_PROCESSORS)]
        if stateful:
            raise ValueError(
                f"{', '.join(stateful)} keeps state between calls (or pairs rows with the batch), which tree decoding "
                "cannot honour: tree decoding calls logits processors on drafted nodes and rows of its own. Generate "
                "without assistant_model to use it."
            )
        self.processors = processors
        self.path_only = any(not isinstance(p, ROW_WISE_PROCESSORS) for p in processors)

    def walk(
        self, input_ids: torch.LongTensor, scores: torch.FloatTensor, tree: DraftTree, row: int, do_sample: bool,
        stops: Callable[[int, int], bool] | None = None,
    ) -> tuple[torch.LongTensor, torch.LongTensor, torch.FloatTensor]:  # fmt: skip
        """Accept along the path the target agrees with, processing only that path's nodes, in order (`walk_accept`).

        input_ids: [1, S] one row's committed tokens (ending with the root); scores: [N+1, V] raw logits per node;
        stops: (sequence length, last token) -> whether the sequence ends there (the walk stops with it). Returns
        the accepted nodes (root excluded), the bonus token [1] and the scores [N+1, V] with the visited nodes' rows
        processed (the others are never read)."""
        processed = scores.clone()
        tokens = tree.tokens.to(input_ids.device)

        def node_scores(node: int, path: list[int]) -> torch.FloatTensor:
            prefix = torch.cat([input_ids, tokens[path][None]], dim=1)
            processed[node] = self._apply(prefix, scores[node : node + 1].clone(), row)[0]
            return processed[node]

        length = input_ids.shape[1]
        ends = (lambda accepted, token: stops(length + accepted, token)) if stops is not None else None
        path, bonus = walk_accept(tree, node_scores, do_sample, stops=ends)
        return path, bonus, processed

    def __call__(
        self, input_ids: torch.LongTensor, scores: torch.FloatTensor, tree: DraftTree, row: int = 0
    ) -> torch.FloatTensor:
        """input_ids: [1, S] one row's committed tokens (ending with the root); scores: [N+1, V] raw logits per node;
        row: that row's index in the user's batch (what a per-row processor sees as its `batch_id`)."""
        if len(self.processors) == 0:
            return scores
        paths = tree.path_tokens().to(input_ids.device)
        processed = torch.empty_like(scores)
        for depth in range(tree.max_depth + 1):
            rows = (tree.depths == depth).nonzero().squeeze(1).to(scores.device)
            prefix = torch.cat([input_ids.expand(rows.numel(), -1), paths[rows, :depth]], dim=1)
            processed[rows] = self._apply(prefix, scores[rows].clone(), row)
        return processed

    def _apply(self, prefix: torch.LongTensor, scores: torch.FloatTensor, row: int) -> torch.FloatTensor:
        """Run the processors in order on [R, S+d] prefixes and their [R, V] scores; a per-row processor sees each
        node as the last row of a batch of `row + 1` copies, so its row index is the user's."""
        for processor in self.processors:
            if isinstance(processor, ROW_WISE_PROCESSORS):
                scores = _for_row(processor, row, prefix.shape[0])(prefix, scores)
            else:
                scores = torch.cat([
                    processor(prefix[i : i + 1].expand(row + 1, -1), scores[i : i + 1].expand(row + 1, -1).clone())[-1:]
                    for i in range(scores.shape[0])
                ])  # fmt: skip
        return scores


def _for_row(processor: LogitsProcessor, row: int, count: int) -> LogitsProcessor:
    """`processor` for `count` nodes of the user's row `row`: the repetition penalty's per-row prompt lengths
    (`prompt_ignore_length`, the rows' left padding) are that row's, once per node."""
    ignore = getattr(processor, "prompt_ignore_length", None)
    if not isinstance(processor, lp.RepetitionPenaltyLogitsProcessor) or not isinstance(ignore, torch.Tensor):
        return processor
    one_row = copy.copy(processor)
    one_row.prompt_ignore_length = ignore[row].repeat(count)
    return one_row
