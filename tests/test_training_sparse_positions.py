"""Training computes the EAGLE-3 head and loss, and SpecBlock's follow-up blocks, only over the positions whose loss
counts, and learns exactly what the dense computation learns: for a batch with prompt spans and right padding in
every row, the loss terms, the logged metric sums and the gradient of every parameter equal (float32) those of the
dense computation kept here as the reference; dropping one counted position breaks the equality."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import make_target
from test_training_speed_switches import _dense_draft_loss
from transformers_specblock import SpecBlockConfig
from transformers_specblock.models.eagle3 import Eagle3DraftModel
from transformers_specblock.training import SpecBlockDraftModelForTraining, SpecBlockLossConfig, followup_training_mask
from transformers_specblock.training import modeling as training_modeling
from transformers_specblock.training.losses import followup_query_positions, slot_windows

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, LENGTH = 6, 40  # a 6-token vocabulary: one guess in six is right, so later slots and chains survive


def _batch(target, layer_ids, seed=0):
    """Two rows: row 0 with two prompt spans (0-11, 26-30), row 1 a prompt (0-14) and right padding from 28."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, LENGTH), generator=g)
    real = torch.ones(2, LENGTH, dtype=torch.bool)
    real[1, 28:] = False
    loss_mask = real.clone()
    loss_mask[0, :12] = loss_mask[0, 26:31] = loss_mask[1, :15] = False
    with torch.no_grad():
        out = target.model(ids, output_hidden_states=True)
        logits = out.last_hidden_state @ target.lm_head.weight.T
    features = torch.cat([out.hidden_states[i] for i in layer_ids], dim=-1)
    return ids, real, loss_mask, features, logits


def _grads(model: nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_same(result, reference, grads, reference_grads):
    for name in ("loss", "stats"):
        torch.testing.assert_close(getattr(result, name), getattr(reference, name), rtol=1e-5, atol=1e-6)
    assert grads.keys() == reference_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference_grads[name], rtol=1e-5, atol=1e-6, msg=name)


# -------------------------------------------------------------------------------------------------------------------
# SpecBlock: follow-up blocks at the positions some follow-up slot counts
# -------------------------------------------------------------------------------------------------------------------
def _specblock(seed=0, **loss):
    target = make_target("llama", vocab_size=VOCAB)
    config = SpecBlockConfig.from_target_config(target.config, block_size=3, num_hidden_layers=2, draft_vocab_size=6)
    torch.manual_seed(seed)
    drafter = SpecBlockDraftModelForTraining(config)
    drafter.bind_target(target)
    drafter.loss_config = SpecBlockLossConfig(**loss)
    ids, real, loss_mask, features, logits = _batch(target, config.target_layer_ids, seed)
    args = (ids, real, loss_mask, features, logits[..., drafter.d2t], logits.argmax(-1))
    drafter.kept_target = target  # the drafter holds its target weakly
    return drafter, args


def _all_positions(counted_tokens, offsets, num_positions, block_size):
    return torch.arange(num_positions)


def test_followup_selection_keeps_every_counted_position_and_drops_the_rest():
    counted = torch.zeros(2, LENGTH, dtype=torch.bool)
    counted[0, 12:26] = counted[0, 31:] = counted[1, 15:28] = True
    k_slots, offsets = 3, [2, 3]
    kept = set(followup_query_positions(counted, offsets, LENGTH - 1, k_slots).tolist())
    for i in range(LENGTH - 1):  # slot k of position i in the block at cumulative offset o predicts token i+2+o+k
        counts = any(counted[r, i + 2 + o + k] for r in range(2) for o in offsets for k in range(k_slots)
                     if i + 2 + o + k < LENGTH)  # fmt: skip
        assert (i in kept) == counts, i
    assert 0 < len(kept) <= LENGTH - 1 - 8


def test_followup_mask_at_query_positions_is_the_full_masks_restriction():
    num_pos, k_slots, increments = 9, 3, [2, 1]
    query = torch.tensor([1, 2, 5, 8])
    full = followup_training_mask(num_pos, k_slots, increments, "cpu")
    slots = (query[:, None] * k_slots + torch.arange(k_slots)).flatten()
    every = torch.arange(num_pos * k_slots)
    columns = torch.cat([every, num_pos * k_slots + slots, 2 * num_pos * k_slots + slots])
    expected = full[slots][:, columns]
    assert torch.equal(followup_training_mask(num_pos, k_slots, increments, "cpu", query), expected)


@pytest.mark.parametrize(
    "loss", [{}, {"rank_loss_form": "reference", "valid_prefix_mask": False}], ids=["default", "reference_rank"]
)
@pytest.mark.parametrize("offsets", [[2], [2, 1]])
def test_specblock_followup_positions_equal_dense(monkeypatch, loss, offsets):
    drafter, args = _specblock(**loss)
    kept = followup_query_positions(args[1] & args[2], list(torch.tensor(offsets).cumsum(0)), LENGTH - 1, 3)
    assert kept.numel() <= LENGTH - 1 - 8  # the selection does skip positions on this batch
    result = drafter(*args, followup_offsets=offsets, training_step=10**6)
    grads = _grads(drafter, result.loss)
    assert result.stats[4:7].sum() > 0  # block 1's slots do get right, so prefixes and rank labels vary
    if not loss:  # the module docstring's formula (valid-prefix mask on), every block dense
        torch.testing.assert_close(result.loss_draft, _dense_draft_loss(drafter, *args, offsets), rtol=1e-5, atol=1e-6)

    monkeypatch.setattr(training_modeling, "followup_query_positions", _all_positions)  # the dense path
    reference = drafter(*args, followup_offsets=offsets, training_step=10**6)
    _assert_same(result, reference, grads, _grads(drafter, reference.loss))


