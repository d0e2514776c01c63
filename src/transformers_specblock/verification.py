"""Verification: one target forward over the tree, lossless acceptance, KV-cache compaction."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
from transformers.generation import logits_process as lp

from .tree import DraftTree, tree_verification_mask


@dataclass
class Verification:
    """Target outputs for every tree node (node 0 = the root).

    logits:   [N+1, V] raw float32 next-token logits
    features: [N+1, 3 * H] the drafter's three target hidden states, concatenated
    """

    logits: torch.Tensor
    features: torch.Tensor


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
    """Applies a standard `LogitsProcessorList` to every node of a draft tree on that node's own path prefix.

    Nodes of equal depth share a prefix length, so row-wise processors (`ROW_WISE_PROCESSORS`: penalties, n-gram
    bans, minimum lengths, warpers) see them as one batch. Any other processor, e.g. `PrefixConstrainedLogitsProcessor`
    (which passes the row index as `batch_id`) or a user's own, is called once per node with a one-row batch, so
    row 0 is always the user's row. Processors that keep state between calls (`STATEFUL_PROCESSORS`) are refused.
    """

    def __init__(self, processors: LogitsProcessorList) -> None:
        stateful = [type(p).__name__ for p in processors if isinstance(p, STATEFUL_PROCESSORS)]
        if stateful:
            raise ValueError(
                f"{', '.join(stateful)} keeps state between calls (or pairs rows with the batch), which tree decoding "
                "cannot honour: it calls logits processors on every drafted node, rejected ones included. Generate "
                "without assistant_model to use it."
            )
        self.processors = processors

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, tree: DraftTree) -> torch.FloatTensor:
        """input_ids: [1, S] committed tokens (ending with the root); scores: [N+1, V] raw logits per node."""
        if len(self.processors) == 0:
            return scores
        paths = tree.path_tokens().to(input_ids.device)
        processed = torch.empty_like(scores)
        for depth in range(tree.max_depth + 1):
            rows = (tree.depths == depth).nonzero().squeeze(1).to(scores.device)
            prefix = torch.cat([input_ids.expand(rows.numel(), -1), paths[rows, :depth]], dim=1)
            processed[rows] = self._apply(prefix, scores[rows].clone())
        return processed

    def _apply(self, prefix: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """Run the processors in order on [R, S+d] prefixes and their [R, V] scores."""
        for processor in self.processors:
            if isinstance(processor, ROW_WISE_PROCESSORS):
                scores = processor(prefix, scores)
            else:
                scores = torch.cat([processor(prefix[i : i + 1], scores[i : i + 1]) for i in range(scores.shape[0])])
        return scores


def verify_tree(
    target: PreTrainedModel,
    tree: DraftTree,
    cache: DynamicCache,
    prefix_visible: torch.BoolTensor,
    root_position: int,
    feature_layers: list[int],
) -> Verification:
    """Run the target once over [root + drafted nodes] with a tree mask and `position = root + depth`."""
    device = target.device
    mask = tree_verification_mask(tree, prefix_visible, target.dtype).to(device)
    outputs = target(
        input_ids=tree.tokens[None].to(device),
        attention_mask=mask,
        position_ids=(root_position + tree.depths)[None].to(device),
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=feature_layers,
    )
    features = torch.cat([outputs.hidden_states[i][0] for i in feature_layers], dim=-1)
    return Verification(logits=outputs.logits[0].float(), features=features)


def greedy_accept(tree: DraftTree, processed: torch.Tensor) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Longest root path whose tokens equal the target's argmax; returns (accepted node ids, bonus token)."""
    choice = processed.argmax(-1).to(tree.tokens.device)  # [N+1] target's pick after each node
    matches = tree.tokens == choice[tree.parents.clamp(min=0)]
    matches[0] = True
    on_path = ~(tree.ancestor_matrix() & ~matches[None, :]).any(-1)  # every ancestor matched
    # siblings hold distinct tokens, so the matching nodes form one chain; order it by depth
    path = on_path.nonzero().squeeze(1)
    path = path[torch.argsort(tree.depths[path])][1:]
    last = path[-1] if path.numel() else torch.zeros((), dtype=torch.long, device=path.device)
    return path, choice[last].reshape(1)


def sample_accept(
    tree: DraftTree, processed: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Lossless multi-candidate speculative sampling over the tree.

    At each node the children are deterministic candidates (q = 1), tried best-first: accept x with probability
    p(x) under the current residual p; on rejection set p(x) = 0 and renormalise. When every child is rejected (or
    at a leaf), the bonus token is sampled from the residual. The result is distributed exactly as p.
    """
    probs = processed.softmax(-1)
    node, path = 0, []
    while True:
        residual = probs[node].clone()
        accepted = None
        for child in tree.children_of(node).tolist():
            token = tree.tokens[child]
            draw = torch.rand((), device=residual.device, generator=generator)
            if draw * residual.sum() < residual[token]:
                accepted = child
                break
            residual[token] = 0.0
        if accepted is None:
            bonus = torch.multinomial(residual / residual.sum(), 1, generator=generator)
            return torch.tensor(path, dtype=torch.long, device=tree.tokens.device), bonus
        path.append(accepted)
        node = accepted


def compact_cache(cache: DynamicCache, past_length: int, keep: torch.LongTensor) -> None:
    """Keep the tree entries `keep` (node ids, root first) right after the first `past_length` entries; drop the rest."""
    positions = (past_length + keep).to(cache.layers[0].keys.device)
    for layer in cache.layers:
        if isinstance(layer, DynamicSlidingWindowLayer) or not isinstance(layer, DynamicLayer):
            raise NotImplementedError(
                f"Tree verification compacts full-attention DynamicCache layers only, got {type(layer).__name__}."
            )
        idx = positions.to(layer.keys.device)
        layer.keys[:, :, past_length : past_length + idx.numel()] = layer.keys[:, :, idx]
        layer.values[:, :, past_length : past_length + idx.numel()] = layer.values[:, :, idx]
    truncate_cache(cache, past_length + keep.numel())


def truncate_cache(cache: DynamicCache, length: int) -> None:
    """Drop every cache entry after the first `length` (DynamicCache.crop takes the count to remove)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)
