"""The training-throughput switches do what they say (correctness only, no timing): the bfloat16 features cache
holds exactly the target's features, the sparse heads give the dense formula's loss and gradients, sparse_sdpa equals
SDPA while skipping hidden keys, --bf16 runs the drafter's matmuls (not the target's) in bfloat16 with float32
master weights, and a precomputed bfloat16 run learns, reuses its features over epochs and resumes exactly."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import DynamicCache
from transformers.integrations import sdpa_attention

from conftest import make_target
from test_training import common_args, logged_losses, workspace  # noqa: F401  (workspace is a fixture)
from transformers_specblock import SpecBlockConfig
from transformers_specblock.commands.cli import train_main
from transformers_specblock.models.specblock.modeling_specblock import block_causal_mask
from transformers_specblock.training import (
    PrecomputedFeatures,
    SpecBlockDataCollator,
    SpecBlockDraftModelForTraining,
    SpecBlockLossConfig,
    attention,
    followup_training_mask,
    precompute_features,
    sparse_sdpa_attention_forward,
    target_argmax,
    target_features,
    tokenize_conversations,
)
from transformers_specblock.training.data import load_conversations
from transformers_specblock.training.features import _target_head

pytestmark = pytest.mark.usefixtures("one_thread")


def test_bf16_features_cache_round_trip(workspace, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(workspace["target"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(workspace["target"])
    dataset = tokenize_conversations(load_conversations(workspace["data4"]), tokenizer, 64)
    layer_ids = [2, 3, 4]
    info = precompute_features(target, dataset, tmp_path, layer_ids, dtype=torch.bfloat16, batch_size=len(dataset))
    assert info["dtype"] == "bfloat16" and info["bytes_per_token"] == 4 * 64 * 2 + 9
    batch = SpecBlockDataCollator()([dict(row) for row in dataset])
    features, final = target_features(target, batch["input_ids"], batch["attention_mask"], layer_ids)
    argmax = target_argmax(final, _target_head(target)[0])
    stored = PrecomputedFeatures(tmp_path)
    assert len(stored) == len(dataset)
    for row in range(len(dataset)):
        n = len(dataset[row]["input_ids"])
        item = stored[row]
        assert item["features"].dtype == item["final_hidden"].dtype == torch.bfloat16
        assert torch.equal(item["features"], features[row, :n].bfloat16())
        assert torch.equal(item["final_hidden"], final[row, :n].bfloat16())
        assert torch.equal(item["target_argmax"].long(), argmax[row, :n])
        assert item["input_ids"].tolist() == dataset[row]["input_ids"]
        assert item["loss_mask"].tolist() == dataset[row]["loss_mask"]
    # the same data and target: the folder is reused as it is, not recomputed
    shard = tmp_path / info["shards"][0]["file"]
    written = shard.stat().st_mtime_ns
    assert precompute_features(target, dataset, tmp_path, layer_ids, dtype=torch.bfloat16)["fingerprint"] == (
        info["fingerprint"]
    )
    assert shard.stat().st_mtime_ns == written


def _dense_draft_loss(
    drafter, ids, mask, loss_mask, features, target_logits, target_argmax, offsets, weights=None, slot0=False
):
    """The module docstring's L_draft, with the heads run on every slot of every block (valid-prefix mask on);
    ``weights``: the slot weights (default slot_decay**k); ``slot0``: every slot divided by its block's slot-0 count."""
    k_slots, decay = drafter.config.block_size, drafter.loss_config.slot_decay
    weights = weights or [decay**k for k in range(k_slots)]
    batch, length = ids.shape
    num_pos = length - 1
    probs, index = target_logits.float().softmax(-1), drafter._target_draft_index(target_argmax)
    positions = torch.arange(1, length).expand(batch, -1)
    cache = DynamicCache()
    hidden = drafter.draft_blocks(
        drafter.project_condition(features[:, :num_pos]), ids[:, 1:], positions,
        block_causal_mask(num_pos, k_slots, 0, "cpu")[None], cache,
    ).hidden_states  # fmt: skip
    blocks, offset = [(hidden, 0)], 0
    for b, m in enumerate(offsets, start=1):
        offset += m
        tokens = ids[:, (torch.arange(num_pos) + 1 + offset).clamp(max=length - 1)]
        visible = followup_training_mask(num_pos, k_slots, offsets[:b], "cpu")[None]
        hidden = drafter.draft_blocks(hidden[:, :, m - 1], tokens, positions + offset, visible, cache).hidden_states
        blocks.append((hidden, offset))
    total = torch.zeros(())
    for hidden, offset in blocks:
        logits = drafter.heads(hidden)[0].float()
        prefix = torch.ones(batch, num_pos, dtype=torch.bool)
        for k in range(k_slots):
            j = torch.arange(num_pos) + 1 + offset + k  # compared target position; predicts token j + 1
            inside = j + 1 < length
            jc = j.clamp(max=length - 2)
            ce = -(probs[:, jc] * logits[:, :, k].log_softmax(-1)).sum(-1)
            tid = index[:, jc]
            counted = (loss_mask & mask)[:, (j + 1).clamp(max=length - 1)] & inside
            draft = counted & (tid >= 0) & prefix
            den = draft.sum() if k == 0 or not slot0 else den
            total = total + weights[k] * (ce * draft).sum() / den.clamp(min=1)
            prefix = prefix & (logits[:, :, k].argmax(-1) == tid) & (tid >= 0) & inside
    return total / len(blocks)


