"""What the tree loop checks before its first forward: the prompt, attention, cache and output settings are ones it
can decode (each refusal says what to change)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig, PreTrainedModel
from transformers.generation.streamers import BaseStreamer

from ..utils import CACHE_ARGUMENT


def generation_cache(model_kwargs: dict[str, Any]) -> Any:
    """The cache `generate` prepared (its argument is `past_key_values` up to transformers 5.23, `cache` since)."""
    return model_kwargs.get(CACHE_ARGUMENT)


def check_inputs(
    target: PreTrainedModel,
    input_ids: torch.LongTensor,
    generation_config: GenerationConfig,
    model_kwargs: dict[str, Any],
    streamer: BaseStreamer | None,
) -> None:
    """Raise a ValueError naming the fix for anything the tree loop cannot decode exactly (the drafter was checked
    against the target when it was bound to it, `TreeDraftModel.serve`)."""
    if input_ids.shape[1] == 0:
        raise ValueError("The prompt is empty: SpecBlock needs at least one prompt token (e.g. the BOS token).")
    if streamer is not None and input_ids.shape[0] > 1:
        raise ValueError(
            f"Streamers support batch size 1 (transformers' TextStreamer refuses batches too), got "
            f"{input_ids.shape[0]} sequences. Drop the streamer or generate one prompt at a time."
        )
    if target.config._attn_implementation not in ("eager", "sdpa"):
        raise ValueError(
            f"Tree verification needs a 4D tree attention mask, which '{target.config._attn_implementation}' attention "
            "cannot take. Load the target with attn_implementation='sdpa' or 'eager'."
        )
    if not generation_config.use_cache or not model_kwargs.get("use_cache", True):
        raise ValueError(
            "Tree decoding verifies every tree against the target's KV cache: drop use_cache=False (speculative "
            "decoding without a cache would recompute the whole text at every step)."
        )
    cache = generation_cache(model_kwargs)
    if generation_config.cache_implementation not in (None, "dynamic") or not isinstance(cache, DynamicCache):
        raise ValueError(
            f"Tree decoding keeps the accepted path of every tree in a DynamicCache; got cache_implementation="
            f"{generation_config.cache_implementation!r} and a {type(cache).__name__} cache. Drop cache_implementation "
            f"and pass no `{CACHE_ARGUMENT}` (generate makes a DynamicCache)."
        )
    if cache.get_seq_length() > 0:
        raise ValueError(
            f"Tree decoding starts from an empty cache: a pre-filled `{CACHE_ARGUMENT}` is not supported; pass the "
            "whole text as input_ids."
        )
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError("output_attentions / output_hidden_states are not available with tree decoding.")
    mask = model_kwargs.get("attention_mask")
    if mask is None:
        return
    right_padded = (mask[:, 1:] < mask[:, :-1]).any(dim=1).nonzero().flatten().tolist()
    if right_padded:
        raise ValueError(
            f"attention_mask rows {right_padded} pad on the right (ones before zeros); SpecBlock decoding takes left "
            "padding only, as transformers' batched generate does: set tokenizer.padding_side = 'left'."
        )
    empty = (mask.sum(dim=1) == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(
            f"attention_mask rows {empty} mask every token: each prompt needs at least one token (e.g. the BOS token)."
        )
