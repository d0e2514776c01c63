"""The cost-aware bandit choosing, after each `generate` call, whether and how to update the drafter.

Arms: "skip", "head_only", "full". The reward of the arm taken after call t is measured, not modelled: the
throughput of call t+1 with the update's own time charged to it, tokens_{t+1} / (decode_seconds_{t+1} +
update_seconds_t), divided by a running throughput scale so that rewards of different prompts and domains are
comparable (about 1). An update arm therefore wins only while what it buys in the next call's speed exceeds what
it costs; when the drafter has caught up (or an update is too slow for the device) "skip" wins.

Choice: discounted UCB (Garivier & Moulines 2011): every arm's reward sum and count decay by `discount` per call,
so the estimates follow a stream whose domain shifts. Arms are given cheapest update first; that one and "skip"
are measured first, and a costlier update ("full": the head step plus a replay of the body, 3-4x the time) is tried
only once a cheaper update has beaten "skip" over at least `escalate_after` pulls - where a head-only update does
not pay, a whole-drafter one is not explored (measured in domain: one exploratory call cost a quarter of a call's
time, and one head-only reward that noise had put above "skip" was enough to explore it twice in 15 calls).

The same held-out check also gates the costlier arms: the adapter lets the bandit explore or take "full" only on
calls where the adapted weights beat the loaded ones on the call's fresh signal by `ESCALATION_GAIN`, two in a row
(`choose(escalate=...)`): a whole-drafter update is worth its cost where adapting measurably helps, not in domain
(one call's win was not enough: on a HumanEval stream a served candidate's one win opened two whole-drafter
updates of 3.4 s each, both rolled back).

A second, low-noise signal: when the held-out check finds the loaded weights better than the adapted ones on a call's
fresh signal (same states, no throughput noise) and puts them back, drops a head-only update's candidate head that
did not beat the served one, or the tau check rolls an update back, the measured reward of the update that made
them is replaced by what it really earned: "skip"'s mean less the update's
share of the call (`reject`): its weights were thrown away, its time was spent. Throughput rewards vary by +-20%
between prompts, so without it the bandit kept updating in domain although most updates were thrown away (measured
on 15 held-out ShareGPT calls: 9-10 head updates, 6-7 of them rejected, tau -6 to -8%). A zero reward instead (an
earlier version) was too harsh: the depth-1 check is conservative, and one rejection of a useful update on a code
prompt ended the adaptation for the rest of the stream.
"""

from __future__ import annotations

import math

SKIP = "skip"
WAIT = "wait"  # no update and no question to the policy: backing off after updates thrown away (`Backoff`)


