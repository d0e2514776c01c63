"""Greedy exactness over the tree shapes of `test_greedy_exactness.py` (SpecBlock) and `test_eagle3.py` (EAGLE-3)
with the deep oracle: the random drafters there rarely get a draft accepted (their guard asks for ONE multi-token
chunk anywhere); here the target's own continuation is grafted into every tree, so every iteration but the last
must commit the oracle's chunk (2-5 tokens) and the output must still equal plain greedy, with and without a
repetition penalty (which the oracle's continuation follows)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_drafter, make_target
from deep_oracle import install_deep_oracle
from test_dflash_deep import assert_oracle_chunks
from test_eagle3 import SHAPES as EAGLE3_SHAPES
from test_eagle3 import make_eagle3
from test_greedy_exactness import SHAPES as SPECBLOCK_SHAPES
from test_greedy_exactness import SMALL_VOCAB

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_NEW = 30


def drafters():
    """(id, factory) of every shape whose budget leaves room for the oracle's chain."""
    for block_size, max_blocks, budget, policy in SPECBLOCK_SHAPES:
        if budget >= 8:
            settings = dict(block_size=block_size, max_blocks=max_blocks, tree_budget=budget, tree_policy=policy,
                            fixed_width=4, branch_widths=[2, 4, 6, 3])  # fmt: skip
            yield f"specblock-K{block_size}-blocks{max_blocks}-budget{budget}-{policy}", (make_drafter, settings)
    for top_k, depth, budget in EAGLE3_SHAPES:
        if budget >= 8:
            settings = dict(tree_top_k=top_k, tree_depth=depth, tree_budget=budget)
            yield f"eagle3-k{top_k}-depth{depth}-budget{budget}", (make_eagle3, settings)


DRAFTERS = dict(drafters())


@pytest.mark.parametrize("repetition_penalty", [None, 1.5], ids=["plain", "rep1.5"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("shape", list(DRAFTERS))
def test_deep_oracle_commits_chunks_and_equals_plain(monkeypatch, shape, family, repetition_penalty):
    target = make_target(family, vocab_size=SMALL_VOCAB, seed=1)
    factory, settings = DRAFTERS[shape]
    drafter = factory(target, **settings)
    prompt = torch.randint(1, SMALL_VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    extra = {"repetition_penalty": repetition_penalty} if repetition_penalty else {}
    plain = target.generate(prompt, do_sample=False, max_new_tokens=MAX_NEW, **extra)
    generators = install_deep_oracle(monkeypatch, drafter, plain[0])
    out = target.generate(prompt, do_sample=False, max_new_tokens=MAX_NEW, assistant_model=drafter, **extra)
    assert out.tolist() == plain.tolist()
    assert len(generators) == 1 and sum(generators[0].grafted) > 0
    assert_oracle_chunks(drafter.last_stats.accepted_per_iteration)
