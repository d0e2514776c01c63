"""The tree speculative decoding loop: draft -> verify -> accept -> compact -> observe.

draft (`candidate_generators`: the drafter reads the queued context and grows a tree; `lookup`'s free candidates
join it) -> verify (`verification`: one target forward over the tree) -> accept (`acceptance`: greedy or lossless
sampling, after `logits_process`) -> compact (`cache_utils`: the target KV cache keeps the accepted path) -> observe
(the accepted positions' target features are queued for the drafter; the free candidates learn what was accepted).
`budget` picks the tree size per step when `tree_budget="auto"`, and sizes each drafted tree. With
`online_adaptation` on, `adaptation` collects the verified rows as a training signal and updates the drafter after
the call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation import GenerateDecoderOnlyOutput
from transformers.generation.streamers import BaseStreamer

from ..models.tree_drafter.configuration_tree_drafter import AUTO
from ..models.tree_drafter.modeling_tree_drafter import TreeDraftModel
from ..utils import sync
from .acceptance import greedy_accept, sample_accept
from .adaptation import online_adapter_for
from .budget import auto_budget_for
from .cache_utils import compact_cache, full_attention_cache
from .candidate_generators import TreeCandidateGenerator, get_candidate_generator
from .logits_process import TreeLogitsProcessor
from .tree import DraftTree
from .verification import target_features, verify_tree


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
    accepted_by_source: dict[str, int] = field(default_factory=dict)  # accepted drafted tokens each source proposed
    # online adaptation (`generation.adaptation`): the action taken after this call's tokens ("off", "skip",
    # "head_only", "full"), its time (inside total_time_s), the signal samples captured (of which the drafter's
    # best proposal was wrong), whether the previous call's update was rolled back, whether the loaded output
    # side was put back (it did better on this call's signal), the served minus the loaded weights' first-proposal
    # acceptance on this call's depth-1 signal (nan before the first update), the last head-only update's candidate
    # head minus the served one on the same signal (nan where no candidate was tested) and whether it is served now
    adaptation_action: str = "off"
    adaptation_time_s: float = 0.0
    adaptation_signal: int = 0
    adaptation_signal_wrong: int = 0
    adaptation_rolled_back: bool = False
    adaptation_restored_loaded: bool = False
    adaptation_held_out_gain: float = float("nan")
    adaptation_candidate_gain: float = float("nan")
    adaptation_promoted: bool = False

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
    generator = get_candidate_generator(drafter)
    adapter = online_adapter_for(drafter) if drafter.config.online_adaptation != "off" else None
    if adapter is not None:
        adapter.start_call(generator)
    auto_budget = auto_budget_for(drafter, model) if drafter.config.tree_budget == AUTO else None
    cache = full_attention_cache(model, model_kwargs["past_key_values"], generation_config, generator.tree_budget)
    feature_layers = drafter.config.feature_layers if generator.reads_features else []
    tree_processor = TreeLogitsProcessor(logits_processor)  # refuses stateful processors before any forward
    accept = sample_accept if generation_config.do_sample else greedy_accept
    outputs = _Outputs(generation_config)
    stats = SpecBlockStats()
    started = time.perf_counter()

    # prefill: the prompt through the target gives the first token and the drafter's context features
    mask_2d = model_kwargs.get("attention_mask")
    prefix_visible = (
        mask_2d[0].bool() if mask_2d is not None else torch.ones(input_ids.shape[1], dtype=torch.bool)
    ).to(model.device)
    prompt = model(
        input_ids=input_ids.to(model.device),
        attention_mask=mask_2d,
        position_ids=((prefix_visible.long().cumsum(0) - 1).clamp(min=0))[None],
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=feature_layers or False,
        logits_to_keep=1,
    )
    raw = prompt.logits[:, -1].float()
    processed = logits_processor(input_ids, raw.clone())
    token = torch.multinomial(processed.softmax(-1), 1)[0] if generation_config.do_sample else processed.argmax(-1)
    features = target_features(prompt, feature_layers, input_ids.shape[1], model.device)[prefix_visible]
    next_position = int(prefix_visible.sum())  # rotary position of the first generated token
    prompt_length = input_ids.shape[1]
    left_padding = prompt_length - next_position  # the committed text (what free candidates read) starts after it
    input_ids, kept, done = _commit(input_ids, token.to(input_ids.device), stopping_criteria, processed, streamer)
    outputs.record(processed, raw, kept)
    # the drafter reads committed positions lazily, right before it drafts (none at all while "auto" chooses 0)
    drafts_ever = auto_budget is None or auto_budget.largest > 0
    if not done and drafts_ever:
        context = torch.cat([input_ids[0, :-1][prefix_visible.to(input_ids.device)][1:], input_ids[0, -1:]])
        generator.queue(features, context, first_position=1)

    while not done:
        # draft
        if auto_budget is not None:
            budget = auto_budget.next_budget(drafter.config.auto_budget_explore_interval)
        else:
            budget = generator.tree_budget
        largest = auto_budget.largest if auto_budget is not None else budget
        tree, drafting_seconds = _draft(generator, input_ids[0, left_padding:], budget, largest, model.device)
        if auto_budget is not None:  # verify only the part of this tree that pays for its nodes
            tree = auto_budget.worth_verifying(tree, drafted=budget > 0)
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
        if budget > 0 or generator.free_candidates is not None:
            generator.record_verified(tree, path)
        if adapter is not None and budget > 0:  # the verified rows teach the drafter (no extra target forward)
            adapter.capture(generator, tree, path, bonus, result.logits)
        if auto_budget is not None and budget > 0:
            auto_budget.observe(tree, path, drafting_seconds, budget=budget)
        elif auto_budget is not None and auto_budget.free_at_zero:
            auto_budget.observe_free(tree, path)
        new_tokens = torch.cat([tree.tokens[path], bonus.to(tree.tokens.device)]).to(input_ids.device)
        prefix_visible = torch.cat([prefix_visible, prefix_visible.new_ones(keep.numel())])
        next_position += keep.numel()
        stats.iterations += 1
        stats.nodes_per_iteration.append(tree.num_drafted)
        stats.accepted_per_iteration.append(new_tokens.numel())
        input_ids, kept, done = _commit(input_ids, new_tokens, stopping_criteria, processed[keep], streamer)
        outputs.record(processed[keep], result.logits[keep], kept)
        # observe: queue the accepted positions' target features for the drafter's next draft
        if not done and drafts_ever:
            generator.queue(result.features[keep], new_tokens, first_position=next_position - keep.numel() + 1)

    if streamer is not None:
        streamer.end()
    stats.new_tokens = input_ids.shape[1] - prompt_length
    stats.drafter_forwards = generator.stats.drafter_forwards
    stats.drafter_time_s = generator.stats.drafter_time_s
    stats.accepted_by_source = dict(generator.stats.accepted_by_source)
    if adapter is not None:  # update after the call's last token, timed inside the call
        report = adapter.finish_call(stats.new_tokens, time.perf_counter() - started, stats.tau)
        stats.adaptation_action, stats.adaptation_time_s = report.action, report.update_time_s
        stats.adaptation_signal, stats.adaptation_signal_wrong = report.signal, report.signal_wrong
        stats.adaptation_rolled_back, stats.adaptation_restored_loaded = report.rolled_back, report.restored_loaded
        stats.adaptation_held_out_gain = report.held_out_gain
        stats.adaptation_candidate_gain, stats.adaptation_promoted = report.candidate_gain, report.promoted
    stats.total_time_s = time.perf_counter() - started
    drafter.last_stats = stats
    return outputs.result(input_ids, cache)


def _draft(
    generator: TreeCandidateGenerator, sequence: torch.LongTensor, budget: int, largest: int, device: torch.device
) -> tuple[DraftTree, float | None]:
    """Read the queued context and draft a tree of at most `budget` nodes after the committed tokens `sequence` [T]
    (budget 0: no drafter call, the root alone or, where the drafter has them, the free candidates' tree up to the
    largest budget). Also returns the step's drafting seconds where they are representative of a steady step (the
    drafter read just the previous step, not a prompt or several skipped steps), else None."""
    if budget == 0 and generator.free_candidates is None:
        return DraftTree.root_only(int(sequence[-1]), device), None
    if budget == 0:
        generator.tree_budget = largest
        return generator.draft_tree(sequence, with_drafter=False), None
    generator.tree_budget = budget
    steady = generator.has_read and len(generator.queued) == 1
    before = generator.stats.drafter_time_s
    generator.read_queued()
    tree = generator.draft_tree(sequence)
    return tree, (generator.stats.drafter_time_s - before if steady else None)


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


class _Outputs:
    """What `return_dict_in_generate` asks for: one [1, V] processed score / raw logit entry per committed token."""

    def __init__(self, generation_config: GenerationConfig) -> None:
        self.as_dict = generation_config.return_dict_in_generate
        self.want_scores = self.as_dict and generation_config.output_scores
        self.want_logits = self.as_dict and generation_config.output_logits
        self.scores: tuple[torch.Tensor, ...] = ()
        self.logits: tuple[torch.Tensor, ...] = ()

    def record(self, processed: torch.Tensor, raw: torch.Tensor, count: int) -> None:
        """Keep the first `count` rows of this step's [n, V] processed scores and raw logits."""
        if self.want_scores:
            self.scores += tuple(processed[i : i + 1] for i in range(count))
        if self.want_logits:
            self.logits += tuple(raw[i : i + 1] for i in range(count))

    def result(self, sequences: torch.LongTensor, cache: DynamicCache) -> GenerateDecoderOnlyOutput | torch.LongTensor:
        if not self.as_dict:
            return sequences
        return GenerateDecoderOnlyOutput(
            sequences=sequences,
            scores=self.scores if self.want_scores else None,
            logits=self.logits if self.want_logits else None,
            past_key_values=cache,
        )
