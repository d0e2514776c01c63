"""A drafter is a model, not a stateful server: what serving learns and keeps lives in one explicit object per
(drafter, target), holding the target weakly; serving never casts or moves the user's drafter; settings passed to
`generate` apply to that call only; copies and pickles work after any call."""

from __future__ import annotations

import copy
import gc
import json
import pickle
import weakref

import pytest
import torch

from conftest import make_drafter, make_target
from scripted_clock import ScriptedMachine
from transformers import AutoModel
from transformers.utils import logging

from transformers_specblock import LookupTreeModel, SpecBlockDraftModel
from transformers_specblock.models.tree_drafter.generation_config import DRAFTING_SETTINGS, TreeGenerationConfig
from transformers_specblock.generation.adaptation import online_adapter_for
from transformers_specblock.generation import auto_choosers
from transformers_specblock.generation.auto_choosers import auto_budget_for
from transformers_specblock.generation.suffix_cache import suffix_cache_for
from transformers_specblock.hub.shipped import resolve_drafter_path
from transformers_specblock.generation.target_cost import _COST_CACHE, COST_CACHE_FILE, measure_target_cost

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = torch.tensor([[0, 5, 9, 3, 7, 2, 5, 9, 3, 7, 2, 5]])
EVERY_FREE_SOURCE = dict(
    prompt_lookup_num_tokens=4, ngram_cache_num_tokens=3, suffix_cache_num_tokens=8, suffix_local_num_tokens=4
)


def greedy(target, **kwargs) -> torch.LongTensor:
    return target.generate(PROMPT, max_new_tokens=16, do_sample=False, **kwargs)


def floating_dtypes(model) -> set[torch.dtype]:
    return {t.dtype for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()}


def test_deepcopy_and_pickle_after_calls_with_every_free_source_and_adaptation():
    target = make_target(vocab_size=32, seed=1)
    drafter = make_drafter(target, tree_budget=8, online_adaptation="always", **EVERY_FREE_SOURCE)
    expected = greedy(target)
    for _ in range(2):  # the second call reads the suffix store and adapts again
        assert torch.equal(greedy(target, assistant_model=drafter), expected)
    assert len(suffix_cache_for(drafter)) == 2 and drafter.serving_state(target).adaptation is not None

    for clone in (copy.deepcopy(drafter), pickle.loads(pickle.dumps(drafter))):
        assert len(clone.serving_states) == 0 and clone.serving_states.suffix_store is None  # a fresh serving state
        for (name, a), (_, b) in zip(drafter.state_dict().items(), clone.state_dict().items()):
            assert torch.equal(a, b), name
        assert torch.equal(greedy(target, assistant_model=clone), expected)  # and it serves
    assert set(drafter.state_dict()) == set(make_drafter(target).state_dict())  # no serving state in the weights


def test_a_16bit_target_leaves_a_float32_drafter_float32_and_saves_float32(tmp_path):
    target = make_target(vocab_size=32, seed=2).to(torch.bfloat16)
    drafter = make_drafter(target, tree_budget=8).float()
    weights = {name: tensor.clone() for name, tensor in drafter.state_dict().items()}
    expected = greedy(target)
    assert torch.equal(greedy(target, assistant_model=drafter), expected)
    assert floating_dtypes(drafter) == {torch.float32}
    assert all(torch.equal(weights[name], tensor) for name, tensor in drafter.state_dict().items())
    served = drafter.served_for(target)  # what drafted: a bfloat16 copy, kept for the next call
    assert served is not drafter and floating_dtypes(served) == {torch.bfloat16}
    assert served is drafter.served_for(target)

    drafter.save_pretrained(tmp_path)
    loaded = SpecBlockDraftModel.from_pretrained(tmp_path)
    assert floating_dtypes(loaded) == {torch.float32} and loaded.config.dtype in (torch.float32, "float32")
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(weights[name], tensor), name

    with torch.no_grad():  # a change of the drafter's weights reaches the next call's copy
        drafter.lm_head.weight.mul_(2)
    assert drafter.served_for(target) is not served


