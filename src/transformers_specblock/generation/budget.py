"""Choosing the tree budget for the hardware (`tree_budget="auto"`).

Throughput is tau(B) / (T_M(B) + T_D): tau grows with the verified tree size B while the target's forward cost
T_M(B) grows too — slowly on a GPU, steeply on a CPU. `TargetCost` times the target's forward once per model and
device; `AutoBudget` learns tau(B) for every candidate B from the trees actually verified (a tree pruned to B
keeps its first B nodes in pruning order, so the accepted path is cut where its first node falls outside them)
and the mean size such a tree verifies (less than B where fewer candidates were proposed: free candidates cost only
the nodes they add), counting a tree only for the candidates it can tell about, with statistics over the last
`window` verified steps, and explores budgets above its choice every `explore_interval` steps, so its choice
follows a drafter or a device that changes. T_M is the curve plus what the loop's own steps took beyond it
(`AutoBudget.observe_step`: masks, acceptance, compaction and each row's bookkeeping, measured per batch bucket for
tree steps and plain steps apart), so a tree that pays for its forward but not for the loop's work around it loses.
Once a budget has been chosen `keep` times, what its steps took in all (`AutoBudget.step_time`: drafting, the
drafter's catching up on steps it skipped, verification and the loop) replaces that model for it: where the choice
alternates between drafting and not, the model's steady drafting time is too low, and it misjudges the free
candidates' steps. A budget not chosen for `window` steps is judged by the model again, which the explorations keep
current: its steps' times are refreshed only while it is chosen, and slow steps long ago must not shut it out.

The budget caps the tree; `AutoBudget.worth_verifying` then sizes each drafted tree, keeping the prefix of its
pruning order with the most expected tokens per second (a node's exp(path score) read as its chance of acceptance).

Budget 0 means "do not speculate": the target decodes one token per forward and the drafter is not run (tau = 1, no
drafting time). It wins where no tree pays for its drafting and verification, e.g. a weak drafter on a CPU; the
exploring steps keep measuring larger budgets, so the drafter comes back when its trees start to pay.

What a chooser learnt can be kept for the next process (`auto_choosers`, `autotune_cache`); its step times are the
machine's of that moment, so a state is saved with the plain step's seconds the machine showed then
(`TargetCost.plain_seconds_now`: the probe of the stored cost curve, or the curve just timed) and is not restored where
the machine now runs a plain step more than `PERSISTED_TOLERANCE` times faster (it was learnt while other work
shared the cores: its slow drafted steps would keep the chooser from drafting), nor where it does not say (saved by a
version that did not record it). The chooser then starts as a new one does, with a warm-up.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..models.tree_drafter.generation_config import (
    DEFAULT_EXPLORE_INTERVAL,
    DEFAULT_EXPLORE_SHARE,
    DEFAULT_WARMUP_COST,
)
from ..utils import RecentMean
from .target_cost import PERSISTED_TOLERANCE, TargetCost, batch_bucket
from .lookup import FreeShadow
from .tree import DraftTree, HostTree

DEFAULT_WINDOW = 64  # verified steps: the estimates are means over the samples of the last `window` steps
DEFAULT_KEEP = 4  # ... and over at least the last `keep` samples of each candidate

PLAIN = -1
"""The choice below budget 0 for a drafter with free candidates: a plain step, neither the drafter nor the free
candidates run (their lookups cost time of their own)."""


def best_budget(
    tau: dict[int, float], seconds: Callable[[int], float], plain: bool = False, min_gain: float = 0.0
) -> int:
    """The budget B maximising tau(B) / seconds(B), the expected seconds of a step drafting with B (budget 0 runs no
    drafter: the root alone, or the free candidates' tree where they are on). With `plain`, a plain step (`PLAIN`:
    1 / seconds(PLAIN)) competes too. A budget that speculates must beat the one that does not (`PLAIN`, else 0) by
    `min_gain` (0.05: 5% more tokens per second)."""
    rates = {b: tau[b] / seconds(b) for b in tau}
    if plain:
        rates[PLAIN] = 1.0 / seconds(PLAIN)
    plainly = PLAIN if plain else 0
    if plainly in rates:
        rates[plainly] *= 1.0 + min_gain
    return max(rates, key=rates.get)


LEARNT_COUNTERS = ("trees", "clock", "steps", "explorations", "explored_at", "free_explored_at")
LEARNT_MEANS = ("tau", "size", "drafting", "exploration_extra", "free_tau", "free_size", "free_seconds", "reading")


@dataclass
class AutoBudget:
    """Learns tau(B) for candidate budgets from verified trees and picks the budget for each verified step.

    What is counted: a verified tree drafted with budget D and holding n drafted nodes tells exactly what every
    candidate c <= n would have committed (pruning it to c keeps its first c nodes in `pruning_order`: the tree
    budget c drafts); if n < D the tree was not pruned, and every larger budget drafts that same tree, so it tells
    about all candidates. Each candidate has its own samples and count: a tree never counts for a candidate it
    cannot tell about, so budgets above the current choice are not credited with a smaller tree's accepted path.

    Following change: a candidate's tau (and the drafting time T_D) is the mean of its samples of the last `window`
    verified steps, and at least of its last `keep` samples. Candidate 0 needs none: tau = 1, no drafting - unless
    the drafter has free candidates (`free_at_zero`): then budget 0 still verifies their tree, with no drafter call,
    and its tau and size are measured like any candidate's (`observe_free`), and at every drafted step too, from
    what their tree alone would have committed there (`observe_free_alone`).

    Warming up: the first `warmup` trees are drafted at the largest candidate whose tree the live batch's target
    verifies for at most `warmup_cost` plain steps (`warmup_budget`: the largest candidate on a GPU; on a CPU, where a
    64-node tree costs several plain steps, a smaller one, so a first call does not pay for trees that cannot pay).

    Exploring: after the warm-up, `next_budget` returns the best budget (`choose`),
    except on every `explore_interval`-th step, which drafts above it: the k-th exploration goes 1 + (trailing zeros
    of k) candidates up (capped at the largest), so the next larger candidate is measured at every exploration, the
    one above it at every second, and so on; from a choice that does not draft (0 or `PLAIN`) every second
    exploration goes at least to the rung above the drafter's best candidate, so the estimates that decide whether
    drafting pays are refreshed where it would draft, not a rung at a time from the bottom. A candidate never
    measured is tried first. Budget 0 explores too, so it is not absorbing. From a drafting choice, a drafter with
    free candidates also tries them alone (budget 0) every `explore_interval` steps, on a clock of its own (cheaper
    than a drafted step), so budget 0 stays measured as its own trees do and can win back.
    """

    candidates: list[int]
    cost: TargetCost
    warmup: int = 8
    warmup_cost: float = DEFAULT_WARMUP_COST  # the warm-up's trees cost at most this many plain steps
    window: int = DEFAULT_WINDOW
    keep: int = DEFAULT_KEEP
    trees: int = 0  # verified trees observed
    clock: int = 0  # verified steps (calls of next_budget)
    steps: int = 0  # verified steps after the warm-up: the exploration clock
    explorations: int = 0
    explored_at: int = 0  # `steps` at the latest exploration
    free_explored_at: int = 0  # `steps` at the latest step that tried the free candidates alone from a drafting choice
    explored_from: int | None = None  # the choice an exploring step left, until the step is timed
    free_at_zero: bool = False  # budget 0 verifies the free candidates' tree (no drafter call) instead of nothing
    min_gain: float = 0.0  # what speculating must promise beyond plain decoding (`best_budget`)
    # batches: the target's cost curve per batch bucket (`batch_bucket`), measured on first use by `measure`; `cost`
    # is the live batch's, and drafting (measured per row) is paid once per live row
    measure: Callable[[int], TargetCost] | None = None
    batch_size: int = 1
    batch_costs: dict[int, TargetCost] = field(default_factory=dict)
    # measured seconds of a step (drafting excluded) beyond the cost curve's, per (batch bucket, whether a tree was
    # verified): the loop's own work (masks, acceptance, compaction, bookkeeping per row), the real cache's length
    step_overhead: dict[tuple[int, bool], RecentMean] = field(default_factory=dict)
    # measured seconds of whole steps (drafting and catching up included) per (batch bucket, chosen budget), exploring
    # steps left out: what choosing a budget costs in the running regime, which the model above misses where steps
    # alternate (a drafter that sat idle catches up before it drafts)
    step_time: dict[tuple[int, int], RecentMean] = field(default_factory=dict)
    state_path: Path | None = None  # where its learnt state is kept for the next process (`autotune_cache`)
    tau: dict[int, RecentMean] = field(init=False)  # committed tokens per tree, per candidate > 0
    size: dict[int, RecentMean] = field(init=False)  # nodes a tree of each candidate budget verifies
    drafting: RecentMean = field(init=False)  # drafter seconds per representative speculative step

    def __post_init__(self) -> None:
        self.ladder = sorted(set(self.candidates))
        self.tau = {b: RecentMean(self.window, self.keep) for b in self.ladder if b > 0}
        self.size = {b: RecentMean(self.window, self.keep) for b in self.ladder if b > 0}
        self.drafting = RecentMean(self.window, self.keep)
        self.exploration_extra = RecentMean(self.window, self.keep)  # what exploring steps took beyond chosen ones
        self.free_tau = RecentMean(self.window, self.keep)  # budget 0 with free candidates: tau, size, and their
        self.free_size = RecentMean(self.window, self.keep)
        self.free_seconds = RecentMean(self.window, self.keep)  # seconds per row (of budget-0 steps)
        self.reading = RecentMean(self.window, self.keep)  # drafter seconds per position it catches up on

    @property
    def largest(self) -> int:
        return self.ladder[-1]

    def learnt_state(self) -> dict[str, Any]:
        """What the chooser learnt (counters and estimates; not the cost curves, kept apart), JSON-able."""
        means = {}
        for name in LEARNT_MEANS:
            value = getattr(self, name)
            means[name] = {str(b): m.to_dict() for b, m in value.items()} if isinstance(value, dict) else value.to_dict()
        pairs = {name: RecentMean.pairs_to_json(getattr(self, name)) for name in ("step_overhead", "step_time")}
        counters = {name: getattr(self, name) for name in LEARNT_COUNTERS}
        return {**counters, "means": means, **pairs, "plain_step_seconds": self.plain_seconds_now()}

    def plain_seconds_now(self) -> float:
        """A plain step's seconds (one row) as this process timed the machine (`TargetCost.plain_seconds_now`)."""
        return self.batch_costs.get(1, self.cost).plain_seconds_now()

    def restore(self, state: dict[str, Any]) -> bool:
        """Go on from a `learnt_state` (of a chooser with the same candidates); an empty or foreign one is ignored,
        and so is one learnt on a machine more than `PERSISTED_TOLERANCE` times slower than this one is now (by its
        `plain_step_seconds`; one that does not say is not trusted either). Returns whether the state was restored."""
        learnt_on = state.get("plain_step_seconds")
        if not isinstance(learnt_on, (int, float)) or learnt_on > PERSISTED_TOLERANCE * self.plain_seconds_now():
            return False
        try:
            means = {
                name: {int(b): RecentMean.from_dict(m) for b, m in value.items()} if name in ("tau", "size")
                else RecentMean.from_dict(value)
                for name, value in state["means"].items()
            }  # fmt: skip
            overhead, taken = (RecentMean.pairs_from_json(state[name]) for name in ("step_overhead", "step_time"))
            counters = {name: int(state[name]) for name in LEARNT_COUNTERS}
        except (KeyError, TypeError, ValueError, AttributeError):
            return False
        if set(means.get("tau", {})) != set(self.tau):
            return False
        for name, value in {**counters, **means}.items():
            if name in LEARNT_COUNTERS or name in LEARNT_MEANS:  # (a state saved by another version may hold more)
                setattr(self, name, value)
        self.step_overhead, self.step_time = overhead, taken
        return True

    def set_batch_size(self, live_rows: int) -> None:
        """Choose for `live_rows` rows verified together: their bucket's cost curve, drafting paid per row. The first
        batch measures every bucket up to its own (rows leave a batch as they finish: no timing mid-call)."""
        self.batch_size = live_rows
        bucket = batch_bucket(live_rows)
        if self.measure is not None and bucket not in self.batch_costs:
            self.batch_costs.setdefault(1, self.cost)
            for smaller in (1 << i for i in range(1, bucket.bit_length())):
                if smaller not in self.batch_costs:
                    self.batch_costs[smaller] = self.measure(smaller)
        if bucket in self.batch_costs:
            self.cost = self.batch_costs[bucket]

    def step_seconds(self, size: int) -> float:
        """Seconds of a step verifying `size` drafted nodes in each live row, drafting excluded: the target's cost
        curve plus what such steps took beyond it in the loop (a tree step not measured yet: as much as a plain one)."""
        bucket = batch_bucket(self.batch_size)
        for key in ((bucket, size > 0), (bucket, False)):
            stat = self.step_overhead.get(key)
            if stat is not None and stat.count:
                return self.cost(size) + stat.median(self.clock)
        return self.cost(size)

    def observe_step(
        self, size: int, seconds: float, drafting_seconds: float = 0.0, catch_up: tuple[int, float] = (0, 0.0),
        budget: int | None = None,
    ) -> None:
        """Record a step's `seconds` (drafting excluded) that verified `size` drafted nodes per row (the padded
        tree's): what it took beyond the cost curve of its batch (none where the curve says more); for an exploring
        step also what it took with its drafting beyond a step at the choice; for a chosen `budget`, the whole step's
        seconds (`step_time`). `catch_up`: the positions a drafter that sat idle read first (a long read: a prompt or
        a stretch of skipped steps), and the seconds that took (part of `drafting_seconds`), learnt per position apart:
        the next exploration is charged for the positions then unread (`next_budget`)."""
        bucket = batch_bucket(self.batch_size)
        overhead = max(0.0, seconds - self.cost(size))
        self.step_overhead.setdefault((bucket, size > 0), RecentMean(self.window, self.keep)).add(self.clock, overhead)
        positions, reading = catch_up
        if positions:
            self.reading.add(self.clock, reading / positions)
        if budget is not None and self.explored_from is None and self.trees >= self.warmup:
            # a long read (a new call's prompt) is the call's cost, not the budget's
            taken = self.step_time.setdefault((bucket, budget), RecentMean(self.window, self.keep))
            taken.add(self.clock, seconds + drafting_seconds - reading)
        if self.explored_from is not None:
            extra = seconds + drafting_seconds - reading - self.seconds(self.explored_from)
            self.exploration_extra.add(self.clock, max(0.0, extra))
            self.explored_from = None

    def estimates(self) -> dict[int, float]:
        """The current tau estimate of every measured candidate (candidate 0: exactly 1, or the measured tau of the
        free candidates' trees)."""
        zero = self.free_tau.mean(self.clock) if self.free_tau.count else 1.0
        return {b: self.tau[b].mean(self.clock) if b else zero for b in self.ladder if b == 0 or self.tau[b].count}

    def observe_free(self, tree: DraftTree, path: list[int], seconds: float | None = None) -> None:
        """Record a budget-0 step that verified only free candidates (`free_at_zero`; `path`: the accepted nodes),
        and their `seconds` for the row."""
        self.free_tau.add(self.clock, len(path) + 1.0)
        self.free_size.add(self.clock, float(tree.num_drafted))
        if seconds is not None:
            self.free_seconds.add(self.clock, seconds)

    def observe_free_alone(self, trees: list[FreeShadow]) -> None:
        """Record what the free candidates' trees alone would have committed at drafted steps (`FreeShadow`: each
        scored against the text the target committed next): budget 0's tau and size, known at every drafted step,
        exactly for greedy decoding. So a drafting choice knows budget 0 as well as it knows its own trees, and where
        the drafter stops paying (a larger batch, text the lookups copy better) the free candidates take over."""
        for tree in trees:
            self.free_tau.add(self.clock, tree.tau)
            self.free_size.add(self.clock, float(tree.size))

    def observe(
        self, tree: DraftTree, path: list[int], drafting_seconds: float | None, budget: int | None = None
    ) -> None:
        """Record, for every candidate this verified tree tells about, what it would have committed (`path`: the
        accepted nodes, by depth).

        `budget`: the budget the tree was drafted with (None: only candidates up to its size are told about).
        `drafting_seconds`: the drafter time of this step, or None where it is not representative (the drafter first
        caught up on a prompt or on skipped steps).
        """
        drafted = tree.num_drafted
        unpruned = budget is not None and drafted < budget
        told = [b for b in self.tau if b <= drafted or unpruned]
        if told:
            rank = {node: r for r, node in enumerate(tree.host().pruning_order())}  # `prune` keeps a prefix of it
            path_ranks = [rank[node] for node in path]
            for b in told:
                # the accepted path cut at its first node outside the first b of the order
                count = next((i for i, r in enumerate(path_ranks) if r > b), len(path_ranks))
                self.tau[b].add(self.clock, count + 1.0)
                self.size[b].add(self.clock, float(min(b, drafted)))
        if drafting_seconds is not None:
            self.drafting.add(self.clock, drafting_seconds)
        self.trees += 1

    def warmup_budget(self) -> int:
        """The largest candidate whose tree the live batch's target verifies for at most `warmup_cost` plain steps
        (by the cost curve; at least the smallest candidate that drafts)."""
        drafting = [b for b in self.ladder if b > 0]
        if not drafting:
            return self.largest
        affordable = [b for b in drafting if self.cost(b) <= self.warmup_cost * self.cost(0)]
        return max(affordable, default=drafting[0])

    def choose(self) -> int:
        """The best budget now (no side effect): `warmup_budget()` while warming up, then a candidate up to it never
        measured (the largest such), then the argmax of tau(B) / (T_M(B) + T_D) (0 = no drafter call; `PLAIN` = not
        even the free candidates, where they do not pay for their own time either)."""
        if self.trees < self.warmup:
            return self.warmup_budget()
        unmeasured = [b for b, stat in self.tau.items() if not stat.count]
        if unmeasured:  # (the cost curve is read only while a candidate is unmeasured, not on every step)
            warmup = self.warmup_budget()
            unmeasured = [b for b in unmeasured if b <= warmup]
        return max(unmeasured) if unmeasured else self._best()

    def _best(self, drafting_only: bool = False) -> int:
        """The argmax of tau(B) / seconds(B) over the measured candidates (`drafting_only`: over those > 0)."""
        tau = {b: t for b, t in self.estimates().items() if b or not drafting_only}
        if not tau:
            return self.largest
        plain = self.free_at_zero and not drafting_only
        return best_budget(tau, self.seconds, plain=plain, min_gain=self.min_gain)

    def worth_verifying(self, trees: list[DraftTree], drafted: bool = True) -> list[DraftTree]:
        """The rows' trees cut to the common prefix length n of their pruning orders with the most expected tokens
        per second for the whole batch: n maximising (rows + the sum over rows of their first n nodes' path
        probabilities) / (T_M(n) + T_D), reading a node's exp(path score) as the chance it is accepted (calibrated for
        free candidates, whose scores are learnt acceptance rates; the drafter's own probability for its nodes).
        One forward verifies every row at the longest row's size, so a node pays only for what it adds to the
        batch's forward. A strong lookup match is verified whole, weak guesses are left out: the budget caps the
        tree, this sizes it per step. `drafted`: whether the drafter ran (its time T_D is counted). An exploring
        step verifies its trees whole: it is there to measure, and a cut tree measures neither the candidate's tau
        nor what a tree step costs (were every tree cut, stale estimates would never be corrected)."""
        if max(tree.num_drafted for tree in trees) == 0 or self.trees < self.warmup or self.explored_from is not None:
            return trees
        best = self._best_size([tree.host() for tree in trees], drafted)  # (our drafters grow their trees there)
        return [tree.prune(best) for tree in trees]

    def free_alone_tree(self, tree: HostTree) -> HostTree:
        """The free candidates' tree `tree` as a chosen budget-0 step after the warm-up would verify it for this row
        (`worth_verifying` with no drafting time): what budget 0's estimates are for, also while warming up (a whole
        tree would be measured as dearer than budget 0's steps will be, and keep the chooser from them)."""
        if tree.num_drafted == 0:
            return tree
        return tree.prune(self._best_size([tree], drafted=False))

    def _best_size(self, trees: list[HostTree], drafted: bool) -> int:
        """`worth_verifying`'s prefix length n for the rows' host trees."""
        longest = max(tree.num_drafted for tree in trees)
        expected = [float(len(trees))] * (longest + 1)  # E[tokens] over the rows keeping n nodes each
        for tree in trees:
            scores = tree.path_scores()
            gains = list(itertools.accumulate(math.exp(scores[node]) for node in tree.pruning_order()[1:]))
            for n in range(1, longest + 1):
                expected[n] += gains[min(n, len(gains)) - 1] if gains else 0.0
        drafting = self.drafting.mean(self.clock) * self.batch_size if drafted else 0.0
        rates = [float(e) / (self.step_seconds(n) + drafting) for n, e in enumerate(expected)]
        return max(range(len(rates)), key=rates.__getitem__)

    def next_budget(
        self, explore_interval: int = DEFAULT_EXPLORE_INTERVAL, explore_share: float = DEFAULT_EXPLORE_SHARE,
        unread: int = 0,
    ) -> int:
        """The budget to draft with at this verified step (call once per step, budget-0 steps included): `choose()`,
        or, at least `explore_interval` steps after the previous exploration (`explore_interval x batch_size` in a
        batch, whose exploring step drafts for every row) and once the steps since then took 1 / `explore_share`
        times what the exploring step is expected to cost beyond a chosen one, a larger candidate (see the class
        docstring; `PLAIN` sits below the ladder). That cost counts the `unread` positions (over the live rows) the
        drafter would catch up on first where the exploration drafts (budget 0 runs no drafter): a new call's first
        drafting exploration reads its whole prompt. Where that exploration is too dear, the next rung up is explored
        if it is affordable (from `PLAIN`: budget 0, the free candidates alone, which read nothing). Every
        `explore_interval / explore_share` steps an exploration comes whatever it costs, so no choice is absorbing."""
        self.clock += 1
        best = self.choose()
        if self.trees < self.warmup:
            return best
        self.steps += 1
        if self.free_at_zero and best > 0 and self.steps - self.free_explored_at >= explore_interval * self.batch_size:
            self.free_explored_at = self.steps  # the free candidates alone: cheaper than the drafted step it replaces
            return 0
        index = self.ladder.index(best) if best != PLAIN else -1
        since = self.steps - self.explored_at
        if since < explore_interval * self.batch_size or index == len(self.ladder) - 1:
            return best
        up = (self.explorations + 1 & -(self.explorations + 1)).bit_length()  # 1, 2, 1, 3, 1, 2, 1, 4, ...
        explored = self.ladder[min(index + up, len(self.ladder) - 1)]
        if best <= 0 and up > 1:  # not drafting: measure the drafter where it would draft (a rung above its best)
            above = min(self.ladder.index(self._best(drafting_only=True)) + 1, len(self.ladder) - 1)
            explored = max(explored, self.ladder[above])
        nearest = self.ladder[index + 1]  # what an exploration too dear now is replaced by, where it is cheaper
        for candidate in dict.fromkeys((explored, nearest)):
            extra = self.seconds(candidate) - self.seconds(best)  # expected, and as the latest explorations took
            if candidate == explored and self.exploration_extra.count:
                extra = max(extra, self.exploration_extra.median(self.clock))
            if self.reading.count and candidate > 0:  # the drafter drafts, so it first reads what it has not
                extra += unread * self.reading.mean(self.clock)
            if since * self.seconds(best) * explore_share >= extra or since * explore_share >= explore_interval:
                self.explorations, self.explored_at, self.explored_from = self.explorations + 1, self.steps, best
                return candidate
        return best

    def seconds(self, budget: int) -> float:
        """The expected seconds of a step drafting with `budget` (`PLAIN`: a plain step) for the live batch: what such
        steps took once it was chosen `keep` times (drafting, catching up on skipped positions and the loop's work
        included) while it was last chosen within the window, else the model: the cost curve at the nodes it
        verifies, the loop's overhead and the drafter's time on steady steps (which the explorations keep current, so
        steps that were slow long ago do not shut a budget out for good)."""
        taken = self.step_time.get((batch_bucket(self.batch_size), budget))
        if taken is not None and taken.count >= self.keep and taken.latest_within_window(self.clock):
            return taken.mean(self.clock)
        if budget == PLAIN or (budget == 0 and not self.free_at_zero):
            return self.step_seconds(0)
        if budget == 0:
            size, drafting = self.free_size, self.free_seconds
        else:
            size, drafting = self.size[budget], self.drafting
        nodes = size.mean(self.clock) if size.count else budget
        return self.step_seconds(nodes) + drafting.mean(self.clock) * self.batch_size
