"""A scripted machine for the tests of what "auto" measures: time passes only as a test says, never as the host runs.

`ScriptedMachine(monkeypatch)` makes `time.perf_counter` (what the decoding loop, the drafters' timers and
`measure_target_cost` read) return its own clock, which moves only when a module it times runs a forward
(`times_forwards`: a target verifying n drafted nodes takes its scripted cost curve at n) or the test moves it
(`advance`). `load` says how many times slower than scripted every forward runs now (2.0: a machine another
process keeps busy). So the chooser sees given step times and the cost curve given seconds, the same on an idle machine and on
one that other work keeps busy. Ordinary wall-clock time (pytest's own durations) is untouched.
"""

from __future__ import annotations

import time
from typing import Callable

from torch import nn


class ScriptedMachine:
    """A clock read as `time.perf_counter` for the rest of the test (undone with `monkeypatch`)."""

    def __init__(self, monkeypatch, start: float = 1000.0) -> None:
        self.now = start
        self.load = 1.0  # every forward takes this many times its scripted seconds
        self.handles: list = []
        monkeypatch.setattr(time, "perf_counter", self.read)

    def read(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def times_forwards(self, module: nn.Module, seconds: Callable[[int, int], float]) -> None:
        """Each forward of `module` takes `seconds(rows, positions)` (positions: the new ones per row, the input's
        length): a target verifying a tree of n drafted nodes gets n + 1 positions."""

        def hook(module, args, kwargs, output):
            tokens = kwargs.get("input_ids", args[0] if args else None)
            if tokens is None:
                tokens = kwargs["inputs_embeds"]
            self.advance(self.load * seconds(tokens.shape[0], tokens.shape[1]))

        self.handles.append(module.register_forward_hook(hook, with_kwargs=True))

    def times_target(self, target: nn.Module, curve: Callable[[int], float]) -> None:
        """`target`'s forwards take its cost curve at the nodes they verify (positions - 1; a prefill of P positions:
        the curve at P - 1), for every row alike."""
        self.times_forwards(target, lambda rows, positions: curve(positions - 1))

    def forget_modules(self) -> None:
        """Stop timing the modules (the clock stays the test's)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
