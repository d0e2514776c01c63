"""tree_budget="auto": the budget maximising tau / (T_M + T_D)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_drafter, make_target
from transformers_specblock.budget import AutoBudget, TargetCost, best_budget, check_tree_budget
from transformers_specblock.tree import DraftTree


def test_best_budget_on_synthetic_cpu_and_gpu_curves():
    tau = {4: 1.6, 8: 2.2, 16: 2.7, 32: 2.9, 64: 3.0}
    # a CPU-like cost: SmolLM2-135M measured 106 ms (1 token) .. 402 ms (64 tokens)
    cpu = TargetCost([4, 8, 16, 32, 64], [0.150, 0.193, 0.227, 0.300, 0.402])
    rates = {b: tau[b] / (cpu(b) + 0.02) for b in tau}
    assert best_budget(tau, cpu, 0.02) == max(rates, key=rates.get) == 16
    # a GPU-like flat cost: the biggest tree wins
    gpu = TargetCost([4, 64], [0.0100, 0.0101])
    assert best_budget(tau, gpu, 0.002) == 64
    assert cpu(12) == pytest.approx((0.193 + 0.227) / 2) and cpu(2) == 0.150


def test_auto_budget_counts_what_each_budget_would_have_accepted():
    tree = DraftTree.root_only(0)
    # scores: node1 -0.1, node2 -0.5, node3 (child of 1) -0.3, node4 (child of 3) -2.0
    tree.add_nodes(torch.tensor([5, 6, 7, 8]), torch.tensor([0, 0, 1, 3]), torch.tensor([1, 1, 2, 3]),
                   torch.tensor([-0.1, -0.5, -0.3, -2.0]))  # fmt: skip
    chooser = AutoBudget([1, 2, 3, 4], TargetCost([1, 4], [1.0, 1.0]), warmup=1)
    assert chooser.choose() == 4  # learning: the largest tree
    chooser.observe(tree, torch.tensor([1, 3, 4]), drafting_seconds=0.0)
    # ranks: node1 1, node3 2, node2 3, node4 4 -> budget 1 keeps 1 path node, 2 and 3 keep 2, 4 keeps 3
    assert chooser.accepted == {1: 2.0, 2: 3.0, 3: 3.0, 4: 4.0}
    assert chooser.choose() == 4  # equal costs: the most accepted


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


def test_auto_budget_in_generate_is_exact_and_picks_a_candidate():
    target = make_target("llama", vocab_size=24, seed=1)
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
    chooser = drafter._auto_budget
    assert chooser.trees == len(nodes) and chooser.choose() in {2, 4, 8, 16, 32}
    assert chooser.cost.seconds == sorted(chooser.cost.seconds)  # a monotone cost curve


def test_budget_zero_wins_when_no_tree_pays_for_itself():
    tau = {0: 1.0, 4: 1.3, 8: 1.35}
    cost = TargetCost([0, 4, 8], [0.100, 0.150, 0.190])  # a CPU: every drafted node costs verification time
    assert best_budget(tau, cost, drafting_seconds=0.04) == 0  # 1/0.10 beats 1.3/0.19 and 1.35/0.23
    assert best_budget({0: 1.0, 4: 2.5}, cost, drafting_seconds=0.04) == 4  # a good drafter pays for its tree


def test_auto_budget_zero_stops_drafting_and_stays_exact():
    target = make_target("llama", vocab_size=24, seed=2)
    drafter = make_drafter(target, tree_budget="auto", auto_budget_candidates=[0, 4], auto_budget_warmup=2)
    prompt = torch.randint(1, 24, (1, 6), generator=torch.Generator().manual_seed(2))
    reference = target.generate(prompt, max_new_tokens=24, do_sample=False)
    drafter.auto_budget(target).cost = TargetCost([0, 4], [0.01, 10.0])  # verifying a tree is prohibitively slow
    out = target.generate(prompt, assistant_model=drafter, max_new_tokens=24, do_sample=False)
    assert out.tolist() == reference.tolist()
    stats = drafter.last_stats
    assert min(stats.nodes_per_iteration[:2]) > 0 and set(stats.nodes_per_iteration[2:]) == {0}
    assert drafter._auto_budget.trees == 2  # nothing is learnt once drafting stopped
    forwards = stats.drafter_forwards
    target.generate(prompt, assistant_model=drafter, max_new_tokens=24, do_sample=False)
    assert set(drafter.last_stats.nodes_per_iteration) == {0} and drafter.last_stats.drafter_forwards == 0
    assert forwards > drafter.last_stats.drafter_forwards
