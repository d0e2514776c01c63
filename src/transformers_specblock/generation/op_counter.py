"""Count what a GPU pays per decoding iteration: aten ops (one kernel launch or view each) and host syncs.

On a GPU a small model's step is bound by kernel launches and by the host waiting for the device, not by
arithmetic. Both are exact, noise-free counts on any CPU: `count_ops` wraps a `generate` call in a
`TorchDispatchMode` that sees every aten op, attributes it to the target's forward, to drafting (the candidate
generators' `read_queued` / `draft_tree`, or transformers' `get_candidates`) or to the rest of the loop (accept,
compact, commit), and counts the ops that make the host wait for the device (`SYNC_OPS`, boolean-mask indexing,
`Tensor.tolist` / `.cpu()` / `.numpy()`). Only the decoding loop is counted per iteration: everything up to the end
of the first target forward (the prompt's prefill and `generate`'s set-up) is kept apart as `setup`.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.generation import candidate_generator as hf_candidates

from .candidate_generators.base import TreeCandidateGenerator

REGIONS = ("target", "drafting", "loop")
"""Where an op of the decoding loop ran: inside the target's forward, inside drafting, or elsewhere in the loop."""

SYNC_OPS = {
    "aten::_local_scalar_dense",  # .item(), int(t), float(t), bool(t)
    "aten::nonzero",
    "aten::masked_select",
    "aten::unique_consecutive",
    "aten::_unique2",
    "aten::unique_dim",
}
"""aten ops whose output size or value the host must read back from the device (a device -> host sync)."""

SYNC_METHODS = {torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy}
"""Tensor methods that copy to the host (invisible to the dispatcher on a CPU, a sync on a GPU)."""

_MASK_INDEXED = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}


def _is_sync(name: str, func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether this aten call makes the host wait: see `SYNC_OPS`; a boolean-mask index (x[mask], x[mask] = v)
    is a `nonzero`; `repeat_interleave` with tensor repeats and no `output_size` must read the total back."""
    if name in SYNC_OPS:
        return True
    if name in _MASK_INDEXED and len(args) > 1:
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] or ())
    if func is torch.ops.aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    return False


@dataclass
class OpCounts:
    """Counts of one or more counted `generate` calls (`iterations` = target forwards after the prefill)."""

    iterations: int = 0
    ops: Counter = field(default_factory=Counter)  # region -> aten ops
    syncs: Counter = field(default_factory=Counter)  # region -> host syncs
    by_name: dict[str, Counter] = field(default_factory=lambda: {region: Counter() for region in REGIONS})
    setup_ops: int = 0  # before the end of the first target forward (prefill, `generate`'s set-up)
    target_forwards: int = 0

    def per_iteration(self) -> dict[str, float]:
        """aten ops and host syncs per iteration inside the target forward, in drafting, in the rest of the loop,
        and outside the target forward (drafting + loop)."""
        n = max(1, self.iterations)
        out = {f"{region}_ops": self.ops[region] / n for region in REGIONS}
        out |= {f"{region}_syncs": self.syncs[region] / n for region in REGIONS}
        out["outside_ops"] = out["drafting_ops"] + out["loop_ops"]
        out["outside_syncs"] = out["drafting_syncs"] + out["loop_syncs"]
        return out

    def top_outside(self, count: int = 10) -> list[tuple[str, float]]:
        """The most frequent aten ops outside the target forward, per iteration."""
        total = self.by_name["drafting"] + self.by_name["loop"]
        return [(name, ops / max(1, self.iterations)) for name, ops in total.most_common(count)]


class _Counter(TorchDispatchMode):
    def __init__(self, counts: OpCounts) -> None:
        super().__init__()
        self.counts = counts
        self.in_target = 0
        self.in_drafting = 0
        self.prefilled = False

    def region(self) -> str | None:
        if not self.prefilled:
            return None
        if self.in_target:
            return "target"
        return "drafting" if self.in_drafting else "loop"

    def add(self, name: str, sync: bool) -> None:
        region = self.region()
        if region is None:
            self.counts.setup_ops += 1
            return
        self.counts.ops[region] += 1
        self.counts.by_name[region][name] += 1
        if sync:
            self.counts.syncs[region] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        self.add(name, _is_sync(name, func, args, kwargs))
        return func(*args, **kwargs)


class _HostCopies(TorchFunctionMode):
    """Counts `SYNC_METHODS` calls (the dispatcher does not see `tolist` on a CPU)."""

    def __init__(self, counter: _Counter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNC_METHODS:
            self.counter.add(f"Tensor.{func.__name__}", sync=True)
        return func(*args, **(kwargs or {}))


def _drafting_entry_points() -> list[tuple[type, str]]:
    """Methods whose calls are drafting: our generators' and every transformers candidate generator's own."""
    points = [(TreeCandidateGenerator, "read_queued"), (TreeCandidateGenerator, "draft_tree")]
    pending = list(hf_candidates.CandidateGenerator.__subclasses__())
    while pending:
        cls = pending.pop()
        pending += cls.__subclasses__()
        if "get_candidates" in cls.__dict__ and not issubclass(cls, TreeCandidateGenerator):
            points.append((cls, "get_candidates"))
    return points


def _wrap_drafting(counter: _Counter, method: Callable) -> Callable:
    @functools.wraps(method)
    def drafting(*args: Any, **kwargs: Any) -> Any:
        counter.in_drafting += 1
        try:
            return method(*args, **kwargs)
        finally:
            counter.in_drafting -= 1

    return drafting


@contextmanager
def count_ops(target: torch.nn.Module, counts: OpCounts | None = None) -> Iterator[OpCounts]:
    """Count the aten ops and host syncs of the `generate` calls inside the block, per region (`REGIONS`).

    `target` is the model whose `generate` runs (its forward calls mark the target region; the first one ends the
    set-up). Pass the same `counts` again to add another call. The counting costs Python time per op: time nothing
    inside it.
    """
    counts = counts if counts is not None else OpCounts()
    counter = _Counter(counts)

    def enter_target(*_: Any) -> None:
        counter.in_target += 1

    def leave_target(*_: Any) -> None:
        counter.in_target -= 1
        counts.target_forwards += 1
        if counter.prefilled:
            counts.iterations += 1
        counter.prefilled = True

    with ExitStack() as stack:
        for cls, name in _drafting_entry_points():
            original = cls.__dict__[name]
            setattr(cls, name, _wrap_drafting(counter, original))
            stack.callback(setattr, cls, name, original)
        stack.callback(target.register_forward_pre_hook(enter_target).remove)
        stack.callback(target.register_forward_hook(leave_target).remove)
        stack.enter_context(counter)
        stack.enter_context(_HostCopies(counter))
        yield counts
