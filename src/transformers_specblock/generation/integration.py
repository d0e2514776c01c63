"""The entry into `generate(assistant_model=...)`: a class-level router (`install`) or patch-free calls."""

from __future__ import annotations

import copy
import functools
import inspect
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import transformers
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation import GenerateDecoderOnlyOutput, GenerationMixin, GenerationMode
from transformers.generation.streamers import BaseStreamer

from ..models.tree_drafter.generation_config import DRAFTING_SETTINGS
from ..models.tree_drafter.modeling_tree_drafter import TreeDraftModel
from ..utils import PATCH_FREE_ROUTE, SUPPORTED_TRANSFORMERS
from .decoding import tree_speculative_decoding

_STOCK_ASSISTED_DECODING = GenerationMixin._assisted_decoding
_STOCK_VALIDATE_GENERATION_MODE = GenerationMixin._validate_generation_mode
_STOCK_PREPARE_GENERATION_CONFIG = GenerationMixin._prepare_generation_config
# transformers' own generation arguments that mean something for a tree drafter: the drafter setting each sets
STOCK_SETTINGS = {
    "prompt_lookup_num_tokens": "prompt_lookup_num_tokens",
    "max_matching_ngram_size": "prompt_lookup_max_ngram_size",
}
# transformers' assisted-decoding settings (with their defaults) that shape a chain drafter's drafting
STOCK_ASSISTANT_SETTINGS = {"num_assistant_tokens": 20, "assistant_confidence_threshold": 0.4,
                            "num_assistant_tokens_schedule": "constant"}  # fmt: skip


def drafting_overrides(generation_config: GenerationConfig, passed: dict[str, Any] | None = None) -> dict[str, Any]:
    """The drafter settings one `generate` call asks for: this package's own keyword arguments (`DRAFTING_SETTINGS`,
    carried on the call's generation config), the stock ones of `STOCK_SETTINGS` that were set, and
    `num_assistant_tokens` (tokens drafted per step: a fixed `tree_budget` of that many nodes). The other stock
    assisted-decoding settings, which a tree drafter cannot honour, are refused. `passed`: drafting settings the
    patch-free route took from `generate`'s keyword arguments itself."""
    overrides = {
        name: getattr(generation_config, name)
        for name in DRAFTING_SETTINGS
        if name in generation_config.__dict__ and name not in STOCK_SETTINGS
    }
    overrides.update(passed or {})
    for stock, name in STOCK_SETTINGS.items():
        if getattr(generation_config, stock, None) is not None:
            overrides[name] = getattr(generation_config, stock)
    asked = {name: getattr(generation_config, name, default) for name, default in STOCK_ASSISTANT_SETTINGS.items()}
    if asked["assistant_confidence_threshold"] != STOCK_ASSISTANT_SETTINGS["assistant_confidence_threshold"]:
        raise ValueError(
            "assistant_confidence_threshold stops a chain drafter early; a tree drafter ranks its nodes by their "
            "draft scores and keeps the best `tree_budget`: drop it, and set tree_budget (or tree_budget=\"auto\")."
        )
    if asked["num_assistant_tokens_schedule"] != STOCK_ASSISTANT_SETTINGS["num_assistant_tokens_schedule"]:
        raise ValueError(
            f"num_assistant_tokens_schedule={asked['num_assistant_tokens_schedule']!r} adapts a chain's length; a tree "
            "drafter's size adapts with tree_budget=\"auto\": drop the schedule."
        )
    drafted = asked["num_assistant_tokens"]
    if drafted != STOCK_ASSISTANT_SETTINGS["num_assistant_tokens"]:
        if overrides.get("tree_budget", drafted) != drafted:
            raise ValueError(
                f"num_assistant_tokens={drafted} and tree_budget={overrides['tree_budget']!r} both set the nodes "
                "drafted per step: pass one of them."
            )
        overrides["tree_budget"] = drafted
    return overrides


@contextmanager
def serving(drafter: TreeDraftModel, overrides: dict[str, Any] | None = None) -> Iterator[TreeDraftModel]:
    """One tree-loop `generate` call of `drafter`: busy meanwhile (a second call while it is busy, from another thread
    or a streamer / stopping criterion calling generate again, is a RuntimeError), with `overrides` applied to its
    settings for this call only."""
    with drafter.serving_states.busy(type(drafter).__name__), drafter.tree_settings(**(overrides or {})):
        yield drafter


def _prepare_generation_config(
    self: PreTrainedModel, generation_config: GenerationConfig | None, **kwargs: Any
) -> tuple[GenerationConfig, dict[str, Any]]:
    """Stock preparation; this package's drafter settings passed to `generate` are carried on the call's own copy of
    the generation config (instead of being refused as unknown model arguments)."""
    generation_config, model_kwargs = _STOCK_PREPARE_GENERATION_CONFIG(self, generation_config, **kwargs)
    for name in DRAFTING_SETTINGS:
        if name in model_kwargs:
            setattr(generation_config, name, model_kwargs.pop(name))
    return generation_config, model_kwargs


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
        with serving(assistant_model, drafting_overrides(generation_config)):
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
    asked = [name for name in DRAFTING_SETTINGS if name in generation_config.__dict__ and name not in STOCK_SETTINGS]
    if asked and not isinstance(assistant, TreeDraftModel):
        raise ValueError(
            f"{asked} are settings of this package's tree drafters: pass a drafter as `assistant_model` (e.g. "
            "SpecBlockDraftModel, or LookupTreeModel for prompt lookup without weights), or drop them."
        )
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


