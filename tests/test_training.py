"""Drafter training: loss parts against hand-computed examples, data handling, and the CLI end to end on a tiny
random target (online and precomputed features, resume, DDP on two CPU processes, bad inputs)."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import socket
import string
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from conftest import make_target
from transformers_specblock import SpecBlockConfig, SpecBlockDraftModel
from transformers_specblock.commands.cli import train_main
from transformers_specblock.training import (
    SpecBlockDataCollator,
    SpecBlockDraftModelForTraining,
    SpecBlockLossConfig,
    block_terms,
    build_draft_vocab,
    default_draft_vocab_size,
    followup_training_mask,
    load_conversations,
    ordinal_targets,
    rank_head_loss,
    rank_labels,
    render_conversation,
    soft_cross_entropy,
    target_ranks,
)
from transformers_specblock.training.trainer import CHECKPOINT_COMPLETE, SESSION_KEY, last_complete_checkpoint

SPECIALS = ["<pad>", "<unk>", "<s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


pytestmark = pytest.mark.usefixtures("one_thread")


def make_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer with role markers and a chat template (about 100 tokens)."""
    chars = sorted(set(string.ascii_letters + string.digits + string.punctuation + " "))
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.add_special_tokens(SPECIALS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="<|end|>"
    )
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def write_conversations(path: Path, count: int, seed: int = 0, assistant: bool = True) -> Path:
    """JSONL chats, half in ShareGPT form and half in OpenAI form; assistant replies follow simple patterns."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(count):
            word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6)))
            question = f"spell {word} {i}"
            answer = " ".join([word] * rng.randint(3, 5)) + f" done {i % 10}"
            if not assistant:
                record = {"messages": [{"role": "user", "content": question}, {"role": "system", "content": "x"}]}
            elif i % 2:
                record = {"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]}
            else:
                record = {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
            f.write(json.dumps(record) + "\n")
    return path


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A tiny random Llama target (6 layers, vocab 128) with a chat tokenizer, and small chat datasets."""
    root = tmp_path_factory.mktemp("specblock_train")
    target_dir = root / "target"
    target = make_target("llama", vocab_size=128)
    with torch.no_grad():  # a peaked target (entropy ~1.2 nat) that a drafter picks up within a few dozen steps
        target.lm_head.weight.mul_(3.0)
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.02)
            layer.mlp.down_proj.weight.mul_(0.02)
    target.save_pretrained(target_dir)
    make_tokenizer().save_pretrained(target_dir)
    return {
        "root": root,
        "target": str(target_dir),
        "data": str(write_conversations(root / "chats.jsonl", 16)),
        "data4": str(write_conversations(root / "chats4.jsonl", 4, seed=1)),
        "eval": str(write_conversations(root / "eval.jsonl", 4, seed=2)),
    }


def common_args(ws, out, *extra):
    return [
        "--target_model", ws["target"], "--dataset", ws["data"], "--output_dir", str(out),
        "--block_size", "3", "--num_blocks", "3", "--drafter_num_layers", "1", "--max_length", "64",
        "--per_device_train_batch_size", "4", "--learning_rate", "3e-3", "--warmup_steps", "0",
        "--logging_steps", "1", "--save_strategy", "no", "--seed", "0", "--dataloader_num_workers", "0",
        "--use_cpu", "--disable_tqdm", "true", "--report_to", "none", *extra,
    ]  # fmt: skip


def logged_losses(out) -> list[float]:
    state = json.loads((Path(out) / "trainer_state.json").read_text())
    return [entry["loss"] for entry in state["log_history"] if "loss" in entry]


# ------------------------------------------------------------------------------------------------ loss parts
def test_jsonl_strings_may_hold_unicode_line_separators(tmp_path):
    record = {"conversations": [{"from": "human", "value": "a\u2028b"}, {"from": "gpt", "value": "c\x85d"}]}
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps(record, ensure_ascii=False) + "\n" + json.dumps(record) + "\n", encoding="utf-8")
    chats = load_conversations(str(path))
    assert chats == [[{"role": "user", "content": "a\u2028b"}, {"role": "assistant", "content": "c\x85d"}]] * 2