def test_a_drafter_holds_no_target_it_served_once_deleted():
    settings = dict(tree_budget="auto", auto_budget_warmup=2, suffix_cache_num_tokens=8)
    drafter = make_drafter(make_target(vocab_size=32), **settings)
    refs = []
    for seed in (3, 4):  # two targets one after the other, each with "auto" (a cost curve) and the suffix cache
        target = make_target(vocab_size=32, seed=seed)
        greedy(target, assistant_model=drafter)
        assert drafter.serving_state(target).auto_budget is not None
        refs.append(weakref.ref(target))
        suffix_cache_for(drafter).reset()  # the next target has other embeddings: its store must start empty
        del target
        gc.collect()
    assert [ref() for ref in refs] == [None, None]
    assert len(drafter.serving_states) == 0  # their states went with them
    with pytest.raises(ValueError, match="has not served a target that is still alive"):
        drafter.serving_state()


def test_settings_passed_to_generate_apply_to_that_call_only():
    target = make_target(vocab_size=32, seed=5)
    lookup = LookupTreeModel.from_target(target, tree_budget=8, prompt_lookup_num_tokens=10)
    expected = greedy(target)
    assert torch.equal(greedy(target, assistant_model=lookup, prompt_lookup_num_tokens=1), expected)
    nodes_one = max(lookup.last_stats.nodes_per_iteration)
    assert torch.equal(greedy(target, assistant_model=lookup), expected)
    nodes_ten = max(lookup.last_stats.nodes_per_iteration)
    assert nodes_one <= lookup.generation_config.prompt_lookup_branches < nodes_ten  # chains of 1 token vs up to 10
    assert lookup.generation_config.prompt_lookup_num_tokens == 10  # the call's setting did not stay

    drafter = make_drafter(target, tree_budget=16)
    assert torch.equal(greedy(target, assistant_model=drafter, tree_budget=2), expected)
    assert max(drafter.last_stats.nodes_per_iteration) <= 2 and drafter.generation_config.tree_budget == 16
    assert torch.equal(greedy(target, assistant_model=drafter), expected)
    assert max(drafter.last_stats.nodes_per_iteration) > 2

    with pytest.raises(ValueError, match="tree_budget must be a positive int"):
        greedy(target, assistant_model=drafter, tree_budget=0)
    assert drafter.generation_config.tree_budget == 16
    with pytest.raises(ValueError, match=r"\['tree_budget'\] are settings of this package's tree drafters"):
        greedy(target, tree_budget=4)


def test_reset_serving_state_forgets_what_serving_learnt():
    target = make_target(vocab_size=32, seed=6)
    drafter = make_drafter(target, tree_budget="auto", auto_budget_warmup=2, suffix_cache_num_tokens=8)
    expected = greedy(target, assistant_model=drafter)
    assert len(suffix_cache_for(drafter)) == 1 and drafter.serving_state(target).auto_budgets
    drafter.reset_serving_state()
    assert len(drafter.serving_states) == 0 and drafter.serving_states.suffix_store is None
    assert torch.equal(greedy(target, assistant_model=drafter), expected)


def test_online_adaptation_of_a_cast_copy_reaches_the_users_drafter_in_its_own_dtype():
    """Serving casts nothing of the user's: the bfloat16 copy drafts and adapts, and what it learnt is written back
    into the user's float32 drafter after each call (its dtype unchanged)."""
    target = make_target(vocab_size=32, seed=7).to(torch.bfloat16)
    drafter = make_drafter(target, tree_budget=8, online_adaptation="always").float()
    weights = {name: tensor.clone() for name, tensor in drafter.state_dict().items()}
    expected = greedy(target)
    for _ in range(2):
        assert torch.equal(greedy(target, assistant_model=drafter), expected)
    adapter = online_adapter_for(drafter.served_for(target), drafter.serving_state(target))
    assert adapter.drafter is drafter.served_for(target) and adapter.drafter is not drafter
    assert all(tensor.dtype == weights[name].dtype for name, tensor in drafter.state_dict().items())
    assert any(not torch.equal(weights[name], tensor) for name, tensor in drafter.state_dict().items())


