"""DFlash training (`specblock-train --drafter dflash`), after the public DFlash recipe (z-lab; SpecForge's
`OnlineDFlashModel`):

* every step draws, per sequence, up to `num_anchors` anchor positions a (without replacement) among the positions
  whose token and next token are supervised (assistant tokens; at inference the anchor is a committed token);
* block a holds [x_a, mask, ..., mask] at rotary positions a .. a + block_size - 1; all blocks of a sequence run in
  ONE drafter forward: a block sees the target context of positions < a and its own block (bidirectionally), never
  another block;
* offset k >= 1 of block a predicts x_{a+k}; its label is the target's distribution at position a + k - 1 (soft
  labels; with `--no_soft_labels` the target's argmax), and its weight exp(-(k - 1) / loss_decay_gamma) (1 with
  gamma 0) where x_{a+k} is supervised and inside the sequence, else 0;
* loss = sum(weight * CE) / sum(weight) over the batch (a weighted mean, as the public code).

The drafter logits come from the target's own (frozen) `lm_head`, as at inference.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from ..models.dflash.configuration_dflash import DFlashConfig
from ..models.dflash.modeling_dflash import DFlashDraftModel
from ..models.tree_drafter.modeling_tree_drafter import training_stat_names
from .arguments import ModelArguments, SpecBlockLossConfig, _parse_layer_ids
from .features import _target_head, draft_target_logits, target_argmax, target_features
from .losses import soft_cross_entropy
from .modeling import SpecBlockTrainingOutput
from .trainer import SpecBlockTrainer


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
) -> tuple[torch.LongTensor, torch.BoolTensor]:
    """Up to `num_anchors` distinct anchors per sequence, sorted, among positions a with loss_mask[a] and
    loss_mask[a + 1]. Returns anchors [B, N] (0 where unused) and keep [B, N] (N = the largest count drawn)."""
    mask = loss_mask.bool()
    valid = mask[:, :-1] & mask[:, 1:]  # [B, T-1]
    counts = valid.sum(1)
    n = int(min(num_anchors, int(counts.max()) if counts.numel() else 0))
    if n == 0:
        empty = torch.zeros(mask.shape[0], 0, dtype=torch.long, device=mask.device)
        return empty, empty.bool()
    noise = torch.rand(valid.shape, generator=generator, device=mask.device if generator is None else "cpu")
    noise = noise.to(mask.device).masked_fill(~valid, 2.0)  # invalid positions sort last
    chosen = noise.argsort(dim=1)[:, :n]
    keep = torch.arange(n, device=mask.device)[None] < counts.clamp(max=n)[:, None]
    anchors = torch.where(keep, chosen, 0)
    order = torch.where(keep, anchors, mask.shape[1]).argsort(dim=1)  # sorted, unused slots last
    return anchors.gather(1, order), keep.gather(1, order)


def training_block_mask(anchors: torch.LongTensor, seq_len: int, block_size: int) -> torch.BoolTensor:
    """[B, 1, N*bs, T + N*bs] visibility: block j sees context keys < anchors[:, j] and the keys of block j only."""
    batch, n = anchors.shape
    query_block = torch.arange(n * block_size, device=anchors.device) // block_size  # [Q]
    block_anchor = anchors.repeat_interleave(block_size, 1)[..., None]  # [B, Q, 1]
    context = torch.arange(seq_len, device=anchors.device)[None, None] < block_anchor
    own = query_block[:, None] == query_block[None, :]  # [Q, Q]
    return torch.cat([context, own[None].expand(batch, -1, -1)], dim=2)[:, None]


def block_offset_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[block_size] loss weight of each block offset: 0 for the anchor, exp(-(k - 1) / gamma) for k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    weights = torch.exp(-(k - 1) / gamma) if gamma > 0 else torch.ones(block_size)
    weights[0] = 0.0
    return weights


def dflash_block_stats(
    correct: torch.BoolTensor, counted: torch.BoolTensor, ce: torch.Tensor, loss: torch.Tensor
) -> torch.Tensor:
    """Metric sums in the `training_stat_names(block_size - 1)` layout (one slot per masked offset k >= 1).

    correct / counted / ce: [B, N, bs - 1] per masked offset of each block (ce 0 where not counted); a kept block has
    offset 1 counted. accept: 1 + the leading correct counted offsets of each counted block (greedy chain).
    """
    slots = correct.shape[-1]
    hit = correct & counted
    leading = hit.long().cumprod(-1).sum(-1)  # [B, N]
    blocks = counted[..., 0]
    values = [loss.detach().float(), torch.zeros(()), torch.ones(()), counted.sum().float()]
    values += [hit[..., k].sum().float() for k in range(slots)] + [counted[..., k].sum().float() for k in range(slots)]
    values += [ce[..., k].sum().float() for k in range(slots)] + [counted[..., k].sum().float() for k in range(slots)]
    values += [(1 + leading[blocks]).sum().float(), blocks.sum().float(), torch.zeros(()), torch.zeros(())]
    stats = torch.stack([v.to(loss.device) for v in values])
    assert stats.numel() == len(training_stat_names(slots))
    return stats


class DFlashDraftModelForTraining(DFlashDraftModel):
    """The DFlash drafter with the training pass as `forward` (same parameters as `DFlashDraftModel`)."""

    main_input_name = "input_ids"  # what the Trainer counts as input tokens

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__(config)
        self.loss_config = SpecBlockLossConfig()  # soft_labels is the switch DFlash reads

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor,
        loss_mask: torch.Tensor,
        features: torch.Tensor,
        final_hidden: torch.Tensor,
        target_argmax: torch.LongTensor,
        followup_offsets: list[int] | None = None,
    ) -> SpecBlockTrainingOutput:
        """input_ids / attention_mask / loss_mask: [B, T]; features: [B, T, L * H_target] (target hidden states of
        `feature_layers`); final_hidden: [B, T, H_target] the target's final-norm hidden; target_argmax: [B, T].
        `followup_offsets` is unused (a DFlash step drafts one block per anchor)."""
        config, device = self.config, self.device
        block, (batch, seq_len) = config.block_size, input_ids.shape
        anchors, keep = sample_anchors(loss_mask.to(device), config.num_anchors)
        n = anchors.shape[1]
        if n == 0:  # no supervised token pair in the batch: a zero loss that still reaches every parameter (DDP)
            zero = sum(p.sum() for p in self.parameters() if p.requires_grad) * 0.0
            empty = torch.zeros(batch, 0, block - 1, device=device)
            stats = dflash_block_stats(empty.bool(), empty.bool(), empty, zero)
            return SpecBlockTrainingOutput(loss=zero, loss_draft=zero.detach(), loss_rank=torch.zeros(()), stats=stats)
        offsets = torch.arange(block, device=device)
        label_pos = anchors[..., None] + offsets  # [B, N, bs]: offset k predicts the token at a + k
        noise_ids = torch.full_like(label_pos, config.mask_token_id)
        noise_ids[..., 0] = input_ids.to(device).gather(1, anchors)
        positions = torch.cat([torch.arange(seq_len, device=device).expand(batch, -1), label_pos.view(batch, -1)], 1)
        hidden = super().forward(
            noise_embeds=self.embed_target_tokens(noise_ids.view(batch, n * block)),
            context_hidden_states=features,
            position_ids=positions,
            attention_mask=training_block_mask(anchors, seq_len, block),
        ).last_hidden_state.view(batch, n, block, -1)

        inside = label_pos < seq_len
        safe = label_pos.clamp(max=seq_len - 1)
        supervised = loss_mask.to(device).bool().gather(1, safe.view(batch, -1)).view_as(safe)
        counted = keep[..., None] & inside & supervised & (offsets > 0)  # [B, N, bs]
        weights = block_offset_weights(block, config.loss_decay_gamma).to(device) * counted
        rows = counted.nonzero(as_tuple=True)  # (b, j, k) of every counted offset
        previous = (rows[0], safe[rows] - 1)  # the target position whose next-token distribution is the label
        draft_logits = self.draft_logits(hidden[rows])  # [R, V], through the target's lm_head
        head_device = draft_logits.device
        labels = target_argmax.to(head_device)[tuple(i.to(head_device) for i in previous)]
        if self.loss_config.soft_labels:
            weight, softcap = self.target_head()
            final_rows = final_hidden[tuple(i.to(final_hidden.device) for i in previous)]
            target_logits = draft_target_logits(final_rows.to(head_device), weight, softcap)
            ce = soft_cross_entropy(draft_logits, target_logits.softmax(-1))
        else:
            ce = F.cross_entropy(draft_logits.float(), labels, reduction="none")
        ce = ce.to(device)
        row_weights = weights[rows]
        loss = (ce * row_weights).sum() / row_weights.sum().clamp(min=1e-6)

        with torch.no_grad():
            correct = torch.zeros_like(counted)
            correct[rows] = draft_logits.argmax(-1).to(device) == labels.to(device)
            ce_grid = torch.zeros(counted.shape, device=device)
            ce_grid[rows] = ce.detach().float()  # bfloat16 under autocast
            stats = dflash_block_stats(correct[..., 1:], counted[..., 1:], ce_grid[..., 1:], loss)
        return SpecBlockTrainingOutput(loss=loss, loss_draft=loss.detach(), loss_rank=torch.zeros(()), stats=stats)


class DFlashTrainer(SpecBlockTrainer):
    """`SpecBlockTrainer` for DFlash: the target's hidden states of `feature_layers` (layer OUTPUTS), its final
    hidden (soft labels are computed for the counted offsets only, not the whole vocabulary at every position) and
    its argmax; metrics per masked offset (``acc_slot{k}`` is offset k + 1)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["num_blocks"] = 1
        super().__init__(*args, **kwargs)
        drafter = self.accelerator.unwrap_model(self.model)
        self.layer_ids = drafter.config.feature_layers
        self.block_size = drafter.config.block_size - 1  # logged slots: the masked offsets

    def target_batch(self, drafter: DFlashDraftModel, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The drafter's training inputs: target features, final hidden state and argmax."""
        weight, _ = _target_head(self.target)
        with torch.no_grad():
            if "features" in inputs:  # precomputed
                features, final, argmax = inputs["features"], inputs["final_hidden"], inputs["target_argmax"]
            else:
                features, final = target_features(
                    self.target, inputs["input_ids"], inputs["attention_mask"], self.layer_ids
                )
                argmax = target_argmax(final, weight)
        device = drafter.device
        return {
            "input_ids": inputs["input_ids"],
            "attention_mask": inputs["attention_mask"],
            "loss_mask": inputs["loss_mask"],
            "features": features.to(device),
            "final_hidden": final,
            "target_argmax": argmax.to(device),
        }


def build_dflash_drafter(model_args: ModelArguments, target: PreTrainedModel) -> DFlashDraftModelForTraining:
    """A new DFlash drafter for `target` from the command's arguments, or the `--init_drafter` one (checked)."""
    other_drafters = {
        "--ttt_steps": model_args.ttt_steps,
        "--ttt_decay": model_args.ttt_decay,
        "--fusion_identity_init": model_args.fusion_identity_init,
        "--draft_vocab_size": model_args.draft_vocab_size,
    }
    for option, value in other_drafters.items():
        if value:
            raise ValueError(f"{option} is not a DFlash setting (DFlash drafts over the target's full vocabulary).")
    requested = {
        "mask_token_id": model_args.mask_token_id,
        "block_size": model_args.block_size,
        "num_hidden_layers": model_args.drafter_num_layers,
        "target_layer_ids": _parse_layer_ids(model_args.target_layer_ids),
        "num_anchors": model_args.num_anchors,
        "loss_decay_gamma": model_args.loss_decay_gamma,
    }
    requested = {name: value for name, value in requested.items() if value is not None}
    if model_args.init_drafter:
        drafter = DFlashDraftModelForTraining.from_pretrained(model_args.init_drafter, dtype=torch.float32)
        for name in ("block_size", "num_hidden_layers", "target_layer_ids", "mask_token_id"):
            if name in requested and requested[name] != getattr(drafter.config, name):
                raise ValueError(
                    f"--init_drafter {model_args.init_drafter} has {name}={getattr(drafter.config, name)}, but "
                    f"{requested[name]} was requested. Drop the option or train a new drafter."
                )
        for name in ("num_anchors", "loss_decay_gamma"):  # training settings may change between sessions
            if name in requested:
                setattr(drafter.config, name, requested[name])
    else:
        if "mask_token_id" not in requested:
            raise ValueError(
                "--drafter dflash needs --mask_token_id: the id of a token the target never emits, whose embedding "
                "marks the masked block positions (SmolLM2: 16, '<empty_output>')."
            )
        drafter = DFlashDraftModelForTraining(DFlashConfig.from_target_config(target.config, **requested))
    drafter.bind_target(target, place=False)
    return drafter
