"""The drafters compute only what is used, with the same drafts: heads only where read (draft `lm_head`, rank
head), no follow-up block or slot whose nodes pruning would drop."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import make_drafter, make_target
from transformers_specblock import Eagle3DraftModel
from transformers_specblock.generation.tree import DraftTree, HostTree
from transformers_specblock.models.specblock.modeling_specblock import block_causal_mask


def test_specblock_logits_to_keep_equals_the_last_rows_of_the_full_head():
    target = make_target("llama", vocab_size=40, seed=6)
    drafter = make_drafter(target, block_size=3)
    torch.manual_seed(6)
    features = torch.randn(1, 7, 3 * target.config.hidden_size)
    tokens = torch.randint(0, 40, (1, 7))
    positions = torch.arange(1, 8)[None]
    mask = block_causal_mask(7, 3, 0, torch.device("cpu"))[None]
    condition = drafter.project_condition(features)
    full = drafter.draft_blocks(condition, tokens, positions, mask, DynamicCache())
    last = drafter.draft_blocks(condition, tokens, positions, mask, DynamicCache(), logits_to_keep=1)
    assert last.logits.shape == (1, 1, 3, drafter.config.draft_vocab_size)
    assert last.hidden_states.shape == full.hidden_states.shape  # follow-up blocks may start from any position
    torch.testing.assert_close(last.logits[0, -1], full.logits[0, -1])
    torch.testing.assert_close(last.rank_logits[0, -1], full.rank_logits[0, -1])


def test_eagle3_logits_to_keep_equals_the_last_row_of_the_full_head():
    target = make_target("llama", vocab_size=40, seed=7)
    torch.manual_seed(7)
    drafter = Eagle3DraftModel.from_target(target, tree_budget=8)
    hidden = drafter.fuse_features(torch.randn(1, 5, 3 * target.config.hidden_size))
    tokens = torch.randint(0, 40, (1, 5))
    mask = torch.ones(5, 5, dtype=torch.bool).tril()[None]
    positions = torch.arange(1, 6)[None]
    full = drafter.draft_step(hidden, tokens, positions, mask, DynamicCache())
    last = drafter.draft_step(hidden, tokens, positions, mask, DynamicCache(), logits_to_keep=1)
    assert last.logits.shape == (1, 1, drafter.config.draft_vocab_size)
    torch.testing.assert_close(last.logits[0, -1], full.logits[0, -1])


def _device_tree(tree: DraftTree | HostTree, root: torch.LongTensor) -> DraftTree:
    return tree.to_device("cpu", root) if isinstance(tree, HostTree) else tree


def _grown_then_pruned_equals_grown_at_budget(make_generator, budgets, features, tokens):
    """A tree grown at each small budget (rounds that cannot survive pruning skipped) equals the tree grown with no
    budget limit and pruned to it; returns the drafter forwards each small budget ran."""
    forwards = {}
    for budget in budgets:
        full = make_generator(10_000)
        small = make_generator(budget)
        for generator in (full, small):
            generator.observe(features, tokens, first_position=1)
        before = small.stats.drafter_forwards
        with torch.no_grad():
            expected = _device_tree(full.grow_tree(tokens[-1:]), tokens[-1:]).prune(budget)
            got = small.draft_tree(tokens)
        forwards[budget] = small.stats.drafter_forwards - before
        assert got.tokens.tolist() == expected.tokens.tolist() and got.parents.tolist() == expected.parents.tolist()
    return forwards


def test_rounds_that_cannot_survive_pruning_are_skipped_with_the_same_tree():
    from transformers_specblock.generation.candidate_generators import get_candidate_generator

    target = make_target("llama", vocab_size=40, seed=8)
    torch.manual_seed(8)
    features, tokens = torch.randn(6, 3 * target.config.hidden_size), torch.randint(0, 40, (6,))
    specblock = make_drafter(target, block_size=3, max_blocks=4, tree_policy="fixed", fixed_width=3)
    specblock.bind_target(target)
    forwards = _grown_then_pruned_equals_grown_at_budget(
        lambda budget: get_candidate_generator(specblock, tree_budget=budget), [1, 2, 4, 8, 30], features, tokens
    )
    assert forwards[1] < forwards[30] == 3  # a small budget needs fewer follow-up rounds; a large one needs all
    eagle3 = Eagle3DraftModel.from_target(target, tree_top_k=3, tree_depth=5)
    eagle3.bind_target(target)
    forwards = _grown_then_pruned_equals_grown_at_budget(
        lambda budget: get_candidate_generator(eagle3, tree_budget=budget), [2, 4, 8, 30], features, tokens
    )
    assert forwards[2] < forwards[30]


@pytest.mark.parametrize("seed", range(6))
def test_followup_blocks_and_slots_that_cannot_survive_are_not_drafted(seed):
    """Rank-guided and fixed trees, several rounds, few follow-ups per round: drafting only the blocks and slots
    that could survive pruning gives the tree grown without a budget and pruned."""
    from transformers_specblock.generation.candidate_generators import get_candidate_generator

    target = make_target("llama", vocab_size=40, seed=seed)
    torch.manual_seed(seed)
    features, tokens = torch.randn(6, 3 * target.config.hidden_size), torch.randint(0, 40, (6,))
    widths = {"tree_policy": "fixed", "fixed_width": 1 + seed % 3} if seed % 2 else {}
    drafter = make_drafter(target, block_size=3 + seed % 2, max_blocks=3, max_followups=1 + seed % 3, **widths)
    drafter.bind_target(target)
    _grown_then_pruned_equals_grown_at_budget(
        lambda budget: get_candidate_generator(drafter, tree_budget=budget), [1, 2, 3, 5, 8, 13], features, tokens
    )


def test_followup_positions_setting_reaches_the_drafting_loop():
    """`followup_positions="block1"` (the SpecBlock reference's rule, set when its checkpoints load) drafts follow-up
    blocks at block 1's rotary positions: other draft scores than "start_node" from the same weights, and decoding with
    either stays plain greedy."""
    from transformers_specblock.generation.candidate_generators import get_candidate_generator

    target = make_target("llama", vocab_size=40, seed=3)
    torch.manual_seed(3)
    features, tokens = torch.randn(6, 3 * target.config.hidden_size), torch.randint(0, 40, (6,))
    trees, outputs = {}, {}
    prompt = torch.randint(0, 40, (1, 7))
    plain = target.generate(prompt, max_new_tokens=12, do_sample=False)
    for rule in ("start_node", "block1"):
        drafter = make_drafter(target, block_size=3, max_blocks=3, tree_policy="fixed", fixed_width=2,
                               followup_positions=rule)  # fmt: skip
        drafter.bind_target(target)
        generator = get_candidate_generator(drafter, tree_budget=30)
        generator.observe(features, tokens, first_position=1)
        with torch.no_grad():
            trees[rule] = generator.draft_tree(tokens).scores
        outputs[rule] = target.generate(prompt, assistant_model=drafter, max_new_tokens=12, do_sample=False)
    block1 = 1 + 3 * 2  # the root and block 1's nodes are the same, the follow-up blocks' scores are not
    torch.testing.assert_close(trees["start_node"][:block1], trees["block1"][:block1])
    assert not torch.equal(trees["start_node"][block1:], trees["block1"][block1:])
    for rule in outputs:
        assert outputs[rule].tolist() == plain.tolist()


def test_a_round_where_every_slot_ends_its_branch_drafts_nothing_more():
    """Rank classes whose widths are all 0 end every branch in block 1: no follow-up, the root alone is verified."""
    target = make_target("llama", vocab_size=64)
    drafter = make_drafter(target, branch_widths=[0, 0, 0, 0], max_blocks=3)
    prompt = torch.tensor([[0, 5, 9, 17, 3, 5, 9]])
    with torch.no_grad():
        expected = target.generate(prompt, max_new_tokens=6, do_sample=False)
        out = target.generate(prompt, max_new_tokens=6, do_sample=False, assistant_model=drafter)
    assert torch.equal(out, expected)
    assert set(drafter.last_stats.nodes_per_iteration) == {0}