# The parameters of the stock methods the router replaces, per transformers release it supports (checked at import:
# a release outside the table, or one whose methods differ from its row, is not patched). 5.24 renamed the cache
# argument `generate` hands them (`past_key_values` -> `cache`, `utils.CACHE_ARGUMENT`); the signatures stayed.
_SIGNATURES_5_23 = {
    "_assisted_decoding": (
        "self", "input_ids", "logits_processor", "stopping_criteria", "generation_config", "synced_gpus", "streamer",
        "inputs_tensor", "assistant_model", "assistant_tokenizer", "tokenizer", "model_kwargs",
    ),
    "_validate_generation_mode": ("self", "generation_mode", "generation_config", "generation_mode_kwargs"),
    "_prepare_generation_config": ("self", "generation_config", "kwargs"),
}  # fmt: skip
ROUTED_SIGNATURES = {"5.23": _SIGNATURES_5_23, "5.24": _SIGNATURES_5_23, "5.25": _SIGNATURES_5_23}


def router_problems(stock: dict[str, Any] | None = None, version: str | None = None) -> list[str]:
    """What differs between this transformers (`version`, by default the installed one) and the releases the router
    was written for (`ROUTED_SIGNATURES`, `SUPPORTED_TRANSFORMERS`), and between the stock methods it replaces
    (`stock`: name -> method, by default the ones this transformers had at import) and their signatures in that
    release's row; empty where it may patch. A release can keep the signatures and change what they are given (the
    cache argument's name changed in 5.24), so both are checked."""
    version = version or transformers.__version__
    release = ".".join(str(part) for part in Version(version).release[:2])
    problems = []
    if release not in ROUTED_SIGNATURES or not SpecifierSet(SUPPORTED_TRANSFORMERS).contains(
        Version(version), prereleases=True
    ):
        problems.append(f"its version {version} is outside {SUPPORTED_TRANSFORMERS}")
    if stock is None:
        stock = {
            "_assisted_decoding": _STOCK_ASSISTED_DECODING,
            "_validate_generation_mode": _STOCK_VALIDATE_GENERATION_MODE,
            "_prepare_generation_config": _STOCK_PREPARE_GENERATION_CONFIG,
        }
    signatures = ROUTED_SIGNATURES.get(release, ROUTED_SIGNATURES[max(ROUTED_SIGNATURES, key=Version)])
    for name, expected in signatures.items():
        method = stock.get(name)
        if method is None:
            problems.append(f"GenerationMixin.{name} is missing")
            continue
        found = tuple(inspect.signature(method).parameters)
        if found != expected:
            problems.append(f"GenerationMixin.{name}{found} differs from {expected}")
    return problems


def install() -> bool:
    """Route `generate(assistant_model=<TreeDraftModel>)` to the tree loop (done on import). Where this transformers'
    internals differ from the ones the router replaces, nothing is patched (a warning names what differs) and
    `generate(assistant_model=drafter)` raises an error naming the supported releases and the patch-free route.
    Returns whether the router is installed."""
    problems = router_problems()
    if problems:
        warnings.warn(
            f"transformers {transformers.__version__} is not a release the generate router supports "
            f"({SUPPORTED_TRANSFORMERS}): {'; '.join(problems)}. `generate(assistant_model=drafter)` is not routed to "
            f"the tree loop; use the patch-free route, {PATCH_FREE_ROUTE}.",
            stacklevel=2,
        )
        return False
    GenerationMixin._assisted_decoding = _assisted_decoding
    GenerationMixin._validate_generation_mode = _validate_generation_mode
    GenerationMixin._prepare_generation_config = _prepare_generation_config
    return True


def uninstall() -> None:
    """Restore transformers' own `_assisted_decoding` and validation."""
    GenerationMixin._assisted_decoding = _STOCK_ASSISTED_DECODING
    GenerationMixin._validate_generation_mode = _STOCK_VALIDATE_GENERATION_MODE
    GenerationMixin._prepare_generation_config = _STOCK_PREPARE_GENERATION_CONFIG


def generate(model: PreTrainedModel, *args: Any, assistant_model: PreTrainedModel | None = None, **kwargs: Any):
    """Patch-free entry: `transformers_specblock.generate(model, **inputs, assistant_model=drafter, ...)`.

    Runs transformers' own `generate` preparation (logits processors, stopping criteria, cache) and hands the
    decoding to the tree loop through a `custom_generate` callable; works whether or not `install()` ran.
    """
    if not isinstance(assistant_model, TreeDraftModel) or kwargs.get("speculation_type") is not None:
        return GenerationMixin.generate(model, *args, assistant_model=assistant_model, **kwargs)
    streamer = kwargs.pop("streamer", None)
    overrides = {name: kwargs.pop(name) for name in DRAFTING_SETTINGS if name in kwargs and name not in STOCK_SETTINGS}
    decoding = functools.partial(
        _custom_decoding, assistant_model=assistant_model, streamer=streamer, overrides=overrides
    )
    return GenerationMixin.generate(model, *args, custom_generate=decoding, **kwargs)


def _custom_decoding(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    assistant_model: TreeDraftModel | None = None,
    streamer: BaseStreamer | None = None,
    overrides: dict[str, Any] | None = None,
    **model_kwargs: Any,
) -> GenerateDecoderOnlyOutput | torch.LongTensor:
    """`custom_generate` callable: generate() prepared everything but dropped the streamer, so put the prompt here;
    `overrides`: the drafter settings passed to `generate`, for this call only."""
    if generation_config.num_beams > 1:
        raise ValueError("SpecBlock drafting works with greedy decoding and sampling only: set num_beams=1.")
    if streamer is not None:
        streamer.put(input_ids.cpu())
    with serving(assistant_model, drafting_overrides(generation_config, overrides)):
        return tree_speculative_decoding(
            model, input_ids, logits_processor, stopping_criteria, generation_config,
            streamer=streamer, assistant_model=assistant_model, **model_kwargs,
        )  # fmt: skip
