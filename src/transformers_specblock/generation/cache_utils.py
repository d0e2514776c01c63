"""Compact: target and drafter KV caches after a verified tree (keep the accepted path, drop the rest)."""

from __future__ import annotations

import torch
from transformers import DynamicCache, GenerationConfig, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer


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


def full_attention_cache(
    model: PreTrainedModel, cache: DynamicCache, generation_config: GenerationConfig, tree_budget: int
) -> DynamicCache:
    """A cache whose entries can be compacted: sliding-window layers are swapped for full ones while the whole
    sequence (and the tree in flight) fits inside the window, where both attend to exactly the same keys."""
    if all(type(layer) is DynamicLayer for layer in cache.layers):
        return cache
    window = getattr(model.config.get_text_config(), "sliding_window", None)
    if window is None or generation_config.max_length + tree_budget > window:
        raise ValueError(
            f"This target uses sliding-window attention (window {window}); SpecBlock tree verification supports it "
            f"only while max_length + tree_budget ({generation_config.max_length} + {tree_budget}) fits in the "
            "window. Lower max_new_tokens or tree_budget."
        )
    return DynamicCache()
