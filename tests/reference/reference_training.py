"""Training fixtures: one batch through the SpecBlock reference's training pass and one optimizer step (see
`make_specblock_fixtures.py`)."""

from __future__ import annotations

import importlib
import sys
import types

import torch
from reference_code import DRAFT_VOCAB, FOLLOWUP_M, HIDDEN, K, VOCAB


def training_batch(model, generator) -> dict[str, torch.Tensor]:
    """One batch in the reference's conventions (after `generate_eagle3_data`'s shift): `input_ids[i]` = x_{i+1}
    (last: the 0 padding), `target[i]` = the target's logits at position i+1 (last: zeros), `loss_mask` [B, S, 1].
    The target logits agree with the drafter's block-1 guesses on some chains (so the valid prefix and the rank
    classes 0 / 1 / 2 all occur), and some target argmaxes lie outside the draft vocabulary."""
    batch, length = 2, 10
    features = torch.randn(batch, length, 3 * HIDDEN, generator=generator)
    tokens = torch.randint(0, VOCAB, (batch, length + 1), generator=generator)
    input_ids = tokens[:, 1:].clone()
    input_ids[:, -1] = 0
    with torch.no_grad():
        logits = model.forward_parallel(features, input_ids, torch.ones_like(input_ids))[0]
    d2t = model.d2t + torch.arange(DRAFT_VOCAB)
    ranked = d2t[logits.argsort(-1, descending=True)]  # [B, S, K, Vd] target ids by draft rank
    target = torch.randn(batch, length, VOCAB, generator=generator) * 2.0
    # (row, position, rank of the target's token per slot 0..3); target[i + k] is what slot k of position i predicts
    chains = [(0, 0, [0, 0, 0, 2]), (0, 4, [0, 0, 6, 0]), (1, 1, [0, 1, 0, 0]), (1, 5, [2, 0, 0, 0])]
    for row, pos, ranks in chains:
        for k, rank in enumerate(ranks):
            target[row, pos + k, ranked[row, pos, k, rank]] = 30.0
    outside = (~model.t2d).nonzero()[:, 0]
    target[0, 8, outside[0]] = 40.0
    target[1, 0, outside[1]] = 40.0
    target[:, -1] = 0.0
    loss_mask = torch.ones(batch, length, 1)
    loss_mask[:, -1] = 0.0
    return {"input_ids": input_ids, "tokens": tokens, "hidden_states": features, "target": target,
            "loss_mask": loss_mask}  # fmt: skip


def run_training(modules, model, batch) -> tuple[dict[str, torch.Tensor], dict]:
    """`OnlineSpecBlockModel.forward` (3 blocks, M fixed to FOLLOWUP_M, rank head trained from step 0) and the
    weighted loss of `scripts/train_specblock.py` (`position_loss_weight` 0.8), term by term."""
    core = modules["core"]
    draws, terms = list(FOLLOWUP_M), []
    original = core._compute_batched_loss_acc_and_rank

    def record(**kwargs):
        result = original(**kwargs)
        terms.append((kwargs["target_offset"], result))
        return result

    core._compute_batched_loss_acc_and_rank = record
    core.random = types.SimpleNamespace(randint=lambda low, high: draws.pop(0))
    try:
        wrapper = core.OnlineSpecBlockModel(model, length=K, rank_start_step=0, num_ttt_blocks=1 + len(FOLLOWUP_M),
                                            budget_per_class=10)  # fmt: skip
        plosses, _, _ = call(wrapper, batch)
    finally:
        core._compute_batched_loss_acc_and_rank = original
        core.random = __import__("random")
    weights = 0.8 ** torch.arange(K, dtype=torch.float32)
    draft = (weights * torch.stack(plosses[:-1])).sum()
    out = {"loss.draft_per_slot": torch.stack(plosses[:-1]).detach(), "loss.rank": plosses[-1].detach(),
           "loss.total": (draft + plosses[-1]).detach()}  # fmt: skip
    for b, (offset, result) in enumerate(terms, start=1):
        draft_losses, accs, rank_loss, rank_acc, rank_count = result[:5]
        parts = {"draft_losses": draft_losses, "accs": accs, "rank_loss": rank_loss, "rank_count": rank_count}
        out.update({f"block{b}.{name}": value.detach() for name, value in parts.items()})
    # the reference's rank labels for block 1 (its `_compute_rank_labels`, target argmax within the draft vocab)
    with torch.no_grad():
        ids = batch["input_ids"]
        logits = model.forward_parallel(batch["hidden_states"], ids, torch.ones_like(ids))[0]
        target_p, position_mask = core._compute_target_p(batch["target"], model.t2d, batch["loss_mask"])
        labels = []
        for k in range(K):
            valid = logits.shape[1] - k
            slot = core._compute_rank_labels(logits[:, :valid, k], target_p[:, k : k + valid].argmax(-1))
            labels.append(pad_labels(slot, k))
        out["block1.rank_labels"] = torch.stack(labels, dim=2)
        out["position_mask"] = position_mask[..., 0]
    return out, {"followup_m": list(FOLLOWUP_M), "position_loss_weight": 0.8, "budget_per_class": 10}