def test_decoding_settings_live_in_generation_config_json(tmp_path):
    target = make_target(vocab_size=32, seed=8)
    drafter = make_drafter(target, tree_budget=12, prompt_lookup_num_tokens=5, online_adaptation="bandit")
    assert isinstance(drafter.generation_config, TreeGenerationConfig)
    drafter.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert not set(saved) & set(DRAFTING_SETTINGS) and "legacy_drafting_settings" not in saved
    written = json.loads((tmp_path / "generation_config.json").read_text())
    assert written["tree_budget"] == 12 and written["prompt_lookup_num_tokens"] == 5
    loaded = SpecBlockDraftModel.from_pretrained(tmp_path)
    assert loaded.generation_config.drafting_settings() == drafter.generation_config.drafting_settings()
    assert SpecBlockDraftModel.from_pretrained(tmp_path, tree_budget=3).generation_config.tree_budget == 3


def test_an_older_checkpoint_reads_its_config_json_settings_with_one_warning(tmp_path, caplog):
    target = make_target(vocab_size=32, seed=9)
    make_drafter(target).save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tree_budget": 6, "suffix_cache_num_tokens": 9}))
    logger = logging.get_logger("transformers_specblock")
    logger.propagate = True
    logger.warning_once.cache_clear()  # once per process: count this test's
    with caplog.at_level("WARNING"):
        first = SpecBlockDraftModel.from_pretrained(tmp_path)
        second = SpecBlockDraftModel.from_pretrained(tmp_path)
    assert first.generation_config.tree_budget == second.generation_config.tree_budget == 6
    assert first.generation_config.suffix_cache_num_tokens == 9
    assert sum("are decoding settings" in record.message for record in caplog.records) == 1
    assert "tree_budget" not in first.config.to_dict()


def test_tree_shape_settings_in_an_older_config_json_fill_what_generation_config_json_lacks(tmp_path, caplog):
    """Written before the tree shape moved to `generation_config.json`: a config.json holding `max_blocks` and
    `branch_widths` beside a generation_config.json without them. Loading reads them (with the warning), a setting
    the file has wins, and saving again moves them."""
    target = make_target(vocab_size=32, seed=9)
    make_drafter(target, tree_budget=7).save_pretrained(tmp_path)
    settings = json.loads((tmp_path / "generation_config.json").read_text())
    for name in ("max_blocks", "branch_widths"):
        del settings[name]
    (tmp_path / "generation_config.json").write_text(json.dumps(settings))
    config = json.loads((tmp_path / "config.json").read_text())
    old = {"max_blocks": 3, "branch_widths": [1, 2, 3, 0], "tree_budget": 5}
    (tmp_path / "config.json").write_text(json.dumps({**config, **old}))
    logging.get_logger("transformers_specblock").warning_once.cache_clear()
    with caplog.at_level("WARNING"):
        loaded = SpecBlockDraftModel.from_pretrained(tmp_path)
    assert (loaded.generation_config.max_blocks, loaded.generation_config.branch_widths) == (3, [1, 2, 3, 0])
    assert loaded.generation_config.tree_budget == 7  # generation_config.json's own value
    loaded.save_pretrained(tmp_path / "again")
    assert not set(json.loads((tmp_path / "again" / "config.json").read_text())) & set(old)
    again = SpecBlockDraftModel.from_pretrained(tmp_path / "again")
    assert again.generation_config.drafting_settings() == loaded.generation_config.drafting_settings()


