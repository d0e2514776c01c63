"""The online updates: soft cross-entropy (forward KL up to a constant) of the drafter's distribution to the target's
top-k at the signal's positions.

- "head_only" trains a *candidate* output side (`lm_head`) on the stored drafter states, served only once it has
  beaten the served one on a call it has not seen (`adapter.py`): no drafter forward, an order of magnitude cheaper
  than
- "full", which trains the whole drafter in place, replaying the samples' committed contexts (the last
  `adaptation_context` positions before each sample's root) through the drafter with gradients.
SpecBlock's rank head is not trained online (it still sees the adapted head's distribution through its features):
trained on one call's labels it cost tau on the next call, in domain and out (measured, docs/design.md).
DFlash drafts with the target's own `lm_head` (frozen, never given a gradient): it has no output side of its own, so
its only update is "full", on replays of its block (`_replay_dflash_block`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from ...models.dflash.modeling_dflash import DFlashDraftModel
from ...models.eagle3.modeling_eagle3 import Eagle3DraftModel
from ...models.specblock.modeling_specblock import SpecBlockDraftModel, block_causal_mask
from ...models.tree_drafter.modeling_tree_drafter import TreeDraftModel
from .signal import SignalBuffer, SignalSample

HEAD_ONLY, FULL = "head_only", "full"
HEAD_STEPS, HEAD_BATCH = 10, 256  # Adam steps of a candidate head, newest stored states it trains on
HEAD_DRAFT_ROWS, HEAD_TARGET_ROWS = 16, 8  # rows a candidate trains: each state's top proposals, the target's top ids
FULL_STEPS, FULL_BATCH = 4, 16  # gradient steps per whole-drafter update, newest replayable samples per step
FULL_STORED = 64  # newest stored states a whole-drafter update trains the output side on besides the replay
FULL_LR_SCALE = 0.5  # a whole-drafter update's output-side rate over `adaptation_learning_rate` (1x lowered tau)
BODY_LR_SCALE = 0.1  # the body's learning rate relative to the output side's (at 1x a full update lowered tau)


def output_parameters(drafter: TreeDraftModel) -> list[nn.Parameter]:
    """The output side: `lm_head` (none for DFlash, whose output layer is the target's)."""
    return [] if isinstance(drafter, DFlashDraftModel) else list(drafter.lm_head.parameters())


def trainable_parameters(drafter: TreeDraftModel, action: str) -> list[nn.Parameter]:
    """What `action` trains: the output side, or every weight but the rank head (see the module docstring)."""
    if action == HEAD_ONLY:
        return output_parameters(drafter)
    frozen = {id(p) for p in drafter.rank_head.parameters()} if isinstance(drafter, SpecBlockDraftModel) else set()
    return [p for p in drafter.parameters() if id(p) not in frozen]


def draft_logits(drafter: TreeDraftModel, states: torch.Tensor) -> torch.Tensor:
    """Drafter states [S, H] (pre-norm; DFlash: its block outputs, normed) -> draft logits [S, Vd]. DFlash reads the
    target's `lm_head` weight detached, so no gradient reaches it (its draft vocabulary is the full one)."""
    if isinstance(drafter, DFlashDraftModel):
        weight, _ = drafter.target_head()  # [V, H]
        return F.linear(states.to(weight.device, weight.dtype), weight.detach())
    return drafter.lm_head(drafter.norm(states))


def replay_states(drafter: TreeDraftModel, samples: list[SignalSample]) -> torch.Tensor:
    """[S, H] the samples' states recomputed (with gradients) from their committed contexts: samples of one verified
    tree share a context, and contexts of one length run as one batched drafter forward. A sample's `slot` picks its
    state among its context's outputs (the root position's output slot; DFlash: the block position)."""
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
    """[G, K, H] (EAGLE-3: K = 1; DFlash: `_replay_dflash_block`) the last position's output states of G contexts of
    C positions (features [G, C, 3H], tokens and positions [G, C]) from a fresh drafter pass: the first C-1 positions
    without gradients into a cache, the last one with (truncated backpropagation: the update does not flow through the
    context's keys and values, which keeps a whole-drafter update to one position's backward per sample)."""
    if isinstance(drafter, DFlashDraftModel):
        return _replay_dflash_block(drafter, features, tokens, positions)
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


def _replay_dflash_block(
    drafter: DFlashDraftModel, features: torch.Tensor, tokens: torch.LongTensor, positions: torch.LongTensor
) -> torch.Tensor:
    """[G, Q, H] DFlash's block outputs (Q = block_size; position d's output proposed depth d) for G contexts of C
    committed positions ending at the root (features [G, C, L * H_target] of the positions before tokens [G, C] at
    rotary positions [G, C]): one fresh forward of the context and the block [root, mask, ...], as the generator ran
    it with the context cut to these C positions. The context runs with gradients too: it only feeds each layer's
    keys / values (no layer runs over it), so this costs C rows of projections and trains `fc` / `hidden_norm`."""
    device = drafter.device
    positions = positions.to(device)
    block = positions[:, -1:] + torch.arange(drafter.config.block_size, device=device)  # [G, Q]: root, root + 1, ...
    embeds = drafter.embed_block(tokens[:, -1].to(device))  # [G, Q, H], the target's embedding without gradient
    # a feature f_i is at position i, the token it predicts at i + 1
    position_ids = torch.cat([positions - 1, block], dim=1)  # [G, C + Q]
    return drafter(noise_embeds=embeds, context_hidden_states=features, position_ids=position_ids).last_hidden_state


def adaptation_loss(
    drafter: TreeDraftModel, samples: list[SignalSample], states: torch.Tensor
) -> torch.Tensor:
    """Soft cross entropy to the target's top-k (renormalised over the draft vocabulary's part of it).
    states: [S, H]."""
    log_q = draft_logits(drafter, states).float().log_softmax(-1)  # [S, Vd]
    return soft_cross_entropy(log_q, *soft_labels(samples, log_q.device))


def soft_labels(samples: list[SignalSample], device: torch.device) -> tuple[torch.LongTensor, torch.Tensor]:
    """ids [S, k] (-1: outside the draft vocabulary) and probabilities [S, k] of the target's top-k, renormalised
    over its draft-vocabulary part."""
    ids = torch.stack([s.target_ids for s in samples]).to(device)
    probs = torch.stack([s.target_probs for s in samples]).to(device) * (ids >= 0)
    return ids, probs / probs.sum(-1, keepdim=True).clamp(min=1e-12)


def soft_cross_entropy(log_q: torch.Tensor, ids: torch.LongTensor, probs: torch.Tensor) -> torch.Tensor:
    """Mean over rows of -sum_k probs * log_q[ids] (log_q [S, V'], ids / probs [S, k]; ids -1 weigh nothing)."""
    return -(probs * (ids >= 0) * log_q.gather(1, ids.clamp(min=0))).sum(-1).mean()


def first_token_acceptance(logits: torch.Tensor, samples: list[SignalSample]) -> float:
    """Summed target probability of each row's top draft token (logits [S, Vd]): how often the drafter's first
    proposal at these positions would be what the target picks (0 where it is outside the target's top-k)."""
    ids = torch.stack([s.target_ids for s in samples]).to(logits.device)  # [S, k]
    probs = torch.stack([s.target_probs for s in samples]).to(logits.device)
    top = logits.argmax(-1, keepdim=True)  # [S, 1]
    return float((probs * (ids == top)).sum())


def greedy_agreement(logits: torch.Tensor, samples: list[SignalSample]) -> int:
    """How many rows' top draft token is the target's own top token (logits [S, Vd]): what greedy decoding accepts
    (`first_token_acceptance` also credits a second choice the target gives some probability, which greedy never
    accepts)."""
    best = torch.stack([s.target_ids[0] for s in samples]).to(logits.device)  # [S] (-1: outside the draft vocabulary)
    return int((logits.argmax(-1) == best).sum())


def held_out_gains(tried: torch.Tensor, served: torch.Tensor, samples: list[SignalSample]) -> tuple[float, float]:
    """What output side `tried` gains over `served` (draft logits [S, Vd] at the same states) per sample: first-proposal
    acceptance (`first_token_acceptance`) and greedy agreement (`greedy_agreement`)."""
    soft = first_token_acceptance(tried, samples) - first_token_acceptance(served, samples)
    greedy = greedy_agreement(tried, samples) - greedy_agreement(served, samples)
    return soft / len(samples), greedy / len(samples)


@torch.no_grad()
def sgd_step(groups: list[tuple[list[nn.Parameter], float]]) -> None:
    """One plain gradient step per (parameters, learning rate) group (a group without gradients is left alone)."""
    for params, learning_rate in groups:
        stepped = [p for p in params if p.grad is not None]
        if stepped:
            torch._foreach_add_(stepped, [p.grad for p in stepped], alpha=-learning_rate)


def train_candidate_head(
    drafter: TreeDraftModel, buffer: SignalBuffer, body_version: int, start: torch.Tensor, learning_rate: float
) -> tuple[torch.Tensor, float] | None:
    """A candidate `lm_head` weight [Vd, H]: `start` (the loaded head) trained with `HEAD_STEPS` Adam steps at
    `learning_rate` on the newest `HEAD_BATCH` stored states the current body computed. Only the rows that matter move:
    each state's top `HEAD_DRAFT_ROWS` draft proposals and the target's top `HEAD_TARGET_ROWS` ids (the softmax runs
    over those rows), which makes an update a few times cheaper than a dense one and leaves every other row as
    loaded. Returns (the weight, the first step's loss), or None when there is nothing to learn from.

    Why Adam from the loaded head on the whole buffer (the served head stays untouched, so this is safe): trained
    offline on all of a code stream's first six calls, this learner lifted SpecBlock's tau on the next three by 23%
    where plain SGD reached 12%; served online behind the promotion test it lifted code tau by 15% (32-token calls)
    and 7% (128) against 12% and 2% for two SGD steps on the newest 64 states, in half their time (docs/design.md)."""
    samples = buffer.for_head(body_version, HEAD_BATCH)
    if not samples:
        return None
    device = drafter.device
    weight = start.detach().to(device=device, dtype=torch.float32)  # [Vd, H]: Adam's moments want float32
    with torch.no_grad():
        normed = drafter.norm(torch.stack([s.state for s in samples]).to(device, drafter.dtype)).float()  # [S, H]
        ids, probs = soft_labels(samples, device)  # [S, k]
        proposals = F.linear(normed, weight).topk(min(HEAD_DRAFT_ROWS, weight.shape[0]), dim=-1).indices  # [S, P]
        target_top = ids[:, :HEAD_TARGET_ROWS]
        rows = torch.cat([target_top[target_top >= 0], proposals.flatten()]).unique()  # [R]
        local = torch.full((weight.shape[0],), -1, dtype=torch.long, device=device)
        local[rows] = torch.arange(rows.numel(), device=device)
        ids = torch.where(ids >= 0, local[ids.clamp(min=0)], -1)  # labels outside the trained rows weigh nothing
    trained = weight[rows].clone().requires_grad_(True)  # [R, H]
    optimizer = torch.optim.Adam([trained], lr=learning_rate)
    first_loss = None
    with torch.enable_grad():
        for _ in range(HEAD_STEPS):
            loss = soft_cross_entropy(F.linear(normed, trained).log_softmax(-1), ids, probs)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            first_loss = float(loss.detach()) if first_loss is None else first_loss
    weight = weight.index_copy(0, rows, trained.detach())
    return weight.to(start.dtype), first_loss


def update_whole_drafter(
    drafter: TreeDraftModel, buffer: SignalBuffer, body_version: int, learning_rate: float
) -> float | None:
    """A whole-drafter update, in place: `FULL_STEPS` plain gradient steps at `FULL_LR_SCALE` of `learning_rate` on
    the newest `FULL_STORED` states the current body computed (output side) plus the newest `FULL_BATCH` replayable
    samples (every weight but the rank head; the body at `BODY_LR_SCALE` of the head's rate; DFlash, without an output
    side of its own: the replayed samples alone, every weight at the body's rate). Returns the first
    step's loss, or None when there is nothing to learn from (nothing is changed then).

    Plain SGD, not Adam: Adam's first steps move every weight by about the learning rate whatever its gradient, and
    a whole-drafter update is served at once; a gradient step moves a weight as much as the signal asks (measured,
    docs/design.md)."""
    head = output_parameters(drafter)
    # stored states train the output side alone (DFlash has none: its update is the replay's)
    stored_samples = buffer.for_head(body_version, FULL_STORED) if head else []
    replay = buffer.for_replay(FULL_BATCH)
    if not stored_samples and not replay:
        return None
    learning_rate *= FULL_LR_SCALE
    head_ids = {id(p) for p in head}
    body = [p for p in trainable_parameters(drafter, FULL) if id(p) not in head_ids]
    groups = [(head, learning_rate), (body, learning_rate * BODY_LR_SCALE)]
    stored = None
    if stored_samples:
        stored = torch.stack([s.state for s in stored_samples]).to(drafter.device, drafter.dtype)
    first_loss = None
    was_training = drafter.training
    drafter.train(False)  # dropout-free: the drafter keeps drafting in eval mode
    with torch.enable_grad():
        for step in range(FULL_STEPS):
            loss = adaptation_loss(drafter, stored_samples, stored) if stored_samples else 0.0
            if replay:
                loss = loss + adaptation_loss(drafter, replay, replay_states(drafter, replay))
            drafter.zero_grad(set_to_none=True)
            loss.backward()
            sgd_step(groups)
            if step == 0:
                first_loss = float(loss.detach())
    drafter.zero_grad(set_to_none=True)  # also the final norm's, which the update does not train
    drafter.train(was_training)
    return first_loss
