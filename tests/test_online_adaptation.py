"""Online adaptation (`generation.adaptation`): the drafter learns from the verifier while it serves.

Outputs never change (greedy identical to plain generate, sampling keeps the target's distribution, with every
policy, for SpecBlock and EAGLE-3), the signal is the verified rows along the accepted path, the buffer is bounded,
each policy acts when it should, a head-only update is served only once it has beaten the served head on a call it
has not trained on, a drop in tau rolls a whole-drafter update back, and reset / save restore the loaded weights.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from conftest import make_drafter, make_target
from scripted_clock import ScriptedMachine
from test_dflash import make_dflash
from test_sampling_lossless import ALPHA, PROMPT, SAMPLING, exact_marginals, fit_pvalues
from transformers_specblock import DFlashDraftModel, Eagle3DraftModel, LookupTreeModel, SpecBlockDraftModel
from transformers_specblock.generation.adaptation import (
    FULL,
    HEAD_ONLY,
    SKIP,
    WAIT,
    Backoff,
    CostAwareBandit,
    SignalBuffer,
    SignalSample,
    collect_signal,
    online_adapter_for,
)
from transformers_specblock.generation.adaptation import adapter as adapter_module
from transformers_specblock.generation.adaptation import update
from transformers_specblock.generation.adaptation.adapter import ESCALATION_CALLS, ESCALATION_GAIN
from transformers_specblock.generation.adaptation.signal import target_to_draft_ids
from transformers_specblock.generation.adaptation.update import (
    adaptation_loss,
    output_parameters,
    train_candidate_head,
    update_whole_drafter,
)
from transformers_specblock.generation.tree import SOURCE_BITS, DraftTree

POLICIES = ["off", "always", "head_only", "full", "bandit"]
VOCAB = 24


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _drafter(kind: str, target, **settings):
    settings.setdefault("tree_budget", 16)
    if kind == "specblock":
        return make_drafter(target, tree_policy="fixed", fixed_width=3, max_blocks=2, **settings)
    torch.manual_seed(1000)
    return Eagle3DraftModel.from_target(target, tree_top_k=3, tree_depth=4, **settings)


def _prompt(seed: int, length: int = 6) -> torch.LongTensor:
    return torch.randint(1, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _serve(target, drafter, calls: int, max_new_tokens: int = 24) -> list[str]:
    """Greedy calls on different prompts, each checked against plain generate; returns the actions taken."""
    actions = []
    for seed in range(calls):
        prompt = _prompt(seed, 5 + seed % 3)
        reference = target.generate(prompt, do_sample=False, max_new_tokens=max_new_tokens)
        out = target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=max_new_tokens)
        assert out.tolist() == reference.tolist(), f"call {seed}"
        actions.append(drafter.last_stats.adaptation.action)
    return actions


# ------------------------------------------------------------------------------------------------ exactness
@pytest.mark.parametrize("kind", ["specblock", "eagle3"])
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_identical_with_every_policy(kind, policy):
    target = make_target("llama", vocab_size=VOCAB, seed=1)
    drafter = _drafter(kind, target, online_adaptation=policy)
    loaded = _weights(drafter)
    actions = _serve(target, drafter, calls=6)
    changed = any(not torch.equal(p, loaded[n]) for n, p in drafter.named_parameters())
    if policy == "off":
        assert set(actions) == {"off"} and not changed
    else:
        assert set(actions) <= {SKIP, HEAD_ONLY, FULL, WAIT} and set(actions) & {HEAD_ONLY, FULL}
        assert policy in ("full", "bandit") or WAIT not in actions  # (only a cost-aware policy backs off)
    if policy == "always":  # (a cost-aware policy may roll its only update back)
        assert changed
    if policy == "head_only":  # its updates train a candidate head, served once it beats the served one
        assert changed or online_adapter_for(drafter).candidate is not None
    if policy == "always":
        assert set(actions) == {FULL}
    if policy == "head_only":  # (none while a candidate that won once awaits its second test)
        assert actions[0] == HEAD_ONLY and set(actions) <= {HEAD_ONLY, SKIP}
    if policy == "full":
        assert HEAD_ONLY not in actions


@pytest.mark.parametrize("policy", POLICIES[1:])
def test_sampling_keeps_the_target_distribution(policy):
    """The chi-square check of test_sampling_lossless, with the drafter updated after every call."""
    target = make_target("llama", vocab_size=8, seed=3, initializer_range=0.08)
    drafter = make_drafter(
        target, tree_policy="fixed", fixed_width=3, block_size=3, max_blocks=2, tree_budget=16,
        online_adaptation=policy, adaptation_learning_rate=1e-2,
    )  # fmt: skip
    loaded = _weights(drafter)
    torch.manual_seed(0)
    counts, draws = torch.zeros(3, 8), 500
    for _ in range(draws):
        out = target.generate(PROMPT, assistant_model=drafter, do_sample=True, max_new_tokens=3, **SAMPLING)
        counts[torch.arange(3), out[0, PROMPT.shape[1] :]] += 1
    assert any(not torch.equal(p, loaded[n]) for n, p in drafter.named_parameters())
    pvalues = fit_pvalues(counts, exact_marginals(target))
    assert min(pvalues) > ALPHA, f"p-values {pvalues}"


# ------------------------------------------------------------------------------------------------ the signal
def _hand_tree() -> tuple[DraftTree, SimpleNamespace]:
    """A drafted tree: root -> {5 (best), 7}; 5 -> {9 (best), 4}; 7 has no children. States: s0 produced 5 and 7,
    s1 produced 9 and 4."""
    tree = DraftTree.root_only(3)
    tree.add_nodes(torch.tensor([5, 7]), torch.tensor([0, 0]), torch.tensor([1, 1]), torch.tensor([-0.1, -1.0]))
    tree.add_nodes(torch.tensor([9, 4]), torch.tensor([1, 1]), torch.tensor([2, 2]), torch.tensor([-0.3, -2.0]))
    states = torch.arange(4 * 2, dtype=torch.float32).view(4, 2)  # four states of a hidden size 2
    context = (torch.zeros(3, 6), torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3]))  # ends at the root token 3
    generator = SimpleNamespace(
        drafted=tree,
        producers=[
            (torch.tensor([1, 2]), states[[0, 0]], torch.tensor([0, 0])),  # the root's own output: replayable
            (torch.tensor([3, 4]), states[[1, 1]], None),
        ],
        context=context,
    )
    return tree, generator


def test_signal_follows_the_accepted_path_to_the_first_rejected_position():
    tree, generator = _hand_tree()
    to_draft = torch.arange(12)
    logits = torch.randn(len(tree), 12)
    # accepted 5 then 4 (not the drafter's best), bonus 11: depths 1, 2 and 3; nothing was drafted under 4
    samples = collect_signal(generator, tree, torch.tensor([1, 4]), torch.tensor([11]), logits, to_draft, 3, 0)
    assert len(samples) == 2
    assert [s.wrong for s in samples] == [False, True]
    assert torch.equal(samples[0].state, torch.tensor([0.0, 1.0]))
    assert torch.equal(samples[1].state, torch.tensor([2.0, 3.0]))
    for sample, row in zip(samples, [0, 1]):  # the target's top-3 at the row of the path node before
        probs, ids = logits[row].softmax(-1).topk(3)
        assert torch.equal(sample.target_ids, ids) and torch.allclose(sample.target_probs, probs)
    assert (samples[0].slot, samples[1].slot) == (0, -1)  # only the root's own output replays
    assert samples[0].context is generator.context and samples[1].context is None
    # nothing accepted, bonus 7: the first rejected position; the drafter's best (5) was wrong
    nothing = torch.tensor([], dtype=torch.long)
    (only,) = collect_signal(generator, tree, nothing, torch.tensor([7]), logits, to_draft, 3, 0)
    assert only.wrong


def test_signal_marks_positions_a_free_candidate_had_proposed():
    """Where a free source had proposed the committed token, the drafter's proposal did not decide the position:
    the held-out checks leave it out."""
    tree, generator = _hand_tree()
    verified = DraftTree(tree.tokens.clone(), tree.parents.clone(), tree.depths.clone(), tree.scores.clone())
    verified.sources[1] |= SOURCE_BITS["prompt_lookup"]  # 5 also came from prompt lookup; 4 only from the drafter
    logits = torch.randn(len(tree), 12)
    path, to_draft = torch.tensor([1, 4]), torch.arange(12)
    samples = collect_signal(generator, verified, path, torch.tensor([11]), logits, to_draft, 3, 0)
    assert [s.covered for s in samples] == [True, False]
    nothing = torch.tensor([], dtype=torch.long)
    (bonus,) = collect_signal(generator, verified, nothing, torch.tensor([5]), logits, to_draft, 3, 0)
    assert not bonus.covered  # (rejected: whatever proposed it was not in the verified tree)


def test_draft_vocabulary_mapping_marks_missing_ids():
    mapping = target_to_draft_ids(torch.tensor([4, 0, 7]), 9)
    assert mapping.tolist() == [1, -1, -1, -1, 0, -1, -1, 2, -1]


def test_buffer_is_bounded():
    target = make_target("llama", vocab_size=VOCAB, seed=1)
    drafter = _drafter(
        "specblock", target, online_adaptation="head_only", adaptation_buffer_size=10, adaptation_top_k=5
    )
    _serve(target, drafter, calls=3)
    buffer = online_adapter_for(drafter).buffer
    assert len(buffer) == 10 and drafter.last_stats.adaptation.signal > 10
    assert all(s.target_ids.shape == (5,) and s.target_probs.shape == (5,) for s in buffer.samples)
    context = drafter.generation_config.adaptation_context
    assert all(s.context is None or s.context[1].shape[0] <= context for s in buffer.samples)
    small = SignalBuffer(2)
    small.add([1, 2, 3])
    assert list(small.samples) == [2, 3]


# ------------------------------------------------------------------------------------------------ the update
@pytest.mark.parametrize("kind", ["specblock", "eagle3"])
def test_updates_learn_and_touch_only_their_weights(kind):
    target = make_target("llama", vocab_size=VOCAB, seed=2)
    drafter = _drafter(kind, target, online_adaptation="head_only", adaptation_learning_rate=1e-2)
    _serve(target, drafter, calls=2)
    adapter = online_adapter_for(drafter)
    samples = adapter.buffer.for_head(adapter.body_version, 256)
    assert samples and adapter.buffer.for_replay(16)
    states = torch.stack([s.state for s in samples])
    head = {id(p) for p in output_parameters(drafter)}

    # head-only: a candidate weight that fits the signal better; the drafter itself is left as it is
    before = _weights(drafter)
    with torch.no_grad():
        loss_before = float(adaptation_loss(drafter, samples, states))
    start = drafter.lm_head.weight.detach().clone()
    weight, _ = train_candidate_head(drafter, adapter.buffer, adapter.body_version, start, 1e-2)
    assert weight.shape == start.shape and weight.dtype == start.dtype and not torch.equal(weight, start)
    assert all(torch.equal(p, before[n]) for n, p in drafter.named_parameters())
    with torch.no_grad():
        drafter.lm_head.weight.copy_(weight)
        assert float(adaptation_loss(drafter, samples, states)) < loss_before
        drafter.lm_head.weight.copy_(start)

    # whole drafter: the output side and the body move, the rank head does not
    assert update_whole_drafter(drafter, adapter.buffer, adapter.body_version, 1e-2) is not None
    moved = {name for name, param in drafter.named_parameters() if not torch.equal(param, before[name])}
    assert {n for n, p in drafter.named_parameters() if id(p) in head} <= moved
    assert {n for n, p in drafter.named_parameters() if id(p) not in head} & moved
    assert not {n for n in moved if n.startswith("rank_head.")}  # the rank head is not trained online
    assert all(p.grad is None for p in drafter.parameters())  # no gradients left behind
    assert train_candidate_head(drafter, SignalBuffer(4), 0, start, 1e-2) is None  # no signal, no step
    assert update_whole_drafter(drafter, SignalBuffer(4), 0, 1e-2) is None


def test_a_candidate_head_trains_only_the_rows_the_signal_touches(monkeypatch):
    """Rows that are neither among a state's top draft proposals nor the target's top ids keep their loaded values."""
    target = make_target("llama", vocab_size=VOCAB, seed=2)
    drafter = _drafter("eagle3", target, online_adaptation="head_only")
    _serve(target, drafter, calls=2)
    adapter = online_adapter_for(drafter)
    monkeypatch.setattr(update, "HEAD_DRAFT_ROWS", 1)
    monkeypatch.setattr(update, "HEAD_TARGET_ROWS", 1)
    samples = adapter.buffer.for_head(adapter.body_version, update.HEAD_BATCH)
    start = drafter.lm_head.weight.detach().clone()
    weight, _ = train_candidate_head(drafter, adapter.buffer, adapter.body_version, start, 1e-2)
    with torch.no_grad():
        proposals = drafter.lm_head(drafter.norm(torch.stack([s.state for s in samples]))).argmax(-1)
    touched = set(proposals.tolist()) | {int(s.target_ids[0]) for s in samples if s.target_ids[0] >= 0}
    moved = {row for row in range(start.shape[0]) if not torch.equal(weight[row], start[row])}
    assert moved and moved <= touched
    assert len(touched) < start.shape[0]  # the test means something: some rows were left out


@pytest.mark.parametrize("kind", ["specblock", "eagle3"])
def test_head_only_adaptation_runs_in_bfloat16(kind):
    """A CPU user of this hardware runs bfloat16: the candidate head trains in float32 and comes back in the
    drafter's dtype, and serving goes on with it."""
    target = make_target("llama", vocab_size=VOCAB, seed=2).to(torch.bfloat16)
    drafter = _drafter(kind, target, online_adaptation="head_only").to(torch.bfloat16)
    for seed in range(3):
        out = target.generate(_prompt(seed), assistant_model=drafter, do_sample=False, max_new_tokens=16)
        assert out.shape[1] == _prompt(seed).shape[1] + 16
        assert drafter.last_stats.adaptation.action == "head_only"
        assert math.isfinite(online_adapter_for(drafter).report.loss)
    adapter = online_adapter_for(drafter)
    assert adapter.candidate["lm_head.weight"].dtype == torch.bfloat16
    assert not math.isnan(drafter.last_stats.adaptation.candidate_gain)  # a candidate was tested on fresh signal
    assert all(p.dtype == torch.bfloat16 for p in drafter.parameters())


