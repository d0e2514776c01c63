"""The target's measured cost of verifying a tree (`tree_budget="auto"` weighs trees by it).

`measure_target_cost` times the target's forward over chains of each size after a cached context, once per model,
device and batch size, and (with a `cache_dir`) keeps the curve on disk per hardware, target architecture, dtype,
device and batch size, like an autotuning cache, so a new process does not time the whole curve again; `TargetCost`
interpolates the curve; `batch_bucket` maps a live batch to its curve.

A curve on disk is checked against the machine now before it is trusted (`probe`): a new process times a plain step
and one tree of the stored sizes (a few forwards, not the whole curve), and where either runs more than
`PERSISTED_TOLERANCE` times faster than the stored curve says, the curve was timed on a busier machine (other work
shared its cores): it is measured again and replaces the stored one. A probe slower than the curve keeps it (the
machine is busy now, not slower for good: the curve is a best case, as each size's fastest repeat is, and the
chooser's measured step times follow the load of the moment). The probe's plain step stays on the curve
(`TargetCost.plain_now`), so a chooser's learnt state can be checked against the machine too (`AutoBudget.restore`).

Every timing reads `clock` (`time.perf_counter` unless given): tests drive it with scripted durations.
"""

from __future__ import annotations

import os
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from transformers import DynamicCache, PreTrainedModel

from ..utils import CACHE_ARGUMENT, sync
from .autotune_cache import hardware_fingerprint, read_json, target_architecture_fingerprint, write_json
from .cache_utils import truncate_cache
from .tree import DraftTree
from .tree_batch import TreeBatch

# Tree sizes always timed: one extra row can cost much more than a step on a CPU (a matrix-vector product becomes a
# matrix product), which interpolating between the candidates would hide, and small trees are common once
# `worth_verifying` sizes them.
SMALL_SIZES = {0, 1, 2, 3, 4}
BATCH_CONTEXT = 128  # cached positions per row when timing a batch (a shorter prefill: 16 rows x 256 took seconds)
MAX_RELATIVE_COST = 4.0  # larger trees are not timed once one costs this many plain steps (the curve extrapolates)
# a stored curve (or a chooser's learnt state) is not trusted where the machine now runs a probed step this many times
# faster than it did: timing noise on a quiet machine stays well within it, another process sharing the cores not
PERSISTED_TOLERANCE = 1.25


_COST_CACHE: "weakref.WeakKeyDictionary[PreTrainedModel, dict[str, TargetCost]]" = weakref.WeakKeyDictionary()
COST_CACHE_FILE = "target-cost-curves.json"


@dataclass
class TargetCost:
    """Measured seconds of one target forward verifying `sizes[i]` drafted nodes (+ the root)."""

    sizes: list[int]
    seconds: list[float]
    # the seconds of a plain step as this process timed it (the probe's, for a curve read from disk; None: the curve's
    # own first point): the machine's speed now, which a persisted chooser state is checked against
    plain_now: float | None = field(default=None, compare=False)

    def plain_seconds_now(self) -> float:
        """What a plain step took when this process timed one (`plain_now`, else the curve's own size-0 point)."""
        return self.plain_now if self.plain_now is not None else self.seconds[0]

    def __call__(self, size: int) -> float:
        """Piecewise-linear interpolation of the measured curve (flat below its first size, its last segment's line
        beyond its last)."""
        sizes, secs = self.sizes, self.seconds
        if size <= sizes[0]:
            return secs[0]
        for (s0, t0), (s1, t1) in zip(zip(sizes, secs), zip(sizes[1:], secs[1:])):
            if size <= s1:
                return t0 + (t1 - t0) * (size - s0) / (s1 - s0)
        return secs[-1] + (secs[-1] - secs[-2]) / (sizes[-1] - sizes[-2]) * (size - sizes[-1])


