"""The entry into `generate(assistant_model=...)`: a class-level router (`install`) or patch-free calls."""

from __future__ import annotations

import copy
import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation import GenerateDecoderOnlyOutput, GenerationMixin, GenerationMode
from transformers.generation.streamers import BaseStreamer

from ..models.tree_drafter.modeling_tree_drafter import TreeDraftModel
from .decoding import tree_speculative_decoding

_STOCK_ASSISTED_DECODING = GenerationMixin._assisted_decoding
_STOCK_VALIDATE_GENERATION_MODE = GenerationMixin._validate_generation_mode
_SERVING: set[int] = set()  # id() of the drafters inside a tree-loop generate call now
_SERVING_LOCK = threading.Lock()


@contextmanager
def serving(drafter: TreeDraftModel) -> Iterator[None]:
    """Mark `drafter` busy for one tree-loop `generate` call; a second call while it is busy (another thread, or a
    streamer / stopping criterion calling generate again) is a RuntimeError. A drafter keeps per-call state (its KV
    cache and tree of the running call, `last_stats`) and state shared across calls (the "auto" budget's estimates,
    online adaptation's signal and in-place weight updates), which two interleaved calls would corrupt."""
    with _SERVING_LOCK:
        if id(drafter) in _SERVING:
            raise RuntimeError(
                f"This {type(drafter).__name__} is already drafting for another generate call (another thread, or "
                "generate called again from a streamer or stopping criterion). One drafter object serves one call at "
                "a time: give each thread its own drafter (copy.deepcopy(drafter), or load it again)."
            )
        _SERVING.add(id(drafter))
    try:
        yield
    finally:
        with _SERVING_LOCK:
            _SERVING.discard(id(drafter))


def _assisted_decoding(
    self: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    streamer: BaseStreamer | None = None,
    inputs_tensor: torch.Tensor | None = None,
    assistant_model: PreTrainedModel | None = None,
    assistant_tokenizer: Any = None,
    tokenizer: Any = None,
    **model_kwargs: Any,
) -> GenerateDecoderOnlyOutput | torch.LongTensor:
    """`GenerationMixin._assisted_decoding`, routed to the tree loop when the assistant is a tree drafter and no
    `speculation_type` asks for transformers' own path (e.g. "dflash": a DFlash drafter verified as a chain)."""
    if isinstance(assistant_model, TreeDraftModel) and generation_config.speculation_type is None:
        with serving(assistant_model):
            return tree_speculative_decoding(
                self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer,
                assistant_model, **model_kwargs,
            )  # fmt: skip
    return _STOCK_ASSISTED_DECODING(
        self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer,
        inputs_tensor, assistant_model, assistant_tokenizer, tokenizer, **model_kwargs,
    )  # fmt: skip


def _validate_generation_mode(
    self: PreTrainedModel, generation_mode: GenerationMode, generation_config: GenerationConfig, generation_mode_kwargs
) -> None:
    """Stock validation, preceded by SpecBlock's own checks when the assistant is a SpecBlock drafter."""
    assistant = generation_mode_kwargs.get("assistant_model")
    if isinstance(assistant, TreeDraftModel):
        assistant.check_target(self)
        if generation_mode != GenerationMode.ASSISTED_GENERATION:
            raise ValueError(
                f"SpecBlock drafting works with greedy decoding and sampling, not '{generation_mode}' "
                f"(num_beams={generation_config.num_beams}). Set num_beams=1, or drop assistant_model."
            )
        if generation_config.num_return_sequences > 1:  # generate expands the batch; the tree loop decodes it
            generation_config = copy.copy(generation_config)
            generation_config.num_return_sequences = 1
    _STOCK_VALIDATE_GENERATION_MODE(self, generation_mode, generation_config, generation_mode_kwargs)


def install() -> None:
    """Route `generate(assistant_model=<TreeDraftModel>)` to the tree loop (done on import)."""
    GenerationMixin._assisted_decoding = _assisted_decoding
    GenerationMixin._validate_generation_mode = _validate_generation_mode


def uninstall() -> None:
    """Restore transformers' own `_assisted_decoding` and validation."""
    GenerationMixin._assisted_decoding = _STOCK_ASSISTED_DECODING
    GenerationMixin._validate_generation_mode = _STOCK_VALIDATE_GENERATION_MODE


def generate(model: PreTrainedModel, *args: Any, assistant_model: PreTrainedModel | None = None, **kwargs: Any):
    """Patch-free entry: `transformers_specblock.generate(model, **inputs, assistant_model=drafter, ...)`.

    Runs transformers' own `generate` preparation (logits processors, stopping criteria, cache) and hands the
    decoding to the tree loop through a `custom_generate` callable; works whether or not `install()` ran.
    """
    if not isinstance(assistant_model, TreeDraftModel) or kwargs.get("speculation_type") is not None:
        return GenerationMixin.generate(model, *args, assistant_model=assistant_model, **kwargs)
    streamer = kwargs.pop("streamer", None)
    decoding = functools.partial(_custom_decoding, assistant_model=assistant_model, streamer=streamer)
    return GenerationMixin.generate(model, *args, custom_generate=decoding, **kwargs)


def _custom_decoding(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    assistant_model: TreeDraftModel | None = None,
    streamer: BaseStreamer | None = None,
    **model_kwargs: Any,
) -> GenerateDecoderOnlyOutput | torch.LongTensor:
    """`custom_generate` callable: generate() prepared everything but dropped the streamer, so put the prompt here."""
    if generation_config.num_beams > 1:
        raise ValueError("SpecBlock drafting works with greedy decoding and sampling only: set num_beams=1.")
    if streamer is not None:
        streamer.put(input_ids.cpu())
    with serving(assistant_model):
        return tree_speculative_decoding(
            model, input_ids, logits_processor, stopping_criteria, generation_config,
            streamer=streamer, assistant_model=assistant_model, **model_kwargs,
        )  # fmt: skip