@pytest.mark.parametrize("kind", ["specblock", "eagle3"])
def test_a_bfloat16_drafter_serving_a_float32_target_keeps_and_saves_what_it_learnt(kind, tmp_path):
    """The drafter drafts as a float32 copy for a float32 target; what that copy learns reaches the user's bfloat16
    drafter after every call (so it outlives the target and is saved with save_adapted=True), while the copy keeps
    serving at full precision; a plain save writes the loaded weights; outputs stay plain greedy's."""
    target = make_target("llama", vocab_size=VOCAB, seed=2)
    drafter = _drafter(kind, target, online_adaptation="always").to(torch.bfloat16)
    loaded = _weights(drafter)
    _serve(target, drafter, calls=3)
    changed = [name for name, weight in drafter.named_parameters() if not torch.equal(weight, loaded[name])]
    assert changed and all(p.dtype == torch.bfloat16 for p in drafter.parameters())
    served = drafter.served_for(target)
    assert served is not drafter and next(served.parameters()).dtype == torch.float32
    assert served is drafter.served_for(target)  # the float32 copy is kept, not cast again from bfloat16
    drafter.save_pretrained(tmp_path / "adapted", save_adapted=True)
    drafter.save_pretrained(tmp_path / "loaded")
    for folder, expected in (("adapted", _weights(drafter)), ("loaded", loaded)):
        saved = _weights(type(drafter).from_pretrained(tmp_path / folder, dtype=torch.bfloat16))
        assert all(torch.equal(saved[name], expected[name]) for name in expected), folder
    del served, target
    assert not any(torch.equal(w, loaded[n]) for n, w in drafter.named_parameters() if n in changed)  # outlives it
    drafter.reset_adaptation()
    assert all(torch.equal(w, loaded[n]) for n, w in drafter.named_parameters())