def test_valid_prefix_drops_everything_after_first_miss():
    correct = torch.tensor([[True, True, False, True], [False, True, True, True], [True, True, True, True]])
    logits = torch.full((3, 5, 4, 3), -5.0)  # 3 rows, 5 positions, 4 slots, draft vocab 3; the target says 0
    logits[..., 1] = 5.0
    logits[:, 0, :, 0] = torch.where(correct, 10.0, -5.0)  # position 0: right exactly where `correct` says
    ones = torch.ones(3, 6, dtype=torch.bool)

    def heads(hidden):
        return hidden, torch.zeros(*hidden.shape[:-1], 2)

    target_index = torch.zeros(3, 6, dtype=torch.long)
    terms = block_terms(heads, logits, torch.ones(3, 6, 3) / 3, target_index, ones, ones, 0, (1,))
    expected = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(terms.prefix[:, 0], expected)


def test_soft_cross_entropy_matches_manual():
    draft = torch.tensor([[2.0, 0.5, -1.0]])
    target_logits = torch.tensor([[0.0, 1.0, 3.0]])
    p = [math.exp(x) for x in (0.0, 1.0, 3.0)]
    p = [x / sum(p) for x in p]
    z = math.log(sum(math.exp(x) for x in (2.0, 0.5, -1.0)))
    manual = -sum(pi * (d - z) for pi, d in zip(p, (2.0, 0.5, -1.0)))
    got = soft_cross_entropy(draft, target_logits.softmax(-1))
    assert got.item() == pytest.approx(manual, rel=1e-6)


def test_rank_labels_follow_bucket_definition():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0]])
    bounds = (1, 4, 10)
    expected = {0: 0, 1: 1, 3: 1, 4: 2, 9: 2, 10: 3, 11: 3}  # index -> class (rank = index + 1)
    for index, label in expected.items():
        tid = torch.tensor([index])
        rank = target_ranks(logits, tid)
        assert rank.item() == index + 1
        assert rank_labels(rank, bounds, tid >= 0).item() == label
    # a target token outside the draft vocabulary: rank Vd + 1, always the last class
    tid = torch.tensor([-1])
    assert target_ranks(logits, tid).item() == 13
    assert rank_labels(torch.tensor([1]), bounds, torch.tensor([False])).item() == 3
    # the model's own bucketing agrees
    ranks = torch.arange(1, 15)
    model_classes = torch.bucketize(ranks, torch.tensor(bounds), right=False)
    assert torch.equal(rank_labels(ranks, bounds, torch.ones(14, dtype=torch.bool)), model_classes)


def test_rank_loss_formula():
    # ordinal smoothing: mass leans 2:1 to the higher (over-estimating) neighbour
    q = ordinal_targets(torch.tensor([0, 1, 3]), 4, 0.3, 2.0)
    assert torch.allclose(q[0], torch.tensor([0.7, 0.3, 0.0, 0.0]))
    assert torch.allclose(q[1], torch.tensor([0.1, 0.7, 0.2, 0.0]))
    assert torch.allclose(q[2], torch.tensor([0.0, 0.0, 0.3, 0.7]))
    # one slot, no smoothing, no class weights: CE + distance term, under-estimation costs twice as much
    logits = torch.tensor([[0.3, -0.2, 1.0, 0.1]])
    p = logits.softmax(-1)[0]
    label = torch.tensor([2])
    num, den = rank_head_loss(logits, label, torch.tensor([True]), None, 0.0, 0.0, 1.0, 2.0)
    distance = (2 * 2 * p[0] + 2 * 1 * p[1] + 1 * p[3]) / 3
    manual = -torch.log(p[2]) + distance
    assert (num / den).item() == pytest.approx(manual.item(), rel=1e-6)
    # class re-weighting: weights (N / (C n_c)) ** power
    logits2 = torch.zeros(3, 4)
    labels2 = torch.tensor([0, 0, 3])
    num, den = rank_head_loss(logits2, labels2, torch.ones(3, dtype=torch.bool), None, 1.0, 0.0, 0.0, 2.0)
    w0, w3 = 3 / (4 * 2), 3 / (4 * 1)
    assert den.item() == pytest.approx(2 * w0 + w3)
    assert (num / den).item() == pytest.approx(math.log(4), rel=1e-6)


