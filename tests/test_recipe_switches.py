"""The recipe switches for the slot-0 ablation (issue 11, section 4) do what they say: the slot-0 normalisation,
progressive slot unlocking, the rank loss' start step, the single-block first phase, the identity-initialised fusion,
and a cosine schedule with warm-up through the standard `TrainingArguments`."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import make_target
from test_training import common_args, workspace  # noqa: F401  (workspace is a fixture)
from test_training_speed_switches import _dense_draft_loss
from transformers_specblock import SpecBlockConfig, SpecBlockDraftModel
from transformers_specblock.commands.cli import parse_train_args
from transformers_specblock.training import SpecBlockDraftModelForTraining, SpecBlockLossConfig, run_training
from transformers_specblock.training.losses import draft_loss

pytestmark = pytest.mark.usefixtures("one_thread")


def test_draft_loss_normalizations_on_a_hand_built_case():
    # block 1: 10 slot-0 tokens, 4 slot-1 and 1 slot-2 tokens with a surviving prefix; block 2: none past slot 0
    sums = torch.tensor([[2.0, 1.2, 0.5], [3.0, 0.0, 0.0]])
    counts = torch.tensor([[10.0, 4.0, 1.0], [6.0, 0.0, 0.0]])
    weights = torch.tensor([1.0, 0.8, 0.64])
    reference = ((2.0 / 10 + 0.8 * 1.2 / 4 + 0.64 * 0.5 / 1) + 3.0 / 6) / 2
    slot0 = ((2.0 + 0.8 * 1.2 + 0.64 * 0.5) / 10 + 3.0 / 6) / 2
    assert draft_loss(sums, counts, weights).item() == pytest.approx(reference)  # 0.63
    assert draft_loss(sums, counts, weights, "valid_prefix").item() == pytest.approx(reference)
    assert draft_loss(sums, counts, weights, "slot0").item() == pytest.approx(slot0)  # 0.414
    with pytest.raises(ValueError, match="slot_normalization"):
        SpecBlockLossConfig(slot_normalization="slot1")


def test_unlock_warmup_slot_weights():
    cfg = SpecBlockLossConfig(slot_decay=0.5, unlock_warmup_steps=10)
    assert cfg.slot_weights(4, 0) == [1.0, 0.0, 0.0, 0.0]
    assert cfg.slot_weights(4, 10) == pytest.approx([1.0, 0.5 * 0.5, 0.25 * 10 / 30, 0.125 * 10 / 40])
    assert cfg.slot_weights(4, 30) == pytest.approx([1.0, 0.5, 0.25, 0.125 * 30 / 40])
    assert cfg.slot_weights(4, 40) == cfg.slot_weights(4, 1000) == cfg.slot_weights(4) == [1.0, 0.5, 0.25, 0.125]
    assert SpecBlockLossConfig(slot_decay=0.5).slot_weights(4, 0) == [1.0, 0.5, 0.25, 0.125]  # off by default


def _tiny_batch(vocab: int = 6, seed: int = 0):
    """A drafter over a 6-token vocabulary (one slot in six is right by chance, so later slots count), a batch and the
    target (the caller keeps it alive: a drafter binds its target weakly)."""
    target = make_target("llama", vocab_size=vocab)
    config = SpecBlockConfig.from_target_config(target.config, block_size=3, num_hidden_layers=2, draft_vocab_size=6)
    torch.manual_seed(seed)
    drafter = SpecBlockDraftModelForTraining(config)
    drafter.bind_target(target)
    ids = torch.randint(0, vocab, (4, 40))
    mask = torch.ones(4, 40, dtype=torch.bool)
    mask[1, 23:] = False
    loss_mask = torch.rand(4, 40) > 0.3
    with torch.no_grad():
        out = target.model(ids, output_hidden_states=True)
    features = torch.cat([out.hidden_states[i] for i in config.target_layer_ids], dim=-1)
    logits = out.last_hidden_state @ target.lm_head.weight.T
    return drafter, (ids, mask, loss_mask, features, logits[..., drafter.d2t], logits.argmax(-1)), target


def test_training_pass_uses_slot0_normalization_and_unlock_weights():
    drafter, args, _target = _tiny_batch()
    offsets = [2, 1]
    drafter.loss_config = SpecBlockLossConfig(rank_loss_weight=0.0, slot_normalization="slot0", unlock_warmup_steps=4)
    result = drafter(*args, followup_offsets=offsets, training_step=3)
    assert result.stats[4 + 3 + 1] > 0  # slot 1 of block 1 was right somewhere: later slots have terms
    weights = [1.0, 0.8 * 3 / 8, 0.64 * 3 / 12]
    with torch.no_grad():
        dense = _dense_draft_loss(drafter, *args, offsets, weights=weights, slot0=True)
        reference = _dense_draft_loss(drafter, *args, offsets, weights=weights)
    assert result.loss_draft.item() == pytest.approx(dense.item(), rel=1e-5)
    assert abs(dense.item() - reference.item()) > 1e-3  # the two normalisations differ on this batch
    evaluation = drafter(*args, followup_offsets=offsets)  # no step: every slot unlocked
    with torch.no_grad():
        full = _dense_draft_loss(drafter, *args, offsets, slot0=True)
    assert evaluation.loss_draft.item() == pytest.approx(full.item(), rel=1e-5)


def test_rank_loss_starts_at_rank_start_step():
    drafter, args, _target = _tiny_batch()
    drafter.loss_config = SpecBlockLossConfig(rank_start_step=5)
    for step, counted in ((0, False), (4, False), (5, True), (None, True)):
        drafter.zero_grad()
        result = drafter(*args, followup_offsets=[2], training_step=step)
        result.loss.backward()
        rank_grad = sum(p.grad.abs().sum() for p in drafter.rank_head.parameters())
        assert (rank_grad > 0) == counted, step
        expected = result.loss_draft + (result.loss_rank if counted else 0.0)
        assert result.loss.item() == pytest.approx(expected.item(), rel=1e-6), step
        assert result.loss_rank.item() > 0.1  # still computed (and logged) before the start


def test_fusion_identity_init_passes_the_condition_through():
    target = make_target("llama", vocab_size=32)
    hidden = target.config.hidden_size
    torch.manual_seed(0)
    cond = torch.randn(5, hidden)
    zeros = torch.zeros(5, target.config.hidden_size + hidden)  # token and slot-query parts
    for flag in (True, False):
        torch.manual_seed(0)
        drafter = SpecBlockDraftModel.from_target(target, draft_vocab_size=16, fusion_identity_init=flag)
        with torch.no_grad():
            fused = drafter.fusion(torch.cat([cond, zeros], dim=-1))
        assert torch.allclose(fused, cond) == flag
        rest = drafter.fusion.weight[:, hidden:]
        assert rest.abs().sum() > 0 and rest.std() < 0.5  # the token / query parts keep their random init


def test_cli_switches_reach_the_trainer(workspace):  # noqa: F811
    """One tiny run with every switch: the rank loss enters at step 2, the first 2 steps train block 1 only, the
    fusion starts as identity, and the learning rate follows transformers' cosine schedule with warm-up."""
    out = workspace["root"] / "run_recipe"
    argv = common_args(workspace, out, "--max_steps", "6")
    argv[argv.index("--warmup_steps") + 1] = "2"
    argv += ["--lr_scheduler_type", "cosine", "--slot_normalization", "slot0", "--unlock_warmup_steps", "2",
             "--rank_start_step", "2", "--single_block_steps", "2", "--fusion_identity_init"]  # fmt: skip
    trainer = run_training(*parse_train_args(argv))
    logs = [e for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in e]
    assert [e["step"] for e in logs] == [1, 2, 3, 4, 5, 6]
    for entry in logs:  # the logged loss is the step's (logging_steps 1), rounded to 4 digits
        gap = entry["loss"] - entry["loss_draft"]
        assert (gap > 0.1) if entry["step"] > 2 else abs(gap) < 1e-3, entry
    lr0, warmup, total = 3e-3, 2, 6
    for entry in logs:  # the logged rate is the one step s used: the schedule at s - 1 (0 at the first step)
        s = entry["step"] - 1
        lam = s / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup)))
        assert entry["learning_rate"] == pytest.approx(lr0 * lam, abs=1e-9), entry
    drafter = trainer.accelerator.unwrap_model(trainer.model)
    assert drafter.loss_config.slot_normalization == "slot0" and drafter.loss_config.unlock_warmup_steps == 2
    assert drafter.config.fusion_identity_init is True
    for step, blocks in ((0, 1), (1, 1), (2, 3), (5, 3)):
        trainer.state.global_step = step
        assert len(trainer.followup_offsets(training=True)) + 1 == blocks
    assert len(trainer.followup_offsets(training=False)) + 1 == 3  # evaluation runs every block


