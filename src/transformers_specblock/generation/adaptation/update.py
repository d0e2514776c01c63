"""The online update: soft cross-entropy (forward KL up to a constant) of the drafter's distribution to the target's
top-k at the signal's positions, with a small Adam step.

- "head_only" trains the output side (`lm_head`, and the rank head where the drafter has one) on the stored drafter
  states: no drafter forward, an order of magnitude cheaper than
- "full", which also trains every drafter weight by replaying the samples' committed contexts (the last
  `adaptation_context` positions before each sample's root) through the drafter with gradients.
The rank head learns the class of the target's top token's rank under the updated draft distribution (plain cross
entropy; the training loss's distance weighting lives in `training`, which generation may not import).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from ...models.eagle3.modeling_eagle3 import Eagle3DraftModel
from ...models.specblock.modeling_specblock import SpecBlockDraftModel, block_causal_mask
from ...models.tree_drafter.modeling_tree_drafter import TreeDraftModel
from .signal import SignalBuffer, SignalSample

HEAD_ONLY, FULL = "head_only", "full"
HEAD_STEPS, HEAD_BATCH = 4, 64  # Adam steps per update, newest stored states per step (output side)
FULL_STEPS, FULL_BATCH = 4, 16  # Adam steps per whole-drafter update, newest replayable samples per step
BODY_LR_SCALE = 0.1  # the body's learning rate relative to the output side's (at 1x a full update lowered tau)


def output_parameters(drafter: TreeDraftModel) -> list[nn.Parameter]:
    """The output side: `lm_head`, plus the rank head where the drafter has one."""
    params = list(drafter.lm_head.parameters())
    if isinstance(drafter, SpecBlockDraftModel):
        params += list(drafter.rank_head.parameters())
    return params


def trainable_parameters(drafter: TreeDraftModel, action: str) -> list[nn.Parameter]:
    return output_parameters(drafter) if action == HEAD_ONLY else list(drafter.parameters())


def draft_heads(drafter: TreeDraftModel, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pre-norm drafter states [S, H] -> draft logits [S, Vd] and rank logits [S, C] (None without a rank head)."""
    if isinstance(drafter, SpecBlockDraftModel):
        return drafter.heads(states)
    return drafter.lm_head(drafter.norm(states)), None


def replay_states(drafter: TreeDraftModel, samples: list[SignalSample]) -> torch.Tensor:
    """[S, H] the samples' states recomputed (with gradients) from their committed contexts: samples of one verified
    tree share a context, and contexts of one length run as one batched drafter forward."""
    contexts: dict[int, int] = {}  # id(context) -> row among the distinct contexts
    distinct = []
    for sample in samples:
        if id(sample.context) not in contexts:
            contexts[id(sample.context)] = len(distinct)
            distinct.append(sample.context)
    by_length: dict[int, list[int]] = {}
    for row, context in enumerate(distinct):
        by_length.setdefault(context[1].shape[0], []).append(row)
    outputs: list[torch.Tensor | None] = [None] * len(distinct)  # [K, H] per context
    for rows in by_length.values():
        features, tokens, positions = (torch.stack([distinct[r][i] for r in rows]) for i in range(3))
        for r, out in zip(rows, _replay_root_outputs(drafter, features, tokens, positions)):
            outputs[r] = out
    return torch.stack([outputs[contexts[id(s.context)]][s.slot] for s in samples])


def _replay_root_outputs(
    drafter: TreeDraftModel, features: torch.Tensor, tokens: torch.LongTensor, positions: torch.LongTensor
) -> torch.Tensor:
    """[G, K, H] (EAGLE-3: K = 1) the last position's output states of G contexts of C positions (features
    [G, C, 3H], tokens and positions [G, C]) from a fresh drafter pass: the first C-1 positions without gradients
    into a cache, the last one with (truncated backpropagation: the update does not flow through the context's keys
    and values, which keeps a whole-drafter update to one position's backward per sample)."""
    batch, num_pos = tokens.shape
    device = drafter.device
    tokens, positions = tokens.to(device), positions.to(device)
    cache = DynamicCache()
    if isinstance(drafter, SpecBlockDraftModel):
        k_slots = drafter.config.block_size
        condition = drafter.project_condition(features)  # [G, C, H]
        if num_pos > 1:
            with torch.no_grad():
                mask = block_causal_mask(num_pos - 1, k_slots, 0, device)[None].expand(batch, -1, -1)
                drafter.draft_blocks(
                    condition[:, :-1], tokens[:, :-1], positions[:, :-1], mask, cache, compute_heads=False
                )
        mask = block_causal_mask(1, k_slots, (num_pos - 1) * k_slots, device)[None].expand(batch, -1, -1)
        last = drafter.draft_blocks(
            condition[:, -1:], tokens[:, -1:], positions[:, -1:], mask, cache, compute_heads=False
        )
        return last.hidden_states[:, -1]
    if isinstance(drafter, Eagle3DraftModel):
        fused = drafter.fuse_features(features)  # [G, C, H]
        if num_pos > 1:
            with torch.no_grad():
                mask = torch.ones(num_pos - 1, num_pos - 1, dtype=torch.bool, device=device).tril()
                drafter.draft_step(fused[:, :-1], tokens[:, :-1], positions[:, :-1], mask.expand(batch, -1, -1), cache)
        mask = torch.ones(batch, 1, num_pos, dtype=torch.bool, device=device)
        return drafter.draft_step(fused[:, -1:], tokens[:, -1:], positions[:, -1:], mask, cache).hidden_states
    raise TypeError(f"No replay is defined for {type(drafter).__name__}; use online_adaptation='head_only'.")