@pytest.mark.parametrize("construction", ["reference", "package"])
def test_trees_grown_as_the_reference_harness_grows_them_adapt_online(construction):
    """The shipped SpecBlock drafter grows its trees as the authors' harness does (tree_construction="reference");
    online adaptation works there too: the pruned, merged tree's nodes carry the states that proposed them, the
    updates change the drafter, and the output stays plain greedy's."""
    target = make_target("llama", vocab_size=VOCAB, seed=2)
    drafter = make_drafter(target, tree_budget=16, tree_construction=construction, block_expansion="best_first",
                           max_blocks=2, online_adaptation="always")  # fmt: skip
    loaded = _weights(drafter)
    assert _serve(target, drafter, calls=3) == ["full"] * 3
    assert online_adapter_for(drafter, drafter.serving_state(target)).buffer  # the verified trees gave a signal
    assert any(not torch.equal(w, loaded[n]) for n, w in drafter.named_parameters())


# ------------------------------------------------------------------------------------------------ the policies
def _bandit_run(arms, net_throughput, calls=60, rejected=(), rejected_first=0):
    """Serve `calls` synthetic calls: `net_throughput[arm]` = (tokens/s while decoding, update seconds); the held-out
    check throws away every update of an arm in `rejected`, and the first `rejected_first` updates of any arm (and,
    as in the adapter, a call whose check threw an update away shows no held-out gain: no escalation)."""
    bandit, taken, gain = CostAwareBandit(arms), [], True
    torch.manual_seed(0)
    for _ in range(calls):
        arm = bandit.choose(escalate=gain)
        speed, update = net_throughput[arm]
        decode = 64 / (speed * (1 + 0.05 * float(torch.randn(()))))  # 5% noise per call
        bandit.record(arm, 64, decode, update)
        updates = [a for a in taken if a != SKIP]
        gain = not (arm != SKIP and (arm in rejected or len(updates) < rejected_first))
        if not gain:
            bandit.reject(arm, update / (decode + update))
        taken.append(arm)
    return taken


def test_bandit_updates_while_the_gain_exceeds_the_cost():
    # head-only: +20% speed for 0.2 s (of a 3.2 s call); full: +25% for 2 s; skip: nothing
    taken = _bandit_run((HEAD_ONLY, FULL, SKIP), {SKIP: (20.0, 0.0), HEAD_ONLY: (24.0, 0.2), FULL: (25.0, 2.0)})
    # the cheap update and skip first; full once head-only paid over two pulls
    assert taken[:4] == [HEAD_ONLY, SKIP, HEAD_ONLY, FULL]
    assert taken[-30:].count(HEAD_ONLY) >= 20


def test_bandit_skips_when_updates_cost_more_than_they_buy():
    taken = _bandit_run((HEAD_ONLY, FULL, SKIP), {SKIP: (20.0, 0.0), HEAD_ONLY: (20.5, 0.5), FULL: (21.0, 2.0)})
    assert taken[-30:].count(SKIP) >= 20
    assert FULL not in taken  # head-only never paid: the costlier update is not explored
    taken = _bandit_run((FULL, SKIP), {SKIP: (20.0, 0.0), FULL: (30.0, 0.3)})  # the "full" policy's arms
    assert taken[-30:].count(FULL) >= 20