def test_time_budget_stops_the_run_and_drives_the_schedule(workspace, monkeypatch):  # noqa: F811
    """`--max_train_minutes`: the run stops (with a checkpoint) once its training time reaches the budget, far below
    max_steps, and after warm-up the cosine decay follows elapsed time / budget. A clock of 10 s per step makes it
    exact: a 1-minute budget ends after step 6."""
    from transformers_specblock.training.trainer import SpecBlockTrainer

    monkeypatch.setattr(SpecBlockTrainer, "training_seconds", lambda self: 10.0 * self.state.global_step)
    out = workspace["root"] / "run_timed"
    argv = common_args(workspace, out, "--max_steps", "100", "--max_train_minutes", "1", "--lr_scheduler_type", "cosine")
    argv[argv.index("--warmup_steps") + 1] = "2"
    trainer = run_training(*parse_train_args(argv))
    assert trainer.state.global_step == 6
    assert (out / "checkpoint-6").is_dir()  # stopped by the budget: saved to resume from
    logs = [e for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in e]
    lr0, warmup = 3e-3, 2
    for entry in logs:  # step t used the schedule stepped after step t - 1, before global_step counted it
        s = entry["step"] - 1
        lam = s / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * 10 * (s - 1) / 60))
        assert entry["learning_rate"] == pytest.approx(lr0 * lam, abs=1e-9), entry
    with pytest.raises(ValueError, match="max_train_minutes"):
        parse_train_args(common_args(workspace, out, "--max_train_minutes", "1", "--lr_scheduler_type", "polynomial"))
    with pytest.raises(ValueError, match="max_train_minutes"):
        parse_train_args(common_args(workspace, out, "--max_train_minutes", "0"))