def one_step(modules, model, batch, lr: float = 5e-5) -> tuple[dict[str, torch.Tensor], dict]:
    """One reference training step on block 1 with the rank loss (`num_ttt_blocks` 1, `rank_start_step` 0) through
    its `BF16Optimizer` (float32 AdamW, betas (0.9, 0.95), no weight decay, gradient norm clipped to 0.5, linear
    schedule without warm-up, the recipe's learning rate 5e-5): the loss and every trainable weight after the step."""
    sys.modules["specforge.utils"] = types.SimpleNamespace(print_on_rank0=lambda *a, **k: None)
    optimizer_module = importlib.import_module("specforge.optimizer")
    model.freeze_embedding()
    optimizer = optimizer_module.BF16Optimizer(model, lr=lr, max_grad_norm=0.5, warmup_steps=0, total_steps=100,
                                               scheduler_type="linear")  # fmt: skip
    step_lr = optimizer.optimizer.param_groups[0]["lr"]
    wrapper = modules["core"].OnlineSpecBlockModel(model, length=K, rank_start_step=0, num_ttt_blocks=1,
                                                   budget_per_class=10)  # fmt: skip
    plosses, _, _ = call(wrapper, batch)
    weights = 0.8 ** torch.arange(K, dtype=torch.float32)
    loss = (weights * torch.stack(plosses[:-1])).sum() + plosses[-1]  # run_backward_and_update, accumulation 1
    loss.backward()
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]).item()
    optimizer.step()
    out = {f"step.{k}": v.detach().clone() for k, v in model.state_dict().items() if "embed" not in k}
    out["step.loss"] = loss.detach()
    out["step.draft_per_slot"] = torch.stack(plosses[:-1]).detach()
    out["step.rank"] = plosses[-1].detach()
    return out, {"step": {"lr": step_lr, "betas": [0.9, 0.95], "weight_decay": 0.0, "max_grad_norm": 0.5,
                          "grad_norm_before_clipping": grad_norm, "loss": loss.item()}}  # fmt: skip


def call(wrapper, batch: dict[str, torch.Tensor]):
    """`OnlineSpecBlockModel.forward` on the batch at step 0 (no attention mask: all ones, as the reference fills)."""
    return wrapper(input_ids=batch["input_ids"], attention_mask=None, target=batch["target"],
                   loss_mask=batch["loss_mask"], hidden_states=batch["hidden_states"], global_step=0)  # fmt: skip


def pad_labels(labels: torch.Tensor, missing: int) -> torch.Tensor:
    """[B, S-k] -> [B, S], -1 past the end."""
    return torch.cat([labels, labels.new_full((labels.shape[0], missing), -1)], dim=1)