def test_block_terms_alignment_masks_and_draft_vocab_skip():
    """T = 6 tokens, P = 5 positions, K = 2 slots, draft vocab 3: hand-built target so every term is known."""
    torch.manual_seed(0)
    length, k_slots, vd = 6, 2, 3
    target_logits = torch.randn(1, length, vd)
    target_index = torch.tensor([[0, 1, 2, -1, 1, 0]])  # target argmax (draft ids) per sequence position
    loss_tokens = torch.tensor([[0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    real = torch.ones(1, length, dtype=torch.bool)
    logits = torch.randn(1, length - 1, k_slots, vd)
    # make the draft argmax of slot (i, k) = target_index[i + 1 + k] except at (0, 0) and (2, 0)
    for i in range(length - 1):
        for k in range(k_slots):
            j = i + 1 + k
            if j < length and target_index[0, j] >= 0:
                logits[0, i, k] = -5.0
                logits[0, i, k, target_index[0, j]] = 5.0
    logits[0, 0, 0] = torch.tensor([0.0, -5.0, 5.0])  # wrong: target is 1
    logits[0, 2, 0] = torch.tensor([5.0, -5.0, -5.0])  # target outside the draft vocab: always wrong
    def heads(hidden):  # the slot states are the logits here
        return hidden, torch.zeros(*hidden.shape[:-1], 3)

    probs = target_logits.softmax(-1)
    terms = block_terms(heads, logits, probs, target_index, loss_tokens, real, 0, (1, 2), metrics=True)
    # slot k at position i predicts token i + 2 + k: exists for i + 2 + k <= 5
    exists = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0], [0, 0]], dtype=torch.bool)
    assert torch.equal(terms.exists[0], exists)
    assert torch.equal(terms.counted[0], exists)  # tokens 2..5 are assistant tokens
    correct = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0], [0, 0]], dtype=torch.bool)
    assert torch.equal(terms.correct[0], correct)
    assert torch.equal(terms.in_vocab[0], torch.tensor([[1, 1], [1, 0], [0, 1], [1, 0], [0, 0]], dtype=torch.bool))
    assert torch.equal(terms.prefix[0], torch.tensor([[1, 0], [1, 1], [1, 0], [1, 1], [1, 0]], dtype=torch.bool))
    # soft CE of slot 1 at position 1 uses target position 3
    manual = soft_cross_entropy(logits[0, 1, 1], target_logits[0, 3].softmax(-1))
    assert terms.ce[0, 1, 1].item() == pytest.approx(manual.item(), rel=1e-6)
    # out-of-vocab target: rank class is the last one
    assert terms.labels[0, 2, 0].item() == 2 and terms.labels[0, 1, 1].item() == 2
    # follow-up block with offset 2: slot k at position i compares with target position i + 3 + k
    follow = block_terms(heads, logits, probs, target_index, loss_tokens, real, 2, (1, 2))
    assert torch.equal(follow.exists[0, :, 0], torch.tensor([1, 1, 0, 0, 0], dtype=torch.bool))
    manual = soft_cross_entropy(logits[0, 1, 0], target_logits[0, 4].softmax(-1))
    assert follow.ce[0, 1, 0].item() == pytest.approx(manual.item(), rel=1e-6)


def test_followup_mask_matches_inference_visibility():
    mask = followup_training_mask(3, 2, [1], "cpu")  # block 2 from slot 0 of block 1
    assert mask.shape == (6, 12)
    row = 2 * 2 + 1  # position 2, slot 1
    block1 = mask[row, :6].view(3, 2)
    assert torch.equal(block1, torch.tensor([[1, 1], [1, 1], [1, 0]], dtype=torch.bool))
    assert torch.equal(mask[row, 6:].view(3, 2), torch.tensor([[0, 0], [0, 0], [1, 1]], dtype=torch.bool))
    third = followup_training_mask(2, 2, [2, 1], "cpu")  # block 3 from slot 0 of block 2, which came from slot 1
    row = 1 * 2 + 0
    assert torch.equal(third[row, :4].view(2, 2), torch.tensor([[1, 1], [1, 1]], dtype=torch.bool))
    assert torch.equal(third[row, 4:8].view(2, 2), torch.tensor([[0, 0], [1, 0]], dtype=torch.bool))
    assert torch.equal(third[row, 8:].view(2, 2), torch.tensor([[0, 0], [1, 0]], dtype=torch.bool))


