"""The tree speculative decoding loop and its entry into `generate(assistant_model=...)`.

draft (SpecBlockCandidateGenerator) -> verify (one target forward over the tree) -> accept (greedy or lossless
sampling) -> compact (target KV cache to the accepted path) -> observe (feed the drafter the committed positions).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation import GenerateDecoderOnlyOutput, GenerationMixin, GenerationMode
from transformers.cache_utils import DynamicLayer
from transformers.generation.streamers import BaseStreamer

from .budget import AUTO, DEFAULT_EXPLORE_INTERVAL
from .drafting import sync
from .modeling_tree_drafter import TreeDraftModel
from .tree import DraftTree
from .verification import TreeLogitsProcessor, compact_cache, greedy_accept, sample_accept, verify_tree


@dataclass
class SpecBlockStats:
    """Statistics of the last `generate` call, stored on the drafter as `drafter.last_stats`."""

    iterations: int = 0
    new_tokens: int = 0
    accepted_per_iteration: list[int] = field(default_factory=list)  # tokens committed per verification
    nodes_per_iteration: list[int] = field(default_factory=list)  # drafted nodes verified per iteration
    drafter_forwards: int = 0
    drafter_time_s: float = 0.0
    target_time_s: float = 0.0
    total_time_s: float = 0.0

    @property
    def tau(self) -> float:
        """Mean accepted length: (accepted draft tokens + 1 target token) per verification."""
        return sum(self.accepted_per_iteration) / max(1, self.iterations)

    @property
    def drafting_share(self) -> float:
        """T_D / (T_D + T_M)."""
        return self.drafter_time_s / max(1e-12, self.drafter_time_s + self.target_time_s)

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "tau": self.tau, "drafting_share": self.drafting_share}


def _validate(
    target: PreTrainedModel,
    drafter: TreeDraftModel,
    input_ids: torch.LongTensor,
    generation_config: GenerationConfig,
    model_kwargs: dict[str, Any],
) -> None:
    drafter.check_target(target)
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"SpecBlock tree decoding supports batch size 1, got {input_ids.shape[0]} sequences. "
            "Call generate once per prompt."
        )
    if input_ids.shape[1] == 0:
        raise ValueError("The prompt is empty: SpecBlock needs at least one prompt token (e.g. the BOS token).")
    if target.config._attn_implementation not in ("eager", "sdpa"):
        raise ValueError(
            f"Tree verification needs a 4D tree attention mask, which '{target.config._attn_implementation}' attention "
            "cannot take. Load the target with attn_implementation='sdpa' or 'eager'."
        )
    cache = model_kwargs.get("past_key_values")
    if generation_config.cache_implementation not in (None, "dynamic") or not isinstance(cache, DynamicCache):
        raise ValueError(
            f"SpecBlock needs a DynamicCache to compact after every step; got cache_implementation="
            f"{generation_config.cache_implementation!r} ({type(cache).__name__}). Drop the static cache setting."
        )
    if cache.get_seq_length() > 0:
        raise ValueError("SpecBlock starts from an empty cache: passing a pre-filled `past_key_values` is not supported.")
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError("output_attentions / output_hidden_states are not available with tree decoding.")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and bool((mask[0, 1:] < mask[0, :-1]).any()):
        raise ValueError("attention_mask may only mask left padding (zeros before ones) with SpecBlock decoding.")


def _full_attention_cache(
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


def tree_speculative_decoding(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    streamer: BaseStreamer | None = None,
    assistant_model: TreeDraftModel | None = None,
    **model_kwargs: Any,
) -> GenerateDecoderOnlyOutput | torch.LongTensor:
    """Decode with a tree drafter (SpecBlock, EAGLE-3); same arguments and outputs as `_assisted_decoding`."""
    drafter = assistant_model
    _validate(model, drafter, input_ids, generation_config, model_kwargs)
    if synced_gpus:
        raise ValueError("synced_gpus (DeepSpeed ZeRO-3 / FSDP) is not supported with SpecBlock decoding.")
    drafter.bind_target(model)
    generator = drafter.candidate_generator()
    auto_budget = drafter.auto_budget(model) if drafter.config.tree_budget == AUTO else None
    cache = _full_attention_cache(model, model_kwargs["past_key_values"], generation_config, generator.tree_budget)
    feature_layers = drafter.config.target_layer_ids
    tree_processor = TreeLogitsProcessor(logits_processor)
    accept = sample_accept if generation_config.do_sample else greedy_accept
    want_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    want_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    scores: tuple[torch.Tensor, ...] = ()
    raw_logits: tuple[torch.Tensor, ...] = ()
    stats = SpecBlockStats()
    started = time.perf_counter()

    # Prefill: the prompt through the target gives the first token and the drafter's context features.
    mask_2d = model_kwargs.get("attention_mask")
    prefix_visible = (
        mask_2d[0].bool() if mask_2d is not None else torch.ones(input_ids.shape[1], dtype=torch.bool)
    ).to(model.device)
    positions = (prefix_visible.long().cumsum(0) - 1).clamp(min=0)
    outputs = model(
        input_ids=input_ids.to(model.device),
        attention_mask=mask_2d,
        position_ids=positions[None],
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=feature_layers,
        logits_to_keep=1,
    )
    raw = outputs.logits[:, -1].float()
    processed = logits_processor(input_ids, raw.clone())
    token = torch.multinomial(processed.softmax(-1), 1)[0] if generation_config.do_sample else processed.argmax(-1)
    features = torch.cat([outputs.hidden_states[i][0] for i in feature_layers], dim=-1)[prefix_visible]
    next_position = int(prefix_visible.sum())  # rotary position of the first generated token
    prompt_length = input_ids.shape[1]
    input_ids, kept, done = _commit(input_ids, token.to(input_ids.device), stopping_criteria, processed, streamer)
    scores, raw_logits = _record(scores, raw_logits, processed, raw, kept, want_scores, want_logits)

    # Committed positions the drafter has not read yet: target features f_i [P, 3H], next tokens x_{i+1} [P], and the
    # rotary position of the first next token. The drafter reads them in one `observe` right before it drafts, so
    # while tree_budget="auto" chooses 0 ("do not speculate") it stays idle (its prompt pass included) and catches up
    # when a step explores a tree.
    unread: list[tuple[torch.Tensor, torch.LongTensor]] = []
    unread_first = 1
    if not done:
        context = torch.cat([input_ids[0, :-1][prefix_visible.to(input_ids.device)][1:], input_ids[0, -1:]])
        unread.append((features, context))
    drafter_started = False  # whether the drafter read the prompt in this call
    explore_interval = getattr(drafter.config, "auto_budget_explore_interval", DEFAULT_EXPLORE_INTERVAL)

    while not done:
        # draft
        budget = auto_budget.next_budget(explore_interval) if auto_budget is not None else generator.tree_budget
        speculating = budget > 0
        root_token = int(input_ids[0, -1])
        drafting_seconds = None
        if speculating:
            generator.tree_budget = budget
            # a step's drafting time (observe + draft) is representative only when the drafter read just the last
            # step's positions, not a prompt or several skipped steps
            steady = drafter_started and len(unread) == 1
            drafting_before = generator.stats.drafter_time_s
            if unread:
                read_features = unread[0][0] if len(unread) == 1 else torch.cat([f for f, _ in unread])
                read_tokens = unread[0][1] if len(unread) == 1 else torch.cat([t for _, t in unread])
                generator.observe(read_features, read_tokens, first_position=unread_first)
                unread.clear()
                drafter_started = True
            tree = generator.draft_tree(root_token)
            if steady:
                drafting_seconds = generator.stats.drafter_time_s - drafting_before
        else:
            tree = DraftTree.root_only(root_token, model.device)
        # verify
        sync(model.device)
        target_start = time.perf_counter()
        past_length = cache.get_seq_length()
        result = verify_tree(model, tree, cache, prefix_visible, next_position, feature_layers)
        processed = tree_processor(input_ids, result.logits.clone(), tree)
        # accept
        path, bonus = accept(tree, processed)
        keep = torch.cat([path.new_zeros(1), path])  # root + accepted nodes
        # compact
        compact_cache(cache, past_length, keep)
        sync(model.device)
        stats.target_time_s += time.perf_counter() - target_start
        if auto_budget is not None and speculating:
            auto_budget.observe(tree, path, drafting_seconds, budget=budget)
        new_tokens = torch.cat([tree.tokens[path], bonus.to(tree.tokens.device)]).to(input_ids.device)
        prefix_visible = torch.cat([prefix_visible, prefix_visible.new_ones(keep.numel())])
        next_position += keep.numel()
        stats.iterations += 1
        stats.nodes_per_iteration.append(tree.num_drafted)
        stats.accepted_per_iteration.append(new_tokens.numel())
        input_ids, kept, done = _commit(input_ids, new_tokens, stopping_criteria, processed[keep], streamer)
        scores, raw_logits = _record(
            scores, raw_logits, processed[keep], result.logits[keep], kept, want_scores, want_logits
        )
        # the accepted positions' target features, for the drafter to read before its next draft
        if not done and (auto_budget is None or auto_budget.largest > 0):
            if not unread:
                unread_first = next_position - keep.numel() + 1
            unread.append((result.features[keep], new_tokens))

    if streamer is not None:
        streamer.end()
    stats.new_tokens = input_ids.shape[1] - prompt_length
    stats.drafter_forwards = generator.stats.drafter_forwards
    stats.drafter_time_s = generator.stats.drafter_time_s
    stats.total_time_s = time.perf_counter() - started
    drafter.last_stats = stats
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(
            sequences=input_ids,
            scores=scores if want_scores else None,
            logits=raw_logits if want_logits else None,
            past_key_values=cache,
        )
    return input_ids


def _commit(
    input_ids: torch.LongTensor,
    new_tokens: torch.LongTensor,
    stopping_criteria: StoppingCriteriaList,
    processed: torch.Tensor,
    streamer: BaseStreamer | None,
) -> tuple[torch.LongTensor, int, bool]:
    """Append accepted tokens one at a time, stopping at the first one a stopping criterion fires on.

    Returns the extended sequence, how many tokens were kept and whether generation is done.
    """
    start = input_ids.shape[1]
    extended = torch.cat([input_ids, new_tokens[None]], dim=1)
    kept, done = new_tokens.numel(), False
    for i in range(new_tokens.numel()):
        if bool(stopping_criteria(extended[:, : start + i + 1], processed[i : i + 1]).any()):
            kept, done = i + 1, True
            break
    extended = extended[:, : start + kept]
    if streamer is not None:
        streamer.put(extended[0, start:].cpu())
    return extended, kept, done


def _record(
    scores: tuple[torch.Tensor, ...],
    raw_logits: tuple[torch.Tensor, ...],
    processed: torch.Tensor,
    raw: torch.Tensor,
    count: int,
    want_scores: bool,
    want_logits: bool,
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """One [1, V] entry per committed token."""
    if want_scores:
        scores += tuple(processed[i : i + 1] for i in range(count))
    if want_logits:
        raw_logits += tuple(raw[i : i + 1] for i in range(count))
    return scores, raw_logits


# ---------------------------------------------------------------------------------------------------------------
# Entry into generate()
# ---------------------------------------------------------------------------------------------------------------
_STOCK_ASSISTED_DECODING = GenerationMixin._assisted_decoding
_STOCK_VALIDATE_GENERATION_MODE = GenerationMixin._validate_generation_mode


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
    """`GenerationMixin._assisted_decoding`, routed to the tree loop when the assistant is a SpecBlock drafter."""
    if isinstance(assistant_model, TreeDraftModel):
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
    if not isinstance(assistant_model, TreeDraftModel):
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
    if generation_config.num_return_sequences > 1:
        raise ValueError("num_return_sequences must be 1 with SpecBlock decoding.")
    if streamer is not None:
        streamer.put(input_ids.cpu())
    return tree_speculative_decoding(
        model, input_ids, logits_processor, stopping_criteria, generation_config,
        streamer=streamer, assistant_model=assistant_model, **model_kwargs,
    )  # fmt: skip
