"""The multi-block training pass of a SpecBlock drafter (`SpecBlockDraftModelForTraining`) and its loss.

Loss (every part has a switch in `SpecBlockTrainingArguments`), per block b (block 1 from the target features,
follow-up blocks from slot ``M-1`` of the previous block with ``M ~ U{1..K}`` drawn once per block per step) and
slot k, at drafter position i (features f_i, token x_{i+1+off_b}, slot k predicts x_{i+2+off_b+k}, whose target
distribution p is the target's softmax at position j = i+1+off_b+k restricted to the draft vocabulary and
renormalised). A follow-up block sits at rotary positions i+1+off_b+k, or at block 1's i+1+k when the drafter's
``followup_positions`` is "block1" (the reference's rule, which its checkpoints load with):

* ``ce[b,i,k] = -sum_v p(v) log q(v)`` with q the drafter's softmax for that slot (hard CE on the target's argmax with
  ``--no_soft_labels``).
* ``correct[b,i,k] = d2t[argmax q] == argmax_target(j)``; ``prefix[b,i,k] = prod_{k'<k} correct[b,i,k']``.
* ``draft_mask = assistant(x_{j+1}) & in_draft_vocab(argmax_target(j)) & prefix`` (prefix only with
  ``valid_prefix_mask``).
* ``L_draft = (1/num_blocks) sum_b sum_k w_k * sum_i ce*draft_mask / sum_i draft_mask`` with ``w_k = slot_decay^k``
  (times a linear ramp while ``unlock_warmup_steps`` unlocks slot k >= 1); ``--slot_normalization slot0`` divides
  every slot by block b's slot-0 count ``sum_i draft_mask[b,i,0]`` instead (not the reference formula).
* Rank head: see `rank_head_loss`; ``rank_mask = assistant(x_{j+1}) & prefix`` (the first wrong slot of a chain
  included), labels from the 1-based rank of the target's argmax in the slot's draft distribution.
* ``--rank_loss_form reference``: ``L_rank`` is the mean over blocks of `reference_rank_loss` (the SpecBlock reference's
  rank loss; it sums draft and rank terms over blocks where this averages both, a factor that only gradient
  clipping sees).
* ``L = L_draft + rank_loss_weight * L_rank`` (the rank weight is 0 before ``rank_start_step``).

The sums over i run over the whole batch. Under DDP the normalisers (counted slots per block and slot, rank class
counts) are summed over all processes, so the averaged gradient and the logged loss equal those of one process on the
same global batch. With the valid-prefix mask the total loss is not monotone early in training: slots 1..K-1 enter
it only as the slots before them become right. The logged ``ce_slot{k}`` (block 1 draft CE per slot),
``acc_slot{k}`` (block-1 top-1 accuracy against the target's argmax), ``accept_length`` (expected accepted length of
block 1's greedy chain, ``1 + sum_k P(slots 0..k all right)``) and ``rank_acc`` are the progress measures.

Cost: the draft ``lm_head``, the rank head and the loss run only on the slots a term reads (`block_terms`): with
gradient on the slots a loss counts (assistant tokens; later slots only where the valid prefix survives), forward
only on block 1's other counted slots (the logged accuracy); the loss, its gradient and the metrics are those of the
dense computation. The follow-up blocks run only at the Q positions where one of their slots counts in some row
(`followup_query_positions`; exact, as a follow-up state is read only at its own position). Attention masks are
[Q*K, P*K + (num_blocks-1)*Q*K] for the last block; ``--drafter_attn_implementation sparse_sdpa`` (`training.attention`) skips the keys they hide.
``max_length`` and the batch size bound the memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.utils import ModelOutput

from ..models.specblock.configuration_specblock import SpecBlockConfig
from ..models.specblock.modeling_specblock import SpecBlockDraftModel, block_causal_mask
from .arguments import SpecBlockLossConfig
from .losses import (
    BlockTerms,
    _all_reduce,
    block_terms,
    draft_loss,
    followup_query_positions,
    followup_training_mask,
    rank_head_loss,
    reference_rank_loss,
)


@dataclass
class SpecBlockTrainingOutput(ModelOutput):
    """loss = loss_draft + the step's rank weight * loss_rank; ``stats``: detached metric sums (`training_stat_names`
    layout)."""

    loss: torch.Tensor | None = None
    loss_draft: torch.Tensor | None = None
    loss_rank: torch.Tensor | None = None
    stats: torch.Tensor | None = None


class SpecBlockDraftModelForTraining(SpecBlockDraftModel):
    """The drafter with the multi-block training pass as ``forward`` (so DDP / Trainer see one call per step).

    Same parameters, buffers and config as `SpecBlockDraftModel`: a checkpoint of one loads into the other.
    ``loss_config`` (a `SpecBlockLossConfig`) holds the loss switches.
    """

    def __init__(self, config: SpecBlockConfig) -> None:
        super().__init__(config)
        self.loss_config = SpecBlockLossConfig()

    def _target_draft_index(self, target_argmax: torch.LongTensor) -> torch.LongTensor:
        lookup = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=self.d2t.device)
        lookup[self.d2t] = torch.arange(self.d2t.numel(), device=self.d2t.device)
        return lookup[target_argmax.to(self.d2t.device)]

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor,
        loss_mask: torch.Tensor,
        features: torch.Tensor,
        target_logits: torch.Tensor,
        target_argmax: torch.LongTensor,
        followup_offsets: Sequence[int] = (),
        training_step: int | None = None,
    ) -> SpecBlockTrainingOutput:
        """Multi-block training pass.

        input_ids / attention_mask / loss_mask [B, T]; features [B, T, 3*H_target] target features per position;
        target_logits [B, T, Vd] the target's logits over the draft vocabulary; target_argmax [B, T] its greedy
        token (target ids); followup_offsets: M (1..K) of each follow-up block (``num_blocks - 1`` values);
        training_step: the optimizer step, for the loss schedule (``unlock_warmup_steps``, ``rank_start_step``;
        None = evaluation: the full weights).
        """
        cfg = self.loss_config
        k_slots = self.config.block_size
        batch, length = input_ids.shape
        num_pos = length - 1
        device = input_ids.device
        if num_pos < 1:
            raise ValueError("Training sequences need at least 2 tokens.")
        real = attention_mask.bool()
        counted_tokens = loss_mask.bool() & real
        target_index = self._target_draft_index(target_argmax)
        target_probs = target_logits.float().softmax(-1)
        positions = torch.arange(1, num_pos + 1, device=device).expand(batch, -1)
        block1_positions = self.config.followup_positions == "block1"  # trained where it drafts them
        bounds = self.config.rank_bucket_upper_bounds
        reference_rank = cfg.rank_loss_form == "reference"  # its chain follows the class predictions: every row

        def terms_of(hidden: torch.Tensor, offset: int, metrics: bool = False) -> BlockTerms:
            return block_terms(
                self.heads, hidden, target_probs, target_index, counted_tokens, real, offset, bounds,
                cfg.soft_labels, cfg.valid_prefix_mask, cfg.rank_chain_mask and not reference_rank, metrics,
            )  # fmt: skip

        cache = DynamicCache()
        hidden = self.draft_blocks(
            self.project_condition(features[:, :num_pos]),
            input_ids[:, 1:],
            positions,
            block_causal_mask(num_pos, k_slots, 0, device)[None],
            cache,
            compute_heads=False,
        ).hidden_states
        terms = [terms_of(hidden, 0, metrics=True)]  # block 1's accuracy and acceptance are logged
        for m in followup_offsets:
            if not 1 <= m <= k_slots:
                raise ValueError(f"Follow-up offsets must lie in 1..{k_slots}, got {m}.")
        offsets = [sum(followup_offsets[: b + 1]) for b in range(len(followup_offsets))]
        # the follow-up blocks run only where one of their slots counts (exact: see `followup_query_positions`)
        query = followup_query_positions(counted_tokens, offsets, num_pos, k_slots) if offsets else None
        for b, (m, offset) in enumerate(zip(followup_offsets, offsets), start=1):
            # (a block past the end of short sequences still runs: every process must run the same blocks)
            token_idx = (query + 1 + offset).clamp(max=length - 1)
            hidden = self.draft_blocks(
                hidden[:, query, m - 1] if b == 1 else hidden[:, :, m - 1],
                input_ids[:, token_idx],
                positions[:, query] + (0 if block1_positions else offset),
                followup_training_mask(num_pos, k_slots, list(followup_offsets[:b]), device, query)[None],
                cache,
                compute_heads=False,
            ).hidden_states
            dense = hidden.new_zeros(batch, num_pos, *hidden.shape[2:]).index_copy(1, query, hidden)
            terms.append(terms_of(dense, offset))

        # ---- normalisers, summed over processes
        draft_masks = [
            t.counted & t.in_vocab & (t.prefix if cfg.valid_prefix_mask else torch.ones_like(t.prefix)) for t in terms
        ]
        rank_masks = [t.counted & (t.prefix if cfg.rank_chain_mask else torch.ones_like(t.prefix)) for t in terms]
        num_classes = self.config.num_rank_classes
        draft_den = torch.stack([m.sum((0, 1)) for m in draft_masks]).float()  # [blocks, K]
        class_counts = sum(torch.bincount(t.labels[m], minlength=num_classes) for t, m in zip(terms, rank_masks))
        norms = torch.cat([draft_den.flatten(), class_counts.float()])
        if cfg.sync_normalizers:
            norms, world = _all_reduce(norms.detach())
        else:
            world = 1
        num_blocks_run = len(terms)
        draft_den = norms[: num_blocks_run * k_slots].view(num_blocks_run, k_slots)
        class_counts = norms[num_blocks_run * k_slots :]

        # ---- draft loss
        slot_weights = torch.tensor(cfg.slot_weights(k_slots, training_step), device=device)
        masked_sums = torch.stack([(t.ce * m).sum((0, 1)) for t, m in zip(terms, draft_masks)])
        loss_draft = draft_loss(masked_sums, draft_den, slot_weights, cfg.slot_normalization) * world

        # ---- rank loss (its input is detached inside the model: it trains the rank head only)
        rank_logits = torch.cat([t.rank_logits for t in terms], dim=1)
        labels = torch.cat([t.labels for t in terms], dim=1)
        rank_mask = torch.cat(rank_masks, dim=1)
        if reference_rank:  # per process and per block (DDP averages the gradients, as the reference's FSDP)
            valid = [t.counted & t.in_vocab for t in terms]
            loss_rank = sum(
                reference_rank_loss(t.rank_logits, t.labels, v, v[..., 0], cfg.rank_budget_per_class)
                for t, v in zip(terms, valid)
            ) / len(terms)
        else:
            rank_sum, rank_weight = rank_head_loss(
                rank_logits, labels, rank_mask, class_counts,
                cfg.rank_class_weight_power, cfg.rank_label_smoothing, cfg.rank_distance_weight, cfg.rank_under_penalty,
            )  # fmt: skip
            loss_rank = rank_sum * world / rank_weight.clamp(min=1e-12)
        loss = loss_draft
        rank_weight = cfg.rank_weight(training_step)
        if rank_weight:
            loss = loss + rank_weight * loss_rank
        else:  # keep the rank head in the graph (DDP expects every parameter to get a gradient)
            loss = loss + rank_logits.sum() * 0.0

        # ---- metrics (block 1 for accuracy and acceptance; all blocks for the rank head)
        with torch.no_grad():
            first = terms[0]
            chain = first.correct.long().cumprod(-1)
            accept_rows = first.counted[..., 0] & first.exists[..., -1]
            rank_hits = (rank_logits.argmax(-1) == labels.clamp(max=num_classes - 1)) & rank_mask
            stats = torch.cat(
                [
                    torch.stack([loss_draft.detach() / world, loss_rank.detach() / world]).double(),
                    torch.tensor([1.0 / world, float(real.sum())], dtype=torch.double, device=device),
                    (first.correct & first.counted).sum((0, 1)).double(),
                    first.counted.sum((0, 1)).double(),
                    (first.ce.detach() * draft_masks[0]).sum((0, 1)).double(),
                    draft_masks[0].sum((0, 1)).double(),
                    torch.stack(
                        [
                            ((1 + chain.sum(-1)) * accept_rows).sum(),
                            accept_rows.sum(),
                            rank_hits.sum(),
                            rank_mask.sum(),
                        ]
                    ).double(),
                ]
            )
        return SpecBlockTrainingOutput(loss=loss, loss_draft=loss_draft, loss_rank=loss_rank, stats=stats)