def adaptation_loss(
    drafter: TreeDraftModel, samples: list[SignalSample], states: torch.Tensor
) -> torch.Tensor:
    """Soft cross entropy to the target's top-k (renormalised over the draft vocabulary's part of it), plus the rank
    head's cross entropy where the drafter has one. states: [S, H]."""
    logits, rank_logits = draft_heads(drafter, states)
    log_q = logits.float().log_softmax(-1)  # [S, Vd]
    ids = torch.stack([s.target_ids for s in samples]).to(log_q.device)  # [S, k]
    probs = torch.stack([s.target_probs for s in samples]).to(log_q.device) * (ids >= 0)
    probs = probs / probs.sum(-1, keepdim=True).clamp(min=1e-12)
    loss = -(probs * log_q.gather(1, ids.clamp(min=0))).sum(-1).mean()
    if rank_logits is not None:
        labels = rank_classes(logits.detach(), ids[:, 0], drafter.config.rank_bucket_upper_bounds)
        loss = loss + F.cross_entropy(rank_logits.float(), labels)
    return loss


def first_token_acceptance(logits: torch.Tensor, samples: list[SignalSample]) -> float:
    """Summed target probability of each row's top draft token (logits [S, Vd]): how often the drafter's first
    proposal at these positions would be what the target picks (0 where it is outside the target's top-k)."""
    ids = torch.stack([s.target_ids for s in samples]).to(logits.device)  # [S, k]
    probs = torch.stack([s.target_probs for s in samples]).to(logits.device)
    top = logits.argmax(-1, keepdim=True)  # [S, 1]
    return float((probs * (ids == top)).sum())


def rank_classes(logits: torch.Tensor, target_ids: torch.LongTensor, upper_bounds: list[int]) -> torch.LongTensor:
    """[S] rank-head class of each target id's 1-based rank in its row of `logits` [S, Vd] (id -1: the last class)."""
    own = logits.gather(1, target_ids.clamp(min=0)[:, None])
    ranks = torch.where(target_ids >= 0, (logits > own).sum(-1) + 1, logits.shape[-1] + 1)
    return torch.bucketize(ranks, torch.tensor(list(upper_bounds), device=ranks.device), right=False)


class DrafterUpdater:
    """Runs head-only and whole-drafter updates with one Adam optimizer each (their moments carry over between
    calls; `reset` drops them, e.g. after a rollback)."""

    def __init__(self, drafter: TreeDraftModel, learning_rate: float) -> None:
        self.drafter = drafter
        self.learning_rate = learning_rate
        self.optimizers: dict[str, torch.optim.Optimizer] = {}

    def reset(self) -> None:
        self.optimizers.clear()

    def update(self, action: str, buffer: SignalBuffer, body_version: int) -> float | None:
        """Train on the buffer: head-only on the newest states the current body computed; full on those too (the
        output side) plus the newest replayable samples (every weight). Returns the first step's loss, or None
        when there is nothing to learn from (nothing is changed then)."""
        stored_samples = buffer.for_head(body_version, HEAD_BATCH)
        replay = buffer.for_replay(FULL_BATCH) if action == FULL else []
        if not stored_samples and not replay:
            return None
        optimizer = self.optimizers.get(action)
        if optimizer is None or optimizer.param_groups[0]["lr"] != self.learning_rate:
            head = output_parameters(self.drafter)
            head_ids = {id(p) for p in head}
            groups = [{"params": head, "lr": self.learning_rate}]
            if action == FULL:
                body = [p for p in self.drafter.parameters() if id(p) not in head_ids]
                groups.append({"params": body, "lr": self.learning_rate * BODY_LR_SCALE})
            fused = self.drafter.device.type in ("cpu", "cuda")  # one kernel per step: 8x faster on a CPU core
            optimizer = self.optimizers[action] = torch.optim.Adam(groups, fused=fused)
        stored = None
        if stored_samples:
            stored = torch.stack([s.state for s in stored_samples]).to(self.drafter.device, self.drafter.dtype)
        first_loss = None
        was_training = self.drafter.training
        self.drafter.train(False)  # dropout-free: the drafter keeps drafting in eval mode
        with torch.enable_grad():
            for step in range(HEAD_STEPS if action == HEAD_ONLY else FULL_STEPS):
                loss = adaptation_loss(self.drafter, stored_samples, stored) if stored_samples else 0.0
                if replay:
                    loss = loss + adaptation_loss(self.drafter, replay, replay_states(self.drafter, replay))
                self.drafter.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                if step == 0:
                    first_loss = float(loss.detach())
        self.drafter.zero_grad(set_to_none=True)  # also the final norm's, which head-only does not train
        self.drafter.train(was_training)
        return first_loss
