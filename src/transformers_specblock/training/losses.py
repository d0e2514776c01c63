"""The parts of the training loss (soft CE, valid prefix, rank labels and the rank-head loss), the per-block terms,
the follow-up block visibility mask, the cross-process sum of the normalisers and the logged metrics."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..models.tree_drafter.modeling_tree_drafter import training_stat_names


class _SoftCrossEntropy(torch.autograd.Function):
    """Soft CE whose backward writes ``(softmax * sum(p) - p) * grad`` into one buffer (autograd's composite version
    allocates several temporaries of the logits' size)."""

    @staticmethod
    def forward(ctx, draft_logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:  # noqa: D102
        log_q = draft_logits.float().log_softmax(-1)
        ctx.save_for_backward(log_q, target_probs)
        ctx.logits_dtype = draft_logits.dtype
        return -torch.linalg.vecdot(target_probs.float(), log_q)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        log_q, target_probs = ctx.saved_tensors
        grad_logits = log_q.exp().mul_(target_probs.sum(-1, keepdim=True)).sub_(target_probs).mul_(grad[..., None])
        return grad_logits.to(ctx.logits_dtype), None


def soft_cross_entropy(draft_logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """``-sum_v p(v) log softmax(draft_logits)(v)`` over the last dim (p: the target's draft-vocab distribution, no
    gradient), computed in float32."""
    return _SoftCrossEntropy.apply(draft_logits, target_probs.detach())


def target_ranks(draft_logits: torch.Tensor, target_index: torch.LongTensor) -> torch.LongTensor:
    """1-based rank of the target's token (a draft-vocab index, -1 = not in the draft vocabulary) in each draft
    distribution: 1 + the number of draft logits strictly above its logit; ``Vd + 1`` when not in the vocabulary."""
    logits = draft_logits.detach().float()
    own = logits.gather(-1, target_index.clamp(min=0)[..., None])
    ranks = (logits > own).sum(-1) + 1
    return torch.where(target_index >= 0, ranks, logits.shape[-1] + 1)


def rank_labels(ranks: torch.LongTensor, upper_bounds: Sequence[int], in_vocab: torch.BoolTensor) -> torch.LongTensor:
    """Rank-head class per slot: class c holds ranks in (bounds[c-1], bounds[c]] (bounds (1, 4, 10): rank 1 -> 0,
    2-4 -> 1, 5-10 -> 2, >10 -> 3); a target token outside the draft vocabulary is always the last class."""
    bounds = torch.tensor(list(upper_bounds), device=ranks.device)
    labels = torch.bucketize(ranks, bounds, right=False)
    return torch.where(in_vocab, labels, len(bounds))


def ordinal_targets(labels: torch.LongTensor, num_classes: int, smoothing: float, under_penalty: float) -> torch.Tensor:
    """Asymmetric ordinal label smoothing: ``1 - eps`` on the label, ``eps * u/(u+1)`` on the next higher class and
    ``eps * 1/(u+1)`` on the next lower one (u = ``under_penalty``; at an edge the whole eps goes to the one
    neighbour; with a single class no smoothing)."""
    target = F.one_hot(labels, num_classes).float()
    if smoothing <= 0 or num_classes < 2:
        return target
    up_share = under_penalty / (under_penalty + 1.0)
    up = torch.where(labels == 0, 1.0, torch.where(labels == num_classes - 1, 0.0, up_share))
    target = target * (1 - smoothing)
    higher = (labels + 1).clamp(max=num_classes - 1)
    lower = (labels - 1).clamp(min=0)
    up_mass = smoothing * up * (labels < num_classes - 1)
    down_mass = smoothing * (1 - up) * (labels > 0)
    target = target.scatter_add(-1, higher[..., None], up_mass[..., None])
    target = target.scatter_add(-1, lower[..., None], down_mass[..., None])
    return target


def rank_head_loss(
    rank_logits: torch.Tensor,
    labels: torch.LongTensor,
    mask: torch.BoolTensor,
    class_counts: torch.Tensor | None = None,
    class_weight_power: float = 0.5,
    label_smoothing: float = 0.1,
    distance_weight: float = 1.0,
    under_penalty: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-head loss: returns (weighted loss sum, weight sum); the loss is their ratio.

    Per counted slot with label y and predicted class distribution p over C classes::

        l = -sum_c q_c log p_c  +  distance_weight * sum_c p_c * D(c, y) / (C - 1)
        D(c, y) = under_penalty * (y - c)  if c < y  (under-estimating the rank: a branch that would have been
                  (c - y)                  if c >= y  accepted is not drafted)

    q: `ordinal_targets` (asymmetric ordinal smoothing). Each slot is weighted by its class weight
    ``w_y = (N / (C * max(n_y, 1))) ** class_weight_power``, where n_c are the counted slots of class c in
    ``class_counts`` (default: counted in ``mask``; under DDP: summed over processes) and N = sum n_c.
    """
    num_classes = rank_logits.shape[-1]
    labels = labels.clamp(max=num_classes - 1)
    mask_f = mask.float()
    if class_counts is None:
        class_counts = torch.bincount(labels[mask], minlength=num_classes).float()
    total = class_counts.sum()
    class_weights = (total / (num_classes * class_counts.clamp(min=1))).pow(class_weight_power)
    log_p = rank_logits.float().log_softmax(-1)
    q = ordinal_targets(labels, num_classes, label_smoothing, under_penalty)
    loss = -(q * log_p).sum(-1)
    if distance_weight and num_classes > 1:
        c = torch.arange(num_classes, device=labels.device)
        diff = labels[..., None] - c  # > 0: class c under-estimates the label
        dist_ = torch.where(diff > 0, under_penalty * diff, -diff).float() / (num_classes - 1)
        loss = loss + distance_weight * (log_p.exp() * dist_).sum(-1)
    weights = class_weights[labels] * mask_f
    return (loss * weights).sum(), (class_counts * class_weights).sum()


def reference_rank_loss(
    rank_logits: torch.Tensor,
    labels: torch.LongTensor,
    mask: torch.BoolTensor,
    start: torch.BoolTensor,
    budget_per_class: int = 10,
) -> torch.Tensor:
    """The SpecBlock reference's rank-head loss of one block (its ``_compute_batched_loss_acc_and_rank``).

    rank_logits [B, P, K, C], labels [B, P, K], mask [B, P, K] (the slot's target exists, is counted and lies in the
    draft vocabulary), start [B, P] (where a position's chain starts). Slot k of a position counts while every
    earlier slot's predicted class was right (the chain includes the first wrong one); per slot, class c weighs
    ``min(1, budget_per_class / n_c)`` (n_c: counted slots of that class; <= 0 disables it); the soft target is the
    kernel ``1 / (1 + |c - y| + max(y - c, 0))^2`` normalised; each slot's cross-entropy is multiplied by
    ``1 + |y - p| + max(y - p, 0)`` (p: the predicted class). The loss is the weighted mean over counted slots.
    """
    num_classes = rank_logits.shape[-1]
    labels = labels.clamp(max=num_classes - 1)
    predicted = rank_logits.detach().argmax(-1)
    survived = (predicted == labels).long().cumprod(-1)
    chain = start[..., None] & F.pad(survived[..., :-1], (1, 0), value=1).bool()
    counted = (chain & mask).float()
    one_hot = F.one_hot(labels, num_classes).float()
    if budget_per_class > 0:
        counts = (one_hot * counted[..., None]).sum((0, 1))  # [K, C]
        class_weights = (budget_per_class / counts.clamp(min=1)).clamp(max=1.0)
        weights = (one_hot * class_weights).sum(-1) * counted
    else:
        weights = counted
    classes = torch.arange(num_classes, device=labels.device).float()
    diff = labels[..., None].float() - classes
    kernel = 1.0 / (1.0 + diff.abs() + diff.clamp(min=0.0)).square()
    soft = kernel / kernel.sum(-1, keepdim=True)
    ce = -(soft * rank_logits.float().log_softmax(-1)).sum(-1)
    miss = (labels - predicted).float()
    distance = 1.0 + miss.abs() + miss.clamp(min=0.0)
    total = weights.sum()
    return torch.where(total > 0, (ce * distance * weights).sum() / total.clamp(min=1e-12), total)


@dataclass
class BlockTerms:
    """Per (batch, position, slot) terms of one block; see `block_terms`."""

    ce: torch.Tensor  # float, with grad
    correct: torch.BoolTensor  # draft argmax == target argmax
    in_vocab: torch.BoolTensor  # target argmax inside the draft vocabulary
    counted: torch.BoolTensor  # predicted token exists and is an assistant token
    exists: torch.BoolTensor  # predicted token exists (not padding, inside the sequence)
    labels: torch.LongTensor  # rank-head class
    prefix: torch.BoolTensor  # slots 0..k-1 all correct
    rank_logits: torch.Tensor  # [..., num_rank_classes], with grad


def slot_windows(values: torch.Tensor, start: int, num_pos: int, k_slots: int, fill: float | bool) -> torch.Tensor:
    """[B, T, ...] -> [B, P, K, ...] with ``out[:, i, k] = values[:, start + i + k]`` (``fill`` past the end): a
    strided view of ``values`` (padded once if the windows run past it), no copy per slot."""
    need = start + num_pos + k_slots - 1
    missing = need - values.shape[1]
    if missing > 0:
        values = torch.cat([values, values.new_full((values.shape[0], missing, *values.shape[2:]), fill)], dim=1)
    return values[:, start:need].unfold(1, k_slots, 1).movedim(-1, 2)


def _scatter_rows(rows: tuple[torch.Tensor, ...], values: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Dense [*shape, ...] zeros holding ``values`` at the ``rows`` indices (differentiable in ``values``)."""
    return values.new_zeros(*shape, *values.shape[1:]).index_put(rows, values)


def block_terms(
    heads: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    hidden: torch.Tensor,
    target_probs: torch.Tensor,
    target_index: torch.LongTensor,
    loss_tokens: torch.BoolTensor,
    real_tokens: torch.BoolTensor,
    offset: int,
    rank_bounds: Sequence[int],
    soft_labels: bool = True,
    valid_prefix_mask: bool = True,
    rank_chain_mask: bool = True,
    metrics: bool = False,
) -> BlockTerms:
    """Align one block's slots with the target and compute its per-slot terms, running the heads only where read.

    heads: slot states [N, H] -> (draft logits [N, Vd], rank logits [N, C]); hidden [B, P, K, H] the block's
    pre-norm slot states for positions i = 0..P-1 (P = T-1); target_probs [B, T, Vd] the target's draft-vocab
    distribution per sequence position; target_index [B, T] its argmax as a draft index (-1: outside the draft
    vocabulary); loss_tokens / real_tokens [B, T] assistant / non-padding tokens. With the block's cumulative
    ``offset`` (0 for block 1), slot k of position i is compared with target position j = i + 1 + offset + k and
    predicts token j + 1 (past the sequence: every flag False).

    Slot by slot, the heads run with gradient on the slots a loss counts (assistant token; valid prefix when the
    masks ask for it) and without gradient where only the slot's correctness is read (the prefix of a later counted
    slot; with ``metrics``, as for block 1's logged accuracy and acceptance: every counted slot and the greedy chain
    of rows whose slot 0 counts). Elsewhere ce, rank logits and label are 0 and correct is False: no term reads
    them. The loss, its gradient and the metrics equal those of running the heads on every slot; with the valid-
    prefix masks most later slots are skipped (one in five slot-0 guesses right -> slot 1 runs on a fifth of rows).
    """
    batch, num_pos, k_slots, _ = hidden.shape
    length, start = target_probs.shape[1], 1 + offset
    # target position T-1 predicts nothing: cutting it makes every slot past the end read the fill
    probs = slot_windows(target_probs[:, : length - 1], start, num_pos, k_slots, 0.0)
    tid = slot_windows(target_index[:, : length - 1], start, num_pos, k_slots, -1)
    counted = slot_windows(loss_tokens & real_tokens, start + 1, num_pos, k_slots, False)
    exists = slot_windows(real_tokens, start + 1, num_pos, k_slots, False)
    in_vocab = tid >= 0
    any_from = counted.flip(-1).cumsum(-1).flip(-1) > 0  # a slot >= k counts
    counted_later = F.pad(any_from[..., 1:], (0, 1))
    chain_rows = counted[..., 0] & exists[..., -1] if metrics else torch.zeros_like(counted[..., 0])
    prefix = torch.ones_like(counted[..., 0])
    cols: dict[str, list[torch.Tensor]] = {k: [] for k in ("ce", "correct", "labels", "prefix", "rank_logits")}
    shape = (batch, num_pos)
    for k in range(k_slots):
        draft_rows = counted[..., k] & in_vocab[..., k] & (prefix if valid_prefix_mask else True)
        grad_rows = draft_rows | (counted[..., k] & (prefix if rank_chain_mask else True))
        read_rows = prefix & (counted_later[..., k] | chain_rows) | (counted[..., k] if metrics else False)
        rows = grad_rows.nonzero(as_tuple=True)
        logits, rank_logits = heads(hidden[:, :, k][rows])
        slot_tid = tid[..., k][rows]
        if soft_labels:
            ce = soft_cross_entropy(logits, probs[:, :, k][rows])
        else:
            ce = F.cross_entropy(logits.float(), slot_tid.clamp(min=0), reduction="none")
        ranks = target_ranks(logits, slot_tid)
        correct = torch.zeros(shape, dtype=torch.bool, device=hidden.device)
        correct[rows] = (logits.detach().argmax(-1) == slot_tid) & (slot_tid >= 0)
        other = (read_rows & ~grad_rows).nonzero(as_tuple=True)
        if other[0].numel():
            with torch.no_grad():
                other_tid = tid[..., k][other]
                correct[other] = (heads(hidden[:, :, k][other])[0].argmax(-1) == other_tid) & (other_tid >= 0)
        cols["ce"].append(_scatter_rows(rows, ce, shape))
        cols["labels"].append(_scatter_rows(rows, rank_labels(ranks, rank_bounds, slot_tid >= 0), shape))
        cols["rank_logits"].append(_scatter_rows(rows, rank_logits, shape))
        cols["correct"].append(correct)
        cols["prefix"].append(prefix)
        prefix = prefix & correct
    stacked = {key: torch.stack(v, dim=2) for key, v in cols.items()}
    return BlockTerms(**stacked, in_vocab=in_vocab, counted=counted, exists=exists)


def draft_loss(
    masked_sums: torch.Tensor, counts: torch.Tensor, slot_weights: torch.Tensor, normalization: str = "valid_prefix"
) -> torch.Tensor:
    """Draft loss from per-(block, slot) masked CE sums and counted slots [blocks, K]: the mean over blocks of
    ``sum_k w_k * masked_sums[b, k] / den[b, k]``, den = ``counts[b, k]`` (``valid_prefix``: the slot's own count,
    the reference formula) or ``counts[b, 0]`` (``slot0``: the block's slot-0 count), at least 1."""
    den = counts[:, :1] if normalization == "slot0" else counts
    return (slot_weights * masked_sums / den.clamp(min=1)).sum() / counts.shape[0]


def followup_training_mask(
    num_positions: int,
    block_size: int,
    increments: Sequence[int],
    device: torch.device | str,
    query_positions: torch.LongTensor | None = None,
) -> torch.BoolTensor:
    """[Q*K, P*K + b*Q*K] visibility for follow-up block b (after b earlier blocks, all in one cache).

    ``increments[c]`` = M of the block started from block c (it inherits slot M-1). Slot k of position i sees
    block 1's slots of positions < i, slots 0..M-1 of every earlier block at position i (the chain it extends), and
    its own slots 0..k, as `followup_block_mask` does at inference. The follow-up blocks run at ``query_positions``
    (Q sorted positions, default all P): block 1 holds every position, every follow-up block only those.
    """
    every = torch.arange(num_positions, device=device)
    query = every if query_positions is None else query_positions.to(device)
    pos = query.repeat_interleave(block_size)
    slot = torch.arange(block_size, device=device).repeat(query.numel())
    parts = []
    for c, m in enumerate(increments):
        key_pos = every.repeat_interleave(block_size) if c == 0 else pos
        key_slot = torch.arange(block_size, device=device).repeat(key_pos.numel() // block_size)
        visible = (key_pos[None, :] == pos[:, None]) & (key_slot[None, :] < m)
        if c == 0:
            visible = visible | (key_pos[None, :] < pos[:, None])
        parts.append(visible)
    parts.append((pos[None, :] == pos[:, None]) & (slot[None, :] <= slot[:, None]))
    return torch.cat(parts, dim=1)


def followup_query_positions(
    counted_tokens: torch.BoolTensor, offsets: Sequence[int], num_positions: int, block_size: int
) -> torch.LongTensor:
    """The positions the follow-up blocks run at: those where a slot of some follow-up block counts in some batch
    row (``counted_tokens`` [B, T]: real assistant tokens; ``offsets``: the blocks' cumulative offsets).

    Exact: a follow-up block's state at position i is read only by its own loss terms at i and, through the cache,
    by later follow-up blocks at the same position i (`followup_training_mask`); a position where no follow-up slot
    counts contributes nothing to the loss, its gradient or the metrics. At least one position (a block with no
    counted slot still runs, as every process must run the same blocks)."""
    keep = torch.zeros(num_positions, dtype=torch.bool, device=counted_tokens.device)
    for offset in offsets:  # slot k of position i predicts token i + 2 + offset + k
        keep |= slot_windows(counted_tokens, 2 + offset, num_positions, block_size, False).any(-1).any(0)
    if not keep.any():
        keep[0] = True
    return keep.nonzero().squeeze(-1)


def _all_reduce(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        tensor = tensor.clone()
        dist.all_reduce(tensor)
        return tensor, dist.get_world_size()
    return tensor, 1


def stats_to_metrics(stats: torch.Tensor, block_size: int) -> dict[str, float]:
    """Summed stats -> per-slot top-1 accuracy and draft CE (block 1), acceptance estimate, rank-head accuracy and
    the loss parts."""
    s = dict(zip(training_stat_names(block_size), stats.double().tolist()))
    batches = max(s["batches"], 1.0)
    metrics = {"loss_draft": s["loss_draft"] / batches, "loss_rank": s["loss_rank"] / batches}
    for k in range(block_size):
        metrics[f"acc_slot{k}"] = s[f"correct_slot{k}"] / max(s[f"counted_slot{k}"], 1.0)
    for k in range(block_size):
        metrics[f"ce_slot{k}"] = s[f"ce_sum_slot{k}"] / max(s[f"ce_count_slot{k}"], 1.0)
    metrics["accept_length"] = s["accept_sum"] / max(s["accept_count"], 1.0)
    metrics["rank_acc"] = s["rank_correct"] / max(s["rank_count"], 1.0)
    return metrics
