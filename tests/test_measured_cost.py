"""`measure_target_cost` times real target forwards: exactly one warm-up + `repeats` timed verifications per tree
size after one context prefill, of the right shapes, keeps the fastest repeat, and turns timing noise into a curve
that never falls (a larger tree never costs less), cached per model and device. The clock is scripted (`clock=`), so
each number is exact."""

from __future__ import annotations

import itertools


import transformers_specblock.generation.target_cost as target_cost
from conftest import make_target


def test_measured_cost_counts_forwards_keeps_the_fastest_and_never_falls():
    target = make_target("llama", vocab_size=24)
    calls = []
    handle = target.register_forward_hook(lambda module, args, kwargs, out: calls.append(
        (kwargs.get("input_ids", args[0] if args else None)).shape[1]), with_kwargs=True)  # fmt: skip
    # raw durations per size (warm-up first, then 3 repeats): size 2 is noisy-slow, size 4 cheaper than size 3
    durations = {0: [9, 5, 4, 6], 2: [9, 8, 7, 9], 3: [9, 6, 6, 6], 4: [9, 5, 5, 9]}
    ticks = itertools.chain.from_iterable((0.0, d) for size in sorted(durations) for d in durations[size])
    clock = lambda: next(ticks)  # noqa: E731
    cost = target_cost.measure_target_cost(target, [4, 0, 3, 2], context_length=16, repeats=3, clock=clock)
    handle.remove()
    assert calls == [16] + [n + 1 for n in (0, 2, 3, 4) for _ in range(4)]  # prefill, then 4 forwards per size
    assert cost.sizes == [0, 2, 3, 4]
    # fastest of each size: 4, 7, 6, 5 -> then the cheapest of every larger size
    assert cost.seconds == [4, 5, 5, 5]
    assert target_cost.measure_target_cost(target, [0, 2, 3, 4], context_length=16, repeats=3) is cost  # cached


def test_trees_beyond_the_cap_are_not_timed_and_the_curve_goes_on_straight():
    """A first batched call must not time trees of thousands of tokens on a CPU: once a size costs more than
    `max_relative_cost` plain steps, the larger sizes are left out and the curve extrapolates its last segment."""
    target = make_target("llama", vocab_size=24)
    calls = []
    handle = target.register_forward_hook(lambda module, args, kwargs, out: calls.append(
        (kwargs.get("input_ids", args[0] if args else None)).shape[1]), with_kwargs=True)  # fmt: skip
    durations = {0: [2, 1, 1, 1], 4: [3, 2, 2, 2], 8: [6, 5, 5, 5]}  # size 8: 5 plain steps > 4
    ticks = itertools.chain.from_iterable((0.0, d) for size in sorted(durations) for d in durations[size])
    clock = lambda: next(ticks)  # noqa: E731
    cost = target_cost.measure_target_cost(target, [0, 4, 8, 16, 32], context_length=16, repeats=3, clock=clock)
    handle.remove()
    assert calls == [16] + [n + 1 for n in (0, 4, 8) for _ in range(4)]  # 16 and 32 never run
    assert cost.sizes == [0, 4, 8] and cost.seconds == [1, 2, 5]
    assert cost(16) == 5 + (5 - 2) / 4 * 8 and cost(32) == 5 + 3 / 4 * 24