def test_bandit_stops_updating_when_the_held_out_check_rejects_its_updates():
    # head-only looks 5% faster by throughput (in domain: noise that happened to favour it), but every update is
    # thrown away by the held-out check
    speeds = {SKIP: (20.0, 0.0), HEAD_ONLY: (21.5, 0.1), FULL: (21.0, 2.0)}
    assert _bandit_run((HEAD_ONLY, FULL, SKIP), speeds)[-30:].count(HEAD_ONLY) >= 20
    taken = _bandit_run((HEAD_ONLY, FULL, SKIP), speeds, rejected=(HEAD_ONLY,))
    # each thrown-away update is charged as "skip" less its time: skip wins; head-only is still re-explored now and
    # then (a domain shift would make it pay again), the costlier update never
    assert taken[-30:].count(SKIP) >= 18 and FULL not in taken


def test_one_thrown_away_update_does_not_end_a_useful_adaptation():
    # head-only: +20% speed for 0.2 s, but the (conservative, depth-1) held-out check threw the first update away:
    # charged as "skip less its cost", not as nothing, so the bandit comes back to it
    speeds = {SKIP: (20.0, 0.0), HEAD_ONLY: (24.0, 0.2), FULL: (25.0, 2.0)}
    taken = _bandit_run((HEAD_ONLY, FULL, SKIP), speeds, rejected_first=1)
    assert taken[0] == HEAD_ONLY and taken[-30:].count(HEAD_ONLY) >= 20
    bandit = CostAwareBandit((HEAD_ONLY, FULL, SKIP))
    bandit.record(SKIP, 64, 3.0, 0.0)
    bandit.record(HEAD_ONLY, 64, 2.0, 0.2)
    bandit.reject(HEAD_ONLY, 0.1)
    assert bandit.counts[HEAD_ONLY] == 1.0  # the same pull, its reward replaced
    assert bandit.mean(HEAD_ONLY) == pytest.approx(0.9 * bandit.mean(SKIP))


def test_backoff_doubles_the_wait_after_each_update_thrown_away():
    backoff = Backoff(limit=8)
    assert not backoff.waiting()
    waits = []
    for _ in range(4):
        backoff.update_thrown_away()
        waits.append(0)
        while backoff.waiting():
            waits[-1] += 1
    assert waits == [2, 4, 8, 8]  # (capped at the limit)
    backoff.update_thrown_away()
    backoff.update_kept()  # a kept update: the policy is asked on the next call, and the next wait is short again
    assert not backoff.waiting()
    backoff.update_thrown_away()
    assert backoff.wait == 2


def test_a_bandit_whose_updates_are_thrown_away_backs_off_and_captures_nothing_meanwhile(monkeypatch):
    """On a stream where no candidate head is ever served, the bandit waits 2, then 4 calls after each dropped one,
    and captures the signal (keeps producers while drafting) only on calls after which it may update or that test a
    candidate; outputs stay identical."""
    monkeypatch.setattr(adapter_module, "PROMOTION_GAIN", 2.0)  # no candidate can win: each is dropped
    target = make_target("llama", vocab_size=VOCAB, seed=1)
    drafter = _drafter("specblock", target, online_adaptation="bandit")
    actions, signals = [], []
    for call in range(12):
        actions += _serve(target, drafter, calls=1)
        signals.append(drafter.last_stats.adaptation.signal)
    adapter = online_adapter_for(drafter)
    assert actions[:4] == [HEAD_ONLY, WAIT, WAIT, SKIP]  # dropped at call 1: calls 1-2 wait, call 3 asks again
    # captured: the first call, and each call testing a candidate; not while waiting, nor where the bandit asked at
    # the start would skip (call 3: "skip" is not measured yet)
    assert signals[0] > 0 and signals[1] > 0 and signals[2] == 0 and signals[3] == 0
    assert all(signals[i + 1] > 0 for i, action in enumerate(actions[:-1]) if action == HEAD_ONLY)
    asked = [a for a in actions if a != WAIT]
    assert actions.count(HEAD_ONLY) == adapter.backoff.thrown_away + (adapter.candidate is not None)
    assert all(s == 0 for a, s, before in zip(actions[1:], signals[1:], actions) if a == before == WAIT)
    assert len(asked) < len(actions)
    assert torch.equal(drafter.lm_head.weight, drafter.serving_states.loaded_weights["lm_head.weight"])


def test_one_lucky_head_update_does_not_open_the_whole_drafter_update():
    bandit = CostAwareBandit((HEAD_ONLY, FULL, SKIP))
    bandit.record(HEAD_ONLY, 64, 2.0, 0.1)  # one head-only call that noise made faster than...
    bandit.record(SKIP, 64, 3.0, 0.0)  # ...the skip after it
    assert bandit.mean(HEAD_ONLY) > bandit.mean(SKIP)
    assert bandit.choose() == HEAD_ONLY  # measured once more before the costlier update is explored
    bandit.record(HEAD_ONLY, 64, 2.0, 0.1)
    assert bandit.choose() == FULL


@pytest.mark.parametrize("reference_calls", [1, 2])
def test_a_rolled_back_update_is_charged_to_its_arm(reference_calls):
    target = make_target("llama", vocab_size=VOCAB, seed=1)
    drafter = _drafter("specblock", target, online_adaptation="full")
    _serve(target, drafter, calls=1)  # the "full" policy's first action: a whole-drafter update
    adapter = online_adapter_for(drafter)
    adapter.fresh = []  # (no held-out check: only the tau rollback)
    bandit = adapter.bandits["full"]
    assert adapter.pending.action == FULL and adapter.pending.reference_calls == 1
    adapter.pending.reference_calls = reference_calls  # (2: as if a call before had set the reference too)
    adapter.finish_call(new_tokens=10, decode_seconds=1.0, tau=0.1 * adapter.pending.reference_tau)
    if reference_calls == 1:  # one call's tau is no reference (prompts differ too much): no rollback
        assert not adapter.report.rolled_back and bandit.counts[FULL] == pytest.approx(1.0)
    else:  # the throughput reward of the call after it, replaced by what the thrown-away update earned
        assert adapter.report.rolled_back and bandit.pulls[FULL] == 1
        assert bandit.counts[FULL] == pytest.approx(1.0)
        assert bandit.sums[FULL] == pytest.approx(1 - adapter.last_update_share)


