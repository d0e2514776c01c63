"""Choosing the tree budget for the hardware (`tree_budget="auto"`).

Throughput is tau(B) / (T_M(B) + T_D): tau grows with the verified tree size B while the target's forward cost
T_M(B) grows too — slowly on a GPU, steeply on a CPU. `TargetCost` times the target's forward once per model and
device; `AutoBudget` learns tau(B) for every candidate B from the trees actually verified (a tree pruned to B keeps
its top-B nodes by score, so the accepted path is cut where its first node falls outside them) and picks the best.

Budget 0 means "do not speculate": the target decodes one token per forward and the drafter is not run at all
(tau = 1, no drafting time). It wins where no tree pays for its drafting and verification, e.g. a weak drafter on a
CPU; the choice then holds for the rest of the drafter's life (nothing is drafted that could change it).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from .tree import DraftTree, tree_verification_mask
from .verification import truncate_cache

AUTO = "auto"
DEFAULT_CANDIDATES = (0, 2, 4, 8, 16, 24, 32, 48, 64)


def check_tree_budget(value: int | str) -> None:
    """A tree budget is a positive int or "auto"."""
    if value != AUTO and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f'tree_budget must be a positive int or "auto", got {value!r}.')


_COST_CACHE: "weakref.WeakKeyDictionary[PreTrainedModel, dict[str, TargetCost]]" = weakref.WeakKeyDictionary()


@dataclass
class TargetCost:
    """Measured seconds of one target forward verifying `sizes[i]` drafted nodes (+ the root)."""

    sizes: list[int]
    seconds: list[float]

    def __call__(self, size: int) -> float:
        """Piecewise-linear interpolation (flat extrapolation) of the measured curve."""
        sizes, secs = self.sizes, self.seconds
        if size <= sizes[0]:
            return secs[0]
        for (s0, t0), (s1, t1) in zip(zip(sizes, secs), zip(sizes[1:], secs[1:])):
            if size <= s1:
                return t0 + (t1 - t0) * (size - s0) / (s1 - s0)
        return secs[-1] + (secs[-1] - secs[-2]) / (sizes[-1] - sizes[-2]) * (size - sizes[-1])


@torch.no_grad()
def measure_target_cost(
    target: PreTrainedModel, sizes: list[int], context_length: int = 256, repeats: int = 3
) -> TargetCost:
    """Time the target verifying chains of each size after a `context_length` cache (min over repeats), cached per
    model and device. Size 0 is a plain decoding step (the root token alone)."""
    key = f"{target.device}:{context_length}:{sorted(sizes)}"
    per_model = _COST_CACHE.setdefault(target, {})
    if key in per_model:
        return per_model[key]
    vocab = target.get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (1, context_length), generator=generator).to(target.device)
    cache = DynamicCache()
    target(context, past_key_values=cache, use_cache=True)
    seconds = []
    for size in sorted(sizes):
        tree = DraftTree.root_only(0, target.device)
        tree.add_nodes(
            torch.randint(0, vocab, (size,), generator=generator), torch.arange(size), torch.arange(1, size + 1),
            -torch.arange(1.0, size + 1),
        )  # fmt: skip
        mask = tree_verification_mask(tree, torch.ones(context_length, dtype=torch.bool), target.dtype)
        best = float("inf")
        for _ in range(repeats + 1):  # the first call warms up kernels and allocator
            _sync(target.device)
            start = time.perf_counter()
            target(
                tree.tokens[None], attention_mask=mask.to(target.device), past_key_values=cache, use_cache=True,
                position_ids=(context_length + tree.depths)[None],
            )  # fmt: skip
            _sync(target.device)
            best = min(best, time.perf_counter() - start)
            truncate_cache(cache, context_length)  # back to the context for the next timing
        seconds.append(best)
    # timing noise only ever adds time, and a larger tree never costs less: keep the cheapest of every larger size
    seconds = [min(seconds[i:]) for i in range(len(seconds))]
    per_model[key] = TargetCost(sorted(sizes), seconds)
    return per_model[key]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_budget(tau: dict[int, float], cost: TargetCost, drafting_seconds: float) -> int:
    """The budget B maximising tau(B) / (T_M(B) + T_D), where budget 0 (no speculation) drafts nothing."""
    return max(tau, key=lambda b: tau[b] / (cost(b) + (drafting_seconds if b else 0.0)))


@dataclass
class AutoBudget:
    """Learns tau(B) for candidate budgets from verified trees; picks the best once `warmup` trees were seen."""

    candidates: list[int]
    cost: TargetCost
    warmup: int = 8
    accepted: dict[int, float] = field(default_factory=dict)  # sum of committed tokens per candidate budget
    drafting_seconds: float = 0.0
    trees: int = 0

    @property
    def largest(self) -> int:
        return max(self.candidates)

    def observe(self, tree: DraftTree, path: torch.LongTensor, drafting_seconds: float) -> None:
        """Record what each candidate budget would have committed for this verified tree and accepted `path`."""
        order = torch.sort(tree.scores, descending=True, stable=True).indices
        rank = torch.empty_like(order)
        rank[order] = torch.arange(len(tree), device=order.device)  # root has rank 0
        path_ranks = rank[path.to(rank.device)]  # [L]
        budgets = torch.tensor(self.candidates, device=rank.device)
        inside = path_ranks[None, :] <= budgets[:, None]  # [C, L]: each path node kept under each budget
        kept = torch.cumprod(inside.long(), dim=1).sum(dim=1).tolist()  # path cut at its first node outside
        for budget, count in zip(self.candidates, kept):
            self.accepted[budget] = self.accepted.get(budget, 0.0) + count + 1
        self.drafting_seconds += drafting_seconds
        self.trees += 1

    def choose(self) -> int:
        """The budget to draft with now: the largest while learning, then the best measured one (0 = stop
        speculating)."""
        if self.trees < self.warmup:
            return self.largest
        tau = {b: self.accepted[b] / self.trees for b in self.candidates}
        return best_budget(tau, self.cost, self.drafting_seconds / self.trees)
