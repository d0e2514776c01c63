"""What `tree_budget="auto"` persists must not make a later process slower (issue 61).

A cost curve timed, and a chooser state learnt, while other work kept the machine busy are checked against the
machine now before they are trusted: a quiet process measures the curve again and starts the chooser afresh, so it
chooses as it would from an empty cache folder. The machine here is scripted (`ScriptedMachine`): every forward takes
a given time, `load` times slower while "busy", and the host's own load changes nothing.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from conftest import make_drafter, make_target
from scripted_clock import ScriptedMachine
from transformers_specblock.generation import auto_choosers, target_cost
from transformers_specblock.generation.auto_choosers import auto_budget_for, save_chooser
from transformers_specblock.generation.budget import AutoBudget
from transformers_specblock.generation.target_cost import COST_CACHE_FILE, TargetCost, measure_target_cost
from transformers_specblock.generation.tree import DraftTree

SIZES = [0, 1, 2, 4, 8]


def quiet(nodes: int) -> float:
    """The scripted target on a quiet machine: 10 ms a plain step, 0.5 ms more per verified node."""
    return 0.010 + 0.0005 * nodes


def new_process(monkeypatch) -> None:
    """What a new process finds: no cost curve in memory (the files on disk stay)."""
    monkeypatch.setattr(target_cost, "_COST_CACHE", weakref.WeakKeyDictionary())


def forwards_of(target) -> list[int]:
    counted: list[int] = []
    target.register_forward_pre_hook(lambda module, args: counted.append(1))
    return counted


def test_a_curve_timed_on_a_busy_machine_is_timed_again_on_a_quiet_one(tmp_path, monkeypatch):
    target = make_target("llama", vocab_size=24, seed=1)
    machine = ScriptedMachine(monkeypatch)
    machine.times_target(target, quiet)
    forwards = forwards_of(target)
    machine.load = 2.0  # another process shares the cores
    busy = measure_target_cost(target, SIZES, context_length=16, repeats=1, cache_dir=tmp_path)
    assert busy.seconds == pytest.approx([2 * quiet(n) for n in SIZES])

    new_process(monkeypatch)  # the machine is quiet again
    machine.load = 1.0
    again = measure_target_cost(target, SIZES, context_length=16, repeats=1, cache_dir=tmp_path)
    new_process(monkeypatch)
    empty = measure_target_cost(target, SIZES, context_length=16, repeats=1, cache_dir=tmp_path / "empty")
    assert again.seconds == pytest.approx(empty.seconds) and empty.seconds == pytest.approx([quiet(n) for n in SIZES])
    assert again.plain_seconds_now() == pytest.approx(quiet(0))

    # the next quiet process finds the quiet curve: a probe (a prefill, a plain step and one tree size, each once to
    # warm up and `repeats` times timed) confirms it, and it is not timed again
    new_process(monkeypatch)
    forwards.clear()
    kept = measure_target_cost(target, SIZES, context_length=16, repeats=1, cache_dir=tmp_path)
    assert kept == again and len(forwards) == 1 + 2 * 2

    # a process started while the machine is busy keeps the quiet curve (a best case), and knows the machine's now
    new_process(monkeypatch)
    machine.load = 2.0
    forwards.clear()
    loaded = measure_target_cost(target, SIZES, context_length=16, repeats=1, cache_dir=tmp_path)
    assert loaded == again and len(forwards) == 1 + 2 * 2
    assert loaded.plain_seconds_now() == pytest.approx(2 * quiet(0))
    assert (tmp_path / COST_CACHE_FILE).exists()


def chain_tree(length: int) -> DraftTree:
    tree = DraftTree.root_only(0)
    tree.add_nodes(torch.arange(1, length + 1), torch.arange(length), torch.arange(1, length + 1),
                   -0.1 * torch.arange(1.0, length + 1))  # fmt: skip
    return tree


def drive(chooser: AutoBudget, machine: ScriptedMachine, steps: int, drafting: float) -> list[int]:
    """`steps` verified steps as the decoding loop reports them, with given step times: the target's scripted cost
    at the nodes verified (times the machine's load) and `drafting` seconds of drafter time per drafted step; every
    drafted tree of 8 nodes commits 2 tokens. The budgets chosen."""
    chosen = []
    for _ in range(steps):
        budget = chooser.next_budget(explore_interval=16, explore_share=1.0)
        chosen.append(budget)
        nodes = 8 if budget > 0 else 0
        if nodes:
            chooser.observe(chain_tree(8), [1], drafting_seconds=drafting, budget=budget)
        chooser.observe_step(nodes, machine.load * quiet(nodes), drafting_seconds=drafting if nodes else 0.0,
                             budget=budget)  # fmt: skip
    return chosen


def test_a_chooser_state_learnt_on_a_busy_machine_does_not_slow_a_quiet_process(tmp_path, monkeypatch):
    """Learnt while the machine was busy (its drafter steps took 16 ms of drafting: 2 tokens in 60 ms against one in
    20 ms), the state says "do not draft". On the quiet machine a drafted step takes 16 ms (2 tokens, against one in
    10 ms): the next process chooses as a chooser from an empty cache does, and drafts."""
    target = make_target("llama", vocab_size=24, seed=1)
    machine = ScriptedMachine(monkeypatch)
    machine.times_target(target, quiet)
    settings = dict(tree_budget="auto", auto_budget_candidates=[0, 8], auto_budget_warmup=2)
    monkeypatch.setattr(auto_choosers, "default_cache_dir", lambda: tmp_path / "used")

    machine.load = 2.0
    busy = auto_budget_for(make_drafter(target, **settings), target)
    assert busy.cost.seconds[-1] == pytest.approx(2 * quiet(8))
    taken = drive(busy, machine, 40, drafting=0.032)
    assert taken[-8:].count(0) >= 7 and busy.choose() == 0  # busy: drafting did not pay
    save_chooser(busy)
    state = auto_choosers.read_json(busy.state_path)
    # were the state trusted (by a chooser of the busy machine), it would go on not drafting
    trusting = AutoBudget([0, 8], TargetCost(busy.cost.sizes, busy.cost.seconds), warmup=2, min_gain=0.05)
    trusting.restore(state)
    assert trusting.trees == busy.trees and trusting.choose() == 0

    machine.load = 1.0  # the machine is quiet: the next process
    new_process(monkeypatch)
    chooser = auto_budget_for(make_drafter(target, **settings), target)
    monkeypatch.setattr(auto_choosers, "default_cache_dir", lambda: tmp_path / "empty")
    new_process(monkeypatch)
    fresh = auto_budget_for(make_drafter(target, **settings), target)
    assert chooser.cost.seconds == pytest.approx(fresh.cost.seconds) and chooser.cost(8) == pytest.approx(quiet(8))
    assert chooser.trees == fresh.trees == 0 and chooser.choose() == fresh.choose() == 8
    assert drive(chooser, machine, 40, drafting=0.002) == drive(fresh, machine, 40, drafting=0.002)
    assert chooser.choose() == 8
    assert state["plain_step_seconds"] == pytest.approx(2 * quiet(0))  # what the busy state was checked by

    # what it learns on the quiet machine is kept for the next quiet process
    save_chooser(chooser)
    monkeypatch.setattr(auto_choosers, "default_cache_dir", lambda: tmp_path / "used")
    new_process(monkeypatch)
    again = auto_budget_for(make_drafter(target, **settings), target)
    assert (again.trees, again.clock, again.choose()) == (chooser.trees, chooser.clock, 8)


def test_a_state_that_does_not_say_on_what_machine_it_was_learnt_is_not_trusted():
    """A state saved before the machine's speed was kept with it (or any that does not hold one) may have been
    learnt on a busy machine: it is left out, and the chooser warms up as a new one does."""
    learnt = AutoBudget([0, 8], TargetCost([0, 8], [0.010, 0.014]), warmup=2)
    for _ in range(8):
        learnt.next_budget()
        learnt.observe(chain_tree(8), [1], drafting_seconds=0.002, budget=8)
    state = learnt.learnt_state()
    assert state["plain_step_seconds"] == 0.010
    chooser = AutoBudget([0, 8], TargetCost([0, 8], [0.010, 0.014]), warmup=2)
    assert not chooser.restore({k: v for k, v in state.items() if k != "plain_step_seconds"}) and chooser.trees == 0
    # within the tolerance (timing noise), or learnt on a quieter machine than this one is now: trusted
    for now in (0.0085, 0.020):
        chooser = AutoBudget([0, 8], TargetCost([0, 8], [0.010, 0.014], plain_now=now), warmup=2)
        assert chooser.restore(state) and chooser.trees == learnt.trees
    chooser = AutoBudget([0, 8], TargetCost([0, 8], [0.010, 0.014], plain_now=0.0075), warmup=2)
    assert not chooser.restore(state) and chooser.trees == 0