@pytest.mark.parametrize(
    "switches",
    [{}, {"soft_labels": False}, {"valid_prefix_mask": False, "rank_chain_mask": False}, {"rank_loss_weight": 0.0}],
)
def test_training_forward_runs_every_block_and_switch(switches):
    target = make_target("llama", vocab_size=128)
    config = SpecBlockConfig.from_target_config(target.config, block_size=3, num_hidden_layers=2, draft_vocab_size=64)
    torch.manual_seed(0)
    drafter = SpecBlockDraftModelForTraining(config)
    drafter.bind_target(target)
    drafter.loss_config = SpecBlockLossConfig(**switches)
    ids = torch.randint(0, 128, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 5:] = False  # a padded row
    with torch.no_grad():
        out = target.model(ids, output_hidden_states=True)
    features = torch.cat([out.hidden_states[i] for i in config.target_layer_ids], dim=-1)
    logits = out.last_hidden_state @ target.lm_head.weight.T
    result = drafter(ids, mask, mask, features, logits[..., drafter.d2t], logits.argmax(-1), followup_offsets=[3, 3])
    assert torch.isfinite(result.loss)
    result.loss.backward()
    for name, param in drafter.named_parameters():
        assert param.grad is not None, name
    rank_grad = drafter.rank_head[0].weight.grad.abs().sum()
    assert (rank_grad == 0) == (switches.get("rank_loss_weight", 1.0) == 0)


# ------------------------------------------------------------------------------------------------------- data
def test_render_marks_assistant_tokens_and_collator_pads():
    tokenizer = make_tokenizer()
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "ab"},
    ]
    row = render_conversation(messages, tokenizer)
    tokens = tokenizer.convert_ids_to_tokens(row["input_ids"])
    marked = [t for t, m in zip(tokens, row["loss_mask"]) if m]
    assert marked == ["y", "o", "<|end|>", "a", "b", "<|end|>"]
    # an assistant-first conversation (ShareGPT continuation parts) uses the content-search fallback
    row2 = render_conversation([{"role": "assistant", "content": "zz"}, {"role": "user", "content": "zz"}], tokenizer)
    marked = [t for t, m in zip(tokenizer.convert_ids_to_tokens(row2["input_ids"]), row2["loss_mask"]) if m]
    assert marked == ["z", "z", "<|end|>"]
    assert render_conversation(messages, tokenizer, max_length=8)["input_ids"] == row["input_ids"][:8]

    collate = SpecBlockDataCollator(pad_token_id=0)
    batch = collate([{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8], "loss_mask": [1]}])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["loss_mask"].tolist() == [[False, True, True], [True, False, False]]
    assert batch["attention_mask"].tolist() == [[True, True, True], [True, False, False]]
    feats = collate(
        [{"input_ids": torch.tensor([1, 2]), "loss_mask": torch.tensor([1, 1]), "features": torch.ones(2, 3)},
         {"input_ids": torch.tensor([3]), "loss_mask": torch.tensor([0]), "features": torch.ones(1, 3)}]
    )  # fmt: skip
    assert feats["features"].shape == (2, 2, 3) and feats["features"][1, 1].abs().sum() == 0


def test_conversation_formats_and_draft_vocab(workspace):
    chats = load_conversations(workspace["data4"])
    assert [m["role"] for m in chats[0]] == [m["role"] for m in chats[1]] == ["user", "assistant"]
    d2t, coverage = build_draft_vocab([[5, 5, 5, 9, 9, 3, 7]], [[1, 1, 1, 1, 1, 1, 0]], 12, 3)
    assert d2t.tolist() == [3, 5, 9] and coverage == 1.0
    d2t, coverage = build_draft_vocab([[5, 5, 9]], [[1, 1, 1]], 12, 2)
    assert d2t.tolist() == [5, 9]
    assert default_draft_vocab_size(128) == 128 and default_draft_vocab_size(49152) == 16384
    assert default_draft_vocab_size(151936) == 32000


