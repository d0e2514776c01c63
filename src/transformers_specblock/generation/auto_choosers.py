"""The `tree_budget="auto"` chooser of a drafter serving a target: made once per (drafter, target, device, settings),
kept in the drafter's serving state, and, with `auto_budget_cost_cache`, going on from what a chooser of the same
drafter, target and host learnt in an earlier process (`autotune_cache`), once that is checked against the machine
now: the stored cost curve by a probe (`target_cost.probe`), the learnt state by the plain step's seconds it was
learnt with (`AutoBudget.restore`). What was learnt while the machine was busier starts afresh."""

from __future__ import annotations

import weakref

from transformers import PreTrainedModel

from ..hub.assets import default_cache_dir
from ..models.tree_drafter.modeling_tree_drafter import TreeDraftModel
from .autotune_cache import digest, hardware_fingerprint, read_json, target_architecture_fingerprint
from .autotune_cache import weights_fingerprint, write_json
from .budget import AutoBudget
from .lookup import LookupSettings
from .target_cost import BATCH_CONTEXT, SMALL_SIZES, measure_target_cost


def auto_budget_for(drafter: TreeDraftModel, target: PreTrainedModel) -> AutoBudget:
    """The `tree_budget="auto"` chooser of `drafter` for `target`, kept in the drafter's serving state for that target
    (`drafter.serving_state(target).auto_budgets`, the target held weakly): the target's cost curve is measured once
    per device, and what it learns about acceptance carries over between `generate` calls (as the drafter's own tree
    settings change too), except that other free-candidate settings (`generation.lookup`) get their own chooser: a
    drafter with and without prompt lookup draws different kinds of trees."""
    config = drafter.generation_config
    candidates = list(config.auto_budget_candidates)
    state = drafter.serving_state(target)
    key = (str(target.device), tuple(candidates), LookupSettings.from_config(config))
    if key not in state.auto_budgets:
        sizes = sorted(set(candidates) | SMALL_SIZES)
        weak_target = weakref.ref(target)
        cache_dir = default_cache_dir() if config.auto_budget_cost_cache else None
        chooser = AutoBudget(
            candidates, measure_target_cost(target, sizes, cache_dir=cache_dir),
            warmup=config.auto_budget_warmup,
            warmup_cost=config.auto_budget_warmup_cost,
            free_at_zero=key[-1].enabled,
            min_gain=config.auto_budget_min_gain,
            measure=lambda batch_size: measure_target_cost(
                weak_target(), sizes, BATCH_CONTEXT, batch_size=batch_size, cache_dir=cache_dir
            ),
        )  # fmt: skip
        if cache_dir is not None:  # go on from what a chooser of the same drafter, target and host learnt before,
            # unless it was learnt on a busier machine (`AutoBudget.restore`); the next save replaces it
            chooser.state_path = cache_dir / "auto-budget" / f"{chooser_key(drafter, target, key)}.json"
            chooser.restore(read_json(chooser.state_path))
        state.auto_budgets[key] = chooser
    state.auto_budget = state.auto_budgets[key]  # the chooser of the latest call, for inspection
    return state.auto_budget


def save_chooser(chooser: AutoBudget) -> None:
    """Keep what `chooser` learnt in its `state_path` (where it has one), for the next process."""
    if chooser.state_path is not None:
        write_json(chooser.state_path, chooser.learnt_state())


def chooser_key(drafter: TreeDraftModel, target: PreTrainedModel, key: tuple) -> str:
    """What a chooser's learnt state depends on: the host, the target's architecture, dtype and device, the drafter's
    weights and architecture, the candidates and free-candidate settings (`key`), the warm-up settings, how trees
    are built and whether the drafter adapts while serving (both change what a tree commits and costs)."""
    settings = drafter.generation_config
    return digest([
        hardware_fingerprint(target.device), target_architecture_fingerprint(target), str(target.dtype),
        type(drafter).__name__, weights_fingerprint(drafter), drafter.config.to_dict(), repr(key),
        settings.auto_budget_warmup, settings.auto_budget_warmup_cost, settings.tree_construction,
        settings.online_adaptation,
    ])  # fmt: skip