@pytest.mark.parametrize("seed", [0, 1])
def test_sparse_heads_equal_dense_formula(seed):
    """A 6-token vocabulary, so one slot in six is right by chance and later slots run on surviving prefixes."""
    target = make_target("llama", vocab_size=6)
    config = SpecBlockConfig.from_target_config(target.config, block_size=3, num_hidden_layers=2, draft_vocab_size=6)
    torch.manual_seed(seed)
    drafter = SpecBlockDraftModelForTraining(config)
    drafter.bind_target(target)
    drafter.loss_config = SpecBlockLossConfig(rank_loss_weight=0.0)
    ids = torch.randint(0, 6, (4, 40))
    mask = torch.ones(4, 40, dtype=torch.bool)
    mask[1, 23:] = False
    loss_mask = torch.rand(4, 40) > 0.3
    with torch.no_grad():
        out = target.model(ids, output_hidden_states=True)
    features = torch.cat([out.hidden_states[i] for i in config.target_layer_ids], dim=-1)
    logits = out.last_hidden_state @ target.lm_head.weight.T
    args = (ids, mask, loss_mask, features, logits[..., drafter.d2t], logits.argmax(-1))
    result = drafter(*args, followup_offsets=[2, 1])
    counts = result.stats[4 + 3 : 4 + 6]  # correct & counted per slot of block 1: slot 1 and 2 did survive
    assert counts[0] > 0 and counts[1] > 0
    result.loss_draft.backward()
    sparse = {name: p.grad.clone() for name, p in drafter.named_parameters() if p.grad is not None}
    drafter.zero_grad()
    dense = _dense_draft_loss(drafter, *args, [2, 1])
    dense.backward()
    assert result.loss_draft.item() == pytest.approx(dense.item(), rel=1e-5)
    for name, grad in sparse.items():
        torch.testing.assert_close(grad, dict(drafter.named_parameters())[name].grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mask_kind", ["block1", "followup"])
def test_sparse_sdpa_equals_sdpa_and_skips_hidden_keys(monkeypatch, mask_kind):
    positions, k_slots, heads, dim = 24, 4, 4, 8
    if mask_kind == "block1":
        visible = block_causal_mask(positions, k_slots, 0, "cpu")
    else:
        visible = followup_training_mask(positions, k_slots, [2], "cpu")
    mask = torch.zeros(visible.shape).masked_fill_(~visible, torch.finfo(torch.float32).min)[None, None]
    torch.manual_seed(0)
    query = torch.randn(2, heads, visible.shape[0], dim, requires_grad=True)
    key = torch.randn(2, heads // 2, visible.shape[1], dim, requires_grad=True)
    value = torch.randn(2, heads // 2, visible.shape[1], dim, requires_grad=True)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    key_lengths = []

    def recording(module, query, key, *args, **kwargs):
        key_lengths.append(key.shape[2])
        return sdpa_attention.sdpa_attention_forward(module, query, key, *args, **kwargs)

    reference, _ = sdpa_attention.sdpa_attention_forward(module, query, key, value, mask)
    reference_grads = torch.autograd.grad(reference.square().sum(), (query, key, value))
    monkeypatch.setattr(attention, "QUERY_CHUNK", 16)
    monkeypatch.setattr(attention, "sdpa_attention_forward", recording)
    out, _ = sparse_sdpa_attention_forward(module, query, key, value, mask)
    grads = torch.autograd.grad(out.square().sum(), (query, key, value))
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)
    for grad, expected in zip(grads, reference_grads):
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-5)
    assert len(key_lengths) == visible.shape[0] // 16
    assert sum(key_lengths) < 0.7 * len(key_lengths) * visible.shape[1], key_lengths


def test_bf16_autocasts_the_drafter_not_the_target(workspace):
    """--bf16 on the CPU: the drafter's forward runs under autocast, so its matmuls (the draft lm_head included)
    return bfloat16; the online target (float32 by --dtype) runs outside it in float32; master weights stay float32."""
    calls: list[tuple[bool, int, torch.dtype]] = []  # (under CPU autocast, out_features, output dtype)

    def record(module, inputs, output):
        if isinstance(module, torch.nn.Linear):
            calls.append((torch.is_autocast_enabled("cpu"), module.out_features, output.dtype))

    out, draft_vocab = workspace["root"] / "bf16_run", 40
    handle = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        args = common_args(workspace, out, "--max_steps", "2", "--bf16", "--draft_vocab_size", str(draft_vocab))
        train_main(args + ["--save_strategy", "steps", "--save_steps", "2"])
    finally:
        handle.remove()
    drafter_calls = {(size, dtype) for autocast, size, dtype in calls if autocast}
    target_calls = {(size, dtype) for autocast, size, dtype in calls if not autocast}
    assert {dtype for _, dtype in drafter_calls} == {torch.bfloat16}, drafter_calls
    assert (draft_vocab, torch.bfloat16) in drafter_calls  # the draft lm_head
    assert target_calls and {dtype for _, dtype in target_calls} == {torch.float32}, target_calls
    assert draft_vocab not in {size for size, _ in target_calls}
    weights = load_file(out / "checkpoint-2" / "model.safetensors")
    assert all(w.dtype == torch.float32 for w in weights.values() if w.is_floating_point())


def test_precomputed_bf16_run_learns_reuses_features_and_resumes(workspace):
    root = workspace["root"]
    features = root / "features_bf16"
    recipe = [
        "--features", "precomputed", "--features_dir", str(features), "--features_dtype", "bfloat16", "--bf16",
        "--no_valid_prefix_mask", "--per_device_train_batch_size", "2", "--num_train_epochs", "4",
    ]  # fmt: skip
    learns = root / "bf16_learns"
    train_main(common_args(workspace, learns, *recipe))  # 16 conversations, 4 epochs: 32 steps on one cache
    info = json.loads((features / "features_info.json").read_text())
    losses = logged_losses(learns)
    assert len(losses) == 32 and sum(losses[-4:]) < 0.9 * sum(losses[:4]), losses
    results = json.loads((learns / "all_results.json").read_text())
    assert results["train_tokens"] == 4 * info["num_tokens"]  # every epoch reads the one precomputed set
    assert json.loads((features / "features_info.json").read_text()) == info  # not recomputed

    full, resumed = root / "bf16_full", root / "bf16_resumed"
    short = recipe[:-2] + ["--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2"]
    train_main(common_args(workspace, full, *short))
    shutil.copytree(full / "checkpoint-2", resumed / "checkpoint-2")
    train_main(common_args(workspace, resumed, *short, "--resume_from_checkpoint", str(resumed / "checkpoint-2")))
    assert logged_losses(resumed)[-2:] == pytest.approx(logged_losses(full)[-2:], rel=1e-5)
    a, b = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)
