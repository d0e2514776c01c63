"""tree_budget="auto": the budget maximising tau / (T_M + T_D)."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import make_drafter, make_target
from scripted_clock import ScriptedMachine
from transformers_specblock import LookupTreeModel
from transformers_specblock.generation import CANDIDATE_GENERATOR_MAPPING
from transformers_specblock.generation.auto_choosers import auto_budget_for
from transformers_specblock.generation.budget import PLAIN, AutoBudget, best_budget
from transformers_specblock.generation.target_cost import TargetCost
from transformers_specblock.generation.candidate_generators.base import PLAIN_SHADOW_INTERVAL, TreeCandidateGenerator
from transformers_specblock.generation.lookup import FreeShadow
from transformers_specblock.generation.tree import DraftTree, HostTree
from transformers_specblock.models.tree_drafter.generation_config import (
    DEFAULT_EXPLORE_SHARE,
    check_tree_budget,
)


def test_best_budget_on_synthetic_cpu_and_gpu_curves():
    tau = {4: 1.6, 8: 2.2, 16: 2.7, 32: 2.9, 64: 3.0}
    # a CPU-like cost: SmolLM2-135M measured 106 ms (1 token) .. 402 ms (64 tokens)
    cpu = TargetCost([4, 8, 16, 32, 64], [0.150, 0.193, 0.227, 0.300, 0.402])
    rates = {b: tau[b] / (cpu(b) + 0.02) for b in tau}
    assert best_budget(tau, lambda b: cpu(b) + 0.02) == max(rates, key=rates.get) == 16
    # a GPU-like flat cost: the biggest tree wins
    gpu = TargetCost([4, 64], [0.0100, 0.0101])
    assert best_budget(tau, lambda b: gpu(b) + 0.002) == 64
    assert cpu(12) == pytest.approx((0.193 + 0.227) / 2) and cpu(2) == 0.150


def test_auto_budget_counts_what_each_budget_would_have_accepted():
    tree = DraftTree.root_only(0)
    # scores: node1 -0.1, node2 -0.5, node3 (child of 1) -0.3, node4 (child of 3) -2.0
    tree.add_nodes(torch.tensor([5, 6, 7, 8]), torch.tensor([0, 0, 1, 3]), torch.tensor([1, 1, 2, 3]),
                   torch.tensor([-0.1, -0.5, -0.3, -2.0]))  # fmt: skip
    chooser = AutoBudget([1, 2, 3, 4, 8], TargetCost([1, 8], [1.0, 1.0]), warmup=1)
    assert chooser.choose() == 8  # learning: the largest tree
    chooser.observe(tree, [1, 3, 4], drafting_seconds=0.0)
    # ranks: node1 1, node3 2, node2 3, node4 4 -> budget 1 keeps 1 path node, 2 and 3 keep 2, 4 keeps 3; the tree
    # (4 nodes, drafted budget unknown) tells nothing about budget 8
    assert chooser.estimates() == {1: 2.0, 2: 3.0, 3: 3.0, 4: 4.0}
    assert chooser.choose() == 8  # never measured: tried first
    # a tree that was not pruned (4 nodes under budget 8) is what every larger budget drafts too
    chooser.observe(tree, [1, 3, 4], drafting_seconds=0.0, budget=8)
    assert chooser.estimates() == {1: 2.0, 2: 3.0, 3: 3.0, 4: 4.0, 8: 4.0}
    assert chooser.choose() == 4  # equal costs: the most accepted (the smallest such)


def test_the_warm_up_drafts_the_largest_tree_that_costs_at_most_two_plain_steps():
    """A first call must not pay for trees that cannot pay: on a CPU-like curve (the float32 SmolLM2 curve of this
    project's AMD host: 32 nodes cost 2.5 plain steps) the warm-up drafts 16 nodes, on a flat GPU-like curve the
    largest candidate, and where even the smallest tree costs more than two steps (16 rows on a CPU) the smallest."""
    candidates = [0, 2, 4, 8, 16, 24, 32]
    cpu = TargetCost([0, 4, 8, 16, 24, 32], [71.2, 95.7, 95.7, 124.0, 149.7, 177.8])
    chooser = AutoBudget(candidates, cpu, warmup=2)
    assert chooser.warmup_budget() == chooser.next_budget() == 16
    for _ in range(2):
        chooser.observe(_chain(16), [1, 2], drafting_seconds=0.0, budget=16)
    # 24 and 32 were never measured, but they wait for an exploration instead of being tried first
    assert chooser.choose() in (0, 2, 4, 8, 16)
    assert AutoBudget(candidates, TargetCost([0, 32], [10.0, 10.5]), warmup=2).choose() == 32
    assert AutoBudget(candidates, TargetCost([0, 2, 32], [1.0, 2.3, 12.0]), warmup=2).choose() == 2
    assert AutoBudget(candidates, cpu, warmup=2, warmup_cost=1.4).choose() == 8


# A synthetic stream: the chooser's budget drafts a chain of that many nodes (so every tree is pruned to exactly
# its budget), of which the first L are accepted, L drawn from the current regime.
STREAM_COST = TargetCost([0, 2, 4, 8, 16], [1.0, 1.1, 1.25, 1.6, 2.4])  # CPU-like: every node costs time
GOOD, BAD = [5, 6, 7], [0, 0, 0, 0, 0, 0, 1]  # accepted lengths of a good and of a useless drafter


def _chain(size: int) -> DraftTree:
    tree = DraftTree.root_only(0)
    tree.add_nodes(torch.arange(1, size + 1), torch.arange(size), torch.arange(1, size + 1),
                   -0.1 * torch.arange(1, size + 1).float())  # fmt: skip
    return tree


def _true_best(lengths: list[int], cost: TargetCost = STREAM_COST) -> int:
    tau = {b: 1 + sum(min(n, b) for n in lengths) / len(lengths) for b in cost.sizes}
    return best_budget(tau, lambda b: cost(b) + (0.3 if b else 0.0))  # the drafter: 0.3 s wherever it drafts


def _run_stream(
    chooser: AutoBudget, regimes: list[list[int]], steps: int, seed: int, explore_share: float = 1.0
) -> tuple[list[int], list[int]]:
    """Per step: the chooser's choice and the budget it drafted with."""
    rng = random.Random(seed)
    choices, drafted = [], []
    for regime in regimes:
        for _ in range(steps):
            budget = chooser.next_budget(explore_interval=16, explore_share=explore_share)
            choices.append(chooser.choose())
            drafted.append(budget)
            if budget:
                accepted = min(rng.choice(regime), budget)
                chooser.observe(_chain(budget), list(range(1, accepted + 1)), drafting_seconds=0.3)
    return choices, drafted


@pytest.mark.parametrize("direction", ["upwards", "downwards"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auto_budget_follows_a_change_halfway(direction, seed):
    """The best budget jumps halfway (0 -> 8 when the drafter becomes good, 8 -> 0 when it becomes useless): the
    choice follows within a bounded number of verified steps and stays there (noise may move it briefly)."""
    before, after = (BAD, GOOD) if direction == "upwards" else (GOOD, BAD)
    best_before, best_after = _true_best(before), _true_best(after)
    assert {best_before, best_after} == {0, 8}
    chooser = AutoBudget([0, 2, 4, 8, 16], STREAM_COST)
    steps, bound = 300, 200
    choices, drafted = _run_stream(chooser, [before, after], steps, seed, explore_share=DEFAULT_EXPLORE_SHARE)
    assert choices[steps - 50 : steps].count(best_before) >= 45  # it had settled before the change
    followed = [i - steps for i in range(steps, 2 * steps) if choices[i] == best_after]
    assert followed and followed[0] <= bound, f"the change was followed after {followed[:1]} steps (bound {bound})"
    assert choices[steps + bound :].count(best_after) >= 0.9 * (steps - bound)
    # exploring costs at most one step in explore_interval after the warm-up (plus the brief noise moves)
    assert sum(b != c for b, c in zip(drafted, choices)) <= 2 * steps / 16 + 1


def test_auto_budget_estimates_above_the_choice_are_unbiased():
    """Trees pruned to the chosen budget must not count for larger budgets: their estimates stay at the truth
    (a budget of 8 or 16 commits 1 + L tokens here) instead of shrinking towards tau of the chosen budget."""
    cost = TargetCost([0, 2, 4, 8, 16], [1.0, 1.1, 1.25, 2.2, 4.0])  # the best is 4; 8 and 16 are too slow
    chooser = AutoBudget([0, 2, 4, 8, 16], cost)
    lengths = [5, 6, 7]
    choices, drafted = _run_stream(chooser, [lengths], 600, seed=0)
    assert _true_best(lengths, cost) == 4
    assert choices[100:].count(4) >= 0.95 * 500  # it settled on 4
    truth = {2: 3.0, 4: 5.0, 8: 7.0, 16: 7.0}
    seen = {b: [] for b in truth}
    rng = random.Random(1)
    for _ in range(300):  # keep going, recording the estimates: their average must be the truth
        budget = chooser.next_budget(explore_interval=16, explore_share=1.0)  # every 16th step: more samples
        chooser.observe(_chain(budget), list(range(1, min(rng.choice(lengths), budget) + 1)), drafting_seconds=0.3)
        for b, value in chooser.estimates().items():
            if b:
                seen[b].append(value)
    for b, value in truth.items():
        assert sum(seen[b]) / len(seen[b]) == pytest.approx(value, abs=0.25), b
    assert set(drafted[100:]) == {4, 8, 16} and drafted[100:].count(4) >= 0.9 * 500  # above 4 only to explore


def test_budget_validation():
    check_tree_budget("auto")
    check_tree_budget(3)
    for bad in (0, "fast", 2.5, True):
        with pytest.raises(ValueError, match="tree_budget"):
            check_tree_budget(bad)
    target = make_target("llama", vocab_size=24, seed=1)
    for bad in ([], [4, -1], [2.5]):
        with pytest.raises(ValueError, match="auto_budget_candidates"):
            make_drafter(target, tree_budget="auto", auto_budget_candidates=bad)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="auto_budget_explore_interval"):
            make_drafter(target, tree_budget="auto", auto_budget_explore_interval=bad)
    for bad in (0.5, "2", True):
        with pytest.raises(ValueError, match="auto_budget_warmup_cost"):
            make_drafter(target, tree_budget="auto", auto_budget_warmup_cost=bad)


def test_auto_budget_in_generate_is_exact_and_picks_a_candidate(monkeypatch):
    target = make_target("llama", vocab_size=24, seed=1)
    # given forward times (a GPU-like curve: 32 nodes cost 1.3 plain steps), whatever the host's load
    ScriptedMachine(monkeypatch).times_target(target, lambda nodes: 0.010 + 0.0001 * nodes)
    drafter = make_drafter(
        target, tree_policy="fixed", fixed_width=4, max_blocks=3, tree_budget="auto",
        auto_budget_candidates=[2, 4, 8, 16, 32], auto_budget_warmup=3,
    )  # fmt: skip
    prompt = torch.randint(1, 24, (1, 6), generator=torch.Generator().manual_seed(1))
    reference = target.generate(prompt, max_new_tokens=30, do_sample=False)
    out = target.generate(prompt, assistant_model=drafter, max_new_tokens=30, do_sample=False)
    assert out.tolist() == reference.tolist()
    nodes = drafter.last_stats.nodes_per_iteration
    assert all(n <= 32 for n in nodes) and max(nodes[:3]) > 8  # learning phase drafts the largest tree
    chooser = drafter.serving_state().auto_budget
    assert chooser.trees == len(nodes) and chooser.choose() in {2, 4, 8, 16, 32}
    # the cost curve was measured for every candidate and the small sizes (`test_measured_cost.py`: how)
    assert chooser.cost.sizes == [0, 1, 2, 3, 4, 8, 16, 32]
    assert chooser.cost.seconds == pytest.approx([0.010 + 0.0001 * n for n in chooser.cost.sizes])


def test_budget_zero_wins_when_no_tree_pays_for_itself():
    tau = {0: 1.0, 4: 1.3, 8: 1.35}
    cost = TargetCost([0, 4, 8], [0.100, 0.150, 0.190])  # a CPU: every drafted node costs verification time
    seconds = lambda b: cost(b) + (0.04 if b else 0.0)  # noqa: E731  (budget 0 runs no drafter)
    assert best_budget(tau, seconds) == 0  # 1/0.10 beats 1.3/0.19 and 1.35/0.23
    assert best_budget({0: 1.0, 4: 2.5}, seconds) == 4  # a good drafter pays for its tree


def test_auto_budget_zero_stops_drafting_and_stays_exact(monkeypatch):
    target = make_target("llama", vocab_size=24, seed=2)
    ScriptedMachine(monkeypatch).times_target(target, TargetCost([0, 4], [0.01, 10.0]))  # given step times
    drafter = make_drafter(
        target, tree_budget="auto", auto_budget_candidates=[0, 4], auto_budget_warmup=2,
        auto_budget_explore_interval=1000,
    )  # fmt: skip
    prompt = torch.randint(1, 24, (1, 6), generator=torch.Generator().manual_seed(2))
    reference = target.generate(prompt, max_new_tokens=24, do_sample=False)
    auto_budget_for(drafter, target).cost = TargetCost([0, 4], [0.01, 10.0])  # verifying a tree is prohibitively slow
    out = target.generate(prompt, assistant_model=drafter, max_new_tokens=24, do_sample=False)
    assert out.tolist() == reference.tolist()
    stats = drafter.last_stats
    assert min(stats.nodes_per_iteration[:2]) > 0 and set(stats.nodes_per_iteration[2:]) == {0}
    assert drafter.serving_state().auto_budget.trees == 2  # no exploring step within 1000 steps
    forwards = stats.drafter_forwards
    # chosen 0 from the start: the drafter does not even read the prompt
    target.generate(prompt, assistant_model=drafter, max_new_tokens=24, do_sample=False)
    assert set(drafter.last_stats.nodes_per_iteration) == {0} and drafter.last_stats.drafter_forwards == 0
    assert forwards > drafter.last_stats.drafter_forwards


def test_auto_budget_zero_comes_back_when_acceptance_improves(monkeypatch):
    """A drafter whose trees do not pay chooses 0; it keeps exploring (reading the context it skipped, its prompt
    included, just before an exploring tree), and speculates again once its trees pay. Output stays plain greedy.
    The chooser sees given step times (a scripted machine, the drafter's time none): on a loaded host (CI) its
    exploring steps moved with the wall clock."""
    vocab = 24
    target = make_target("llama", vocab_size=vocab, seed=3)
    # a tree costs 1.6 plain steps: one guess (tau about 1 + 1/24) does not pay, every token as a guess (tau 2) does
    ScriptedMachine(monkeypatch).times_target(target, TargetCost([0, vocab], [1.0, 1.6]))
    drafter = make_drafter(
        target, block_size=1, max_blocks=1, tree_policy="fixed", fixed_width=1, tree_budget="auto",
        auto_budget_candidates=[0, vocab], auto_budget_warmup=2, auto_budget_explore_interval=4,
    )  # fmt: skip
    chooser = auto_budget_for(drafter, target)
    assert chooser.cost(vocab) == pytest.approx(1.6) and chooser.cost(0) == pytest.approx(1.0)
    prompt = torch.randint(1, vocab, (1, 6), generator=torch.Generator().manual_seed(3))
    reference = target.generate(prompt, max_new_tokens=40, do_sample=False)
    out = target.generate(prompt, assistant_model=drafter, max_new_tokens=40, do_sample=False)
    assert out.tolist() == reference.tolist()
    nodes = drafter.last_stats.nodes_per_iteration
    assert nodes[-4:].count(0) >= 3  # chose 0
    assert all(n > 0 for n in nodes[5::4])  # but explores every 4th step
    # record what the drafter reads: every committed position once, in order, at its rotary position
    reads = []
    make_generator = CANDIDATE_GENERATOR_MAPPING["specblock"]

    def recording_generator(drafter, **overrides):
        generator = make_generator(drafter, **overrides)
        observe = generator.observe

        def recording_observe(features, tokens, first_position):
            assert features.shape == (tokens.numel(), 3 * target.config.hidden_size)
            reads.append((first_position, tokens.tolist()))
            observe(features, tokens, first_position)

        generator.observe = recording_observe
        return generator

    monkeypatch.setitem(CANDIDATE_GENERATOR_MAPPING, "specblock", recording_generator)
    # the drafter improves (here: it proposes every token at depth 1, so one token is always accepted)
    with drafter.tree_settings(fixed_width=vocab):
        out = target.generate(prompt, assistant_model=drafter, max_new_tokens=80, do_sample=False)
        assert out.tolist() == target.generate(prompt, max_new_tokens=80, do_sample=False).tolist()
        nodes = drafter.last_stats.nodes_per_iteration
        assert len(reads[0][1]) > prompt.shape[1]  # the prompt pass was skipped, then read with the skipped steps
        position = 1
        for first, tokens in reads:
            assert first == position and tokens == out[0, first : first + len(tokens)].tolist()
            position += len(tokens)
        assert nodes[0] == 0 and drafter.serving_state().auto_budget.choose() == vocab  # it came back to speculating
        # it speculates every step again; the least likely of the 24 guesses may be left out (worth_verifying)
        assert min(nodes[-10:]) >= vocab - 4 and sum(drafter.last_stats.accepted_per_iteration[-10:]) >= 17


def chain_tree(length: int) -> DraftTree:
    tree = DraftTree.root_only(0)
    tree.add_nodes(torch.arange(1, length + 1), torch.arange(length), torch.arange(1, length + 1),
                   -0.1 * torch.arange(1.0, length + 1))  # fmt: skip
    return tree


def test_worth_verifying_keeps_the_prefix_with_the_most_expected_tokens_per_second():
    """Node scores are log acceptance chances; a node is kept only while it pays for what it adds to T_M."""
    chooser = AutoBudget([0, 8], TargetCost([0, 8], [1.0, 1.8]), warmup=0)  # each node costs 0.1 step
    tree = DraftTree.root_only(0)
    chain = torch.tensor([0.9, 0.8, 0.5, 0.05, 0.01]).log().cumsum(0)  # path probabilities .9 .72 .36 .018 .00018
    tree.add_nodes(torch.arange(1, 6), torch.arange(0, 5), torch.arange(1, 6), chain)
    (kept,) = chooser.worth_verifying([tree])
    # expected tokens / cost: n=0 1/1, n=1 1.9/1.1, n=2 2.62/1.2, n=3 2.98/1.3 (best), n=4 2.998/1.4
    assert kept.tokens.tolist() == [0, 1, 2, 3]
    hopeless = DraftTree.root_only(0)
    hopeless.add_nodes(torch.tensor([4]), torch.tensor([0]), torch.tensor([1]), torch.tensor([0.05]).log())
    assert chooser.worth_verifying([hopeless])[0].num_drafted == 0  # 1.05 / 1.1 < 1 / 1: plain step
    assert AutoBudget([0, 8], chooser.cost, warmup=3).worth_verifying([hopeless])[0].num_drafted == 1  # warming up
    # a batch: one forward verifies every row at the longest row's size, so a chain in one row of four pays only for
    # its own tokens: n=2 (4 + 1.62) / 1.2 = 4.68 beats n=3 (4 + 1.98) / 1.3 = 4.60, where alone n=3 won
    batch = chooser.worth_verifying([tree, DraftTree.root_only(0), DraftTree.root_only(0), DraftTree.root_only(0)])
    assert [t.num_drafted for t in batch] == [2, 0, 0, 0]
    assert [t.num_drafted for t in chooser.worth_verifying([tree, tree])] == [3, 3]  # (2 + 3.96) / 1.3 > 2 / 1
    # the free candidates' tree a drafted step scores for budget 0 is sized as a budget-0 step would verify it
    assert chooser.free_alone_tree(tree.host()).tokens == [0, 1, 2, 3]
    assert chooser.free_alone_tree(hopeless.host()).num_drafted == 0
    chooser.explored_from = 8  # (an exploring step verifies its trees whole; budget 0 would not)
    assert chooser.free_alone_tree(tree.host()).tokens == [0, 1, 2, 3]


def test_a_plain_step_wins_where_the_free_candidates_do_not_pay_for_their_own_time():
    """Budget 0 with free candidates still runs the lookups: where their tau does not pay for their seconds, the
    chooser picks a plain step (neither the drafter nor the lookups), and explores back up from it."""
    cost = TargetCost([0, 8], [0.10, 0.18])
    chooser = AutoBudget([0, 8], cost, warmup=0, free_at_zero=True)
    for _ in range(8):
        chooser.observe(chain_tree(8), [1], drafting_seconds=0.05, budget=8)  # 2 tokens / 0.23 s
        chooser.observe_free(chain_tree(2), [], seconds=0.02)  # 1 token / 0.14 s
    assert chooser.choose() == PLAIN  # 1 / 0.10 beats 2 / 0.23 and 1 / 0.14
    chooser.set_batch_size(1)
    chosen = [chooser.next_budget(explore_interval=4, explore_share=1.0) for _ in range(8)]
    assert chosen.count(PLAIN) == 6 and 0 in chosen and 8 in chosen  # explorations climb from PLAIN to 0, then 8
    for _ in range(16):
        chooser.observe_free(chain_tree(2), [1, 2], seconds=0.02)  # the lookups start to pay
    assert chooser.choose() == 0


def test_the_loops_own_time_per_step_is_weighed_beside_the_cost_curve():
    """A step takes more than the target's forward (masks, acceptance, compaction, per-row bookkeeping): the chooser
    learns what tree steps and plain steps took beyond the cost curve, so a tree that pays on the curve alone but
    not in the loop is not drafted; a curve that says more than a step took is not lowered."""
    cost = TargetCost([0, 8], [0.10, 0.15])
    chooser = AutoBudget([0, 8], cost, warmup=0)
    for _ in range(8):
        chooser.observe(chain_tree(8), [1], drafting_seconds=0.02, budget=8)  # 2 tokens per tree
    assert chooser.choose() == 8  # on the curve: 2 / 0.17 beats 1 / 0.10
    assert chooser.step_seconds(8) == cost(8)  # nothing measured yet
    chooser.observe_step(0, 0.09)  # a plain step faster than the curve: no overhead (never a negative one)
    assert chooser.step_seconds(0) == cost(0) and chooser.step_seconds(8) == cost(8)
    for _ in range(4):
        chooser.observe_step(0, 0.11)  # plain steps: 10 ms beyond the forward
        chooser.observe_step(8, 0.25)  # tree steps: 100 ms beyond it
    assert chooser.step_seconds(0) == pytest.approx(0.11) and chooser.step_seconds(8) == pytest.approx(0.25)
    chooser.observe_step(8, 9.0)  # a one-off (a new kernel shape): the median of the recent steps does not move
    assert chooser.step_seconds(8) == pytest.approx(0.25)
    assert chooser.choose() == 0  # 1 / 0.11 beats 2 / 0.27
    chooser.set_batch_size(4)  # another batch bucket: measured on its own (here: no timing, the curve alone)
    assert chooser.step_seconds(8) == cost(8)


def test_the_loop_times_every_step_for_the_chooser(monkeypatch):
    """In a real batched loop each verified step reports its verified tree size (the padded trees') and its seconds
    with drafting left out, to the chooser of its batch bucket; the output stays plain greedy."""
    target = make_target("llama", vocab_size=24, seed=5)
    ScriptedMachine(monkeypatch).times_target(target, lambda nodes: 0.010 + 0.001 * nodes)  # given forward times
    drafter = make_drafter(target, tree_budget="auto", auto_budget_candidates=[0, 16], auto_budget_warmup=2)
    prompts = torch.randint(1, 24, (3, 6), generator=torch.Generator().manual_seed(5))
    reference = target.generate(prompts, max_new_tokens=24, do_sample=False)
    chooser = auto_budget_for(drafter, target)
    chooser.measure = lambda batch_size: chooser.cost  # (no timing of other buckets: not what is tested here)
    reported = []
    monkeypatch.setattr(AutoBudget, "observe_step",
                        lambda self, size, seconds, drafting, catch_up, budget: reported.append((size, seconds)))
    out = target.generate(prompts, assistant_model=drafter, max_new_tokens=24, do_sample=False)
    assert out.tolist() == reference.tolist()
    stats = drafter.last_stats
    assert len(reported) == stats.target_forwards and all(seconds > 0 for _, seconds in reported)
    # the steps verify 3 rows' trees while every row lives (24 tokens each: no row finishes early)
    per_step = [max(stats.nodes_per_iteration[3 * i : 3 * i + 3]) for i in range(stats.target_forwards)]
    assert [size for size, _ in reported] == per_step
    assert sum(seconds for _, seconds in reported) < stats.total_time_s - stats.drafter_time_s


def test_a_chooser_that_does_not_draft_explores_where_the_drafter_would_draft():
    """Chosen 0, the explorations alternate between the next rung (free candidates or the smallest tree) and the
    rung above the drafter's best budget, so tau(8) and tau(16) - what decides whether drafting pays - are measured
    again at every second exploration instead of every eighth."""
    cost = TargetCost([0, 2, 4, 8, 16], [0.10, 0.10, 0.10, 0.11, 0.30])  # 8 is the drafter's best, 16 is too slow
    chooser = AutoBudget([0, 2, 4, 8, 16], cost, warmup=0)
    for _ in range(4):
        chooser.observe(chain_tree(16), list(range(1, 6)), drafting_seconds=0.6, budget=16)  # 6 tokens / 0.71 s
    assert chooser.choose() == 0 and chooser._best(drafting_only=True) == 8
    chooser.set_batch_size(1)
    explored = [b for b in (chooser.next_budget(explore_interval=2, explore_share=1.0) for _ in range(64)) if b]
    assert explored[:6] == [2, 16, 2, 16, 2, 16]


def test_exploring_takes_at_most_its_share_of_the_time():
    """Where an exploring tree costs several plain steps (float32 on a CPU), explorations wait beyond the interval
    until the steps since the previous one took 1 / share times the exploration's extra seconds."""
    cost = TargetCost([0, 8], [0.10, 0.30])  # an 8-node tree costs 3 plain steps
    chooser = AutoBudget([0, 8], cost, warmup=0)
    for _ in range(4):
        chooser.observe(chain_tree(8), [1], drafting_seconds=0.1, budget=8)  # 2 tokens / 0.4 s
    assert chooser.choose() == 0 and chooser.seconds(8) == pytest.approx(0.40) and chooser.seconds(0) == 0.10
    chooser.set_batch_size(1)
    chosen = [chooser.next_budget(explore_interval=4, explore_share=0.05) for _ in range(200)]
    # an exploration costs 0.3 s beyond a 0.1 s step: at 5% of the time, one every 60 steps (not every 4th)
    assert [i + 1 for i, b in enumerate(chosen) if b] == [60, 120, 180]
    chooser.steps, chooser.explored_at = 0, 0
    assert sum(1 for _ in range(64) if chooser.next_budget(explore_interval=4, explore_share=1.0)) == 16


def test_an_exploration_that_took_longer_than_expected_waits_longer():
    """An idle drafter catches up on every skipped position before its exploring tree: what exploring steps really
    took (beyond a step at the choice) spaces the next ones out when it exceeds what the estimates expect."""
    cost = TargetCost([0, 8], [0.10, 0.12])
    chooser = AutoBudget([0, 8], cost, warmup=0)
    for _ in range(4):
        chooser.observe(chain_tree(8), [], drafting_seconds=0.02, budget=8)  # tau 1
    chooser.set_batch_size(1)
    chosen = [chooser.next_budget(explore_interval=4, explore_share=0.05) for _ in range(12)]
    assert [i + 1 for i, b in enumerate(chosen) if b] == [8]  # 0.04 s beyond a 0.1 s step: 8 steps at 5%
    chooser.observe_step(8, 0.15, drafting_seconds=0.35)  # the exploring step really took 0.5 s (catching up)
    assert chooser.exploration_extra.median(chooser.clock) == pytest.approx(0.4)
    chosen = [chooser.next_budget(explore_interval=4, explore_share=0.05) for _ in range(100)]
    assert [i + 13 for i, b in enumerate(chosen) if b] == [8 + 80]  # 0.4 s beyond: 80 steps after step 8 at 5%


def test_an_exploration_pays_for_the_positions_the_drafter_has_not_read():
    """A catch-up read teaches the drafter's seconds per position (apart from the exploring tree's extra): the next
    exploration is charged for every position then unread, so a new call's first one waits until the steps since
    can pay for reading its prompt; every `explore_interval / explore_share` steps one comes whatever it costs."""
    cost = TargetCost([0, 8], [0.10, 0.12])
    chooser = AutoBudget([0, 8], cost, warmup=0)
    for _ in range(4):
        chooser.observe(chain_tree(8), [], drafting_seconds=0.02, budget=8)  # tau 1: budget 0 is best
    chooser.set_batch_size(1)
    chosen = [chooser.next_budget(explore_interval=8, explore_share=0.05, unread=200) for _ in range(12)]
    assert [i + 1 for i, b in enumerate(chosen) if b] == [8]  # no reading cost learnt yet: as before
    chooser.observe_step(8, 0.12, drafting_seconds=0.42, catch_up=(200, 0.4))  # 2 ms per position read
    assert chooser.reading.mean(chooser.clock) == pytest.approx(0.002)
    assert chooser.exploration_extra.median(chooser.clock) == pytest.approx(0.04)  # the tree's extra alone
    chosen = [chooser.next_budget(explore_interval=8, explore_share=0.05, unread=1) for _ in range(100)]
    assert [i + 13 for i, b in enumerate(chosen) if b][:1] == [8 + 9]  # 0.042 s beyond: 9 steps at 5%
    chooser.steps = chooser.explored_at = 0
    chosen = [chooser.next_budget(explore_interval=8, explore_share=0.05, unread=200) for _ in range(100)]
    assert [i + 1 for i, b in enumerate(chosen) if b][:1] == [88]  # 0.44 s beyond: 88 steps at 5%
    chooser.steps = chooser.explored_at = 0
    chosen = [chooser.next_budget(explore_interval=8, explore_share=0.05, unread=10**6) for _ in range(200)]
    assert [i + 1 for i, b in enumerate(chosen) if b] == [160]  # overdue: 8 / 0.05 steps


def test_an_exploration_to_budget_zero_is_not_charged_for_reading():
    """From a plain step (`PLAIN`: not even the free candidates), the next rung is budget 0, which runs no drafter: it
    reads nothing, so the positions the drafter has not read do not delay it (else a chooser at `PLAIN` would stop
    measuring the free candidates on long prompts)."""
    cost = TargetCost([0, 8], [0.10, 0.12])
    chooser = AutoBudget([0, 8], cost, warmup=0, free_at_zero=True)
    for _ in range(4):
        chooser.observe(chain_tree(8), [], drafting_seconds=0.02, budget=8)  # the drafter's trees: tau 1
        chooser.observe_free(chain_tree(4), [], seconds=0.01)  # the free candidates': tau 1, and they cost time
    chooser.set_batch_size(1)
    chooser.observe_step(8, 0.12, drafting_seconds=0.42, catch_up=(200, 0.4))  # 2 ms per position read
    assert chooser.choose() == PLAIN
    chosen = [chooser.next_budget(explore_interval=8, explore_share=0.05, unread=10_000) for _ in range(12)]
    assert chosen[7] == 0 and chosen.count(PLAIN) == 11  # step 8 explores budget 0, the unread positions aside


def test_a_drafting_exploration_too_dear_gives_way_to_the_next_rung():
    """At `PLAIN`, every second exploration drafts (a rung above the drafter's best); where its catch-up makes it
    too dear, budget 0 (the free candidates, no drafter call) is explored instead of nothing, so a chooser stuck at
    plain steps by a long prompt still measures the free candidates."""
    cost = TargetCost([0, 8], [0.10, 0.12])
    chooser = AutoBudget([0, 8], cost, warmup=0, free_at_zero=True)
    for _ in range(4):
        chooser.observe(chain_tree(8), [], drafting_seconds=0.02, budget=8)
        chooser.observe_free(chain_tree(4), [], seconds=0.01)
    chooser.set_batch_size(1)
    chooser.observe_step(8, 0.12, drafting_seconds=0.42, catch_up=(200, 0.4))
    chooser.explorations = 1  # the next one would draft (up = 2)
    chosen = [chooser.next_budget(explore_interval=8, explore_share=0.05, unread=10_000) for _ in range(8)]
    assert chosen[7] == 0 and chooser.explorations == 2  # budget 0 instead of budget 8 and its 20 s catch-up


def test_a_tree_step_that_looks_expensive_can_still_be_measured_again():
    """Were a tree step's overhead estimate inflated (a burst of load while tree steps were timed), `worth_verifying`
    would cut every tree to the root and no tree step would ever refresh that estimate: tau fell to 1.00 for good on
    a loaded machine. An exploring step verifies its tree whole."""
    chooser = AutoBudget([0, 2, 16], TargetCost([0, 16], [0.10, 0.12]), warmup=0)
    for _ in range(4):
        chooser.observe(chain_tree(16), list(range(1, 5)), drafting_seconds=0.01, budget=16)  # tau 5
    chooser.set_batch_size(1)
    for _ in range(4):
        chooser.observe_step(16, 10.0)  # tree steps timed during a burst: 9.9 s beyond the curve
    tree = chain_tree(16)
    assert chooser.worth_verifying([tree])[0].num_drafted == 0  # cut to the root
    chooser.explored_from = 0  # an exploring step (`next_budget` sets it until the step is timed)
    assert chooser.worth_verifying([tree])[0].num_drafted == 16  # verified whole


def test_speculating_must_promise_the_minimum_gain_over_plain_decoding():
    """A tree that promises 3% more tokens per second than plain decoding is not worth the risk (the estimates are
    noisy): with min_gain 0.05 the chooser decodes plainly; one that promises 10% is drafted."""
    curve = TargetCost([0, 4], [0.100, 0.150])
    cost = lambda b: curve(max(b, 0))  # noqa: E731  (a plain step: the curve at 0 nodes)
    assert best_budget({0: 1.0, 4: 1.545}, cost) == 4  # 1.03 x plain
    assert best_budget({0: 1.0, 4: 1.545}, cost, min_gain=0.05) == 0
    assert best_budget({0: 1.0, 4: 1.65}, cost, min_gain=0.05) == 4  # 1.10 x plain
    # with free candidates, PLAIN is the option that does not speculate: budget 0 must beat it too
    assert best_budget({0: 1.02}, cost, plain=True) == 0
    assert best_budget({0: 1.02}, cost, plain=True, min_gain=0.05) == PLAIN
    target = make_target("llama", vocab_size=24, seed=2)
    assert auto_budget_for(make_drafter(target, tree_budget="auto"), target).min_gain == 0.05  # the config's
    with pytest.raises(ValueError, match="auto_budget_min_gain"):
        make_drafter(target, tree_budget="auto", auto_budget_min_gain=-0.1)


def _drafter_and_lookup_tree() -> DraftTree:
    """The drafter's chain 5 -> 6 -> 9 -> 10 (nodes 1-4) with prompt lookup's 5 -> 7 merged in (node 1 proposed by
    both, node 5 by the lookup alone)."""
    tree = DraftTree.root_only(0)
    tree.add_nodes(torch.tensor([5, 6, 9, 10]), torch.tensor([0, 1, 2, 3]), torch.tensor([1, 2, 3, 4]),
                   torch.tensor([-0.1, -0.2, -0.3, -0.4]))  # fmt: skip
    tree.merge_chain([5, 7], [-0.1, -0.5], "prompt_lookup")
    return tree


def _free_alone(tau: float, nodes: int = 2) -> FreeShadow:
    """A free candidates' tree of `nodes` nodes that would have committed `tau` tokens."""
    shadow = FreeShadow(chain_tree(nodes).host())
    shadow.tau = tau
    return shadow


def test_the_free_part_of_a_drafted_tree_is_the_tree_the_free_candidates_alone_build():
    tree = _drafter_and_lookup_tree().host()
    assert tree.sources[1] == 1 | 2 and tree.sources[5] == 2
    free = tree.free_part()
    assert (free.tokens, free.parents, free.depths) == ([0, 5, 7], [-1, 0, 1], [0, 1, 2])
    alone = HostTree.root_only(0)
    alone.merge_chain([5, 7], [-0.1, -0.5], "prompt_lookup")
    assert (alone.tokens, alone.parents, alone.scores) == (free.tokens, free.parents, free.scores)


def test_a_free_shadow_follows_the_committed_text_until_it_leaves_the_tree():
    """Budget 0's tree at a drafted step commits its path the text matched plus the target's own next token; a tree
    the step's tokens do not leave waits for the next step's."""
    tree = HostTree.root_only(0)
    tree.merge_chain([5, 7, 8], [-0.1, -0.2, -0.3], "prompt_lookup")
    tree.merge_chain([5, 9], [-0.1, -0.4], "ngram_cache")
    assert FreeShadow(tree).follow([6, 5]) and FreeShadow(tree).follow([6]) is True
    left_at_once = FreeShadow(tree)
    left_at_once.follow([6, 5, 7])
    assert left_at_once.tau == 1.0  # the bonus token alone
    branch = FreeShadow(tree)
    assert branch.follow([5, 9, 3]) and branch.tau == 3.0  # the second branch, then the bonus
    waiting = FreeShadow(tree)
    assert not waiting.follow([5, 7]) and waiting.tau is None  # the step accepted less than the lookup had
    assert not waiting.follow([8]) and waiting.follow([2, 4]) and waiting.tau == 4.0


def test_drafted_steps_tell_what_the_free_candidates_alone_would_have_committed():
    """Every drafted step also measures budget 0 (the free candidates' tree alone, scored against the text the target
    committed), so where a larger batch makes the drafter's trees too dear the chooser falls to the free
    candidates' trees, not to plain steps it would pick knowing nothing of them."""
    tree = _drafter_and_lookup_tree()
    costs = {1: TargetCost([0, 8], [0.10, 0.12]), 2: TargetCost([0, 8], [0.15, 0.30]),
             4: TargetCost([0, 8], [0.20, 0.80])}  # fmt: skip

    def chooser_after_drafting(with_free_alone: bool) -> AutoBudget:
        chooser = AutoBudget([0, 8], costs[1], warmup=0, free_at_zero=True, min_gain=0.05, measure=costs.__getitem__)
        for _ in range(8):  # the drafter's chain is accepted whole: 5 tokens per tree; the lookup alone: 2
            chooser.observe(tree, [1, 2, 3, 4], drafting_seconds=0.1, budget=8)
            chooser.observe_free_alone([_free_alone(2.0)] if with_free_alone else [])
        return chooser

    chooser = chooser_after_drafting(with_free_alone=True)
    assert chooser.estimates() == {0: 2.0, 8: 5.0} and chooser.free_size.mean(chooser.clock) == 2.0
    chooser.set_batch_size(1)
    assert chooser.choose() == 8  # 5 / (0.1125 + 0.1) beats 2 / 0.105 and 1.05 / 0.10
    chooser.set_batch_size(4)
    assert chooser.choose() == 0  # drafting 4 x 0.1: 2 / 0.275 beats 5 / (0.575 + 0.4) and 1.05 / 0.20
    unaware = chooser_after_drafting(with_free_alone=False)
    unaware.set_batch_size(4)
    assert unaware.estimates()[0] == 1.0 and unaware.choose() == PLAIN
    # where their trees commit the bonus alone, plain steps win: the lookups cost time of their own
    for _ in range(64):
        chooser.observe_free_alone([_free_alone(1.0)])
        chooser.clock += 1
    chooser.observe_free(chain_tree(2), [], seconds=0.01)
    assert chooser.estimates()[0] == 1.0 and chooser.choose() == PLAIN


def test_the_free_alone_estimate_is_exact_against_the_committed_text(monkeypatch):
    """In a real call every resolved budget-0 sample of a drafted step equals what its tree's best path matches of
    the text the target went on to commit (found here by brute force from the call's output), plus one; float32
    greedy, so the output is the target's own. A lookup tree (no drafter) adds none: its budget-0 steps are real.
    The shadows are kept whole here (this checks how they are scored, not how they are sized): sized by the tiny
    target's cost curve, most would be cut to their root."""
    monkeypatch.setattr(AutoBudget, "free_alone_tree", lambda self, tree: tree)
    target = make_target("llama", vocab_size=24, seed=3)
    prompt = torch.tensor([[1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3, 7, 1, 2, 3, 4, 5]])
    drafter = make_drafter(target, tree_budget="auto", auto_budget_candidates=[0, 8], auto_budget_warmup=1000,
                           prompt_lookup_num_tokens=4, ngram_cache_num_tokens=3)  # fmt: skip
    seen: list[tuple[int, FreeShadow]] = []
    original = TreeCandidateGenerator.draft_tree

    def draft_tree(self, sequence, with_drafter=True):
        tree = original(self, sequence, with_drafter)
        if with_drafter and self.shadows:
            seen.append((sequence.shape[0], self.shadows[-1]))
        return tree

    TreeCandidateGenerator.draft_tree = draft_tree
    try:
        out = target.generate(prompt, assistant_model=drafter, max_new_tokens=24, do_sample=False)[0].tolist()
    finally:
        TreeCandidateGenerator.draft_tree = original
    assert out == target.generate(prompt, max_new_tokens=24, do_sample=False)[0].tolist()
    chooser = drafter.serving_state().auto_budget
    resolved = [(length, shadow) for length, shadow in seen if shadow.tau is not None]
    assert len(seen) == chooser.trees == drafter.last_stats.iterations and chooser.free_tau.count == len(resolved)
    assert len(resolved) >= len(seen) - 2 and any(shadow.tau > 1 for _, shadow in resolved)

    def best_match(tree: HostTree, text: list[int]) -> int:
        depth = {0: 0}
        for node in range(1, len(tree)):
            parent = tree.parents[node]
            if parent in depth and depth[parent] < len(text) and text[depth[parent]] == tree.tokens[node]:
                depth[node] = depth[parent] + 1
        return max(depth.values())

    for length, shadow in resolved:
        assert shadow.tau == best_match(shadow.tree, out[length:]) + 1
    lookup = LookupTreeModel.from_target(target, tree_budget="auto", auto_budget_candidates=[0, 8],
                                         auto_budget_warmup=1000)  # fmt: skip
    target.generate(prompt, assistant_model=lookup, max_new_tokens=12, do_sample=False)
    assert lookup.serving_state().auto_budget.free_tau.count == 0


def test_the_free_alone_trees_are_sized_as_after_the_warm_up_while_warming_up():
    """Budget 0's estimates are for the steps after the warm-up, which verify the free candidates' tree cut to what
    pays: a shadow measured whole while warming up would make budget 0 look dearer (and commit more) than it will."""
    chooser = AutoBudget([0, 8], TargetCost([0, 8], [1.0, 1.8]), warmup=8, free_at_zero=True)  # 0.1 step a node
    tree = HostTree.root_only(0)
    tree.merge_chain([5, 6, 7, 8], [-0.1, -0.2, -3.0, -4.0], "prompt_lookup")  # two likely nodes, two unlikely
    assert chooser.trees < chooser.warmup and chooser.free_alone_tree(tree).num_drafted == 2
    chooser.trees = chooser.warmup
    assert chooser.free_alone_tree(tree).num_drafted == 2


def test_plain_steps_keep_measuring_the_free_candidates_alone(monkeypatch):
    """While plain steps are chosen, every `PLAIN_SHADOW_INTERVAL`-th one scores the free candidates' tree alone
    against the text the target commits, with no drafter call: budget 0's estimate stays fresh (a text that starts to
    repeat brings the free candidates back) at the cost of their lookups alone; the output stays the target's own."""
    monkeypatch.setattr(AutoBudget, "free_alone_tree", lambda self, tree: tree)  # whole: scoring, not sizing
    monkeypatch.setattr(AutoBudget, "next_budget", lambda self, *args, **kwargs: PLAIN)
    target = make_target("llama", vocab_size=24, seed=3)
    prompt = torch.tensor([[1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3, 7, 1, 2, 3, 4, 5]])
    drafter = make_drafter(target, tree_budget="auto", auto_budget_candidates=[0, 8], prompt_lookup_num_tokens=4,
                           ngram_cache_num_tokens=3)  # fmt: skip
    out = target.generate(prompt, assistant_model=drafter, max_new_tokens=24, do_sample=False)
    assert out.tolist() == target.generate(prompt, max_new_tokens=24, do_sample=False).tolist()
    stats, chooser = drafter.last_stats, drafter.serving_state().auto_budget
    assert stats.drafter_forwards == 0 and stats.tau == 1.0 and stats.iterations == 23  # plain steps only
    assert chooser.free_tau.count in (23 // PLAIN_SHADOW_INTERVAL - 1, 23 // PLAIN_SHADOW_INTERVAL)  # last: unresolved
    assert chooser.free_size.mean(chooser.clock) > 0


def test_a_drafting_chooser_keeps_measuring_the_free_candidates_alone():
    """A drafting choice tries budget 0 (the free candidates alone) every `explore_interval` steps on a clock of its
    own, so their own steps (and seconds) are measured beside what the drafted steps tell of them."""
    tree = _drafter_and_lookup_tree()
    chooser = AutoBudget([0, 8], TargetCost([0, 8], [0.10, 0.12]), warmup=0, free_at_zero=True, keep=4)
    for _ in range(8):  # the drafter's chain accepted whole; the free candidates alone would have committed 2
        chooser.observe(tree, [1, 2, 3, 4], drafting_seconds=0.01, budget=8)
        chooser.observe_free_alone([_free_alone(2.0)])
    chosen = [chooser.next_budget(explore_interval=4, explore_share=1.0) for _ in range(16)]
    assert chosen.count(0) == 4 and all(chosen[i] == 0 for i in (3, 7, 11, 15))  # every 4th step: the free alone
    chooser.observe_free(chain_tree(3), [1, 2, 3], seconds=0.001)  # one of their own steps: 4 tokens
    assert chooser.estimates()[0] == (8 * 2.0 + 4.0) / 9 and chooser.free_seconds.count == 1


def test_a_chosen_budget_is_weighed_by_what_its_steps_took():
    """Once a budget was chosen `keep` times, its steps' measured seconds (drafting and short catch-ups included;
    a long read, a prompt's, and exploring steps left out) replace the model's estimate: a drafter whose steps
    take longer than its steady drafting time says (it catches up after skipped steps) gives way to budget 0."""
    chooser = AutoBudget([0, 8], TargetCost([0, 8], [0.10, 0.12]), warmup=0, keep=4)
    for _ in range(4):
        chooser.observe(chain_tree(8), [1], drafting_seconds=0.01, budget=8)  # tau 2 at budget 8
    assert chooser.seconds(8) == pytest.approx(0.13) and chooser.choose() == 8  # the model: 2 / 0.13 beats 1 / 0.10
    chooser.explored_from = 0  # an exploring step is not what choosing the budget costs
    chooser.observe_step(8, 0.5, drafting_seconds=0.5, budget=8)
    assert not chooser.step_time
    for _ in range(4):  # each chosen step took 0.25 s in all, and one of them also read a prompt for 1 s
        chooser.observe_step(8, 0.12, drafting_seconds=0.13, budget=8)
    chooser.observe_step(8, 0.12, drafting_seconds=1.13, catch_up=(40, 1.0), budget=8)
    assert chooser.seconds(8) == pytest.approx(0.25) and chooser.choose() == 0  # 2 / 0.25 < 1 / 0.10


def test_what_a_budget_took_long_ago_gives_way_to_the_model():
    """A drafting budget's measured step times (`step_time`) are refreshed only while it is chosen. Steps that were
    slow once (a loaded machine, a drafter catching up) must not keep it from being chosen for good: once they are
    older than the chooser's window, the model (kept current by the explorations) judges it again, and where it
    pays the chooser drafts with it again, and measures it anew."""
    chooser = AutoBudget([0, 8], TargetCost([0, 8], [0.10, 0.12]), warmup=0, keep=4, window=64)

    def step(drafting: float, accepted: int) -> int:  # one verified step as the decoding loop reports it
        budget = chooser.next_budget(explore_interval=16, explore_share=1.0)
        if budget:  # the drafter's steady time is 0.01 s; `drafting` is what this step's drafting took in all
            chooser.observe(chain_tree(8), list(range(1, accepted + 1)), drafting_seconds=0.01, budget=8)
            chooser.observe_step(8, 0.12, drafting_seconds=drafting, budget=budget)
        else:
            chooser.observe_step(0, 0.10, budget=budget)
        return budget

    for _ in range(4):  # drafted steps took 0.25 s in all: plain decoding wins (2 tokens / 0.25 s < 1 / 0.10 s)
        assert step(0.13, accepted=1) == 8
    assert chooser.choose() == 0
    # from now on a drafted step takes 0.13 s and commits 2.4 tokens on average: 2.4 / 0.13 s beats 1 / 0.10 s
    taken = [step(0.01, accepted=1 + (i % 5 < 2)) for i in range(300)]
    assert chooser.choose() == 8 and taken[-100:].count(8) >= 90
    assert chooser.seconds(8) == pytest.approx(0.13)
