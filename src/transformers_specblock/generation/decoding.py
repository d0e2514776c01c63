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

import copy
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from ..models.tree_drafter.generation_config import AUTO, TreeGenerationConfig
from ..models.tree_drafter.modeling_tree_drafter import TreeDraftModel
from ..utils import CACHE_ARGUMENT, sync, to_device
from .acceptance import greedy_accept_rows, kept_rows, sample_accept
from .adaptation import OnlineAdapter, online_adapter_for
from .auto_choosers import auto_budget_for, save_chooser
from .budget import PLAIN, AutoBudget
from .cache_utils import compact_cache, full_attention_cache, repack_cache
from .candidate_generators import TreeCandidateGenerator, get_candidate_generator
from .input_checks import check_inputs, generation_cache
from .logits_process import TreeLogitsProcessor
from .rows import HostStopRule, Row, batch_output, commit, host_stop_rule, record
from .stats import RowStats, SpecBlockStats, TreeGenerateOutput
from .tree import DraftTree
from .tree_batch import TreeBatch, kept_index
from .verification import target_features, verify_trees

REPACK_MIN_HOLES = 16  # cache columns every row hides before they are dropped (and at least a quarter of the cache)


CATCH_UP_POSITIONS = 16  # a read this long measures the drafter's cost per position (a shorter one, its fixed cost)

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
) -> TreeGenerateOutput | torch.LongTensor:
    """Decode a batch with a tree drafter; same arguments and outputs as `_assisted_decoding`.

    Every row drafts its own tree (its own candidate generator: drafter cache, queued context, free candidates);
    the target verifies all rows' trees in one forward; each row accepts its own path and rows that finish leave
    the batch."""
    drafter = assistant_model
    state = drafter.serve(model)  # the target checked; `state.drafter`: this drafter, or a copy in the target's dtype
    served = state.drafter
    check_inputs(model, input_ids, generation_config, model_kwargs, streamer)
    if synced_gpus:
        raise ValueError("synced_gpus (DeepSpeed ZeRO-3 / FSDP) is not supported with SpecBlock decoding.")
    generators = [get_candidate_generator(served, state=state) for _ in range(input_ids.shape[0])]
    adapter = online_adapter_for(served, state) if drafter.generation_config.online_adaptation != "off" else None
    if adapter is not None:
        adapter.start_call(generators)
    auto_budget = auto_budget_for(drafter, model) if drafter.generation_config.tree_budget == AUTO else None
    if auto_budget is not None and auto_budget.free_at_zero:  # drafted steps also tell what budget 0 would commit
        for generator in generators:
            generator.size_free_alone = auto_budget.free_alone_tree
    # the drafter reads committed positions lazily, right before it drafts (none at all while "auto" chooses 0)
    drafts_ever = auto_budget is None or auto_budget.largest > 0
    loop = _Loop(
        model, generation_config, logits_processor, TreeLogitsProcessor(logits_processor), stopping_criteria,
        full_attention_cache(model, generation_cache(model_kwargs), generation_config, generators[0].tree_budget),
        auto_budget, adapter, drafts_ever,
        feature_layers=drafter.config.feature_layers if generators[0].reads_features and drafts_ever else [],
        host_stop_rule=host_stop_rule(stopping_criteria),
    )  # fmt: skip
    started = time.perf_counter()

    loop.stats.rows = [RowStats() for _ in generators]
    rows, visible = loop.prefill(input_ids, model_kwargs.get("attention_mask"), generators)
    if streamer is not None:
        streamer.put(rows[0].sequence[-1:].cpu())
    live, visible = _retire(rows, loop.cache, visible)
    while live:
        budget = loop.budget(live, generators[0].tree_budget, drafter.generation_config)
        step_started, drafting_before = time.perf_counter(), _drafting_seconds(generators)
        adapting_before = adapter.capture_seconds if adapter is not None else 0.0
        drafted = [_draft(row.generator, row.committed, budget, loop.largest(budget), model.device) for row in live]
        visible, counts = loop.step(live, drafted, budget, visible)
        if auto_budget is not None:  # the step's own seconds, drafting and adaptation's signal excluded: what the
            drafting = _drafting_seconds(generators) - drafting_before  # chooser weighs trees by
            adapting = adapter.capture_seconds - adapting_before if adapter is not None else 0.0
            step_seconds = time.perf_counter() - step_started - drafting - adapting
            catch_up = [read for _, _, read in drafted if read[0]]
            catch_up = (sum(p for p, _ in catch_up), sum(s for _, s in catch_up))
            auto_budget.observe_step(loop.verified_size, step_seconds, drafting, catch_up, budget)
        if streamer is not None:
            streamer.put(live[0].sequence[-counts[0] :].cpu())
        live, visible = _retire(live, loop.cache, visible)

    if streamer is not None:
        streamer.end()
    for row in rows:  # the suffix store remembers every row's whole text
        row.generator.finish(row.committed)
    stats = loop.stats
    for row, row_stats in zip(rows, stats.rows):
        row_stats.new_tokens = row.sequence.numel() - input_ids.shape[1]
        row_stats.drafter_forwards = row.generator.stats.drafter_forwards
        row_stats.drafter_time_s = row.generator.stats.drafter_time_s
    stats.new_tokens = sum(row.sequence.numel() for row in rows) - len(rows) * input_ids.shape[1]
    stats.drafter_forwards = sum(g.stats.drafter_forwards for g in generators)
    stats.drafter_time_s = _drafting_seconds(generators)
    per_row = [g.stats.accepted_by_source for g in generators]
    stats.accepted_by_source = {source: sum(counts[source] for counts in per_row) for source in per_row[0]}
    if adapter is not None:  # update after the call's last token, timed inside the call; the user's drafter takes
        stats.adaptation = copy.copy(adapter.finish_call(stats.new_tokens, time.perf_counter() - started, stats.tau))
        if served is not drafter:  # what a cast copy learnt
            state.write_back(drafter)
    stats.total_time_s = time.perf_counter() - started
    drafter.last_stats = stats
    if auto_budget is not None:  # what it learnt, for the next process (`auto_budget_cost_cache`)
        save_chooser(auto_budget)
    # a batch's cache holds rows that left and holes: only a single row's cache can be decoded on from
    return batch_output(rows, generation_config, loop.cache if len(rows) == 1 else None, stats)