def test_decoder_layers_start_from_the_targets_top_layers():
    """--init_decoder_from_target: drafter layer i of N starts as target layer L-N+i; EAGLE-3's 2H-wide q/k/v and
    its own hidden-state norm keep their start and are named; combined with --init_drafter the option is refused."""
    from transformers_specblock import Eagle3DraftModel
    from transformers_specblock.training import ModelArguments, init_decoder_from_target
    from transformers_specblock.training.run import _build_drafter

    target = make_target("llama")
    top = target.get_decoder().layers
    drafter = SpecBlockDraftModel.from_target(target, num_hidden_layers=2)
    assert init_decoder_from_target(drafter, target) == []
    for layer, source in zip(drafter.layers, top[-2:]):
        for name, weight in source.state_dict().items():
            assert torch.equal(layer.state_dict()[name], weight), name

    eagle3 = Eagle3DraftModel.from_target(target)
    skipped = init_decoder_from_target(eagle3, target)
    assert sorted(skipped) == ["layers.0.hidden_norm.weight"] + [f"layers.0.self_attn.{p}_proj.weight" for p in "kqv"]
    for name in ("mlp.up_proj.weight", "mlp.down_proj.weight", "self_attn.o_proj.weight"):
        assert torch.equal(eagle3.layer.state_dict()[name], top[-1].state_dict()[name]), name
    assert not torch.equal(eagle3.layer.self_attn.q_proj.weight[:, -64:], top[-1].self_attn.q_proj.weight)

    args = ModelArguments(target_model="tiny", init_drafter="anything", init_decoder_from_target=True)
    with pytest.raises(ValueError, match="cannot be combined with --init_drafter"):
        _build_drafter(args, target, None)
