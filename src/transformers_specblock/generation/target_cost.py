"""The target's measured cost of verifying a tree (`tree_budget="auto"` weighs trees by it).

`measure_target_cost` times the target's forward over chains of each size after a cached context, once per model,
device and batch size, and (with a `cache_dir`) keeps the curve on disk per hardware, target architecture, dtype,
device and batch size, like an autotuning cache, so a new process does not time the target again; `TargetCost`
interpolates the curve; `batch_bucket` maps a live batch to its curve.
"""

from __future__ import annotations

import os
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import DynamicCache, PreTrainedModel

from ..utils import sync
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


_COST_CACHE: "weakref.WeakKeyDictionary[PreTrainedModel, dict[str, TargetCost]]" = weakref.WeakKeyDictionary()
COST_CACHE_FILE = "target-cost-curves.json"


@dataclass
class TargetCost:
    """Measured seconds of one target forward verifying `sizes[i]` drafted nodes (+ the root)."""

    sizes: list[int]
    seconds: list[float]

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
) -> TargetCost:  # fmt: skip
    """Time the target verifying chains of each size after a `context_length` cache in each of `batch_size` rows
    (min over repeats), cached per model, device and batch size. Size 0 is a plain decoding step (the root alone).
    Sizes above the first that costs more than `max_relative_cost` plain steps are not timed: where every verified
    token costs compute (a CPU, a large batch) the curve goes on as the straight line through its last two points, and
    a first batched call does not spend a minute timing trees of thousands of tokens. With `cache_dir` the curve is
    read from (or, once timed, added to) `cache_dir/target-cost-curves.json`."""
    key = f"{target.device}:{context_length}:{sorted(sizes)}:{batch_size}:{max_relative_cost}"
    per_model = _COST_CACHE.setdefault(target, {})
    if key in per_model:
        return per_model[key]
    disk_key = f"{hardware_fingerprint(target.device)}|{target_architecture_fingerprint(target)}|{target.dtype}|{key}"
    if cache_dir is not None:
        stored = read_json(Path(cache_dir) / COST_CACHE_FILE).get(disk_key)
        if stored is not None:
            per_model[key] = TargetCost(**stored)
            return per_model[key]
    vocab = target.get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (batch_size, context_length), generator=generator).to(target.device)
    cache = DynamicCache()
    target(context, past_key_values=cache, use_cache=True)
    visible = torch.ones(batch_size, context_length, dtype=torch.bool)
    seconds = []
    for size in sorted(sizes):
        tree = DraftTree.root_only(0, target.device)
        tree.add_nodes(
            torch.randint(0, vocab, (size,), generator=generator), torch.arange(size), torch.arange(1, size + 1),
            -torch.arange(1.0, size + 1),
        )  # fmt: skip
        trees = TreeBatch.pad([tree] * batch_size)
        mask = trees.attention_mask(visible, target.dtype).to(target.device)
        best = float("inf")
        for _ in range(repeats + 1):  # the first call warms up kernels and allocator
            sync(target.device)
            start = time.perf_counter()
            target(
                trees.tokens.to(target.device), attention_mask=mask, past_key_values=cache, use_cache=True,
                position_ids=(context_length + trees.depths).to(target.device),
            )  # fmt: skip
            sync(target.device)
            best = min(best, time.perf_counter() - start)
            truncate_cache(cache, context_length)  # back to the context for the next timing
        seconds.append(best)
        if best > max_relative_cost * seconds[0]:
            break
    # timing noise only ever adds time, and a larger tree never costs less: keep the cheapest of every larger size
    seconds = [min(seconds[i:]) for i in range(len(seconds))]
    per_model[key] = TargetCost(sorted(sizes)[: len(seconds)], seconds)
    if cache_dir is not None:
        path = Path(cache_dir) / COST_CACHE_FILE
        write_json(path, read_json(path) | {disk_key: asdict(per_model[key])})
    return per_model[key]


def batch_bucket(batch_size: int) -> int:
    """The batch size whose cost curve stands for `batch_size` live rows: the next power of two."""
    return 1 << (batch_size - 1).bit_length()