@dataclass
class _Loop:
    """What every step of one `generate` call shares: the target and its cache, the user's processors and stopping
    criteria, the budget chooser, online adaptation and the call's statistics."""

    model: PreTrainedModel
    generation_config: GenerationConfig
    logits_processor: LogitsProcessorList
    tree_processor: TreeLogitsProcessor  # refuses stateful processors before any forward
    stopping_criteria: StoppingCriteriaList
    cache: DynamicCache
    auto_budget: AutoBudget | None
    adapter: OnlineAdapter | None
    drafts_ever: bool
    feature_layers: list[int] = field(default_factory=list)
    stats: SpecBlockStats = field(default_factory=SpecBlockStats)
    verified_size: int = 0  # drafted nodes per row the last step verified (its padded trees')
    host_stop_rule: HostStopRule | None = None  # the stopping criteria answered on the host, where they allow it

    @property
    def walk_stop_rule(self) -> HostStopRule:
        """Where a walk along the accepted path ends (`TreeLogitsProcessor.walk`): the host rule, or else the maximum
        length alone (other stopping criteria, e.g. stop strings, are checked when the tokens are committed)."""
        if self.host_stop_rule is not None:
            return self.host_stop_rule
        return lambda length, token: length >= self.generation_config.max_length

    def prefill(
        self, input_ids: torch.LongTensor, mask_2d: torch.Tensor | None, generators: list[TreeCandidateGenerator]
    ) -> tuple[list[Row], torch.BoolTensor]:
        """The prompts through the target give each row its first token and its drafter's context features; returns
        the rows and the cache columns each sees [B, S]."""
        device = self.model.device
        visible = (mask_2d.bool() if mask_2d is not None else torch.ones_like(input_ids, dtype=torch.bool)).to(device)
        prompt = self.model(
            input_ids=input_ids.to(device),
            attention_mask=mask_2d,
            position_ids=(visible.long().cumsum(-1) - 1).masked_fill(~visible, 1),  # as transformers' generate
            **{CACHE_ARGUMENT: self.cache},
            use_cache=True,
            output_hidden_states=self.feature_layers or False,
            logits_to_keep=1,
        )
        raw = prompt.logits[:, -1].float()
        processed = self.logits_processor(input_ids, raw.clone())  # the whole batch, as plain generate's first step
        sample = self.generation_config.do_sample
        first = torch.multinomial(processed.softmax(-1), 1)[:, 0] if sample else processed.argmax(-1)
        features = target_features(prompt, self.feature_layers, tuple(input_ids.shape), device)
        width = input_ids.shape[1]
        rows = [
            Row(r, input_ids[r], width - n, n, generator, hidden=width - n)
            for r, (n, generator) in enumerate(zip(visible.sum(1).tolist(), generators))
        ]
        kept = commit(rows, list(first.to(input_ids.device)[:, None]), list(processed[:, None]), self.stopping_criteria)
        for row, count in zip(rows, kept):
            record(row, self.generation_config, processed[row.index, None], raw[row.index, None], count)
            if not row.done and self.drafts_ever:  # its prompt: the columns after its left padding (`check_inputs`)
                context = torch.cat([input_ids[row.index, row.left_padding + 1 :], row.sequence[-1:]])
                row.generator.queue(features[row.index, row.left_padding :], context, first_position=1)
        return rows, visible

    def budget(self, live: list[Row], fixed: int, config: TreeGenerationConfig) -> int:
        """This step's budget: the chooser's for the live batch (an exploration pays for what the drafters have not
        read yet), or the fixed one."""
        if self.auto_budget is None:
            return fixed
        self.auto_budget.set_batch_size(len(live))
        unread = sum(row.generator.unread_positions for row in live)
        return self.auto_budget.next_budget(
            config.auto_budget_explore_interval, config.auto_budget_explore_share, unread
        )

    def largest(self, budget: int) -> int:
        return self.auto_budget.largest if self.auto_budget is not None else budget

    def step(
        self, live: list[Row], drafted: list[tuple[DraftTree, float | None]], budget: int, visible: torch.BoolTensor
    ) -> tuple[torch.BoolTensor, list[int]]:
        """Verify -> accept -> compact -> observe the live rows' drafted trees; returns the new cache visibility and
        how many tokens each row committed."""
        trees = [tree for tree, _, _ in drafted]
        if self.auto_budget is not None:  # verify only the part of each tree that pays for its nodes
            trees = self.auto_budget.worth_verifying(trees, drafted=budget > 0)
        batch = TreeBatch.pad(trees)
        self.verified_size = batch.size - 1
        # verify
        device = self.model.device
        sync(device)
        target_start = time.perf_counter()
        past_length = self.cache.get_seq_length()
        positions = to_device([row.next_position for row in live], device)
        result = verify_trees(self.model, batch, self.cache, visible, positions, self.feature_layers)
        # [B, N+1, V]: a greedy step without processors picks from the target's own logits (a float32 copy of every
        # node's row would cost as much as the pick); the kept rows become float32 scores below
        plain_greedy = not self.generation_config.do_sample and not len(self.logits_processor)
        raw = result.logits if plain_greedy else result.logits.float()
        processed, sample = raw, self.generation_config.do_sample
        # accept
        host_tokens = None  # each row's new tokens, where the host knows them (then `commit` reads nothing back)
        if self.tree_processor.path_only:  # processors run on the accepted path's nodes only, as it is walked
            processed, paths = raw.clone(), []
            for i, (row, tree) in enumerate(zip(live, trees)):
                path, row_bonus, processed[i, : len(tree)] = self.tree_processor.walk(
                    row.sequence[None], raw[i, : len(tree)], tree, row.index, sample, self.walk_stop_rule
                )
                paths.append((path, row_bonus))
        elif len(self.logits_processor):
            processed = raw.clone()
            for i, (row, tree) in enumerate(zip(live, trees)):
                processed[i, : len(tree)] = self.tree_processor(row.sequence[None], raw[i, : len(tree)], tree, row.index)
        if self.tree_processor.path_only or sample:
            if not self.tree_processor.path_only:
                paths = [sample_accept(tree, processed[i, : len(tree)]) for i, tree in enumerate(trees)]
            kept = [[0] + path.tolist() for path, _ in paths]
            bonus = torch.cat([b.to(batch.tokens.device) for _, b in paths])
        else:
            kept, bonus, host_bonus = greedy_accept_rows(batch, processed)
            if host_bonus is not None:
                host_tokens = [[tree.host().tokens[node] for node in nodes[1:]] + [token] if len(nodes) > 1 else [token]
                               for tree, nodes, token in zip(trees, kept, host_bonus)]  # fmt: skip
        # compact
        holds = compact_cache(self.cache, past_length, kept)
        visible = torch.cat([visible, holds.to(device)], dim=1)
        sync(device)
        self.stats.target_time_s += time.perf_counter() - target_start
        self.stats.target_forwards += 1
        # every row's kept nodes as one [B, K] index (root first; a shorter row repeats its last node)
        index = kept_index(kept, batch.tokens.device)
        lengths = [len(nodes) for nodes in kept]
        new_tokens = batch.new_tokens(index, lengths, bonus)
        kept_scores, kept_raw = kept_rows(kept, index, processed, raw, self.generation_config.output_logits)
        if budget > 0 or (budget == 0 and any(row.generator.free_candidates is not None for row in live)):
            for i, (row, tree, (_, drafting_seconds, _)) in enumerate(zip(live, trees, drafted)):
                self._learn(row, tree, kept[i][1:], bonus[i : i + 1], raw[i, : len(tree)], budget, drafting_seconds)
        self.stats.iterations += len(live)
        self.stats.nodes_per_iteration += [tree.num_drafted for tree in trees]
        self.stats.accepted_per_iteration += lengths
        for row, tree, n in zip(live, trees, lengths):
            self.stats.rows[row.index].nodes_per_iteration.append(tree.num_drafted)
            self.stats.rows[row.index].accepted_per_iteration.append(n)
        counts = commit(live, [new_tokens[i, :n] for i, n in enumerate(lengths)], list(kept_scores),
                        self.stopping_criteria, host_tokens, self.host_stop_rule)  # fmt: skip
        for i, (row, n, count) in enumerate(zip(live, lengths, counts)):
            if self.auto_budget is not None:  # what budget 0 would have committed at earlier drafted steps
                self.auto_budget.observe_free_alone(row.generator.take_free_alone())
            record(row, self.generation_config, kept_scores[i], kept_raw[i], count)
            row.hidden += holds.shape[1] - n
            row.next_position += n
            # observe: queue the accepted positions' target features for the drafter's next draft
            if not row.done and self.drafts_ever:
                row.generator.queue(result.features[i, index[i, :n]], new_tokens[i, :n],
                                    first_position=row.next_position - n + 1)  # fmt: skip
        return visible, counts

    def _learn(
        self, row: Row, tree: DraftTree, path: list[int], bonus: torch.LongTensor, logits: torch.Tensor,
        budget: int, drafting_seconds: float | None,
    ) -> None:  # fmt: skip
        """What one row's verified tree (its accepted nodes `path`) teaches: the free candidates' scores, online
        adaptation's signal and the budget chooser's estimates."""
        row.generator.record_verified(tree, path)
        if self.adapter is not None and self.adapter.capturing and budget > 0:  # the verified rows teach the drafter
            path_nodes = torch.tensor(path, dtype=torch.long, device=tree.tokens.device)
            self.adapter.capture(row.generator, tree, path_nodes, bonus, logits.float())
        if self.auto_budget is not None and budget > 0:
            self.auto_budget.observe(tree, path, drafting_seconds, budget=budget)
        elif self.auto_budget is not None and self.auto_budget.free_at_zero:
            self.auto_budget.observe_free(tree, path, drafting_seconds)


