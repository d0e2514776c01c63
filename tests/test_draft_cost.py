"""The drafters' head (draft `lm_head`, rank head) runs only where its output is used, with the same drafts."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from conftest import make_drafter, make_target
from transformers_specblock import Eagle3DraftModel
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
