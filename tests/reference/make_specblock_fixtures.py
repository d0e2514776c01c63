"""Freeze what the SpecBlock reference code computes into small fixtures (tests/reference/fixtures/).

    python tests/reference/make_specblock_fixtures.py /path/to/SpecBlock [--output tests/reference/fixtures]

The reference (github shiweijiezero/SpecBlock, Apache-2.0) is not a registry package: this script imports its
pure-PyTorch modules from a checkout (`specforge/modeling/draft/{base,_llama3_specblock_base,llama3_specblock}.py`,
`specforge/core/specblock.py`, `benchmarks_hf/algorithms/_specblock_inference_model_base.py`) without running the
package `__init__` files (they import SGLang), with TorchDynamo disabled (its `torch.compile` decorators run
eagerly). Its attention calls `flex_attention`, which has no backward on the CPU: every call is answered by dense
softmax attention over the mask the reference's own `mask_mod` defines (`create_mask`); `--check_flex` measures that
substitution against the real `flex_attention` forward. Nothing of the reference is copied into the package.

Outputs, all float32 on tiny random weights (hidden 64, 2 layers, 4 heads / 2 KV heads, K 4, vocabulary 256, draft
vocabulary 128, 4 rank classes):
* `reference_drafter/`: the drafter as the reference's `save_pretrained` writes it, plus `vocab_mapping.pt`.
* `target_embedding.safetensors`: the token embedding the drafter reads (the target's).
* `modeling.safetensors`: inputs and outputs of block 1 and of two training-time follow-up blocks
  (`forward_parallel` with its caches and masks), the masks themselves, the harness's rank logits (`_rank_forward`,
  `RANK_TOPK` 10 and 20), and the reference class's outputs on this package's export of the drafter.
* `training.safetensors`: one batch, the reference's per-block loss terms (`_compute_batched_loss_acc_and_rank`),
  the training loss of `OnlineSpecBlockModel` for fixed follow-up offsets M.
* `manifest.json`: the reference commit, the settings, the scalar results.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 64, 2, 4, 2, 128
VOCAB, DRAFT_VOCAB, K, RANK_CLASSES = 256, 128, 4, 4
POSITIONS = 6  # modeling fixtures: positions of one sequence
FOLLOWUP_M = (2, 3)  # training-time follow-up blocks: block 2 starts from slot M1-1 of block 1, block 3 from M2-1
TREE_HEAD_SCALES = (1.0, 1.0, 6.0, 6.0, 12.0, 12.0, 25.0, 25.0, 50.0, 50.0)  # block-1 tree cases: lm_head x scale


def load_reference(root: str) -> dict[str, types.ModuleType]:
    """The reference modules, imported from `root` without the package `__init__` files."""
    torch._dynamo.config.disable = True
    for name, sub in (("specforge", "specforge"), ("specforge.modeling", "specforge/modeling"),
                      ("specforge.modeling.draft", "specforge/modeling/draft"), ("specforge.core", "specforge/core"),
                      ("benchmarks_hf", "benchmarks_hf"), ("benchmarks_hf.algorithms", "benchmarks_hf/algorithms")):  # fmt: skip
        module = types.ModuleType(name)
        module.__path__ = [os.path.join(root, sub)]
        sys.modules[name] = module
    base = importlib.import_module("specforge.modeling.draft.base")
    sys.modules["specforge.modeling.draft"].Eagle3DraftModel = base.Eagle3DraftModel
    modules = {
        "blocks": importlib.import_module("specforge.modeling.draft._llama3_specblock_base"),
        "draft": importlib.import_module("specforge.modeling.draft.llama3_specblock"),
        "core": importlib.import_module("specforge.core.specblock"),
        "harness": importlib.import_module("benchmarks_hf.algorithms._specblock_inference_model_base"),
    }
    modules["blocks"].get_compiled_flex_attention = lambda kv_len: dense_flex_attention
    return modules


def load_harness_tree_module(root: str) -> types.ModuleType:
    """`benchmarks_hf/algorithms/_specblock_base.py` (the inference harness's tree code). It imports `triton` at the
    top (for GPU kernels this script never calls: a stub module answers `triton.jit` / `triton.language`) and, through
    `algorithms/base.py`, `utils.prompt`, which needs `specforge.data`, absent from the repository (a stub answers
    its three chat-prompt helpers, unused by tree building)."""
    triton = types.ModuleType("triton")
    triton.jit = lambda fn=None, **kwargs: fn if fn is not None else (lambda inner: inner)
    language = types.ModuleType("triton.language")
    language.constexpr = int
    triton.language = language
    prompt = types.ModuleType("utils.prompt")
    prompt.detect_model_family = lambda path: "llama"
    prompt.prepare_conversation = lambda conversation, family: conversation
    prompt.get_system_prompt = lambda family: ""
    utils = types.ModuleType("utils")
    utils.__path__, utils.prompt = [], prompt
    sys.modules.update({"triton": triton, "triton.language": language, "utils": utils, "utils.prompt": prompt})
    return importlib.import_module("benchmarks_hf.algorithms._specblock_base")


def pruning_cases(harness, generator, cases: int = 24) -> tuple[dict[str, torch.Tensor], dict]:
    """Random trees (node i's parent < i, -1 = the root; cumulative draft log-probs that fall along every path, as
    drafted trees' do) pruned by the harness's `_prune_tree_np` (`COVERAGE_PRUNE` off, its default) to a budget."""
    out, budgets = {}, []
    holder = types.SimpleNamespace(_coverage_prune=False)
    for case in range(cases):
        num = int(torch.randint(20, 80, (1,), generator=generator))
        budget = int(torch.randint(5, num, (1,), generator=generator))
        parents = [-1] + [int(torch.randint(-1, i, (1,), generator=generator)) for i in range(1, num)]
        step = torch.rand(num, generator=generator, dtype=torch.float64) * 3.0 + 1e-3
        lps = []
        for i, parent in enumerate(parents):
            lps.append((lps[parent] if parent >= 0 else 0.0) - float(step[i]))
        buffers = [np.arange(num, dtype=np.int64) + 1000, np.array(parents, dtype=np.int64),
                   np.array(lps, dtype=np.float64)] + [np.zeros(num, dtype=np.int64) for _ in range(3)]  # fmt: skip
        kept = harness._SpecBlockAlgorithmBase._prune_tree_np(holder, num, *buffers, budget)
        out[f"prune{case}.parents"] = torch.tensor(parents)
        out[f"prune{case}.lps"] = torch.tensor(lps, dtype=torch.float64)
        out[f"prune{case}.kept"] = torch.tensor(sorted(int(t) - 1000 for t in buffers[0][:kept]))
        budgets.append(budget)
    return out, {"pruning_budgets": budgets}


def block1_trees(modules, harness, model, folder: Path, generator) -> tuple[dict, dict]:
    """Block-1 trees the harness builds (`_build_tree_from_block1`, one block step so no follow-up forward) at
    `SpecBlockAlgorithm._PARETO_DEFAULTS` (slot widths "slim_r2" [2, 4, 6, 4], `ADAPTIVE_SLOT0` and `ADAPTIVE_ALL` 1,
    beam width 10, 90 tree tokens) for the reference drafter's block 1 at the last of 6 random positions, rank logits
    as the harness computes them (`RANK_TOPK` 10), with `lm_head` scaled by TREE_HEAD_SCALES (confident slots). `torch.cuda.synchronize` is a no-op here (the CPU has nothing to
    wait for) and the final `build_tree_buffers_triton` (Triton kernels turning nodes into masks) is replaced by a
    recorder of the nodes it receives: tokens (target ids) and parents (-1 = the root)."""
    settings = {**harness_module(harness, "specblock").SpecBlockAlgorithm._PARETO_DEFAULTS}
    for key, value in settings.items():
        os.environ.setdefault(key, value)
    algorithm = harness_module(harness, "specblock").SpecBlockAlgorithm(
        model_path="target", draft_model_path=str(folder), device="cpu", total_tokens=90, max_blocks=1, beam_width=10
    )
    algorithm.draft_model = model
    algorithm._block_forward_events = {}
    recorded = []

    def record(n_nodes, tokens, parents, sample_token, device, k_slots, max_blocks):
        recorded.append((tokens[:n_nodes].copy(), parents[:n_nodes].copy()))
        return None, None, None, None

    torch.cuda.synchronize = lambda *args, **kwargs: None
    harness.build_tree_buffers_triton = record
    out, head = {}, model.lm_head.weight.detach().clone()
    for case, scale in enumerate(TREE_HEAD_SCALES):  # sharper heads: confident slots, where the harness narrows
        features = torch.randn(1, POSITIONS, 3 * HIDDEN, generator=generator)
        ids = torch.randint(0, VOCAB, (1, POSITIONS), generator=generator)
        with torch.no_grad():
            model.lm_head.weight.copy_(head * scale)
            logits, _, hidden, _, _ = model.forward_parallel(features, ids, torch.ones_like(ids))
            rank_logits = harness_rank_logits(modules, model, hidden[:, -1], 10)
            model.lm_head.weight.copy_(head)
        ttt = [(torch.zeros(1, KV_HEADS, K, HIDDEN // HEADS),) * 2 for _ in range(LAYERS)]
        cache = [[torch.zeros(1, KV_HEADS, 64, HIDDEN // HEADS), torch.zeros(1, KV_HEADS, 64, HIDDEN // HEADS),
                  POSITIONS * K, 64] for _ in range(LAYERS)]  # fmt: skip
        algorithm._build_tree_from_block1(logits[:, -1], rank_logits, hidden[:, -1], ttt, ids[:, -1:], cache,
                                          POSITIONS - 1)  # fmt: skip
        tokens, parents = recorded.pop()
        out.update({f"tree{case}.features": features, f"tree{case}.input_ids": ids,
                    f"tree{case}.tokens": torch.from_numpy(tokens), f"tree{case}.parents": torch.from_numpy(parents)})  # fmt: skip
    return out, {"block1_trees": {"lm_head_scales": list(TREE_HEAD_SCALES), "settings": settings, "beam_width": 10, "total_tokens": 90,
                                  "rank_topk": 10}}  # fmt: skip


class _NoEvent:
    """`torch.cuda.Event` stand-in: the harness times its block forwards with CUDA events; nothing to time here."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, *args, **kwargs) -> None:
        pass

    def elapsed_time(self, other) -> float:
        return 0.0


def followup_round(harness, folder: Path, generator, scales=(1.0, 6.0)) -> tuple[dict, dict]:
    """Two-block trees drafted by the harness's own inference model (`SpecBlockInferenceModel`, float32 here, the
    harness runs bfloat16): `prefill_and_draft` on 5 random context positions and the first drafted position, then
    `_build_tree_from_block1` at the harness's defaults with two block steps. Recorded: the context, block 1, every
    follow-up block of the round (`forward_with_cache`: start slot states, tokens, which of block 1's slots each
    sees, its logits / rank logits / slot states) and the final tree (nodes, parents) after pruning to 90."""
    import collections

    from transformers import LlamaConfig

    torch.cuda.Event = _NoEvent
    torch.cuda.synchronize = lambda *args, **kwargs: None
    config = LlamaConfig.from_pretrained(folder)
    model = harness_module(harness, "specblock_inference_model").SpecBlockInferenceModel(config).float().eval()
    result = model.load_state_dict(load_file(folder / "model.safetensors"), strict=False)
    assert result.missing_keys == ["input_layer.embed_tokens.weight"] and not result.unexpected_keys, result
    model.load_vocab_mapping(str(folder / "vocab_mapping.pt"))
    model.input_layer.embed_tokens.weight.data.copy_(load_file(folder.parent / "target_embedding.safetensors")["weight"])
    model.prepare_for_inference()
    head = model.lm_head.weight.detach().clone()
    algorithm = harness_module(harness, "specblock").SpecBlockAlgorithm(
        model_path="target", draft_model_path=str(folder), device="cpu", total_tokens=90, max_blocks=2, beam_width=10
    )
    algorithm.draft_model = model
    algorithm._block_forward_events = collections.defaultdict(list)
    calls, trees = [], []
    forward = model.forward_with_cache

    def record_forward(**kwargs):
        out = forward(**kwargs)
        calls.append((kwargs["hidden"], kwargs["input_ids"], kwargs["ttt_mask"], kwargs["position_id"], *out[:3]))
        return out

    model.forward_with_cache = record_forward
    harness.build_tree_buffers_triton = lambda n, tokens, parents, *rest: trees.append(
        (tokens[:n].copy(), parents[:n].copy())
    ) or (None, None, None, None)
    out = {}
    for case, scale in enumerate(scales):
        features = torch.randn(1, POSITIONS, 3 * HIDDEN, generator=generator)
        ids = torch.randint(0, VOCAB, (1, POSITIONS), generator=generator)
        with torch.no_grad():
            model.lm_head.weight.copy_(head * scale)
            cache, position, logits, rank, hidden, ttt = model.prefill_and_draft(
                features[:, :-1], ids[:, :-1], features[:, -1:], ids[:, -1:]
            )
            algorithm._build_tree_from_block1(logits, rank, hidden, ttt, ids[:, -1:], cache, position - 1)
            model.lm_head.weight.copy_(head)
        (start, tokens, seen, position_id, f_logits, f_rank, f_hidden), (nodes, parents) = calls.pop(), trees.pop()
        assert not calls and position_id == position - 1
        out.update({f"round{case}.{name}": t for name, t in (
            ("features", features), ("input_ids", ids), ("block1.logits", logits), ("block1.rank_logits", rank),
            ("block1.hidden", hidden), ("start_states", start[:, 0]), ("start_tokens", tokens[:, 0]),
            ("seen_block1_slots", seen.sum(-1)), ("logits", f_logits), ("rank_logits", f_rank),
            ("hidden", f_hidden), ("tree.tokens", torch.from_numpy(nodes)),
            ("tree.parents", torch.from_numpy(parents)))})  # fmt: skip
    return out, {"followup_rounds": {"lm_head_scales": list(scales), "context_positions": POSITIONS - 1,
                                     "max_blocks": 2, "total_tokens": 90, "beam_width": 10}}  # fmt: skip


def harness_module(harness: types.ModuleType, name: str) -> types.ModuleType:
    return importlib.import_module(f"{harness.__name__.rsplit('.', 1)[0]}.{name}")


def dense_mask(block_mask) -> torch.Tensor:
    """[Q, KV] bool: the reference's `mask_mod` evaluated at every (query, key)."""
    from torch.nn.attention.flex_attention import create_mask

    q_len, kv_len = block_mask.seq_lengths
    return create_mask(block_mask.mask_mod, None, None, q_len, kv_len, device="cpu")[0, 0]


def dense_flex_attention(query, key, value, block_mask, enable_gqa=True):
    """`flex_attention(query, key, value, block_mask=..., enable_gqa=True)` (default scale), as dense attention."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = query @ key.transpose(-1, -2) / query.shape[-1] ** 0.5
    scores = scores.masked_fill(~dense_mask(block_mask), float("-inf"))
    return scores.softmax(-1) @ value


def reference_config():
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, vocab_size=VOCAB, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    config.architectures = ["LlamaForCausalLMSpecBlock"]
    config.draft_vocab_size, config.diffspec_draft_token_num = DRAFT_VOCAB, K
    config.rank_classes, config.num_ttt_blocks = RANK_CLASSES, 1 + len(FOLLOWUP_M)
    return config


def random_reference_drafter(modules, embedding: torch.Tensor):
    """The reference class with random weights: norms away from 1 (so their placement matters), a random sorted
    draft vocabulary (offsets `d2t`, mask `t2d`), the target's embedding."""
    torch.manual_seed(0)
    model = modules["draft"].LlamaForCausalLMSpecBlock(reference_config()).float()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
        model.input_layer.embed_tokens.weight.copy_(embedding)
        ids = torch.randperm(VOCAB, generator=generator)[:DRAFT_VOCAB].sort().values
        model.d2t.copy_(ids - torch.arange(DRAFT_VOCAB))
        model.t2d.zero_()
        model.t2d[ids] = True
    return model.eval()


def followup_inputs(draft_hidden, input_ids, m: int, offset: int):
    """What `OnlineSpecBlockModel.forward` feeds the next block: slot M-1's state and the token `offset` further."""
    length = input_ids.shape[1]
    shifted = (torch.arange(length) + offset).clamp(max=length - 1)
    return draft_hidden[:, :, m - 1, :], input_ids[:, shifted]


def run_blocks(modules, model, features, input_ids, ms=FOLLOWUP_M) -> tuple[dict[str, torch.Tensor], list]:
    """Block 1 and the training-time follow-up blocks, chained as `OnlineSpecBlockModel.forward` chains them."""
    out: dict[str, torch.Tensor] = {}
    mask_calls = []
    module = modules["blocks"]  # forward_parallel imports its mask builders from here at each call
    originals = {n: getattr(module, n) for n in ("build_block2plus_mask",)}

    def record(*args, **kwargs):
        mask = originals["build_block2plus_mask"](*args, **kwargs)
        mask_calls.append(dense_mask(mask))
        return mask

    length = input_ids.shape[1]
    condition, ids, draft_condition = features, input_ids, False
    cache, cross, counts, offset = None, None, [], 0
    try:
        module.build_block2plus_mask = record
        for b in range(1 + len(ms)):
            logits, rank, hidden, new_kv, _ = model.forward_parallel(
                condition, ids, torch.ones_like(ids), use_draft_condition=draft_condition, prev_kv_cache=cache,
                ttt_valid_counts=torch.stack(counts) if counts else None, cross_kv_cache=cross,
            )  # fmt: skip
            out.update({f"block{b + 1}.{n}": t for n, t in (("logits", logits), ("rank_logits", rank),
                                                              ("hidden", hidden), ("input_ids", ids))})  # fmt: skip
            out[f"block{b + 1}.condition"] = condition
            if b == len(ms):
                break
            m = ms[b]
            cross = cross if cross is not None else new_kv
            counts.append(torch.full((length,), m, dtype=torch.long))
            offset += m
            cache = new_kv if cache is None else [(torch.cat([a, c], 2), torch.cat([v, w], 2))
                                                  for (a, v), (c, w) in zip(cache, new_kv)]  # fmt: skip
            condition, ids = followup_inputs(hidden, input_ids, m, offset)
            draft_condition = True
    finally:
        module.build_block2plus_mask = originals["build_block2plus_mask"]
    for b, mask in enumerate(mask_calls, start=2):
        out[f"block{b}.mask"] = mask
    return out, mask_calls


def block1_mask(modules, length: int) -> torch.Tensor:
    return dense_mask(modules["blocks"].get_cached_cross_position_causal_mask(length, K, 1, "cpu"))


def harness_rank_logits(modules, model, hidden: torch.Tensor, top_k: int) -> torch.Tensor:
    """The inference harness's rank logits (`_SpecBlockInferenceModelBase._rank_forward`, env `RANK_TOPK`)."""
    previous = os.environ.get("RANK_TOPK")
    os.environ["RANK_TOPK"] = str(top_k)
    try:
        normed = model.norm(hidden)
        logits = model.lm_head(normed)
        holder = types.SimpleNamespace(rank_head=model.rank_head)
        return modules["harness"]._SpecBlockInferenceModelBase._rank_forward(holder, normed, logits)
    finally:
        if previous is None:
            os.environ.pop("RANK_TOPK")
        else:
            os.environ["RANK_TOPK"] = previous


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
        plosses, _, _ = wrapper(input_ids=batch["input_ids"], attention_mask=None, target=batch["target"],
                                loss_mask=batch["loss_mask"], hidden_states=batch["hidden_states"], global_step=0)  # fmt: skip
    finally:
        core._compute_batched_loss_acc_and_rank = original
        core.random = __import__("random")
    weights = 0.8 ** torch.arange(K, dtype=torch.float32)
    draft = (weights * torch.stack(plosses[:-1])).sum()
    out = {"loss.draft_per_slot": torch.stack(plosses[:-1]).detach(), "loss.rank": plosses[-1].detach(),
           "loss.total": (draft + plosses[-1]).detach()}  # fmt: skip
    for b, (offset, result) in enumerate(terms, start=1):
        draft_losses, accs, rank_loss, rank_acc, rank_count = result[:5]
        out.update({f"block{b}.draft_losses": draft_losses.detach(), f"block{b}.accs": accs.detach(),
                    f"block{b}.rank_loss": rank_loss.detach(), f"block{b}.rank_count": rank_count.detach()})  # fmt: skip
    # the reference's rank labels for block 1 (its `_compute_rank_labels`, target argmax within the draft vocab)
    with torch.no_grad():
        logits = model.forward_parallel(batch["hidden_states"], batch["input_ids"], torch.ones_like(batch["input_ids"]))[0]
        target_p, position_mask = core._compute_target_p(batch["target"], model.t2d, batch["loss_mask"])
        labels = []
        for k in range(K):
            valid = logits.shape[1] - k
            labels.append(F_pad(core._compute_rank_labels(logits[:, :valid, k], target_p[:, k : k + valid].argmax(-1)), k))
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
    plosses, _, _ = wrapper(input_ids=batch["input_ids"], attention_mask=None, target=batch["target"],
                            loss_mask=batch["loss_mask"], hidden_states=batch["hidden_states"], global_step=0)  # fmt: skip
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


def F_pad(labels: torch.Tensor, missing: int) -> torch.Tensor:
    """[B, S-k] -> [B, S], -1 past the end."""
    return torch.cat([labels, labels.new_full((labels.shape[0], missing), -1)], dim=1)


def check_our_export(modules, folder: Path, features, input_ids, expected: dict) -> dict[str, torch.Tensor]:
    """Load the reference checkpoint with this package, export it with `checkpoint_format="specblock_reference"`,
    load the export in the reference class (config through `LlamaConfig`, weights through `load_state_dict`,
    `vocab_mapping.pt` through its `load_vocab_mapping`) and run block 1 there."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from transformers_specblock import SpecBlockDraftModel

    embedding = load_file(folder.parent / "target_embedding.safetensors")["weight"]
    target = LlamaForCausalLM(LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=4,
                                          num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB))  # fmt: skip
    target.get_input_embeddings().weight.data.copy_(embedding)
    ours = SpecBlockDraftModel.from_pretrained(folder, target=target)
    export = folder.parent / "_export"
    ours.save_pretrained(export, checkpoint_format="specblock_reference")
    config = LlamaConfig.from_pretrained(export)
    theirs = modules["draft"].LlamaForCausalLMSpecBlock(config).float()
    result = theirs.load_state_dict(load_file(export / "model.safetensors"), strict=False)
    if result.unexpected_keys or result.missing_keys != ["input_layer.embed_tokens.weight"]:
        raise RuntimeError(f"The export does not load strictly in the reference class: {result}")
    theirs.load_vocab_mapping(str(export / "vocab_mapping.pt"))
    theirs.input_layer.embed_tokens.weight.data.copy_(embedding)
    with torch.no_grad():
        logits, rank, hidden, _, _ = theirs.eval().forward_parallel(features, input_ids, torch.ones_like(input_ids))
    diffs = {n: (a - expected[f"block1.{n}"]).abs().max().item() for n, a in (("logits", logits),
                                                                              ("rank_logits", rank), ("hidden", hidden))}  # fmt: skip
    out = {f"export.{k}": v.detach().clone() for k, v in theirs.state_dict().items() if "embed" not in k}
    out.update({"export.block1.logits": logits, "export.block1.rank_logits": rank, "export.block1.hidden": hidden})
    for path in sorted(export.iterdir()):
        path.unlink()
    export.rmdir()
    return out, {"export_vs_reference_max_abs_diff": diffs, "export_missing_keys": result.missing_keys}


def check_flex(modules, model, features, input_ids) -> float:
    """max |diff| between the dense substitution and the real `flex_attention` (forward, no gradient)."""
    from torch.nn.attention.flex_attention import flex_attention

    blocks = modules["blocks"]
    with torch.no_grad():
        dense = model.forward_parallel(features, input_ids, torch.ones_like(input_ids))[0]
        def real_flex(*args, **kwargs):  # eager flex_attention runs through Dynamo: on for this call only
            torch._dynamo.config.disable = False
            try:
                return flex_attention(*args, **kwargs)
            finally:
                torch._dynamo.config.disable = True

        blocks.get_compiled_flex_attention = lambda kv_len: real_flex
        try:
            real = model.forward_parallel(features, input_ids, torch.ones_like(input_ids))[0]
        finally:
            blocks.get_compiled_flex_attention = lambda kv_len: dense_flex_attention
    return (dense - real).abs().max().item()


def commit_of(root: str) -> str:
    try:
        return subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "unknown (not a git checkout: pass --commit)"


def atomic_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, tmp)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reference", help="A checkout of github.com/shiweijiezero/SpecBlock.")
    parser.add_argument("--output", default=str(Path(__file__).parent / "fixtures"))
    parser.add_argument("--commit", default=None, help="The reference commit (default: git rev-parse HEAD).")
    parser.add_argument("--check_flex", action="store_true", help="Also measure the dense attention substitution.")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    modules = load_reference(args.reference)
    out = Path(args.output)
    (out / "reference_drafter").mkdir(parents=True, exist_ok=True)

    torch.manual_seed(0)
    embedding = torch.randn(VOCAB, HIDDEN) * 0.5
    atomic_save({"weight": embedding}, out / "target_embedding.safetensors")
    model = random_reference_drafter(modules, embedding)
    model.save_pretrained(str(out / "reference_drafter"))  # its own writer: config.json + model.safetensors
    torch.save({"d2t": model.d2t.clone(), "t2d": model.t2d.clone()}, out / "reference_drafter" / "vocab_mapping.pt")

    generator = torch.Generator().manual_seed(2)
    features = torch.randn(1, POSITIONS, 3 * HIDDEN, generator=generator)
    input_ids = torch.randint(0, VOCAB, (1, POSITIONS), generator=generator)
    with torch.no_grad():
        modeling, _ = run_blocks(modules, model, features, input_ids)
        modeling["block1.mask"] = block1_mask(modules, POSITIONS)
        for top_k in (10, 20):
            modeling[f"harness.rank_logits_top{top_k}"] = harness_rank_logits(modules, model, modeling["block1.hidden"], top_k)
    modeling.update({"inputs.features": features, "inputs.input_ids": input_ids})
    export, export_info = check_our_export(modules, out / "reference_drafter", features, input_ids, modeling)
    modeling.update(export)
    atomic_save(modeling, out / "modeling.safetensors")

    batch = training_batch(model, torch.Generator().manual_seed(3))
    model.freeze_embedding()
    training, training_info = run_training(modules, model, batch)
    training.update({f"batch.{k}": v for k, v in batch.items()})
    step, step_info = one_step(modules, random_reference_drafter(modules, embedding), batch)
    training.update(step)
    training_info.update(step_info)
    harness = load_harness_tree_module(args.reference)
    trees, trees_info = pruning_cases(harness, torch.Generator().manual_seed(4))
    block1, block1_info = block1_trees(modules, harness, model, out / "reference_drafter", torch.Generator().manual_seed(5))
    trees.update(block1)
    trees_info.update(block1_info)
    rounds, rounds_info = followup_round(harness, out / "reference_drafter", torch.Generator().manual_seed(6))
    trees.update(rounds)
    trees_info.update(rounds_info)
    atomic_save(trees, out / "trees.safetensors")
    atomic_save(training, out / "training.safetensors")

    manifest = {
        "reference": "github.com/shiweijiezero/SpecBlock",
        "commit": args.commit or commit_of(args.reference),
        "torch": torch.__version__,
        "sizes": dict(hidden=HIDDEN, layers=LAYERS, heads=HEADS, kv_heads=KV_HEADS, intermediate=INTERMEDIATE,
                      vocab=VOCAB, draft_vocab=DRAFT_VOCAB, block_size=K, rank_classes=RANK_CLASSES,
                      positions=POSITIONS),  # fmt: skip
        "followup_m": list(FOLLOWUP_M),
        "attention": "flex_attention answered by dense softmax attention over the reference mask_mod",
        **export_info,
        **training_info,
        **trees_info,
        "loss": {k: v.tolist() for k, v in training.items() if k.startswith("loss.")},
    }
    if args.check_flex:
        manifest["dense_vs_flex_attention_max_abs_diff"] = check_flex(modules, model, features, input_ids)
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, out / "manifest.json")
    print(json.dumps(manifest, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
