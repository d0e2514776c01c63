"""What a tree-decoding `generate` call reports: `SpecBlockStats` (kept as `drafter.last_stats`, and returned as the
output's `drafting_stats` with `return_dict_in_generate=True`), one `RowStats` per row of a batch nested in it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from transformers.generation import GenerateDecoderOnlyOutput

from .adaptation import AdaptationReport

STATS_SCHEMA = 2  # the layout of `SpecBlockStats.as_dict()`


@dataclass
class RowStats:
    """One row's share of a call: its verified trees, what each committed, its drafter's forwards and seconds."""

    new_tokens: int = 0
    accepted_per_iteration: list[int] = field(default_factory=list)  # tokens committed per verified tree
    nodes_per_iteration: list[int] = field(default_factory=list)  # drafted nodes per verified tree
    drafter_forwards: int = 0
    drafter_time_s: float = 0.0

    @property
    def tau(self) -> float:
        """This row's mean accepted length per verification."""
        return sum(self.accepted_per_iteration) / max(1, len(self.accepted_per_iteration))


@dataclass
class SpecBlockStats:
    """Statistics of the last `generate` call, stored on the drafter as `drafter.last_stats`; reports of optional
    features nest (`adaptation`), and `as_dict()` gives the whole as plain nested dicts."""

    iterations: int = 0  # verified trees (a batch verifies one tree per live row in each target forward)
    target_forwards: int = 0  # verification forwards (the prefill not counted)
    new_tokens: int = 0  # over all rows
    accepted_per_iteration: list[int] = field(default_factory=list)  # tokens committed per verified tree
    nodes_per_iteration: list[int] = field(default_factory=list)  # drafted nodes per verified tree
    drafter_forwards: int = 0
    drafter_time_s: float = 0.0
    target_time_s: float = 0.0
    total_time_s: float = 0.0
    accepted_by_source: dict[str, int] = field(default_factory=dict)  # accepted drafted tokens each source proposed
    adaptation: AdaptationReport = field(default_factory=AdaptationReport)  # online adaptation (action "off": none)
    rows: list[RowStats] = field(default_factory=list)  # each row of the batch, in the user's order

    @property
    def tau(self) -> float:
        """Mean accepted length: (accepted draft tokens + 1 target token) per verification."""
        return sum(self.accepted_per_iteration) / max(1, self.iterations)

    @property
    def drafting_share(self) -> float:
        """T_D / (T_D + T_M)."""
        return self.drafter_time_s / max(1e-12, self.drafter_time_s + self.target_time_s)

    def as_dict(self) -> dict[str, Any]:
        """Every field (the nested reports as nested dicts) and the derived `tau` and `drafting_share`, for logging;
        `schema` numbers the layout (it changes only when a field is renamed or removed)."""
        return {"schema": STATS_SCHEMA, **asdict(self), "tau": self.tau, "drafting_share": self.drafting_share}


@dataclass
class TreeGenerateOutput(GenerateDecoderOnlyOutput):
    """`generate`'s output with `return_dict_in_generate=True` and a tree drafter: transformers' own fields, and the
    call's `drafting_stats` (`SpecBlockStats`: tau, drafting share, per row in `drafting_stats.rows`)."""

    drafting_stats: SpecBlockStats | None = None