def _retire(live: list[Row], cache: DynamicCache, visible: torch.BoolTensor) -> tuple[list[Row], torch.BoolTensor]:
    """Rows that finished leave the batch (the target cache keeps the live rows only); then the cache columns every
    live row hides are dropped once they are a quarter of the cache (`repack_cache`)."""
    staying = [i for i, row in enumerate(live) if not row.done]
    if len(staying) < len(live) and staying:
        index = torch.tensor(staying, device=visible.device)
        cache.batch_select_indices(index)
        visible = visible[index]
        live = [live[i] for i in staying]
    elif not staying:
        return [], visible
    if len(live) > 1 or live[0].hidden:
        drop = min(row.hidden for row in live)
        if drop >= max(REPACK_MIN_HOLES, visible.shape[1] // 4):
            visible = repack_cache(cache, visible, drop)
            for row in live:
                row.hidden -= drop
    return live, visible


def _drafting_seconds(generators: list[TreeCandidateGenerator]) -> float:
    return sum(generator.stats.drafter_time_s for generator in generators)


def _draft(
    generator: TreeCandidateGenerator, sequence: torch.LongTensor, budget: int, largest: int, device: torch.device
) -> tuple[DraftTree, float | None, tuple[int, float]]:
    """Read the queued context and draft a tree of at most `budget` nodes after the committed tokens `sequence` [T]
    (budget 0: no drafter call, the root alone or, where the drafter has them, the free candidates' tree up to the
    largest budget; `PLAIN`: the root alone, the free candidates' tree scored aside now and then). Also returns the
    step's drafting seconds where they are representative of a steady step (the drafter read just the previous
    step, not a prompt or several skipped steps; at budget 0 the free candidates' seconds), else None; and a
    catch-up's positions and reading seconds (a read of at least `CATCH_UP_POSITIONS` positions; else (0, 0.0))."""
    before = generator.stats.drafter_time_s
    if budget == PLAIN:
        generator.plain_step(sequence)
        return DraftTree.root_only(sequence[-1], device), None, (0, 0.0)
    if budget == 0 and generator.free_candidates is None:
        return DraftTree.root_only(sequence[-1], device), None, (0, 0.0)
    if budget == 0:
        generator.tree_budget = largest
        return generator.draft_tree(sequence, with_drafter=False), generator.stats.drafter_time_s - before, (0, 0.0)
    generator.tree_budget = budget
    steady = generator.has_read and len(generator.queued) == 1
    positions = generator.unread_positions
    generator.read_queued()
    reading = generator.stats.drafter_time_s - before
    catch_up = (positions, reading) if not steady and positions >= CATCH_UP_POSITIONS else (0, 0.0)
    tree = generator.draft_tree(sequence)
    return tree, (generator.stats.drafter_time_s - before if steady else None), catch_up