def test_no_whole_drafter_update_where_the_held_out_check_sees_no_gain():
    bandit = CostAwareBandit((HEAD_ONLY, FULL, SKIP))
    for arm, decode in ((HEAD_ONLY, 2.0), (SKIP, 3.0), (HEAD_ONLY, 2.0)):  # head-only pays, twice
        bandit.record(arm, 64, decode, 0.1)
    assert bandit.choose(escalate=False) == HEAD_ONLY and bandit.choose() == FULL
    bandit.record(FULL, 64, 1.0, 0.1)  # once tried and the best by far: still left out without escalation
    assert bandit.choose(escalate=False) != FULL and bandit.choose() == FULL


def test_the_held_out_gain_gates_the_whole_drafter_update():
    target = make_target("llama", vocab_size=VOCAB, seed=1)
    drafter = _drafter("specblock", target, online_adaptation="bandit")
    _serve(target, drafter, calls=1)
    assert math.isnan(drafter.last_stats.adaptation.held_out_gain)  # nothing adapted yet
    adapter = online_adapter_for(drafter)
    bandit = adapter.bandits["bandit"]
    for arm in (HEAD_ONLY, SKIP, HEAD_ONLY):  # head-only has paid twice: the bandit wants to try "full"
        bandit.record(arm, 64, 2.0 if arm == HEAD_ONLY else 3.0, 0.0)
    adapter.adapted_wins = ESCALATION_CALLS - 1  # the adapted weights won once: not enough
    assert adapter.choose_action() == HEAD_ONLY
    adapter.adapted_wins = ESCALATION_CALLS
    assert adapter.choose_action() == FULL
    _serve(target, drafter, calls=1)  # the loaded head is served (the candidate was not): nothing to compare
    if not drafter.last_stats.adaptation.promoted:
        assert math.isnan(drafter.last_stats.adaptation.held_out_gain)
        with torch.no_grad():  # an adapted head served
            drafter.lm_head.weight.mul_(1.5)
    _serve(target, drafter, calls=1)  # measured on every call while adapted weights are served
    assert -1.0 <= drafter.last_stats.adaptation.held_out_gain <= 1.0


def test_the_whole_drafter_update_waits_for_adapted_weights_that_win_calls_in_a_row():
    """The held-out check counts the calls in a row on which the adapted head served beat the loaded one by
    `ESCALATION_GAIN` on both measures; a call without a clear win (or with the loaded head served) starts over."""
    target = make_target("llama", vocab_size=VOCAB, seed=1)
    drafter = _drafter("specblock", target, online_adaptation="bandit")
    _serve(target, drafter, calls=1)
    loaded = drafter.serving_states.loaded_weights["lm_head.weight"]
    state = torch.randn(drafter.config.hidden_size, generator=torch.Generator().manual_seed(0))
    (top,) = _top(drafter, loaded, state[None])
    best = next(t for t in range(loaded.shape[0]) if t != top)
    with torch.no_grad():  # an adapted head proposing the target's top token where the loaded one does not
        drafter.lm_head.weight[best] = loaded[top] + drafter.norm(state[None])[0]
    others = [t for t in range(loaded.shape[0]) if t not in (top, best)][:2]
    win, tie = [(state, [best, top], [0.7, 0.3])] * 4, [(state, others, [0.7, 0.3])] * 4  # (tie: neither proposes)
    expected = 0
    for rows in (win, tie, win, win):
        adapter = _held_out_call(drafter, rows)
        adapter._keep_better_output_side()
        expected = expected + 1 if rows is win else 0
        assert adapter.adapted_wins == expected and not adapter.report.restored_loaded
        assert adapter.choose_action() != FULL or expected >= ESCALATION_CALLS
    with torch.no_grad():
        drafter.lm_head.weight.copy_(loaded)
    adapter.loaded_head = adapter._head_versions()  # the loaded head served: no comparison, no win
    adapter = _held_out_call(drafter, win)
    adapter._keep_better_output_side()
    assert adapter.adapted_wins == 0


def test_a_rejected_update_is_charged_to_its_arm():
    target = make_target("llama", vocab_size=VOCAB, seed=1)
    drafter = _drafter("specblock", target, online_adaptation="bandit")
    _serve(target, drafter, calls=1)  # the bandit's first action: a head-only update
    assert drafter.last_stats.adaptation.action == HEAD_ONLY
    with torch.no_grad():
        drafter.lm_head.weight.neg_()  # an adapted head that proposes the worst tokens
    adapter = online_adapter_for(drafter)
    _serve(target, drafter, calls=1)  # its throughput is measured, then the held-out check throws it away
    bandit = adapter.bandits["bandit"]
    assert drafter.last_stats.adaptation.restored_loaded and not drafter.last_stats.adaptation.rolled_back
    # one pull whose reward is what the update earned: nothing over "skip" (not measured yet: 1), less its time
    assert 0.0 < adapter.last_update_share < 1.0
    assert bandit.counts[HEAD_ONLY] == 1.0 and bandit.sums[HEAD_ONLY] == pytest.approx(1 - adapter.last_update_share)


@pytest.mark.parametrize(
    "policy,first", [("always", FULL), ("head_only", HEAD_ONLY), ("full", FULL), ("bandit", HEAD_ONLY)]
)
def test_each_policy_takes_its_action(policy, first):
    target = make_target("llama", vocab_size=VOCAB, seed=1)
    drafter = _drafter("specblock", target, online_adaptation=policy)
    _serve(target, drafter, calls=1)
    assert drafter.last_stats.adaptation.action == first
    report = drafter.last_stats.as_dict()["adaptation"]  # nested in the logged dict
    assert report["update_time_s"] > 0 and report["signal"] >= report["signal_wrong"] > 0


def test_no_signal_means_no_update():
    target = make_target("llama", vocab_size=VOCAB, seed=1)
    drafter = _drafter("specblock", target, online_adaptation="always")
    adapter = online_adapter_for(drafter, drafter.serving_state(target))
    assert adapter.finish_call(new_tokens=10, decode_seconds=1.0, tau=1.5).action == SKIP


def test_rollback_when_tau_drops_after_a_whole_drafter_update():
    target = make_target("llama", vocab_size=VOCAB, seed=1)
    drafter = _drafter("specblock", target, online_adaptation="always", adaptation_learning_rate=1e-2)
    _serve(target, drafter, calls=1)  # collects a signal and runs one whole-drafter update
    adapter = online_adapter_for(drafter)
    adapter.fresh = []  # (no held-out check: only the tau rollback)
    before = _weights(drafter)
    report = adapter.finish_call(new_tokens=20, decode_seconds=1.0, tau=2.0)  # scores the first, runs a second
    assert report.action == FULL and not report.rolled_back
    updated = _weights(drafter)
    assert any(not torch.equal(updated[n], before[n]) for n in before)
    report = adapter.finish_call(new_tokens=20, decode_seconds=1.0, tau=1.0)  # tau halved: undo the second update
    assert report.rolled_back
    # the rollback restored the weights from before the second update, then this call's update ran on them
    adapter.rollback(adapter.pending)
    assert all(torch.equal(p, before[n]) for n, p in drafter.named_parameters())


