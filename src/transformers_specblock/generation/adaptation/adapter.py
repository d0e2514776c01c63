"""Online adaptation of a tree drafter while it serves: the per-drafter state that ties the signal, the update and
the policy together, and what the decoding loop calls (`start_call`, `capture`, `finish_call`).

Per `generate` call: the loop captures the signal after every verification (`signal.collect_signal`) where an update
may follow or a check needs it; after the last token `finish_call` (1) scores the action taken after the previous
call (the bandit's reward; a rollback to the snapshot taken before a whole-drafter update if this call's tau fell
more than `ROLLBACK_TOLERANCE` below the mean tau of the (2 to 4) calls before it), (2) runs the held-out check on
this call's signal, which no update has trained on yet: the loaded output side comes back where it does better than
the served one, and the candidate head of the last head-only update is served only once it has done better than the
served head on two calls in a row, (3) picks this call's action from the policy (after updates thrown away in a row,
a cost-aware policy backs off: `bandit.Backoff`), (4) runs it, timed, inside the `generate` call (its time is part
of the call's).

Head-only updates train a candidate head (from the loaded one, on the whole buffer), served only once it has beaten
the served head on calls it has not trained on; the bandit's reward for them is the next call's measured throughput,
and a dropped candidate is charged as thrown away. A whole-drafter update is served at once (a candidate copy would
double the drafter's memory), guarded by the tau rollback and the held-out check. Why: docs/design.md.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...models.dflash.modeling_dflash import DFlashDraftModel
from ...models.eagle3.modeling_eagle3 import Eagle3DraftModel
from ...models.specblock.modeling_specblock import SpecBlockDraftModel
from ...models.tree_drafter.modeling_tree_drafter import TreeDraftModel
from ...models.tree_drafter.serving_state import ServingState
from ...utils import sync
from ..candidate_generators.base import TreeCandidateGenerator
from ..tree import DraftTree
from .bandit import SKIP, WAIT, Backoff, CostAwareBandit
from .signal import SignalBuffer, SignalSample, collect_signal, target_to_draft_ids
from .update import (
    FULL,
    HEAD_ONLY,
    draft_logits,
    held_out_gains,
    output_parameters,
    replay_states,
    train_candidate_head,
    trainable_parameters,
    update_whole_drafter,
)

ROLLBACK_TOLERANCE = 0.15  # roll an update back when the next call's tau is this much below the reference
REFERENCE_CALLS = 4  # calls whose mean tau is the reference of the rollback check
MIN_REFERENCE_CALLS = 2  # no rollback against one call's tau (prompts differ by +-20%: it undid sound updates)
PROMOTION_GAIN = 0.02  # what a candidate head must gain over the served one to be served, on both measures
PROMOTION_CALLS = 2  # held-out calls in a row on which a candidate head must gain that before it is served
ESCALATION_GAIN = 0.05  # held-out gain over the loaded weights (both measures) that lets the bandit try "full" ...
ESCALATION_CALLS = 2  # ... on this many calls in a row
POLICY_ARMS = {"full": (FULL, SKIP), "bandit": (HEAD_ONLY, FULL, SKIP)}  # cost-aware policies
FIXED_ACTION = {"always": FULL, "head_only": HEAD_ONLY}


@dataclass
class AdaptationReport:
    """What online adaptation did in one `generate` call (copied into `drafter.last_stats`)."""

    action: str = "off"  # "skip", "head_only" or "full" (after this call's tokens); "wait" while backing off
    # after updates thrown away (no signal captured); "off" when disabled
    update_time_s: float = 0.0  # the update and the held-out check before it
    signal: int = 0  # samples captured in this call
    signal_wrong: int = 0  # of which the drafter's best proposal was wrong
    rolled_back: bool = False  # the previous call's update was undone
    restored_loaded: bool = False  # the loaded output side did better on this call's signal and was put back
    held_out_gain: float = float("nan")  # first-proposal acceptance of the served minus the loaded weights (nan
    # while the loaded ones are served)
    candidate_gain: float = float("nan")  # the same, the last head-only update's candidate minus the served head
    promoted: bool = False  # that candidate gained `PROMOTION_GAIN` or more (and as much in greedy agreement): it is
    # served from the next call on
    loss: float = float("nan")  # soft cross entropy of the update's first step


@dataclass
class _Pending:
    """The action taken after the previous call, scored by the next one."""

    action: str
    update_seconds: float
    reference_tau: float
    reference_calls: int
    snapshot: dict[str, torch.Tensor] | None  # parameters before the update


class OnlineAdapter:
    """Signal buffer, bandits and rollback state of one drafter (kept on it, see `online_adapter_for`)."""

    def __init__(self, drafter: TreeDraftModel) -> None:
        self.drafter = drafter
        self.buffer = SignalBuffer(drafter.generation_config.adaptation_buffer_size)
        self.bandits: dict[str, CostAwareBandit] = {}
        self.backoff = Backoff()
        self.capturing = True  # whether this call captures the signal (`start_call`)
        self.body_version = 0
        self.full_updates = 0  # whole-drafter updates run (none: the body is the loaded one)
        self.pending: _Pending | None = None
        self.candidate: dict[str, torch.Tensor] | None = None  # the head-only update's head, served once it wins
        self.candidate_wins = 0  # held-out calls in a row it has won so far
        self.adapted_wins = 0  # held-out calls in a row the adapted weights served beat the loaded ones (escalation)
        self.last_update: str | None = None  # the update action that made the current weights
        self.last_update_share = 0.0  # its time's share of the call after it (what a rejection charges)
        self.loaded_head: tuple[int, ...] | None = None  # versions of the head weights while they are the loaded ones
        self.recent_tau: deque[float] = deque(maxlen=REFERENCE_CALLS)
        self.report = AdaptationReport()
        self.fresh: list[SignalSample] = []  # this call's samples: held out until the update after it
        self.capture_seconds = 0.0  # this call's signal collection (inside its steps)
        self.to_draft = target_to_draft_ids(drafter.d2t, drafter.config.vocab_size)

    @property
    def policy(self) -> str:
        return self.drafter.generation_config.online_adaptation

    def start_call(self, generators: list[TreeCandidateGenerator]) -> None:
        """Ask the generators (one per row) to keep what the signal needs where this call needs a signal at all."""
        config = self.drafter.generation_config
        adapted = self.drafter.serving_states.loaded_weights is not None and (
            self.full_updates > 0 or self._head_versions() != self.loaded_head
        )
        # an update may run after this call: the policy asked now (the bandit's choice may still change once this
        # call is scored; an update then trains on the buffer alone); a candidate to test or adapted weights to check
        may_update = self.backoff.wait == 0 and (not self.buffer or self.choose_action() != SKIP)
        self.capturing = may_update or self.candidate is not None or adapted
        for generator in generators:
            generator.keep_producers = self.capturing
            generator.context_size = config.adaptation_context
        self.buffer.resize(config.adaptation_buffer_size)
        if self.to_draft.device != self.drafter.d2t.device:
            self.to_draft = self.to_draft.to(self.drafter.d2t.device)
        self.report = AdaptationReport()
        self.fresh = []
        self.capture_seconds = 0.0

    def capture(
        self,
        generator: TreeCandidateGenerator,
        tree: DraftTree,
        path: torch.LongTensor,
        bonus: torch.LongTensor,
        target_logits: torch.Tensor,
    ) -> None:
        """Add one verified tree's signal (target_logits [N+1, V]: the verification's raw rows); its time counts as
        adaptation's (`capture_seconds`), not as the step's."""
        start = time.perf_counter()
        samples = collect_signal(
            generator, tree, path, bonus, target_logits, self.to_draft, self.drafter.generation_config.adaptation_top_k,
            self.body_version,
        )  # fmt: skip
        self.buffer.add(samples)
        self.fresh += samples
        self.report.signal += len(samples)
        self.report.signal_wrong += sum(s.wrong for s in samples)
        sync(self.drafter.device)
        self.capture_seconds += time.perf_counter() - start

    def finish_call(self, new_tokens: int, decode_seconds: float, tau: float) -> AdaptationReport:
        """Score the previous action, then choose and run this call's (see the module docstring)."""
        if self.pending is not None:
            self._score_pending(new_tokens, decode_seconds, tau)
        sync(self.drafter.device)
        start = time.perf_counter()
        self._keep_better_output_side()
        self._try_candidate()
        sync(self.drafter.device)
        # the held-out check and this call's signal collection are charged to the action like the update itself
        check_seconds = time.perf_counter() - start + self.capture_seconds
        if self._charge_thrown_away_updates():
            self.backoff.update_thrown_away()
        elif self.report.promoted or self.adapted_wins > 0:  # (the adapted weights won this call's check)
            self.backoff.update_kept()
        self.recent_tau.append(tau)
        action = WAIT if self.policy in POLICY_ARMS and self.backoff.waiting() else self.choose_action()
        if action == HEAD_ONLY and self.candidate is not None:  # one has won and is tested again on the next call:
            action = SKIP  # a new candidate would replace it
        snapshot, seconds = None, check_seconds
        if action not in (SKIP, WAIT):
            if self.drafter.serving_states.loaded_weights is None:  # (the first update: the head is the loaded one)
                self.drafter.remember_loaded_weights()
                self.loaded_head = self._head_versions()
            if action == FULL:
                snapshot = {n: p.detach().clone() for n, p in self._named(action)}
            start = time.perf_counter()
            loss = self._train_candidate() if action == HEAD_ONLY else self._update_whole_drafter()
            sync(self.drafter.device)
            if loss is None:  # no signal: nothing was changed
                action, snapshot = SKIP, None
            else:
                self.report.loss = loss
                seconds += time.perf_counter() - start
                self.last_update = action
            if action == FULL:
                self.body_version += 1  # stored states of earlier samples no longer match the body
                self.full_updates += 1
                self.candidate, self.candidate_wins = None, 0  # trained on states of the old body
        reference = sum(self.recent_tau) / len(self.recent_tau)
        self.pending = _Pending(action, seconds, reference, len(self.recent_tau), snapshot)
        self.report.action, self.report.update_time_s = action, seconds
        return self.report

    def choose_action(self) -> str:
        """The policy's action for now: fixed for "always" / "head_only", the bandit's for "full" / "bandit"."""
        if self.policy in FIXED_ACTION:
            return FIXED_ACTION[self.policy]
        if self.policy not in self.bandits:
            # a drafter without an output side of its own (DFlash) has no head-only update: skip or the whole drafter
            arms = POLICY_ARMS[self.policy] if output_parameters(self.drafter) else POLICY_ARMS["full"]
            self.bandits[self.policy] = CostAwareBandit(arms)
        # measured (first-proposal acceptance, 32-token calls): +0.01..+0.24 on code after head updates, -0.01..+0.08
        # on held-out ShareGPT, where whole-drafter explorations cost tau
        return self.bandits[self.policy].choose(escalate=self.adapted_wins >= ESCALATION_CALLS)

    def _update_whole_drafter(self) -> float | None:
        return update_whole_drafter(
            self.drafter, self.buffer, self.body_version, self.drafter.generation_config.adaptation_learning_rate
        )

    def _train_candidate(self) -> float | None:
        """A head-only update: a candidate head trained from the loaded one (`update.train_candidate_head`) into
        `self.candidate`; the served head stays in place until the candidate has proven itself."""
        loaded = self.drafter.serving_states.loaded_weights
        trained = train_candidate_head(
            self.drafter, self.buffer, self.body_version, loaded["lm_head.weight"],
            self.drafter.generation_config.adaptation_head_learning_rate,
        )  # fmt: skip
        if trained is None:
            return None
        weight, loss = trained
        self.candidate, self.candidate_wins = {"lm_head.weight": weight}, 0
        return loss

    def _charge_thrown_away_updates(self) -> bool:
        """Tell the bandit which update's weights the held-out check threw away (a rollback has charged its own);
        whether any update was thrown away this call."""
        bandit = self.bandits.get(self.policy)
        if bandit is None:
            return False
        thrown_away = set()
        if self.report.restored_loaded and not self.report.rolled_back and self.last_update in bandit.arms:
            thrown_away.add(self.last_update)
        if not math.isnan(self.report.candidate_gain) and not self.report.promoted and self.candidate is None:
            thrown_away.add(HEAD_ONLY)
        for arm in thrown_away & set(bandit.arms):
            bandit.reject(arm, self.last_update_share)
        return bool(thrown_away) or self.report.rolled_back

    def _score_pending(self, new_tokens: int, decode_seconds: float, tau: float) -> None:
        pending, self.pending = self.pending, None
        bandit = self.bandits.get(self.policy)
        if pending.action not in (SKIP, WAIT):
            self.last_update_share = pending.update_seconds / max(decode_seconds + pending.update_seconds, 1e-9)
        if bandit is not None and pending.action in bandit.arms:
            bandit.record(pending.action, new_tokens, decode_seconds, pending.update_seconds)
        dropped = tau < (1 - ROLLBACK_TOLERANCE) * pending.reference_tau
        if pending.snapshot is not None and pending.reference_calls >= MIN_REFERENCE_CALLS and dropped:
            self.rollback(pending)
            if bandit is not None and pending.action in bandit.arms:
                bandit.reject(pending.action, self.last_update_share)

    @torch.no_grad()
    def rollback(self, pending: _Pending) -> None:
        """Put back the parameters from before `pending`'s update."""
        for name, param in self._named(pending.action):
            param.copy_(pending.snapshot[name])
        if pending.action == FULL:
            self.body_version += 1  # states captured since then came from the rolled-back body
        self.report.rolled_back = True
        self.recent_tau.clear()  # a fresh reference for the restored drafter

    @torch.no_grad()
    def _keep_better_output_side(self) -> None:
        """Held-out check on this call's signal (no update has trained on it yet): where the body is still the
        loaded one, compare how often the served and the loaded output side would have proposed the target's token
        first right after each step's root (the target probability of each one's top draft token, and how often it
        is the target's own top token, over the same depth-1 states); if the loaded one does better on either, put
        it back. This keeps a head adapted to one domain from costing tau when the stream moves on. Nothing to
        compare (and no time spent) while the loaded head is served."""
        loaded = self.drafter.serving_states.loaded_weights
        # depth 1 only: a tree's deeper samples exist because of what the current head got right, and its last one
        # mostly because it got it wrong, which would bias the comparison; depth 1 is there every step
        fresh = [s for s in self._decisive() if s.depth == 1]
        wins, self.adapted_wins = self.adapted_wins, 0
        if loaded is None or not fresh or self._head_versions() == self.loaded_head:  # (the loaded head is served)
            return
        head = self._named(HEAD_ONLY)
        head_names = {n for n, _ in head}
        if not head or self.full_updates and any(
            not torch.equal(p, loaded[n]) for n, p in self.drafter.named_parameters() if n not in head_names
        ):  # (comparing every weight takes 13-25 ms, 0.5-1% of a 32-token call: only after a whole-drafter update)
            gains = self._keep_better_drafter(loaded)  # a whole-drafter update changed the body (DFlash: all of it)
        else:
            states = torch.stack([s.state for s in fresh]).to(self.drafter.device, self.drafter.dtype)
            normed = self.drafter.norm(states)
            gains = held_out_gains(self.drafter.lm_head(normed), F.linear(normed, loaded["lm_head.weight"]), fresh)
            self.report.held_out_gain = gains[0]
            if min(gains) < 0.0:
                for name, param in head:
                    param.copy_(loaded[name])
                self.loaded_head = self._head_versions()
                self.report.restored_loaded = True
        if gains is not None and min(gains) >= ESCALATION_GAIN:
            self.adapted_wins = wins + 1

    @torch.no_grad()
    def _try_candidate(self) -> None:
        """Serve the last head-only update's candidate head once it has beaten the served head by `PROMOTION_GAIN`
        on `PROMOTION_CALLS` calls in a row, on each call's decided positions (`_decisive`, which it has not trained
        on), in first-proposal acceptance and in greedy agreement. A candidate that loses is dropped (the next update
        trains a new one); one that won not yet often enough, or got no verdict, is kept for the next call's test.
        Why each condition (the measurements): docs/design.md, "Candidate head"."""
        candidate, self.candidate = self.candidate, None
        fresh = self._decisive()
        if candidate is None:
            self.candidate_wins = 0
            return
        if not fresh:  # the drafter decided no position on this call: no verdict, tested again on the next
            self.candidate = candidate
            return
        normed = self.drafter.norm(torch.stack([s.state for s in fresh]).to(self.drafter.device, self.drafter.dtype))
        gains = held_out_gains(F.linear(normed, candidate["lm_head.weight"]), self.drafter.lm_head(normed), fresh)
        self.report.candidate_gain = gains[0]
        self.candidate_wins = self.candidate_wins + 1 if min(gains) >= PROMOTION_GAIN else 0
        if 0 < self.candidate_wins < PROMOTION_CALLS:
            self.candidate = candidate  # tested again on the next call
        elif self.candidate_wins:
            for name, param in self._named(HEAD_ONLY):
                param.copy_(candidate[name])
            self.candidate_wins = 0
            self.report.promoted = True

    @torch.no_grad()
    def _keep_better_drafter(self, loaded: dict[str, torch.Tensor]) -> tuple[float, float] | None:
        """The same check for a drafter whose body changed: both drafters replay this call's depth-1 contexts (the
        root's own output), and the loaded weights come back, all of them, where they would have done better.
        Returns the gains (None: nothing to replay)."""
        replayable = [s for s in self.fresh if s.depth == 1 and s.slot >= 0 and not s.covered]
        if not replayable:
            return None
        current = draft_logits(self.drafter, replay_states(self.drafter, replayable))
        with self.drafter.loaded_weights_in_place(True):
            before = draft_logits(self.drafter, replay_states(self.drafter, replayable))
        gains = held_out_gains(current, before, replayable)
        self.report.held_out_gain = gains[0]
        if min(gains) >= 0.0:
            return gains
        for name, param in self.drafter.named_parameters():
            param.copy_(loaded[name])
        self.body_version += 1  # stored states came from the body just replaced
        self.loaded_head = self._head_versions()
        self.report.restored_loaded = True
        return gains

    def _decisive(self) -> list[SignalSample]:
        """This call's samples from the current body at positions the drafter's proposal decided: not where a free
        candidate had proposed the committed token (a better head changes nothing there; docs/design.md)."""
        return [s for s in self.fresh if s.body_version == self.body_version and not s.covered]

    def _head_versions(self) -> tuple[int, ...]:
        """Identity and in-place version of each head weight (DFlash, without a head of its own: every weight): equal to
        `loaded_head` while the loaded ones are served."""
        params = output_parameters(self.drafter) or list(self.drafter.parameters())
        return tuple(v for p in params for v in (p.data_ptr(), p._version))

    def _named(self, action: str) -> list[tuple[str, torch.nn.Parameter]]:
        wanted = {id(p) for p in trainable_parameters(self.drafter, action)}
        return [(n, p) for n, p in self.drafter.named_parameters() if id(p) in wanted]