@torch.no_grad()
def measure_target_cost(
    target: PreTrainedModel, sizes: list[int], context_length: int = 256, repeats: int = 3, batch_size: int = 1,
    max_relative_cost: float = MAX_RELATIVE_COST, cache_dir: str | os.PathLike | None = None,
    clock: Callable[[], float] | None = None,
) -> TargetCost:  # fmt: skip
    """Time the target verifying chains of each size after a `context_length` cache in each of `batch_size` rows
    (min over repeats), cached per model, device and batch size. Size 0 is a plain decoding step (the root alone).
    Sizes above the first that costs more than `max_relative_cost` plain steps are not timed: where every verified
    token costs compute (a CPU, a large batch) the curve goes on as the straight line through its last two points, and
    a first batched call does not spend a minute timing trees of thousands of tokens. With `cache_dir` the curve is
    read from (or, once timed, added to) `cache_dir/target-cost-curves.json`; one read from there is first checked
    against the machine now (`probe`: a plain step and one tree size), and measured again where the machine now runs
    them more than `PERSISTED_TOLERANCE` times faster. `clock`: what timings read (default `time.perf_counter`)."""
    key = f"{target.device}:{context_length}:{sorted(sizes)}:{batch_size}:{max_relative_cost}"
    per_model = _COST_CACHE.setdefault(target, {})
    if key in per_model:
        return per_model[key]
    disk_key = f"{hardware_fingerprint(target.device)}|{target_architecture_fingerprint(target)}|{target.dtype}|{key}"
    path = Path(cache_dir) / COST_CACHE_FILE if cache_dir is not None else None
    timer = _ForwardTimer(target, context_length, batch_size, repeats, clock or time.perf_counter)
    stored = _stored_curve(read_json(path).get(disk_key)) if path is not None else None
    if stored is not None:
        probed = probe(stored, timer)
        if probed is not None:
            per_model[key] = probed
            return probed
    seconds = []
    for size in sorted(sizes):
        seconds.append(timer(size))
        if seconds[-1] > max_relative_cost * seconds[0]:
            break
    # timing noise only ever adds time, and a larger tree never costs less: keep the cheapest of every larger size
    seconds = [min(seconds[i:]) for i in range(len(seconds))]
    per_model[key] = TargetCost(sorted(sizes)[: len(seconds)], seconds)
    if path is not None:
        write_json(path, read_json(path) | {disk_key: {"sizes": per_model[key].sizes, "seconds": seconds}})
    return per_model[key]


def probe(stored: TargetCost, timer: Callable[[int], float]) -> TargetCost | None:
    """`stored` (a curve read from disk) where the machine now is not faster than when it was timed, with the probe's
    plain step as its `plain_now`; None where it is (the curve is to be measured again). The probe times a plain step
    and the middle one of the curve's tree sizes (`timer`: a size's fastest repeat) and compares each with the curve:
    more than `PERSISTED_TOLERANCE` times faster now means the curve was timed while other work shared the machine.
    Slower now is kept: the machine is busy now, and the curve stays its best case."""
    trees = [size for size in stored.sizes if size > 0]
    probed = {0: timer(0)}
    if trees:
        probed[trees[len(trees) // 2]] = timer(trees[len(trees) // 2])
    if any(stored(size) > PERSISTED_TOLERANCE * seconds for size, seconds in probed.items()):
        return None
    return TargetCost(stored.sizes, stored.seconds, plain_now=probed[0])


def _stored_curve(entry: object) -> TargetCost | None:
    """The curve a cache file's entry holds, or None where it holds none that can be read."""
    try:
        curve = TargetCost([int(s) for s in entry["sizes"]], [float(t) for t in entry["seconds"]])  # type: ignore[index]
    except (KeyError, TypeError, ValueError):
        return None
    return curve if curve.sizes and len(curve.sizes) == len(curve.seconds) else None


class _ForwardTimer:
    """Times the target verifying a chain of `size` drafted nodes after a `context_length` cache in each of
    `batch_size` rows: the fastest of `repeats` timed forwards after one that warms up kernels and the allocator. The
    context is prefilled once, on the first timing (a stored curve the probe confirms costs no prefill beyond it)."""

    def __init__(
        self, target: PreTrainedModel, context_length: int, batch_size: int, repeats: int, clock: Callable[[], float]
    ) -> None:
        self.target, self.context_length, self.batch_size = target, context_length, batch_size
        self.repeats, self.clock = repeats, clock
        self.vocab = target.get_input_embeddings().num_embeddings
        self.generator = torch.Generator().manual_seed(0)
        self.cache: DynamicCache | None = None

    def __call__(self, size: int) -> float:
        target, device = self.target, self.target.device
        if self.cache is None:
            context = torch.randint(0, self.vocab, (self.batch_size, self.context_length), generator=self.generator)
            self.cache = DynamicCache()
            target(context.to(device), use_cache=True, **{CACHE_ARGUMENT: self.cache})
        visible = torch.ones(self.batch_size, self.context_length, dtype=torch.bool)
        tree = DraftTree.root_only(0, device)
        tree.add_nodes(
            torch.randint(0, self.vocab, (size,), generator=self.generator), torch.arange(size),
            torch.arange(1, size + 1), -torch.arange(1.0, size + 1),
        )  # fmt: skip
        trees = TreeBatch.pad([tree] * self.batch_size)
        mask = trees.attention_mask(visible, target.dtype).to(device)
        best = float("inf")
        for _ in range(self.repeats + 1):  # the first call warms up kernels and allocator
            sync(device)
            start = self.clock()
            target(
                trees.tokens.to(device), attention_mask=mask, use_cache=True, **{CACHE_ARGUMENT: self.cache},
                position_ids=(self.context_length + trees.depths).to(device),
            )  # fmt: skip
            sync(device)
            best = min(best, self.clock() - start)
            truncate_cache(self.cache, self.context_length)  # back to the context for the next timing
        return best


def batch_bucket(batch_size: int) -> int:
    """The batch size whose cost curve stands for `batch_size` live rows: the next power of two."""
    return 1 << (batch_size - 1).bit_length()
