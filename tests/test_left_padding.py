"""A left-padded prompt (batch of one, zeros in `attention_mask` before the text) with every kind of tree drafter:
EAGLE-3 and DFlash (with the deep oracle, whose grafted continuation is that of the UNPADDED prompt, so chunks are
accepted only if positions and context ignore the padding), `LookupTreeModel` and a drafter with free candidates
(prompt lookup + n-gram cache read the committed text from the `left_padding` offset on: padding that repeats the
text's n-grams must not change a single tree). SpecBlock's own cases are in `test_api.py`."""

from __future__ import annotations

import pytest
import torch

from conftest import make_drafter, make_target
from deep_oracle import install_deep_oracle
from test_dflash import make_dflash
from test_dflash_deep import assert_oracle_chunks
from transformers_specblock import Eagle3DraftModel, LookupTreeModel

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = torch.tensor([[0, 5, 17, 33, 2, 9]])
MAX_NEW = 30


@pytest.fixture(scope="module")
def target():
    return make_target("llama", vocab_size=128)


def pad(prompt: torch.Tensor, pads: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    padded = torch.cat([torch.tensor([pads]), prompt], 1)
    mask = torch.cat([torch.zeros(1, len(pads), dtype=torch.long), torch.ones_like(prompt)], 1)
    return padded, mask


def make_eagle3(target):
    torch.manual_seed(5)
    return Eagle3DraftModel.from_target(target, tree_budget=12)


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
@pytest.mark.parametrize("pads", [[3, 3, 3], [90, 1, 44, 7]])
def test_feature_drafters_ignore_left_padding(target, monkeypatch, kind, pads):
    if kind == "eagle3":
        drafter = make_eagle3(target)
    else:
        drafter = make_dflash(target, block_size=6, tree_top_k=2, tree_budget=12)
    unpadded = target.generate(PROMPT, do_sample=False, max_new_tokens=MAX_NEW)
    padded, mask = pad(PROMPT, pads)
    plain = target.generate(padded, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW)
    # the oracle follows the unpadded prompt's continuation, by rotary position: padding counted anywhere derails it
    generators = install_deep_oracle(monkeypatch, drafter, unpadded[0])
    out = target.generate(padded, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, assistant_model=drafter)
    assert out.tolist() == plain.tolist()
    assert out[0, padded.shape[1] :].tolist() == unpadded[0, PROMPT.shape[1] :].tolist()
    assert generators and sum(generators[-1].grafted) > 0
    assert_oracle_chunks(drafter.last_stats.accepted_per_iteration)


def lookup_drafter(target, kind: str):
    """A fresh one per call (the free candidates' source scores carry over between calls), with a fixed budget
    ("auto" sizes trees from timings, which differ between runs)."""
    if kind == "lookup_tree":
        return LookupTreeModel.from_target(target, tree_budget=16)
    return make_drafter(target, tree_budget=16, prompt_lookup_num_tokens=6, ngram_cache_num_tokens=4)


@pytest.mark.parametrize("kind", ["lookup_tree", "specblock+lookup"])
def test_free_candidates_read_no_padding(kind):
    target = make_target("llama", vocab_size=24, seed=0)  # small vocabulary: its greedy text repeats n-grams
    prompt = torch.randint(1, 24, (1, 6), generator=torch.Generator().manual_seed(0))
    drafter = lookup_drafter(target, kind)
    unpadded = target.generate(prompt, do_sample=False, max_new_tokens=40)
    reference = target.generate(prompt, do_sample=False, max_new_tokens=40, assistant_model=drafter)
    assert reference.tolist() == unpadded.tolist()
    stats = drafter.last_stats
    trees = (stats.nodes_per_iteration, stats.accepted_per_iteration, dict(stats.accepted_by_source))
    assert max(stats.accepted_per_iteration) >= 3  # the lookups' chains were accepted
    # padding that repeats the text's n-grams, followed by other tokens: a lookup reading it would propose them
    last = prompt[0, -3:].tolist()
    for pads in ([*last, 20, 21, 22, 23], [*prompt[0, :4].tolist(), 19, *last, 18]):
        padded, mask = pad(prompt, pads)
        plain = target.generate(padded, attention_mask=mask, do_sample=False, max_new_tokens=40)
        drafter = lookup_drafter(target, kind)
        out = target.generate(padded, attention_mask=mask, do_sample=False, max_new_tokens=40,
                              assistant_model=drafter)  # fmt: skip
        assert out.tolist() == plain.tolist()
        assert out[0, padded.shape[1] :].tolist() == unpadded[0, prompt.shape[1] :].tolist()
        stats = drafter.last_stats
        assert (stats.nodes_per_iteration, stats.accepted_per_iteration, dict(stats.accepted_by_source)) == trees