class CostAwareBandit:
    """Discounted UCB over `arms` with throughput-net-of-update-time rewards (see the module docstring)."""

    def __init__(
        self,
        arms: tuple[str, ...],
        discount: float = 0.95,
        exploration: float = 0.15,
        scale_decay: float = 0.8,
        escalate_after: int = 2,
    ) -> None:
        self.arms = arms
        self.discount = discount
        self.exploration = exploration
        self.scale_decay = scale_decay
        self.escalate_after = escalate_after
        self.pulls = dict.fromkeys(arms, 0)  # scored pulls (`record`)
        self.counts = dict.fromkeys(arms, 0.0)  # discounted number of pulls
        self.sums = dict.fromkeys(arms, 0.0)  # discounted reward sums
        self.scale: float | None = None  # running throughput (tokens/s) without update time
        self.last_reward: dict[str, tuple[float, float]] = {}  # arm -> (its last reward, that reward's weight now)

    def choose(self, escalate: bool = True) -> str:
        """The arm to take now: the cheapest update and "skip" are measured first; a costlier update arm is tried
        only once a cheaper one has beaten "skip" over `escalate_after` pulls; then the highest upper confidence
        bound among the tried arms. `escalate=False` (the held-out check saw no gain from adapting) leaves the
        costlier update arms out."""
        cheapest = [self.arms[0], SKIP] if SKIP in self.arms and self.arms[0] != SKIP else [self.arms[0]]
        eligible = [arm for arm in self.arms if escalate or arm in cheapest]
        tried = [arm for arm in eligible if self.counts[arm] > 0.0]
        for arm in cheapest:
            if arm not in tried:
                return arm
        baseline = self.mean(SKIP) if SKIP in self.arms else -math.inf
        for index, arm in enumerate(self.arms):
            cheaper = [a for a in self.arms[:index] if a != SKIP and self.pulls[a] >= self.escalate_after]
            if arm in eligible and arm not in tried and any(self.mean(a) > baseline for a in cheaper):
                return arm
        total = sum(self.counts.values())
        bounds = {
            arm: self.mean(arm) + self.exploration * math.sqrt(max(math.log(total), 0.0) / self.counts[arm])
            for arm in tried
        }
        return max(tried, key=lambda arm: bounds[arm])

    def mean(self, arm: str) -> float:
        return self.sums[arm] / self.counts[arm] if self.counts[arm] else float("nan")

    def reject(self, arm: str, update_share: float) -> None:
        """`arm`'s last update was thrown away: its recorded reward becomes "skip"'s mean less the update's share of
        its call (`update_share`, update seconds over decode plus update seconds)."""
        baseline = self.mean(SKIP) if SKIP in self.arms and self.counts[SKIP] else 1.0
        reward = baseline * (1.0 - update_share)
        if arm in self.last_reward:
            last, weight = self.last_reward[arm]
            self.sums[arm] += weight * (reward - last)
        else:  # (not measured yet: a pull of its own)
            self.counts[arm] += 1.0
            self.sums[arm] += reward
        self.last_reward[arm] = (reward, self.last_reward.get(arm, (0.0, 1.0))[1])

    def record(self, arm: str, tokens: int, decode_seconds: float, update_seconds: float) -> float:
        """The next call's measurement for `arm` (taken before it); returns the reward."""
        throughput = tokens / max(decode_seconds, 1e-9)
        if self.scale is None:
            self.scale = throughput
        self.scale = self.scale_decay * self.scale + (1 - self.scale_decay) * throughput
        reward = tokens / max(decode_seconds + update_seconds, 1e-9) / max(self.scale, 1e-9)
        for name in self.arms:
            self.counts[name] *= self.discount
            self.sums[name] *= self.discount
        self.last_reward = {name: (last, weight * self.discount) for name, (last, weight) in self.last_reward.items()}
        self.counts[arm] += 1.0
        self.pulls[arm] += 1
        self.sums[arm] += reward
        self.last_reward[arm] = (reward, 1.0)
        return reward


class Backoff:
    """Exponential back-off of a cost-aware policy: after the `n`-th update thrown away in a row (a dropped candidate
    head, a rollback, the loaded weights put back), the adapter waits `min(2**n, limit)` calls before it asks the
    policy again, capturing no signal meanwhile; an update that is kept (a candidate served, adapted weights that beat
    the loaded ones) resets it. The bandit's rewards alone let it re-explore a head-only update every few calls on a
    stream where none is ever kept (30 HumanEval problems: 10 updates, each thrown away, 2.4% of the time); backing
    off bounds that to about log2 of the stream's length, and a domain where updates are kept still gets them after
    at most `limit` calls."""

    def __init__(self, limit: int = 32) -> None:
        self.limit = limit
        self.thrown_away = 0  # updates thrown away in a row
        self.wait = 0  # calls left before the policy is asked again

    def update_thrown_away(self) -> None:
        self.thrown_away += 1
        self.wait = min(2**self.thrown_away, self.limit)

    def update_kept(self) -> None:
        self.thrown_away, self.wait = 0, 0

    def waiting(self) -> bool:
        """Whether this call still waits (one call less to wait after it)."""
        waiting, self.wait = self.wait > 0, max(self.wait - 1, 0)
        return waiting
