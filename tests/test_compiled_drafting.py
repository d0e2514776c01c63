"""`compile_drafter`: the drafters' forwards under `torch.compile` draft the same trees as eager ones."""

from __future__ import annotations

import pytest
import torch

from conftest import make_target
from test_op_counts import PROMPT, tiny_methods
from transformers_specblock import Eagle3DraftModel
from transformers_specblock.generation.candidate_generators import base

pytestmark = pytest.mark.usefixtures("one_thread")


def test_compile_drafter_is_a_checked_setting_and_off_calls_the_drafter_itself():
    target = make_target("llama", vocab_size=128)
    with pytest.raises(ValueError, match="compile_drafter must be True or False"):
        Eagle3DraftModel.from_target(target, compile_drafter="yes")
    drafter = Eagle3DraftModel.from_target(target)
    assert drafter.generation_config.compile_drafter is False
    assert base.compiled_method(drafter, "draft_step") == drafter.draft_step
    assert base.compiled_method(drafter, "forward") is drafter  # a module's forward keeps its hooks


@pytest.mark.slow
@pytest.mark.parametrize("method", ["specblock", "eagle3", "dflash"])
def test_compiled_drafting_drafts_the_same_trees(method):
    """Same greedy output, and the same tree sizes and accepted lengths every iteration (the drafts themselves)."""
    torch._dynamo.reset()
    base._COMPILED.clear()
    target = make_target("llama", vocab_size=128)
    drafter = tiny_methods(target)[method]
    runs = {}
    with torch.no_grad():
        for compiled in (False, True, True):  # the second compiled call reuses the graphs
            with drafter.tree_settings(compile_drafter=compiled):
                out = target.generate(PROMPT, max_new_tokens=24, do_sample=False, assistant_model=drafter)
            stats = drafter.last_stats
            runs.setdefault(compiled, []).append((out, stats.nodes_per_iteration, stats.accepted_per_iteration))
    assert any(key[0] is type(drafter) for key in base._COMPILED)  # the compiled path ran
    for out, nodes, accepted in runs[True]:
        assert torch.equal(out, runs[False][0][0])
        assert nodes == runs[False][0][1] and accepted == runs[False][0][2]