def test_the_loaded_output_side_comes_back_where_it_does_better():
    """An adapted head that proposes the worst tokens (its weights negated) loses the held-out check on the next
    call's signal and the loaded output side comes back; a sound adapted head is kept."""
    target = make_target("llama", vocab_size=VOCAB, seed=1)
    drafter = _drafter("specblock", target, online_adaptation="head_only")
    loaded = _weights(drafter)
    _serve(target, drafter, calls=2)
    assert not drafter.last_stats.adaptation.restored_loaded
    with torch.no_grad():
        drafter.lm_head.weight.neg_()
    adapter = online_adapter_for(drafter)
    adapter.pending, adapter.candidate = None, None  # (the negated head is the one to test)
    _serve(target, drafter, calls=1)  # held out: this call's signal, then an update into a new candidate head
    assert drafter.last_stats.adaptation.restored_loaded
    assert torch.equal(drafter.lm_head.weight, loaded["lm_head.weight"]) and adapter.candidate is not None


def _held_out_call(drafter, rows: list[tuple[torch.Tensor, list[int], list[float]]]):
    """The adapter after one served call, its fresh signal replaced by `rows` of (state [H], the target's top ids in
    the draft vocabulary, their probabilities), all at depth 1."""
    adapter = online_adapter_for(drafter)
    adapter.fresh = [
        SignalSample(state=state, target_ids=torch.tensor(ids), target_probs=torch.tensor(probs), wrong=True,
                     body_version=adapter.body_version)
        for state, ids, probs in rows
    ]  # fmt: skip
    adapter.report = adapter_module.AdaptationReport()
    return adapter


def _drafter_and_better_head():
    """A target, a bandit drafter after one call, its served head, a state, the served head's first proposal there
    (`top`) and a head whose first proposal there is another token (`best`)."""
    target = make_target("llama", vocab_size=VOCAB, seed=1)
    drafter = _drafter("specblock", target, online_adaptation="bandit")
    _serve(target, drafter, calls=1)
    served = drafter.lm_head.weight.detach().clone()
    state = torch.randn(drafter.config.hidden_size, generator=torch.Generator().manual_seed(0))
    (top,) = _top(drafter, served, state[None])
    best = next(t for t in range(served.shape[0]) if t != top)
    good = served.clone()
    good[best] = served[top] + drafter.norm(state[None])[0].detach()
    return target, drafter, served, state, top, best, good  # (the drafter holds its target weakly)


@torch.no_grad()
def _top(drafter, weight: torch.Tensor, states: torch.Tensor) -> list[int]:
    return torch.nn.functional.linear(drafter.norm(states), weight).argmax(-1).tolist()


def test_a_candidate_that_only_lifts_the_targets_second_choice_is_not_served():
    """Greedy decoding accepts the target's own top token only: a candidate head whose first proposal is the
    target's second choice where the served head's is its third gains first-proposal acceptance and nothing
    greedy decoding would accept; it is not served. One proposing the target's top token is."""
    target, drafter, served, state, third, _, _ = _drafter_and_better_head()
    second, first = [t for t in range(served.shape[0]) if t != third][:2]
    normed = drafter.norm(state[None])[0].detach()
    candidate = served.clone()
    candidate[second] = served[third] + normed  # the candidate's top token: the target's second choice
    adapter = _held_out_call(drafter, [(state, [first, second, third], [0.6, 0.3, 0.1])] * 4)
    adapter.candidate = {"lm_head.weight": candidate}
    adapter._try_candidate()
    assert adapter.report.candidate_gain == pytest.approx(0.2)  # first-proposal acceptance: 0.3 instead of 0.1
    assert not adapter.report.promoted and torch.equal(drafter.lm_head.weight, served)
    candidate[first] = candidate[second] + normed  # now its top token is the target's own
    adapter.candidate = {"lm_head.weight": candidate}
    for call in range(adapter_module.PROMOTION_CALLS):
        adapter = _held_out_call(drafter, [(state, [first, second, third], [0.6, 0.3, 0.1])] * 4)
        adapter._try_candidate()
    assert adapter.report.promoted and torch.equal(drafter.lm_head.weight, candidate)


def test_a_candidate_is_served_only_after_winning_on_calls_in_a_row():
    """What a candidate head wins on one prompt may not carry to the next: it is served only after winning on
    `PROMOTION_CALLS` held-out calls in a row; in between no head-only update replaces it, and a loss drops it and
    charges its arm."""
    target, drafter, served, state, top, best, good = _drafter_and_better_head()  # (after a call: a candidate)
    adapter = online_adapter_for(drafter)
    won, lost = [(state, [best, top], [0.7, 0.3])] * 4, [(state, [top, best], [0.7, 0.3])] * 4
    for rows in (won, lost):  # a win, then a loss: dropped, charged like a thrown-away update
        adapter = _held_out_call(drafter, rows)
        adapter.candidate = {"lm_head.weight": good} if rows is won else adapter.candidate
        adapter._try_candidate()
        assert not adapter.report.promoted and torch.equal(drafter.lm_head.weight, served)
        assert (adapter.candidate is not None) == (rows is won)
    bandit = adapter.bandits["bandit"]
    adapter._charge_thrown_away_updates()
    assert bandit.sums[HEAD_ONLY] == pytest.approx(1 - adapter.last_update_share)
    adapter.candidate = {"lm_head.weight": good}  # wins in a row: served
    adapter.choose_action = lambda: HEAD_ONLY  # the bandit wants a head-only update after every call
    for call in range(adapter_module.PROMOTION_CALLS):
        adapter = _held_out_call(drafter, won)
        adapter.pending = None
        report = adapter.finish_call(10, 1.0, 2.0)
        last = call == adapter_module.PROMOTION_CALLS - 1
        assert report.promoted == last
        if not last:  # on probation: a head-only update would replace it, so none is run
            assert report.action == SKIP and adapter.candidate["lm_head.weight"] is good
    assert report.action == HEAD_ONLY and torch.equal(drafter.lm_head.weight, good)
    adapter.candidate_wins = 1  # a newly trained candidate starts its probation afresh
    adapter._train_candidate()
    assert adapter.candidate_wins == 0 and adapter.candidate is not None


