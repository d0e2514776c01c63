"""Compact: target and drafter KV caches after verified trees (keep each row's accepted path, drop the rest)."""

from __future__ import annotations

import torch
from transformers import DynamicCache, GenerationConfig, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from .tree_batch import kept_index


def compact_cache(cache: DynamicCache, past_length: int, kept: list[list[int]]) -> torch.BoolTensor:
    """Keep each row's tree entries `kept[row]` (node ids, root first) right after the first `past_length` entries,
    drop the rest; returns which of the K = max(len(kept[row])) new entries each row holds ([B, K]; the rest are
    holes its attention mask must hide).

    A crop where every row keeps the same contiguous prefix of its tree (a plain step, a chain accepted whole);
    otherwise one gather per layer over all rows.
    """
    width = max(len(nodes) for nodes in kept)
    if any(nodes != list(range(width)) for nodes in kept):
        index = past_length + kept_index(kept, cache.layers[0].keys.device)  # [B, K]: holes repeat the row's last entry
        expanded: dict[tuple, torch.LongTensor] = {}  # per (device, heads, head dim): built once, shared by the layers
        for layer in _full_attention_layers(cache):
            shape = (layer.keys.device, layer.keys.shape[1], layer.keys.shape[3])
            if shape not in expanded:
                expanded[shape] = index.to(shape[0])[:, None, :, None].expand(-1, shape[1], -1, shape[2])
            layer.keys[:, :, past_length : past_length + width] = layer.keys.gather(2, expanded[shape])
            layer.values[:, :, past_length : past_length + width] = layer.values.gather(2, expanded[shape])
    truncate_cache(cache, past_length + width)
    return torch.tensor([[j < len(nodes) for j in range(width)] for nodes in kept])


def repack_cache(cache: DynamicCache, visible: torch.BoolTensor, drop: int) -> torch.BoolTensor:
    """Drop `drop` cache columns from every row, columns the row hides (left padding, holes of ragged acceptance,
    entries of rows that left the batch; each row must hide at least `drop`): each row keeps its visible entries in
    order, right-aligned. visible: [B, S] what each row sees; returns the new visibility [B, S - drop]."""
    order = torch.argsort(visible.long(), dim=1, stable=True)[:, drop:]  # hidden entries first, then visible ones
    for layer in _full_attention_layers(cache):
        idx = order.to(layer.keys.device)[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
        layer.keys, layer.values = layer.keys.gather(2, idx), layer.values.gather(2, idx)
    return visible.gather(1, order)


def _full_attention_layers(cache: DynamicCache) -> list[DynamicLayer]:
    for layer in cache.layers:
        if isinstance(layer, DynamicSlidingWindowLayer) or not isinstance(layer, DynamicLayer):
            raise NotImplementedError(
                f"Tree verification compacts full-attention DynamicCache layers only, got {type(layer).__name__}."
            )
    return cache.layers


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
