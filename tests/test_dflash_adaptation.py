"""Online adaptation of a DFlash drafter: it drafts with the target's own `lm_head` and input embedding, so an update
trains the drafter's own weights only (a whole-drafter update of its block denoiser) and never touches the target's;
"head_only" has no meaning for it and is refused; outputs stay plain greedy's.
"""

from __future__ import annotations

import pytest
import torch

from conftest import make_target
from test_dflash import make_dflash
from transformers_specblock import DFlashDraftModel
from transformers_specblock.generation.adaptation import FULL, SKIP, WAIT, online_adapter_for
from transformers_specblock.generation.adaptation import adapter as adapter_module
from transformers_specblock.generation.adaptation.update import replay_states
from transformers_specblock.generation.candidate_generators.base import TreeCandidateGenerator

VOCAB = 64


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _same(model, weights: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(p, weights[n]) for n, p in model.named_parameters())


def _serve(target, drafter, seeds, max_new_tokens: int = 24) -> list[str]:
    """Greedy calls on different prompts, each checked against plain generate; returns the actions taken."""
    actions = []
    for seed in seeds:
        prompt = torch.randint(1, VOCAB - 1, (1, 5 + seed % 3), generator=torch.Generator().manual_seed(seed))
        reference = target.generate(prompt, do_sample=False, max_new_tokens=max_new_tokens)
        out = target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=max_new_tokens)
        assert out.tolist() == reference.tolist(), f"call {seed}"
        actions.append(drafter.last_stats.adaptation.action)
    return actions


@pytest.mark.parametrize("policy", ["always", "full", "bandit"])
def test_a_dflash_drafter_adapts_its_own_weights_and_never_the_targets(policy):
    target = make_target("llama", vocab_size=VOCAB, seed=1)
    drafter = make_dflash(target, online_adaptation=policy)
    loaded, target_weights = _weights(drafter), _weights(target)
    assert _serve(target, drafter, [0]) == [FULL]  # the first update is whole-drafter under every policy
    assert not any(torch.equal(p, loaded[n]) for n, p in drafter.named_parameters())  # every weight of its own
    actions = _serve(target, drafter, range(1, 6))
    assert set(actions) <= ({FULL} if policy == "always" else {FULL, SKIP, WAIT})
    assert drafter.last_stats.adaptation.signal > 0
    adapter = online_adapter_for(drafter)
    if policy != "always":
        assert adapter.bandits[policy].arms == (FULL, SKIP)  # no head of its own: skip or the whole drafter
    # the target's lm_head and input embedding (DFlash drafts with both) are bit for bit as they were, with no .grad
    assert _same(target, target_weights) and all(p.grad is None for p in target.parameters())
    assert all(p.grad is None for p in drafter.parameters())
    drafter.reset_adaptation()
    assert _same(drafter, loaded) and drafter.serving_state().adaptation is None


def test_head_only_is_refused_for_dflash():
    target = make_target("llama", vocab_size=VOCAB, seed=1)
    message = "head_only.*DFlash.*target's own output layer.*'off'.*'always'.*'full'.*'bandit'"
    with pytest.raises(ValueError, match=message):
        make_dflash(target, online_adaptation="head_only")  # refused when set, not at the first generate
    drafter = make_dflash(target)
    with pytest.raises(ValueError, match=message):
        with drafter.tree_settings(online_adaptation="head_only"):
            pass
    with pytest.raises(ValueError, match=message):
        drafter.generation_config.update(online_adaptation="head_only")
    assert drafter.generation_config.online_adaptation == "off"


def test_no_capture_without_adaptation(monkeypatch):
    """With online_adaptation="off" the generator records no producer state (no cost)."""
    target = make_target("llama", vocab_size=VOCAB, seed=1)
    drafter = make_dflash(target)

    def fail(*args):
        raise AssertionError("producers recorded with adaptation off")

    monkeypatch.setattr(TreeCandidateGenerator, "note_producers", fail)
    assert _serve(target, drafter, [0, 1]) == ["off", "off"]


def test_a_replay_of_the_whole_context_reproduces_the_served_block_states():
    """A sample's slot is the block position that proposed its depth; with the whole committed context kept, a fresh
    forward of context and block gives the states the generator drafted from (cut to `adaptation_context` positions,
    an approximation)."""
    target = make_target("llama", vocab_size=VOCAB, seed=1)
    drafter = make_dflash(target, online_adaptation="always", adaptation_context=1000)
    _serve(target, drafter, [0])
    samples = [s for s in online_adapter_for(drafter).buffer.samples if s.body_version == 0]
    assert samples and all(s.slot == s.depth for s in samples)  # every one replayable, at its block position
    with torch.no_grad(), drafter.loaded_weights_in_place(True):  # (the states came from the loaded weights)
        replayed = replay_states(drafter, samples)
    torch.testing.assert_close(replayed, torch.stack([s.state for s in samples]), atol=1e-5, rtol=1e-5)


def test_the_rollback_and_the_held_out_check_put_dflash_weights_back(monkeypatch):
    target = make_target("llama", vocab_size=VOCAB, seed=1)
    drafter = make_dflash(target, online_adaptation="always")
    loaded = _weights(drafter)
    _serve(target, drafter, [0, 1])
    adapter = online_adapter_for(drafter)
    snapshot = adapter.pending.snapshot  # every weight, from before the last update
    assert set(snapshot) == set(loaded) and not _same(drafter, snapshot)
    adapter.rollback(adapter.pending)
    assert _same(drafter, snapshot) and not _same(drafter, loaded)
    # the held-out check replays the call's contexts through the current and the loaded drafter (DFlash has no head
    # of its own to compare alone) and puts every loaded weight back where the loaded ones win
    monkeypatch.setattr(adapter_module, "held_out_gains", lambda *args: (-0.1, -0.1))
    monkeypatch.setattr(adapter, "choose_action", lambda: SKIP)  # (no update after it)
    adapter.pending = None
    _serve(target, drafter, [2])
    assert drafter.last_stats.adaptation.restored_loaded and _same(drafter, loaded)


def test_a_bfloat16_dflash_drafter_serving_a_float32_target_keeps_and_saves_what_it_learnt(tmp_path):
    target = make_target("llama", vocab_size=VOCAB, seed=2)
    drafter = make_dflash(target, online_adaptation="always").to(torch.bfloat16)
    loaded = _weights(drafter)
    _serve(target, drafter, range(3))
    served = drafter.served_for(target)
    assert served is not drafter and next(served.parameters()).dtype == torch.float32
    assert not _same(drafter, loaded) and all(p.dtype == torch.bfloat16 for p in drafter.parameters())
    adapted = _weights(drafter)
    drafter.save_pretrained(tmp_path / "adapted", save_adapted=True)
    drafter.save_pretrained(tmp_path / "loaded")
    for folder, expected in (("adapted", adapted), ("loaded", loaded)):
        assert _same(DFlashDraftModel.from_pretrained(tmp_path / folder, dtype=torch.bfloat16), expected), folder
    drafter.reset_adaptation()
    assert _same(drafter, loaded)