def test_dropping_a_counted_followup_position_changes_the_loss(monkeypatch):
    drafter, args = _specblock()
    reference = drafter(*args, followup_offsets=[2], training_step=10**6)
    reference_grads = _grads(drafter, reference.loss)

    def drop_one(counted_tokens, offsets, num_positions, block_size):
        kept = followup_query_positions(counted_tokens, offsets, num_positions, block_size)
        return torch.cat([kept[:3], kept[4:]])  # one position whose follow-up slots count

    monkeypatch.setattr(training_modeling, "followup_query_positions", drop_one)
    result = drafter(*args, followup_offsets=[2], training_step=10**6)
    with pytest.raises(AssertionError):
        _assert_same(result, reference, _grads(drafter, result.loss), reference_grads)


# -------------------------------------------------------------------------------------------------------------------
# EAGLE-3: head and loss on the counted slots (and the logged chain's live rows)
# -------------------------------------------------------------------------------------------------------------------
def _dense_ttt_loss(drafter, batch, all_logits):
    """The training-time-test loss and metric sums with the head on every slot of every step (the formula in
    `Eagle3DraftModel.forward`'s docstring)."""
    ids, real, loss_mask, target_logits, target_argmax = (
        batch[k] for k in ("input_ids", "attention_mask", "loss_mask", "target_logits", "target_argmax")
    )
    length = ids.shape[1]
    num_pos, steps = length - 1, len(all_logits)
    counted_tokens = loss_mask & real
    probs = target_logits.float().softmax(-1)
    lookup = torch.full((drafter.config.vocab_size,), -1, dtype=torch.long)
    lookup[drafter.d2t] = torch.arange(drafter.config.draft_vocab_size)
    index = lookup[target_argmax]
    cols = {k: [] for k in ("ce", "mask", "correct", "counted", "exists")}
    for s, logits in enumerate(all_logits):
        j = 1 + s
        n = max(0, min(num_pos, length - 1 - j))
        log_q = logits[:, :n].float().log_softmax(-1)
        tid, counted = index[:, j : j + n], counted_tokens[:, j + 1 : j + 1 + n]
        pad = (0, num_pos - n)
        cols["ce"].append(nn.functional.pad(-(probs[:, j : j + n] * log_q).sum(-1), pad))
        cols["mask"].append(nn.functional.pad(counted & (tid >= 0), pad))
        cols["correct"].append(nn.functional.pad((log_q.argmax(-1) == tid) & (tid >= 0), pad))
        cols["counted"].append(nn.functional.pad(counted, pad))
        cols["exists"].append(nn.functional.pad(real[:, j + 1 : j + 1 + n], pad))
    ce, mask, correct, counted, exists = (torch.stack(cols[k], -1) for k in cols)
    step_losses = (ce * mask).sum((0, 1)) / mask.sum((0, 1)).clamp(min=1)
    loss = (torch.tensor([drafter.config.ttt_decay**s for s in range(steps)]) * step_losses).sum()
    chain = correct.long().cumprod(-1)
    rows = counted[..., 0] & exists[..., -1]
    zero = torch.zeros((), dtype=torch.double)
    stats = torch.cat([
        torch.stack([loss.detach().double(), zero]), torch.tensor([1.0, float(real.sum())], dtype=torch.double),
        (correct & counted).sum((0, 1)).double(), counted.sum((0, 1)).double(),
        (ce.detach() * mask).sum((0, 1)).double(), mask.sum((0, 1)).double(),
        torch.stack([((1 + chain.sum(-1)) * rows).sum(), rows.sum()]).double(), torch.stack([zero, zero]),
    ])  # fmt: skip
    return loss, step_losses, stats


@pytest.mark.parametrize("seed", [0, 1])
def test_eagle3_sparse_head_equals_dense(seed):
    target = make_target("llama", vocab_size=VOCAB, seed=seed)
    torch.manual_seed(seed + 2000)
    drafter = Eagle3DraftModel.from_target(target, draft_vocab_size=5)  # one target token outside the draft vocab
    ids, real, loss_mask, features, logits = _batch(target, [2, 3, 3], seed)
    batch = dict(input_ids=ids, features=features, attention_mask=real, loss_mask=loss_mask,
                 target_logits=logits[..., drafter.d2t], target_argmax=logits.argmax(-1))  # fmt: skip
    head_rows = []
    hook = drafter.lm_head.register_forward_hook(lambda m, i, o: head_rows.append(i[0].shape[:-1].numel()))
    result = drafter(**batch, ttt_steps=4)
    hook.remove()
    grads = _grads(drafter, result.loss)
    assert sum(head_rows) < 0.7 * 4 * 2 * (LENGTH - 1)  # the head ran on the counted slots, not every slot
    assert result.stats[4:8].sum() > 0 and result.stats[-4] > result.stats[-3]  # right guesses; chains longer than 1

    dense = drafter(**batch, ttt_steps=4, return_all_steps=True)  # the same unroll, the head on every slot
    loss, step_losses, stats = _dense_ttt_loss(drafter, batch, dense.all_logits)
    reference = type(result)(loss=loss, stats=stats)
    torch.testing.assert_close(result.step_losses, step_losses, rtol=1e-5, atol=1e-6)
    _assert_same(result, reference, grads, _grads(drafter, loss))
