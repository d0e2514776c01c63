"""What a drafter keeps while serving, held apart from its weights and architecture.

A `TreeDraftModel` holds weights and a config. What it learns or keeps while `generate` calls run lives in one
explicit object, `drafter.serving_states` (`ServingStates`):

* per drafter: whether a call is running now (one call at a time), the weights it was loaded with once online
  adaptation changed them, and the suffix cache's memory of served requests (bound to one target vocabulary);
* per target (`ServingState`, `drafter.serving_state(target)`), the target held weakly: the "auto" choosers and
  their measured cost curves, the free candidates' learnt source scores, online adaptation's state, and the drafter
  in the target's dtype and device where it differs from the drafter's own (a cast copy: serving never casts or
  moves the user's drafter).

None of it is a weight: `state_dict`, `save_pretrained`, `copy.deepcopy` and pickling leave it out (a copy starts
with empty serving state), and `drafter.reset_serving_state()` drops it.
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:  # the models layer only stores these; `generation` builds them
    from transformers import PreTrainedModel


class ServingState:
    """What one drafter keeps while serving one target (the target held weakly: deleting it frees this state).

    Attributes:
        auto_budgets: The `tree_budget="auto"` choosers (`generation.budget.AutoBudget`, with the target's measured
            cost curve), one per (device, candidate budgets, free-candidate settings).
        auto_budget: The chooser of the latest call (None before the first "auto" call).
        source_scores: The free candidates' learnt acceptance per source (`generation.lookup.SourceScores`), one
            per free-candidate settings.
        adaptation: Online adaptation's state (`generation.adaptation.OnlineAdapter`), or None.
        drafter: The drafter that drafts for the target, bound to it (`TreeDraftModel.serve` sets it).
    """

    def __init__(self, target: PreTrainedModel, owner: "ServingStates") -> None:
        self._target = weakref.ref(target)
        self.owner = owner  # the drafter's states this one belongs to (its suffix store, its loaded weights)
        self.auto_budgets: dict[tuple, Any] = {}
        self.auto_budget: Any = None
        self.source_scores: dict[Any, Any] = {}
        self.adaptation: Any = None
        self.drafter: nn.Module | None = None
        self._cast: tuple[tuple, nn.Module] | None = None  # (the drafter's weights it was made from, cast copy)

    @property
    def target(self) -> PreTrainedModel:
        target = self._target()
        if target is None:
            raise RuntimeError("The target this serving state belonged to was deleted.")
        return target

    def drop_adaptation(self) -> None:
        """Forget online adaptation's state, and the cast copy it may have changed (made afresh when next served)."""
        self.adaptation, self._cast, self.drafter = None, None, None

    def served_drafter(self, drafter: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
        """`drafter` where its floating-point weights are already `dtype` on `device`, else a copy cast there (made
        once, and again when the drafter's weights change): the user's drafter keeps its own dtype and device."""
        tensors = [*drafter.parameters(), *drafter.buffers()]
        if all(t.device == device and (not t.is_floating_point() or t.dtype == dtype) for t in tensors):
            self._cast = None
            return drafter
        key = _weights_key(drafter, device, dtype)
        if self._cast is None or self._cast[0] != key:
            self._cast = (key, cast_copy(drafter, device, dtype))
        served = self._cast[1]
        # one set of settings (`tree_settings` and per-call overrides reach both)
        served.config, served.generation_config = drafter.config, drafter.generation_config
        return served

    @torch.no_grad()
    def write_back(self, drafter: nn.Module) -> bool:
        """Online adaptation updates the drafter that drafts; where that is a cast copy, the user's `drafter` takes
        the weights it changed (in its own dtype and device; the weights it was loaded with are remembered first, for
        `reset_adaptation` and `save_pretrained`), and the copy stays the one served (its precision is kept across
        calls). Returns whether a weight changed."""
        if self._cast is None:
            return False
        key, served = self._cast
        pairs = [
            (mine, theirs.to(device=mine.device, dtype=mine.dtype))
            for mine, theirs in zip(drafter.parameters(), served.parameters())
        ]
        changed = [(mine, new) for mine, new in pairs if not torch.equal(mine, new)]
        if changed:
            drafter.remember_loaded_weights()
            for mine, new in changed:
                mine.copy_(new)
            device, dtype = key[0], key[1]
            self._cast = (_weights_key(drafter, torch.device(device), dtype), served)
        return bool(changed)


class ServingStates:
    """A drafter's serving states (see the module docstring): never copied, pickled or saved with the drafter."""

    def __init__(self) -> None:
        self._per_target: weakref.WeakKeyDictionary[Any, ServingState] = weakref.WeakKeyDictionary()
        self._latest: weakref.ref[ServingState] | None = None
        self._lock = threading.Lock()
        self._busy = False
        self.loaded_weights: dict[str, torch.Tensor] | None = None  # set by the first online update
        self.suffix_store: Any = None  # `generation.suffix_cache.SuffixStore`, made on first use

    def for_target(self, target: PreTrainedModel) -> ServingState:
        """The state for `target` (made on first use); it becomes the latest one."""
        state = self._per_target.get(target)
        if state is None:
            state = self._per_target.setdefault(target, ServingState(target, self))
        self._latest = weakref.ref(state)
        return state

    @property
    def latest(self) -> ServingState | None:
        """The state of the target served last, while that target is alive."""
        state = self._latest() if self._latest is not None else None
        return state if state is not None and state._target() is not None else None

    def __len__(self) -> int:
        return len(self._per_target)

    def drop_adaptation(self) -> None:
        """Forget online adaptation's state for every target (`ServingState.drop_adaptation`)."""
        for state in list(self._per_target.values()):
            state.drop_adaptation()

    def clear(self) -> None:
        """Forget every target's state and the suffix store (the weights stay as they are)."""
        self._per_target = weakref.WeakKeyDictionary()
        self._latest, self.suffix_store = None, None

    @contextmanager
    def busy(self, owner: str) -> Iterator[None]:
        """Mark the drafter busy for one `generate` call; a second call meanwhile (another thread, or a streamer /
        stopping criterion calling generate again) is a RuntimeError: the calls would share this state."""
        with self._lock:
            if self._busy:
                raise RuntimeError(
                    f"This {owner} is already drafting for another generate call (another thread, or generate called "
                    "again from a streamer or stopping criterion). One drafter object serves one call at a time: give "
                    "each thread its own drafter (copy.deepcopy(drafter), or load it again)."
                )
            self._busy = True
        try:
            yield
        finally:
            with self._lock:
                self._busy = False

    def __deepcopy__(self, memo: dict[int, Any]) -> "ServingStates":
        return ServingStates()

    def __reduce__(self) -> tuple[type, tuple]:
        return ServingStates, ()


def _weights_key(drafter: nn.Module, device: torch.device, dtype: torch.dtype) -> tuple:
    """What a cast copy was made from: the device, the dtype and the drafter's tensors as they are now."""
    return (str(device), dtype, *((t.data_ptr(), t._version) for t in [*drafter.parameters(), *drafter.buffers()]))


def cast_copy(module: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A deep copy of `module` whose floating-point tensors are cast to `dtype` on `device` (each tensor is copied
    once, in the new dtype; integer buffers keep theirs)."""
    memo: dict[int, Any] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        cast = tensor.detach().to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)
        memo[id(tensor)] = nn.Parameter(cast, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else cast
    return copy.deepcopy(module, memo)