def test_the_shipped_drafters_keep_their_decoding_settings():
    expected = {  # what their config.json held before the settings moved
        "tree_budget": "auto", "auto_budget_candidates": [0, 2, 4, 8, 16, 24, 32], "prompt_lookup_num_tokens": 10,
        "ngram_cache_num_tokens": 8, "suffix_cache_num_tokens": 32, "suffix_cache_spec_factor": 4.0,
        "online_adaptation": "off", "auto_budget_warmup_cost": 2.0,
    }  # fmt: skip
    shapes = {  # what their config.json held before the tree shape moved
        "specblock": {"max_blocks": 1, "branch_widths": [2, 4, 6, 4], "max_followups": 4, "tree_policy": "rank"},
        "eagle3": {"tree_top_k": 4, "tree_depth": 3},
        "dflash": {"tree_top_k": 8},
    }
    for name, shape in shapes.items():
        drafter = AutoModel.from_pretrained(resolve_drafter_path(f"{name}-smollm2-135m-instruct"))
        if name != "dflash":
            assert drafter.generation_config.drafting_settings(expected) == expected, name
        assert drafter.generation_config.drafting_settings(shape) == shape, name


def test_cost_curves_are_kept_on_disk_and_a_new_process_reads_them(tmp_path, monkeypatch):
    target = make_target(vocab_size=32, seed=10)
    # given forward times, not the host's (a curve on disk is probed: noise could have it timed again)
    ScriptedMachine(monkeypatch).times_target(target, lambda nodes: 0.010 + 0.001 * nodes)
    forwards = []
    target.register_forward_hook(lambda *args: forwards.append(1))
    first = measure_target_cost(target, [0, 1, 2, 4], context_length=16, repeats=1, cache_dir=tmp_path)
    assert forwards and (tmp_path / COST_CACHE_FILE).exists()
    _COST_CACHE.clear()  # what a new process finds: nothing in memory, the file on disk
    forwards.clear()
    assert measure_target_cost(target, [0, 1, 2, 4], context_length=16, repeats=1, cache_dir=tmp_path) == first
    assert len(forwards) == 1 + 2 * 2  # read and probed (a prefill, a plain step and one tree size), not timed
    half = copy.deepcopy(target).to(torch.bfloat16)  # another dtype is another curve
    half.register_forward_hook(lambda *args: forwards.append(1))
    measure_target_cost(half, [0, 1, 2, 4], context_length=16, repeats=1, cache_dir=tmp_path)
    assert forwards and len(json.loads((tmp_path / COST_CACHE_FILE).read_text())) == 2


def test_a_new_process_goes_on_from_what_auto_learnt(tmp_path, monkeypatch):
    monkeypatch.setattr(auto_choosers, "default_cache_dir", lambda: tmp_path)
    target = make_target(vocab_size=32, seed=11)
    # given forward times, not the host's: the new process's probe of the curve finds the machine as it was
    ScriptedMachine(monkeypatch).times_target(target, lambda nodes: 0.010 + 0.001 * nodes)
    settings = dict(tree_budget="auto", auto_budget_candidates=[0, 4, 8], auto_budget_warmup=3)
    drafter = make_drafter(target, **settings)
    greedy(target, assistant_model=drafter)
    learnt = drafter.serving_state(target).auto_budget
    assert learnt.trees >= 3 and list((tmp_path / "auto-budget").glob("*.json"))

    _COST_CACHE.clear()  # a new process: a new drafter object, nothing in memory
    again = make_drafter(target, **settings)
    chooser = auto_budget_for(again, target)
    assert (chooser.trees, chooser.clock) == (learnt.trees, learnt.clock)  # past the warm-up already
    assert chooser.estimates() == learnt.estimates()
    assert torch.equal(greedy(target, assistant_model=again), greedy(target))

    other = make_drafter(target, seed=1, **settings)  # other weights learn for themselves
    assert auto_budget_for(other, target).trees == 0
    for setting in ({"online_adaptation": "bandit"}, {"tree_construction": "reference"}):  # other trees, other costs
        assert auto_budget_for(make_drafter(target, **settings, **setting), target).trees == 0, setting
    off = make_drafter(target, auto_budget_cost_cache=False, **settings)
    assert auto_budget_for(off, target).trees == 0 and auto_budget_for(off, target).state_path is None