def test_a_candidate_that_wins_only_where_free_candidates_decided_is_not_served():
    target, drafter, served, state, top, best, good = _drafter_and_better_head()
    for covered in (True, False):
        adapter = _held_out_call(drafter, [(state, [best, top], [0.7, 0.3])] * 4)
        for sample in adapter.fresh:
            sample.covered = covered
        adapter.candidate, adapter.candidate_wins = {"lm_head.weight": good}, adapter_module.PROMOTION_CALLS - 1
        adapter._try_candidate()
        assert adapter.report.promoted == (not covered)
        if covered:  # no verdict on this call: neither served nor dropped, tested again on the next
            assert adapter.candidate["lm_head.weight"] is good and math.isnan(adapter.report.candidate_gain)
        drafter.lm_head.weight.data.copy_(served)


def test_the_loaded_head_comes_back_where_the_served_one_agrees_less_with_greedy(monkeypatch):
    """The held-out check puts the loaded head back where the served one proposes the target's top token less often,
    even if it gains first-proposal acceptance elsewhere; while the loaded head is served it compares nothing."""
    target = make_target("llama", vocab_size=VOCAB, seed=1)
    drafter = _drafter("specblock", target, online_adaptation="head_only")
    _serve(target, drafter, calls=1)  # an update: the loaded weights are kept
    loaded = drafter.serving_states.loaded_weights["lm_head.weight"]
    states = torch.randn(4, drafter.config.hidden_size, generator=torch.Generator().manual_seed(0))

    def fail(*args):
        raise AssertionError("compared while the loaded head is served")

    monkeypatch.setattr(adapter_module, "held_out_gains", fail)
    adapter = _held_out_call(drafter, [(s, [0, 1, 2], [0.6, 0.3, 0.1]) for s in states])
    adapter._keep_better_output_side()  # the loaded head is served: no comparison
    assert math.isnan(adapter.report.held_out_gain)
    monkeypatch.undo()
    with torch.no_grad():
        drafter.lm_head.weight.copy_(torch.randn(loaded.shape, generator=torch.Generator().manual_seed(1)))
    tops = list(zip(_top(drafter, loaded, states), _top(drafter, drafter.lm_head.weight, states)))
    rows = []
    for i, (state, (was, now)) in enumerate(zip(states, tops)):
        other = next(t for t in range(loaded.shape[0]) if t not in (was, now))
        if was == now:
            rows.append((state, [other, was], [0.6, 0.4]))  # no difference
        elif i == 0:
            rows.append((state, [was, now, other], [0.6, 0.3, 0.1]))  # the loaded head's top is the target's
        else:
            rows.append((state, [other, now, was], [0.6, 0.3, 0.1]))  # the served head's is the second choice
    assert tops[0][0] != tops[0][1] and sum(was != now for was, now in tops[1:]) >= 2
    adapter = _held_out_call(drafter, rows)
    adapter._keep_better_output_side()
    assert adapter.report.held_out_gain > 0  # more first-proposal acceptance, one greedy token fewer
    assert adapter.report.restored_loaded and torch.equal(drafter.lm_head.weight, loaded)


def test_a_head_only_update_is_served_only_after_it_beats_the_served_head():
    """A head-only update trains a candidate; the next call's held-out check serves it where it does better than
    the served head on that call's signal and drops it otherwise, charging its arm."""
    target = make_target("llama", vocab_size=VOCAB, seed=1)
    drafter = _drafter("specblock", target, online_adaptation="bandit")
    loaded = _weights(drafter)
    _serve(target, drafter, calls=1)  # the bandit's first action: a head-only update, into a candidate
    adapter = online_adapter_for(drafter)
    assert drafter.last_stats.adaptation.action == HEAD_ONLY and adapter.candidate is not None
    assert all(torch.equal(p, loaded[n]) for n, p in drafter.named_parameters())  # nothing served changed
    adapter.candidate = {"lm_head.weight": -loaded["lm_head.weight"]}  # a candidate proposing the worst tokens
    _serve(target, drafter, calls=1)
    stats, bandit = drafter.last_stats, adapter.bandits["bandit"]
    assert stats.adaptation.candidate_gain < 0 and not stats.adaptation.promoted
    assert torch.equal(drafter.lm_head.weight, loaded["lm_head.weight"])
    # charged as thrown away: "skip" (not measured yet: 1) less its time
    assert bandit.counts[HEAD_ONLY] == 1.0 and bandit.sums[HEAD_ONLY] == pytest.approx(1 - adapter.last_update_share)
    with torch.no_grad():  # now the served head is the bad one (and the reference of the loaded check too)
        drafter.lm_head.weight.neg_()
        drafter.serving_states.loaded_weights["lm_head.weight"].neg_()
    adapter.candidate = {"lm_head.weight": loaded["lm_head.weight"].clone()}
    for call in range(adapter_module.PROMOTION_CALLS):  # served once it has won on calls in a row
        _serve(target, drafter, calls=1)
        assert drafter.last_stats.adaptation.candidate_gain > 0
        assert drafter.last_stats.adaptation.promoted == (call == adapter_module.PROMOTION_CALLS - 1)
    assert torch.equal(drafter.lm_head.weight, loaded["lm_head.weight"])


def test_the_loaded_drafter_comes_back_after_whole_drafter_updates():
    """With the body changed, both drafters replay the call's depth-1 contexts; all loaded weights come back.
    (SpecBlock: the tiny random EAGLE-3 drafter's negated head is not reliably worse than its random one.)"""
    target = make_target("llama", vocab_size=VOCAB, seed=1)
    drafter = _drafter("specblock", target, online_adaptation="always")
    loaded = _weights(drafter)
    _serve(target, drafter, calls=1)
    with torch.no_grad():
        drafter.lm_head.weight.neg_()
    online_adapter_for(drafter).pending = None
    _serve(target, drafter, calls=1)
    assert drafter.last_stats.adaptation.restored_loaded
    # the loaded weights, then this call's 4 gradient steps (1e-2 output side, 1e-3 body)
    assert all(float((p.detach() - loaded[n]).abs().max()) < 0.01 for n, p in drafter.named_parameters())


