"""Greedy exactness on the real SmolLM2-135M-Instruct (packaged, offline) with an untrained drafter."""

from __future__ import annotations

import pytest
import torch

from transformers_specblock import (
    DFlashDraftModel,
    Eagle3DraftModel,
    SpecBlockDraftModel,
    load_packaged_model,
    load_prompts,
)

TIE_TOLERANCE = 1e-3

pytestmark = pytest.mark.slow  # loads (and on a fresh machine converts) the packaged SmolLM2-135M-Instruct


@pytest.fixture(scope="module")
def smollm2():
    try:
        return load_packaged_model("smollm2-135m-instruct")
    except ImportError as err:  # the package is part of the test install; say what is missing
        pytest.fail(str(err))


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def test_smollm2_greedy_matches_target(smollm2):
    target, tokenizer = smollm2
    prompts = load_prompts("mt_bench", num_prompts=3, tokenizer=tokenizer)
    drafter = SpecBlockDraftModel.from_target(target, tree_policy="fixed", fixed_width=3, max_blocks=2, tree_budget=24)
    for text in prompts["text"]:
        inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        reference = target.generate(**inputs, do_sample=False, max_new_tokens=24)[0].tolist()
        tree = target.generate(**inputs, assistant_model=drafter, do_sample=False, max_new_tokens=24)[0].tolist()
        assert drafter.last_stats.iterations > 0 and max(drafter.last_stats.nodes_per_iteration) == 24
        diff = first_difference(reference, tree)
        if diff is None:
            assert len(tree) == len(reference)
            continue
        # a difference is only acceptable where the target's own top-2 logits tie within round-off
        with torch.no_grad():
            logits = target(torch.tensor([reference[:diff]])).logits[0, -1].float()
        top2 = logits.topk(2).values
        assert float(top2[0] - top2[1]) < TIE_TOLERANCE, f"position {diff} differs without a tie: {top2.tolist()}"


@pytest.mark.parametrize("kind", ["specblock", "eagle3", "dflash"])
def test_shipped_drafters_are_exact_and_accept_on_smollm2(smollm2, kind, one_thread):
    """float32: each shipped drafter reproduces the target's greedy output token for token on real MT-Bench prompts,
    and, being trained, commits more than one token per verification on average."""
    target, tokenizer = smollm2
    drafter_class = {"specblock": SpecBlockDraftModel, "eagle3": Eagle3DraftModel, "dflash": DFlashDraftModel}[kind]
    drafter = drafter_class.from_pretrained(f"{kind}-smollm2-135m-instruct", dtype=torch.float32)
    accepted = []
    # the drafter's own trees (its shipped "auto" would rightly decode plainly in float32 on a CPU)
    alone = dict(tree_budget=8, prompt_lookup_num_tokens=0, ngram_cache_num_tokens=0, suffix_cache_num_tokens=0)
    for text in load_prompts("mt_bench", num_prompts=2, tokenizer=tokenizer)["text"]:
        inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        reference = target.generate(**inputs, do_sample=False, max_new_tokens=32)[0].tolist()
        with drafter.tree_settings(**alone):
            tree = target.generate(**inputs, assistant_model=drafter, do_sample=False, max_new_tokens=32)[0].tolist()
        assert tree == reference, f"{kind} left plain greedy at {first_difference(reference, tree)}"
        accepted += drafter.last_stats.accepted_per_iteration
    assert sum(accepted) / len(accepted) > 1.1, accepted