# -------------------------------------------------------------------------------------------------- end to end
def test_cli_trains_and_loss_falls(workspace):
    # With the valid-prefix mask the total loss is not monotone early on (later slots enter the loss as slot 0
    # becomes right), so the plain loss is compared without it; with it, slot 0's CE falls and its accuracy rises.
    plain = workspace["root"] / "run_plain"
    train_main(common_args(workspace, plain, "--max_steps", "30", "--no_valid_prefix_mask"))
    losses = logged_losses(plain)
    assert len(losses) == 30
    assert sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3, losses

    out = workspace["root"] / "run_falls"
    args = common_args(
        workspace, out, "--max_steps", "30", "--eval_dataset", workspace["eval"], "--save_dtype", "bfloat16"
    )
    assert train_main(args) is None  # console scripts exit with the return value
    logs = [e for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in e]
    first, last = logs[:3], logs[-3:]
    assert sum(e["ce_slot0"] for e in last) < 0.9 * sum(e["ce_slot0"] for e in first)
    assert sum(e["acc_slot0"] for e in last) > 1.5 * sum(e["acc_slot0"] for e in first)
    metrics = json.loads((out / "all_results.json").read_text())
    for key in ("eval_acc_slot0", "eval_acc_slot2", "eval_accept_length", "eval_rank_acc", "eval_loss"):
        assert key in metrics
    assert 1.0 <= metrics["eval_accept_length"] <= 4.0
    assert {"acc_slot2", "ce_slot1", "accept_length", "rank_acc", "loss_draft", "loss_rank"} <= logs[0].keys()
    # the final drafter: plain SpecBlockDraftModel, bfloat16, no target embedding
    weights = load_file(out / "model.safetensors")
    assert all(w.dtype == torch.bfloat16 for k, w in weights.items() if w.is_floating_point())
    assert not any("embed" in k for k in weights)
    drafter = SpecBlockDraftModel.from_pretrained(out)
    assert drafter.config.block_size == 3 and drafter.config.architectures == ["SpecBlockDraftModel"]


def test_the_last_steps_evaluation_is_not_run_twice(workspace):
    """With evaluations every 2 steps of 4, the final metrics are the step-4 evaluation's, not a third evaluation."""
    out = workspace["root"] / "run_eval_steps"
    argv = common_args(workspace, out, "--max_steps", "4", "--eval_dataset", workspace["eval"], "--eval_samples", "4")
    train_main(argv + ["--eval_strategy", "steps", "--eval_steps", "2"])
    evaluations = [e for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "eval_loss" in e]
    assert [e["step"] for e in evaluations] == [2, 4]
    assert json.loads((out / "all_results.json").read_text())["eval_loss"] == evaluations[-1]["eval_loss"]


def test_do_train_false_evaluates_a_saved_drafter_as_its_run_did(workspace):
    """`--do_train false --init_drafter DIR` reads a saved drafter's held-out metrics without training it: the same
    numbers its own run's last evaluation logged (float32 on disk), and no drafter written."""
    trained = workspace["root"] / "run_to_evaluate"
    evaluated = workspace["root"] / "eval_only"
    eval_args = ("--eval_dataset", workspace["eval"], "--eval_samples", "4")
    train_main(common_args(workspace, trained, "--max_steps", "3", "--save_dtype", "float32", *eval_args))
    ran = json.loads((trained / "all_results.json").read_text())
    train_main(common_args(workspace, evaluated, "--do_train", "false", "--init_drafter", str(trained), *eval_args))
    read = json.loads((evaluated / "eval_results.json").read_text())
    for key in ("eval_loss", "eval_acc_slot0", "eval_accept_length"):
        assert read[key] == pytest.approx(ran[key], rel=1e-5), key
    assert not (evaluated / "model.safetensors").exists()
    with pytest.raises(ValueError, match="--init_drafter"):
        train_main(common_args(workspace, workspace["root"] / "eval_new", "--do_train", "false", *eval_args))
    with pytest.raises(ValueError, match="--eval_dataset"):
        no_eval = ("--do_train", "false", "--init_drafter", str(trained), "--eval_dataset", "none")
        train_main(common_args(workspace, workspace["root"] / "eval_none", *no_eval))