def online_adapter_for(drafter: TreeDraftModel, state: ServingState | None = None) -> OnlineAdapter:
    """The online adaptation state of `drafter` (the drafter that drafts: `served_for(target)`) kept in `state` (by
    default the drafter's serving state of the target served last), created on first use, so it carries over
    between `generate` calls; `drafter.reset_adaptation()` drops it and restores the loaded weights."""
    if not any(p.numel() for p in drafter.parameters()):
        raise ValueError(
            f"{type(drafter).__name__} has no weights to adapt: set online_adaptation='off' (free candidates already "
            "learn their scores while serving)."
        )
    if not isinstance(drafter, (SpecBlockDraftModel, Eagle3DraftModel, DFlashDraftModel)):
        raise ValueError(
            f"online_adaptation supports SpecBlock, EAGLE-3 and DFlash drafters, not {type(drafter).__name__}: set "
            "online_adaptation='off' for it."
        )
    if drafter.bound_embedding is None:
        raise ValueError(
            f"online_adaptation={drafter.generation_config.online_adaptation!r} needs a drafter bound to its target (the "
            "update reads the target's input embedding): call drafter.bind_target(target) first (generate() does it)."
        )
    state = state if state is not None else drafter.serving_state()
    if state.adaptation is None or state.adaptation.drafter is not drafter:
        state.adaptation = OnlineAdapter(drafter)
    return state.adaptation