# ------------------------------------------------------------------------------------------------ reset, save, errors
def test_reset_restores_the_loaded_weights_bit_for_bit(tmp_path):
    target = make_target("llama", vocab_size=VOCAB, seed=1)
    _drafter("specblock", target).save_pretrained(tmp_path / "loaded")
    drafter = SpecBlockDraftModel.from_pretrained(tmp_path / "loaded", online_adaptation="always")
    assert drafter.generation_config.online_adaptation == "always"
    loaded = _weights(drafter)
    _serve(target, drafter, calls=3)  # (a bandit may end where it began: its rejected updates are thrown away)
    adapted = _weights(drafter)
    assert any(not torch.equal(adapted[n], loaded[n]) for n in loaded)
    drafter.save_pretrained(tmp_path / "default")
    drafter.save_pretrained(tmp_path / "adapted", save_adapted=True)
    assert all(torch.equal(p, adapted[n]) for n, p in drafter.named_parameters())  # saving changed nothing
    for folder, expected in (("default", loaded), ("adapted", adapted)):
        saved = SpecBlockDraftModel.from_pretrained(tmp_path / folder)
        assert all(torch.equal(p, expected[n]) for n, p in saved.named_parameters()), folder
    drafter.reset_adaptation()
    assert all(torch.equal(p, loaded[n]) for n, p in drafter.named_parameters())
    assert drafter.serving_state().adaptation is None


def test_tree_settings_scope_the_policy():
    target = make_target("llama", vocab_size=VOCAB, seed=1)
    drafter = _drafter("eagle3", target)
    with drafter.tree_settings(online_adaptation="head_only"):
        assert _serve(target, drafter, calls=1) == [HEAD_ONLY]
    assert drafter.generation_config.online_adaptation == "off"
    assert _serve(target, drafter, calls=1) == ["off"]


def test_bad_settings_are_refused():
    target = make_target("llama", vocab_size=VOCAB, seed=1)
    with pytest.raises(ValueError, match="online_adaptation must be one of .*'off'.*got 'sometimes'"):
        _drafter("specblock", target, online_adaptation="sometimes")
    drafter = _drafter("specblock", target)
    with pytest.raises(ValueError, match="online_adaptation must be one of"):
        with drafter.tree_settings(online_adaptation="on"):
            pass
    with pytest.raises(ValueError, match="adaptation_learning_rate must be a float > 0"):
        _drafter("specblock", target, adaptation_learning_rate=0.0)
    with pytest.raises(ValueError, match="adaptation_head_learning_rate must be a float > 0"):
        _drafter("specblock", target, adaptation_head_learning_rate=-1e-3)
    with pytest.raises(ValueError, match="adaptation_buffer_size must be an int >= 1"):
        _drafter("specblock", target, adaptation_buffer_size=0)
    unbound = SpecBlockDraftModel(drafter.config)
    with pytest.raises(ValueError, match="needs a drafter bound to its target.*bind_target"):
        online_adapter_for(unbound)
    with pytest.raises(ValueError, match="online_adaptation='head_only' does not apply to DFlash drafters"):
        make_dflash(target, online_adaptation="head_only")  # refused when set, not at the first generate
    with pytest.raises(ValueError, match="LookupTreeModel has no weights to adapt.*set online_adaptation='off'"):
        LookupTreeModel.from_target(target, online_adaptation="bandit")


def test_signal_collection_is_charged_to_adaptation_not_to_the_trees(monkeypatch):
    """What the adapter spends collecting its signal inside each step is adaptation's cost (the bandit weighs it with
    the update), never part of the step time "auto" weighs trees by: else adapting would make every tree look
    dearer, "auto" would stop drafting, and with it the signal."""
    target = make_target("llama", vocab_size=VOCAB, seed=1)
    drafter = _drafter(
        "specblock", target, online_adaptation="always", tree_budget="auto", auto_budget_candidates=[0, 8],
        auto_budget_warmup=1000,  # every step drafts (the warm-up), so every step collects a signal
    )  # fmt: skip
    machine = ScriptedMachine(monkeypatch)  # given times: the target's forwards, and the signal's collection
    machine.times_target(target, lambda nodes: 0.010 + 0.001 * nodes)
    delay = 0.05
    collect = adapter_module.collect_signal

    def slow_collect(*args, **kwargs):
        machine.advance(delay)
        return collect(*args, **kwargs)

    monkeypatch.setattr(adapter_module, "collect_signal", slow_collect)
    _serve(target, drafter, calls=1)
    chooser = drafter.serving_state(target).auto_budget
    overhead = chooser.step_overhead[(1, True)]
    assert overhead.count >= 4 and overhead.mean(chooser.clock) < delay / 2  # the trees' cost: as measured
    steps = drafter.last_stats.iterations
    assert drafter.last_stats.adaptation.update_time_s >= delay * steps - 1e-9  # adaptation's, charged to its action


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["specblock-smollm2-135m-instruct", "eagle3-smollm2-135m-instruct", "dflash-smollm2-135m-instruct"]
)
def test_every_shipped_drafter_adapts_with_the_bandit_as_shipped(name):
    """The shipped drafters (bfloat16, their shipped tree settings) load with online_adaptation="bandit" and adapt
    while serving the packaged target in float32, as on a CPU without native bfloat16; output stays plain greedy's.
    DFlash drafts with the target's lm_head and embedding: those stay as they were."""
    from transformers_specblock import load_packaged_model

    target, tokenizer = load_packaged_model("smollm2-135m-instruct", dtype="float32")
    drafter_class = {"specblock": SpecBlockDraftModel, "eagle3": Eagle3DraftModel, "dflash": DFlashDraftModel}
    drafter = drafter_class[name.split("-")[0]].from_pretrained(name, online_adaptation="bandit", tree_budget=8)
    target_weights = {n: p.detach().clone() for n, p in target.named_parameters()}
    loaded = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    updates = []
    for question in ("Write a Python function that reverses a list.", "Name three uses of a hash map.") * 2:
        inputs = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)  # fmt: skip
        plain = target.generate(**inputs, do_sample=False, max_new_tokens=24)
        out = target.generate(**inputs, assistant_model=drafter, do_sample=False, max_new_tokens=24)
        assert out.tolist() == plain.tolist()
        report = drafter.last_stats.adaptation
        updates += [(report.action, report.loss)] if report.action in ("head_only", "full") else []
        if report.action == "full":  # served at once: the user's bfloat16 drafter takes what the float32 copy learnt
            assert any(not torch.equal(p, loaded[n]) for n, p in drafter.named_parameters())
    assert updates and all(math.isfinite(loss) for _, loss in updates), updates  # the bandit trained on the signal
    assert all(torch.equal(p, target_weights[n]) and p.grad is None for n, p in target.named_parameters())