def test_precomputed_features_match_online(workspace):
    online, pre = workspace["root"] / "online", workspace["root"] / "pre"
    extra = ["--max_steps", "1", "--features_dtype", "float32", "--draft_vocab_size", "40"]
    train_main(common_args(workspace, online, *extra))
    features_dir = workspace["root"] / "features"
    train_main(common_args(workspace, pre, *extra, "--features", "precomputed", "--features_dir", str(features_dir)))
    info = json.loads((features_dir / "features_info.json").read_text())
    hidden = 64
    assert info["bytes_per_token"] == 4 * hidden * 4 + 9
    assert info["total_bytes"] == info["bytes_per_token"] * info["num_tokens"] > 0
    assert all((features_dir / s["file"]).is_file() for s in info["shards"])
    assert logged_losses(pre)[0] == pytest.approx(logged_losses(online)[0], rel=1e-4)


def test_resume_from_checkpoint_matches_uninterrupted_run(workspace):
    full, resumed = workspace["root"] / "full", workspace["root"] / "resumed"
    args = ["--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2", "--per_device_train_batch_size", "2"]
    train_main(common_args(workspace, full, *args))
    (resumed / "checkpoint-2").parent.mkdir(parents=True)
    shutil.copytree(full / "checkpoint-2", resumed / "checkpoint-2")
    train_main(common_args(workspace, resumed, *args, "--resume_from_checkpoint", str(resumed / "checkpoint-2")))
    assert logged_losses(resumed)[-2:] == pytest.approx(logged_losses(full)[-2:], rel=1e-5)
    # the record counts every session: the resumed run reports the tokens and time of steps 1-4
    results = [json.loads((d / "all_results.json").read_text()) for d in (full, resumed)]
    assert results[1]["train_tokens"] == results[0]["train_tokens"] > 0
    earlier = json.loads((resumed / "checkpoint-2" / "trainer_state.json").read_text())["log_history"][-1]
    assert 0 < earlier["train_seconds"] <= results[1]["train_seconds"]
    card_info = json.loads((resumed / "training_record.json").read_text())["training"]
    assert card_info["train_tokens"] == results[0]["train_tokens"] and card_info["train_steps"] == 4
    assert json.loads((resumed / "trainer_state.json").read_text())["global_step"] == 4
    a, b = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)


def test_a_resumed_session_saves_at_its_own_save_steps(workspace):
    out = workspace["root"] / "run"
    train_main(common_args(workspace, out, "--max_steps", "2", "--save_strategy", "steps", "--save_steps", "2"))
    resume = ["--max_steps", "4", "--save_strategy", "steps", "--save_steps", "1"]
    train_main(common_args(workspace, out, *resume, "--resume_from_checkpoint", str(out / "checkpoint-2")))
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3", "checkpoint-4"]


def test_resume_last_continues_from_the_newest_complete_checkpoint(workspace):
    out = workspace["root"] / "resume_last"
    first = ["--max_steps", "3", "--save_strategy", "steps", "--save_steps", "1", "--save_total_limit", "3"]
    train_main(common_args(workspace, out, *first, "--resume_from_checkpoint", "last"))  # nothing yet: a fresh start
    assert all((out / f"checkpoint-{s}" / CHECKPOINT_COMPLETE).is_file() for s in (1, 2, 3))
    (out / "checkpoint-3" / CHECKPOINT_COMPLETE).unlink()  # as if the run was stopped while saving step 3
    assert last_complete_checkpoint(out) == str(out / "checkpoint-2")
    train_main(common_args(workspace, out, "--max_steps", "4", "--save_strategy", "steps", "--save_steps", "1",
                           "--resume_from_checkpoint", "last"))  # fmt: skip
    state = json.loads((out / "trainer_state.json").read_text())
    sessions = [entry["step"] for entry in state["log_history"] if SESSION_KEY in entry]
    assert sessions == [0, 2] and state["global_step"] == 4  # resumed at step 2, not at the interrupted 3
    assert (out / "checkpoint-3" / CHECKPOINT_COMPLETE).is_file()  # the step-3 save was redone, completely


