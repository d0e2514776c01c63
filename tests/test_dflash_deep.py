"""DFlash with chunks really accepted, in our tree and in transformers' `speculation_type="dflash"` chain.

A random DFlash drafter's drafts are almost never accepted, so the exactness tests of `test_dflash.py` commit one
token per iteration and never exercise what follows an accepted chunk: the drafter reading several new context
positions at once, cropping its block from the cache, positions moving by more than one. Here an oracle makes 3+
token chunks certain: in our tree loop the `deep_oracle` grafts the target's own greedy continuation into the real
DFlash generator's tree; in transformers' chain the real candidate generator (which runs the drafter's forward with
its `DFlashCache`) has its first `depth` candidate tokens replaced by that continuation. Both must still equal plain
greedy, commit the oracle's chunks in every iteration but the last, and the drafter's cached block outputs must equal
a fresh forward over the whole committed context.
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

from conftest import make_target
from deep_oracle import install_deep_oracle
from test_dflash import PROMPTS, ForwardCounter, make_dflash

DEPTHS = (3, 1, 4, 2)  # oracle tokens per iteration: chunks of 4, 2, 5, 3 (+ the bonus token)
MAX_NEW = 40

pytestmark = pytest.mark.usefixtures("one_thread")


def assert_oracle_chunks(accepted: list[int], depths=DEPTHS) -> None:
    """Every iteration but the last (which max_new_tokens may cut) committed at least the oracle's chunk."""
    assert len(accepted) >= 5, accepted
    short = [(i, a) for i, a in enumerate(accepted[:-1]) if a < depths[i % len(depths)] + 1]
    assert not short, f"iterations committing less than the oracle's chunk: {short} of {accepted}"
    assert sum(a >= 3 for a in accepted) > len(accepted) / 2, accepted


def assert_cached_blocks_equal_one_shot(drafter, calls) -> None:
    """Each block drafted with the cache equals a fresh forward over every context position given so far."""
    contexts = []
    for kwargs, block_out in calls:
        contexts.append(kwargs["context_hidden_states"])
        context = torch.cat(contexts, dim=1)
        positions = torch.arange(context.shape[1] + drafter.config.block_size)[None]
        assert torch.equal(kwargs["position_ids"][0, -drafter.config.block_size :], positions[0, context.shape[1] :])
        with torch.no_grad():
            fresh = drafter(noise_embeds=kwargs["noise_embeds"], context_hidden_states=context, position_ids=positions)
        torch.testing.assert_close(fresh.last_hidden_state, block_out, rtol=1e-5, atol=1e-5)
    assert max(c.shape[1] for c in contexts[1:]) >= 3  # several committed positions were read at once


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tree_with_deep_oracle_commits_chunks_and_equals_plain(monkeypatch, family):
    target = make_target(family, vocab_size=128)
    drafter = make_dflash(target, block_size=6, tree_top_k=2, tree_budget=12)
    for prompt in PROMPTS:
        plain = target.generate(prompt, do_sample=False, max_new_tokens=MAX_NEW)
        generators = install_deep_oracle(monkeypatch, drafter, plain[0], depths=DEPTHS)
        counter = ForwardCounter(drafter)
        tree = target.generate(prompt, do_sample=False, max_new_tokens=MAX_NEW, assistant_model=drafter)
        counter.handle.remove()
        assert tree.tolist() == plain.tolist()
        assert len(generators) == 1 and sum(generators[0].grafted) > 0
        assert_oracle_chunks(drafter.last_stats.accepted_per_iteration)
        assert_cached_blocks_equal_one_shot(drafter, counter.calls)


def install_chain_oracle(monkeypatch, reference: list[int], depths=DEPTHS) -> list[int]:
    """Make transformers' `DFlashTokenCandidateGenerator` propose `reference`'s next `depth` tokens first (after the
    real drafter forward); returns the list of tokens committed per iteration (filled as generation runs)."""
    real = DFlashTokenCandidateGenerator.get_candidates
    committed: list[int] = []
    state = {"calls": 0, "length": None}

    def get_candidates(self, input_ids, model_kwargs, model_outputs, is_first_iteration, n_last_matches, **kwargs):
        if state["length"] is not None:
            committed.append(input_ids.shape[1] - state["length"])
        state["length"] = input_ids.shape[1]
        ids, logits = real(self, input_ids, model_kwargs, model_outputs, is_first_iteration, n_last_matches, **kwargs)
        if logits is None:  # the first iteration (the prefill) or no room left
            return ids, logits
        depth = depths[state["calls"] % len(depths)]
        state["calls"] += 1
        start = input_ids.shape[1]
        truth = torch.tensor(reference[start : start + depth], dtype=ids.dtype)
        ids = ids.clone()
        ids[0, start : start + truth.numel()] = truth
        return ids, logits

    monkeypatch.setattr(DFlashTokenCandidateGenerator, "get_candidates", get_candidates)
    return committed


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_transformers_chain_with_oracle_commits_chunks_and_equals_plain(monkeypatch, family):
    target = make_target(family, vocab_size=128)
    drafter = make_dflash(target, block_size=6)
    for prompt in PROMPTS:
        plain = target.generate(prompt, do_sample=False, max_new_tokens=MAX_NEW)
        committed = install_chain_oracle(monkeypatch, plain[0].tolist())
        counter = ForwardCounter(drafter)
        chain = target.generate(prompt, do_sample=False, max_new_tokens=MAX_NEW, assistant_model=drafter,
                                speculation_type="dflash")  # fmt: skip
        counter.handle.remove()
        assert chain.tolist() == plain.tolist()
        # committed[0] is the prefill's token; then one chunk per verified block
        assert_oracle_chunks(committed[1:])
        assert_cached_blocks_equal_one_shot(drafter, counter.calls)
