"""Online adaptation: the drafter learns from the verifier while it serves (`TreeDrafterConfig.online_adaptation`).

signal.py (what a verification teaches: the target's top-k where the drafter proposed, bounded buffer), update.py
(head-only and whole-drafter updates), bandit.py (the cost-aware choice between skip / head-only / full),
adapter.py (the per-drafter state the decoding loop drives: capture, score, roll back, update).
"""

from .adapter import AdaptationReport, OnlineAdapter, online_adapter_for
from .bandit import SKIP, WAIT, Backoff, CostAwareBandit
from .signal import SignalBuffer, SignalSample, collect_signal
from .update import FULL, HEAD_ONLY, train_candidate_head, update_whole_drafter

__all__ = [
    "FULL",
    "HEAD_ONLY",
    "SKIP",
    "WAIT",
    "AdaptationReport",
    "Backoff",
    "CostAwareBandit",
    "OnlineAdapter",
    "SignalBuffer",
    "SignalSample",
    "collect_signal",
    "online_adapter_for",
    "train_candidate_head",
    "update_whole_drafter",
]