DISTRIBUTED_ENV = {  # what a launcher (torchrun, accelerate, an outer DDP job) leaves for its workers
    "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
    "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "NODE_RANK", "GLOO_SOCKET_IFNAME",
}  # fmt: skip
DISTRIBUTED_ENV_PREFIXES = ("PET_", "TORCHELASTIC_", "ACCELERATE_")  # PET_*: torchrun reads its options from these


def clean_environment() -> dict[str, str]:
    """This process's environment without torch.distributed / launcher variables: a test run inside a
    distributed job (or after one set them) must not join it or inherit its options."""
    env = {
        k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV and not k.startswith(DISTRIBUTED_ENV_PREFIXES)
    }
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    if os.path.isdir("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's own connections on the loopback interface too
    return env


def free_local_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


PORT_TAKEN = ("address already in use", "eaddrinuse", "errno 98")


def run_two_processes(args: list[str], timeout: float = 300, attempts: int = 3) -> tuple[int, str]:
    """`torchrun` with 2 CPU workers on 127.0.0.1 only (a free port there; not --standalone, whose rendezvous
    gives the workers "localhost"). The port is free when picked but released before torchrun binds it, so
    another process may take it in between: a run that failed because the port was taken is retried on a new one.
    Returns (exit code, combined output of the launcher and both workers)."""
    for _ in range(attempts):
        returncode, output = _run_torchrun(args, free_local_port(), timeout)
        if returncode == 0 or not any(sign in output.lower() for sign in PORT_TAKEN):
            break
    return returncode, output


def _run_torchrun(args: list[str], port: int, timeout: float) -> tuple[int, str]:
    """One torchrun on `port`. On timeout the launcher AND its workers (torchrun starts each in a session of its
    own, out of reach of the launcher's process group) are killed, and the test fails showing their output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(port),
           "-m", "transformers_specblock.train", *args]  # fmt: skip
    proc = subprocess.Popen(cmd, env=clean_environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    launcher = psutil.Process(proc.pid)
    try:
        output, _ = proc.communicate(timeout=timeout)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        workers = launcher.children(recursive=True)
        kill_all(proc, workers)
        output, _ = proc.communicate()
        pytest.fail(
            f"torchrun did not finish within {timeout} s; killed it and its {len(workers)} processes. "
            f"Output so far:\n{output[-6000:]}"
        )
    finally:
        if proc.poll() is None:  # interrupted while waiting (e.g. Ctrl-C): leave no worker behind
            kill_all(proc, launcher.children(recursive=True))


def kill_all(proc: subprocess.Popen, workers: list[psutil.Process]) -> None:
    for worker in workers:
        try:
            worker.kill()
        except psutil.NoSuchProcess:
            pass
    proc.kill()
    psutil.wait_procs(workers, timeout=30)


def test_a_taken_port_is_retried_on_another(monkeypatch):
    """The port race: a run whose port was taken meanwhile runs again on a new port; other failures do not."""
    runs = []
    taken = "The server socket has failed to listen on any local network address. [errno 98] Address already in use"

    def fake_torchrun(outcomes):
        outcomes = iter(outcomes)
        return lambda args, port, timeout: runs.append(port) or next(outcomes)

    monkeypatch.setattr(sys.modules[__name__], "_run_torchrun", fake_torchrun([(1, taken), (0, "done")]))
    assert run_two_processes(["--x"]) == (0, "done") and len(runs) == 2
    runs.clear()
    monkeypatch.setattr(sys.modules[__name__], "_run_torchrun", fake_torchrun([(1, "boom")]))
    assert run_two_processes(["--x"]) == (1, "boom") and len(runs) == 1


def test_ddp_two_processes_same_loss_as_one(workspace):
    single, ddp = workspace["root"] / "single", workspace["root"] / "ddp"
    base = ["--dataset", workspace["data4"], "--max_steps", "2", "--num_train_epochs", "2"]
    train_main(common_args(workspace, single, *base))
    args = common_args(workspace, ddp, *base)
    args[args.index("--per_device_train_batch_size") + 1] = "2"
    returncode, output = run_two_processes(args)
    assert returncode == 0, f"torchrun exited with {returncode}; launcher and worker output:\n{output[-6000:]}"
    # same loss on the same global batch, and (step 2) the same update: normalisers are summed over processes
    assert logged_losses(ddp) == pytest.approx(logged_losses(single), rel=1e-4)
    assert len(logged_losses(ddp)) == 2
    histories = [json.loads((d / "trainer_state.json").read_text())["log_history"] for d in (single, ddp)]
    norms = [[e["grad_norm"] for e in history if "grad_norm" in e] for history in histories]
    assert norms[1] == pytest.approx(norms[0], rel=1e-4)


# -------------------------------------------------------------------------------------------------- bad inputs
def test_bad_inputs_raise_clear_errors(workspace):
    root = workspace["root"]
    no_assistant = write_conversations(root / "no_assistant.jsonl", 3, assistant=False)
    with pytest.raises(ValueError, match="assistant"):
        train_main(common_args(workspace, root / "bad1", "--dataset", str(no_assistant), "--max_steps", "1"))
    with pytest.raises(ValueError, match=r"has 6 layers.*\[9\]"):
        train_main(common_args(workspace, root / "bad2", "--target_layer_ids", "1,3,9", "--max_steps", "1"))
    # a drafter built for another target (vocab 256 instead of 128)
    other_dir = root / "other_drafter"
    other = SpecBlockDraftModel.from_target(make_target("llama", vocab_size=256), block_size=3)
    other.save_pretrained(other_dir)
    with pytest.raises(ValueError, match="vocab_size=256.*vocab_size=128"):
        train_main(common_args(workspace, root / "bad3", "--init_drafter", str(other_dir), "--max_steps", "1"))
    # a drafter for this target is accepted (its draft vocabulary is kept); a conflicting option is named
    good_dir = root / "good_drafter"
    good = SpecBlockDraftModel.from_target(make_target("llama", vocab_size=128), block_size=3, num_hidden_layers=1)
    with torch.no_grad():
        good.d2t.copy_(torch.arange(good.d2t.numel()))
    good.save_pretrained(good_dir)
    with pytest.raises(ValueError, match="block_size=3, but 4 was requested"):
        args = common_args(workspace, root / "bad4", "--init_drafter", str(good_dir), "--max_steps", "1")
        args[args.index("--block_size") + 1] = "4"
        train_main(args)
    train_main(common_args(workspace, root / "init_ok", "--init_drafter", str(good_dir), "--max_steps", "1"))
    assert SpecBlockDraftModel.from_pretrained(root / "init_ok").config.block_size == 3


def test_cli_trains_eagle3_and_records_model_card(workspace):
    """`--drafter eagle3` trains the EAGLE-3 baseline with the same Trainer; the saved folder carries a model card."""
    from huggingface_hub import ModelCard

    from transformers_specblock import Eagle3DraftModel

    out = workspace["root"] / "run_eagle3"
    args = common_args(workspace, out, "--max_steps", "12", "--drafter", "eagle3", "--ttt_steps", "3")
    for option in ("--block_size", "--drafter_num_layers"):  # SpecBlock-only settings
        at = args.index(option)
        del args[at : at + 2]
    train_main(args)
    losses = logged_losses(out)
    assert sum(losses[-3:]) < sum(losses[:3]), losses
    drafter = Eagle3DraftModel.from_pretrained(out)
    assert drafter.config.ttt_steps == 3 and drafter.config.architectures == ["Eagle3DraftModel"]
    card = ModelCard.load(out / "README.md")
    assert card.data.pipeline_tag == "text-generation" and "speculative-decoding" in card.data.tags
    command = json.loads((out / "training_record.json").read_text())["training"]["command"]  # provenance: the record
    assert "specblock-train" in command and "--drafter eagle3" in command and "training_record.json" in card.text
