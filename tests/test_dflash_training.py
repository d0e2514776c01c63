"""DFlash training (`--drafter dflash`): anchors, block mask and loss weights against hand-built values, the batched
training loss against block-by-block inference forwards, and the CLI end to end (train, save, decode, resume)."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_target
from test_training import common_args, logged_losses, workspace  # noqa: F401  (module fixture)
from transformers_specblock import DFlashDraftModel
from transformers_specblock.commands.cli import train_main
from transformers_specblock.training.dflash import (
    DFlashConfig,
    DFlashDraftModelForTraining,
    block_offset_weights,
    sample_anchors,
    training_block_mask,
)
from transformers_specblock.training.features import target_argmax, target_features

pytestmark = pytest.mark.usefixtures("one_thread")


def test_sample_anchors_draws_distinct_supervised_positions():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 1, 1, 0], [0, 1, 1, 0, 0, 0, 0, 0, 0, 0]])
    valid = [{2, 3, 4, 7}, {1}]  # a supervised token followed by a supervised one
    for seed in range(20):
        anchors, keep = sample_anchors(loss_mask, num_anchors=3, generator=torch.Generator().manual_seed(seed))
        assert anchors.shape == (2, 3) and keep.tolist() == [[True] * 3, [True, False, False]]
        first = anchors[0].tolist()
        assert first == sorted(first) and len(set(first)) == 3 and set(first) <= valid[0]
        assert anchors[1, 0] == 1
    anchors, keep = sample_anchors(loss_mask, num_anchors=10)
    assert anchors[0].tolist() == [2, 3, 4, 7] and keep.sum() == 5  # all valid positions, once each


def test_training_block_mask_by_hand():
    mask = training_block_mask(torch.tensor([[2, 0]]), seq_len=4, block_size=2)[0, 0]
    expected = torch.tensor(
        [  # context 0..3 | block 0 (anchor 2) | block 1 (anchor 0)
            [1, 1, 0, 0, 1, 1, 0, 0],
            [1, 1, 0, 0, 1, 1, 0, 0],
            [0, 0, 0, 0, 0, 0, 1, 1],
            [0, 0, 0, 0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


def test_block_offset_weights_by_hand():
    torch.testing.assert_close(block_offset_weights(4, 2.0), torch.tensor([0.0, 1.0, math.exp(-0.5), math.exp(-1.0)]))
    torch.testing.assert_close(block_offset_weights(3, 0.0), torch.tensor([0.0, 1.0, 1.0]))


@pytest.mark.parametrize("soft_labels", [True, False])
def test_training_loss_equals_block_by_block_inference(soft_labels):
    """The batched loss (all blocks in one masked forward) equals the weighted mean of per-block losses computed
    with the inference forward: context = target features of positions < a, block = [x_a, mask, ...]."""
    target = make_target("llama", vocab_size=64, seed=4)
    config = DFlashConfig.from_target_config(
        target.config, mask_token_id=63, block_size=4, num_hidden_layers=2, num_anchors=100, loss_decay_gamma=3.0
    )
    torch.manual_seed(0)
    drafter = DFlashDraftModelForTraining(config).eval()
    drafter.bind_target(target, place=False)
    drafter.loss_config.soft_labels = soft_labels
    input_ids = torch.randint(0, 60, (2, 11), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones(2, 11)
    loss_mask = torch.zeros(2, 11)
    loss_mask[0, 3:] = 1
    loss_mask[1, 5:9] = 1
    features, final = target_features(target, input_ids, attention_mask, config.feature_layers)
    argmax = target_argmax(final, target.lm_head.weight)
    out = drafter(input_ids, attention_mask, loss_mask, features, final, argmax)

    weights = block_offset_weights(4, 3.0)
    total, weight_sum, counted = 0.0, 0.0, 0
    with torch.no_grad():
        target_log_probs = target(input_ids).logits.float().log_softmax(-1)  # [B, T, V]
        for b in range(2):
            for a in range(10):
                if not (loss_mask[b, a] and loss_mask[b, a + 1]):
                    continue
                block = torch.tensor([[int(input_ids[b, a])] + [63] * 3])
                plain = DFlashDraftModel.forward(  # the inference forward, one block, no other block in sight
                    drafter, noise_embeds=drafter.embed_target_tokens(block),
                    context_hidden_states=features[b : b + 1, :a], position_ids=torch.arange(a + 4)[None],
                ).last_hidden_state[0]  # fmt: skip
                log_q = drafter.draft_logits(plain).float().log_softmax(-1)  # [bs, V]
                for k in range(1, 4):
                    if a + k >= 11 or not loss_mask[b, a + k]:
                        continue
                    p_log = target_log_probs[b, a + k - 1]
                    ce = -(p_log.exp() * log_q[k]).sum() if soft_labels else -log_q[k, int(p_log.argmax())]
                    total += float(weights[k] * ce)
                    weight_sum += float(weights[k])
                    counted += 1
    assert out.loss.item() == pytest.approx(total / weight_sum, rel=1e-4)
    assert out.stats[3].item() == counted  # "tokens": counted offsets
    # a batch without a supervised token pair: loss 0, and the backward pass still reaches the parameters
    empty = drafter(input_ids, attention_mask, torch.zeros_like(loss_mask), features, final, argmax)
    empty.loss.backward()
    assert empty.loss.item() == 0.0 and drafter.fc.weight.grad is not None and empty.stats[3].item() == 0


def test_cli_trains_dflash_saves_decodes_and_resumes(workspace):  # noqa: F811
    dflash = ["--drafter", "dflash", "--mask_token_id", "127", "--num_anchors", "8", "--loss_decay_gamma", "2"]
    out = workspace["root"] / "run_dflash"
    train_main(common_args(workspace, out, "--max_steps", "20", "--learning_rate", "1e-3", *dflash))
    losses = logged_losses(out)
    assert len(losses) == 20 and sum(losses[-3:]) < sum(losses[:3]), losses
    logs = [e for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in e]
    assert {"acc_slot0", "acc_slot1", "ce_slot1", "accept_length"} <= logs[-1].keys()  # offsets 1 and 2
    assert json.loads((out / "all_results.json").read_text())["train_tokens"] > 0  # counted from input_ids
    drafter = DFlashDraftModel.from_pretrained(out)
    assert drafter.config.architectures == ["DFlashDraftModel"] and drafter.config.block_size == 3
    assert drafter.config.mask_token_id == 127 and drafter.config.num_anchors == 8
    assert not any("embed" in key or "lm_head" in key for key in load_file(out / "model.safetensors"))
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(workspace["target"])
    prompt = torch.tensor([[2, 5, 40, 41, 42]])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=16)
    with drafter.tree_settings(tree_budget=4):
        tree = target.generate(prompt, do_sample=False, max_new_tokens=16, assistant_model=drafter)
    chain = target.generate(prompt, do_sample=False, max_new_tokens=16, assistant_model=drafter,
                            speculation_type="dflash")  # fmt: skip
    assert tree.tolist() == plain.tolist() and chain.tolist() == plain.tolist()

    # resume: steps 3-4 after a restart from checkpoint-2 equal the uninterrupted run's (anchors included)
    full, resumed = workspace["root"] / "dflash_full", workspace["root"] / "dflash_resumed"
    args = ["--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2", "--per_device_train_batch_size", "2"]
    train_main(common_args(workspace, full, *args, *dflash))
    resumed.mkdir()
    shutil.copytree(full / "checkpoint-2", resumed / "checkpoint-2")
    resume = ["--resume_from_checkpoint", str(resumed / "checkpoint-2")]
    train_main(common_args(workspace, resumed, *args, *dflash, *resume))
    assert logged_losses(resumed)[-2:] == pytest.approx(logged_losses(full)[-2:], rel=1e-5)
    a, b = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)


def test_cli_refuses_bad_dflash_settings(workspace):  # noqa: F811
    out = workspace["root"] / "run_bad"
    with pytest.raises(ValueError, match="needs --mask_token_id"):
        train_main(common_args(workspace, out, "--max_steps", "1", "--drafter", "dflash"))
    with pytest.raises(ValueError, match="--draft_vocab_size is not a DFlash setting"):
        train_main(common_args(workspace, out, "--max_steps", "1", "--drafter", "dflash", "--mask_token_id", "127",
                               "--draft_vocab_size", "40"))  # fmt: skip


def test_dflash_precomputed_features_match_online(workspace):  # noqa: F811
    """Precomputed features hold the outputs of DFlash's layers (hidden_states[i + 1]): same first loss as online."""
    dflash = ["--drafter", "dflash", "--mask_token_id", "127", "--max_steps", "1", "--features_dtype", "float32"]
    online, pre = workspace["root"] / "dflash_online", workspace["root"] / "dflash_pre"
    train_main(common_args(workspace, online, *dflash))
    features_dir = workspace["root"] / "dflash_features"
    train_main(common_args(workspace, pre, *dflash, "--features", "precomputed", "--features_dir", str(features_dir)))
    assert json.loads((features_dir / "features_info.json").read_text())["target_layer_ids"] == [4]  # layer 3's output
    assert logged_losses(pre)[0] == pytest.approx(logged_losses(online)[0], rel=1e-4)


def test_cli_trains_dflash_under_bf16_autocast(workspace):  # noqa: F811
    """--bf16 (the GPU recipe; CPU autocast here): the per-offset statistics take the bfloat16 losses."""
    dflash = ["--drafter", "dflash", "--mask_token_id", "127", "--num_anchors", "8", "--loss_decay_gamma", "2"]
    out = workspace["root"] / "run_dflash_bf16"
    train_main(common_args(workspace, out, "--max_steps", "2", "--bf16", *dflash))
    assert len(logged_losses(out)) == 2 and all(math.isfinite(x) for x in logged_losses(out))
