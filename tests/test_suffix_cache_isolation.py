"""Cross-request memory never shares text between callers the user has not put on the same drafter object
(docs/how-to/caches.md): the suffix store is held by the drafter object's serving states, so two drafter objects
for one target (or a copy of one) each remember only the requests they served themselves, while one drafter object
reuses what its earlier calls served."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

from conftest import make_target
from transformers_specblock import LookupTreeModel
from transformers_specblock.generation.suffix_cache import suffix_cache_for

pytestmark = pytest.mark.usefixtures("one_thread")

# the suffix cache across requests is the only source: every node a tree holds comes from an earlier request
SETTINGS = dict(
    tree_budget=16, prompt_lookup_num_tokens=0, ngram_cache_num_tokens=0, suffix_cache_num_tokens=16,
    suffix_local_num_tokens=0,
)  # fmt: skip


def served(target, drafter, prompt: torch.LongTensor) -> list[int]:
    out = target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=32)
    gc.collect()  # the call's candidate generator is dropped: its request joins its drafter's store
    assert torch.equal(out, target.generate(prompt, do_sample=False, max_new_tokens=32))
    return out[0].tolist()


def test_two_drafter_objects_never_propose_each_others_text():
    target = make_target("llama", vocab_size=64, seed=1)
    alice_prompt = torch.randint(1, 64, (1, 8), generator=torch.Generator().manual_seed(5))
    bob_prompt = torch.randint(1, 64, (1, 8), generator=torch.Generator().manual_seed(6))
    alice, bob = LookupTreeModel.from_target(target, **SETTINGS), LookupTreeModel.from_target(target, **SETTINGS)

    alice_text = served(target, alice, alice_prompt)
    assert sum(alice.last_stats.nodes_per_iteration) == 0  # nothing served before: nothing to propose
    # bob asks exactly what alice asked: had his drafter her memory, it would copy her answer whole; it proposes
    # nothing at all
    assert served(target, bob, alice_prompt) == alice_text
    assert sum(bob.last_stats.nodes_per_iteration) == 0
    bob_text = served(target, bob, bob_prompt)
    assert [list(r) for r in suffix_cache_for(alice).requests] == [alice_text]  # nothing of bob's
    assert [list(r) for r in suffix_cache_for(bob).requests] == [alice_text, bob_text]  # his own two requests

    # one drafter object serving a second call reuses the first call's text: alice's repeat is copied whole
    served(target, alice, alice_prompt)
    stats = alice.last_stats
    assert stats.accepted_by_source["suffix_cache"] >= 24 and stats.iterations <= 4, stats
    assert len(suffix_cache_for(alice)) == 2 and len(suffix_cache_for(bob)) == 2

    # a copy of a drafter object is another object: it starts with nothing remembered
    copied = copy.deepcopy(alice)
    assert len(suffix_cache_for(copied)) == 0 and suffix_cache_for(copied) is not suffix_cache_for(alice)
    served(target, copied, alice_prompt)
    assert sum(copied.last_stats.nodes_per_iteration) == 0
