"""Decoding fixtures: a drafter trained by the SpecBlock reference's own training code on a tiny target, and the
reference harness's greedy loop (`_generate_once_streaming`) with it (see `make_specblock_fixtures.py`).

The harness was written for a CUDA machine and transformers 4.x. Run on the CPU with transformers 5, five things
stand in for it here, none inside the tree or verification logic: the final `build_tree_buffers_triton` (Triton
kernels) is answered by `tree_buffers` (the same tensors from the same nodes), its bfloat16 verification-mask
buffer is allocated in the target's float32, `DynamicCache.crop(n)` keeps n tokens (transformers 4.x; version 5
removes -n), the drafter config's `rope_theta` attribute is set from `rope_parameters` (the harness reads
`config.rope_theta`, which transformers 5 no longer sets: it would fall back to 10000 silently), and a tokenizer
stand-in returns the prompt ids (the tiny target has no tokenizer)."""

from __future__ import annotations

import collections
import importlib
import os
import random
import sys
import types
from pathlib import Path

import numpy as np
import torch
from reference_code import HEADS, HIDDEN, INTERMEDIATE, K, KV_HEADS, VOCAB, _NoEvent, harness_module
from safetensors.torch import load_file
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

TARGET_LAYERS = 4
FEATURE_LAYERS = [2, TARGET_LAYERS // 2, TARGET_LAYERS - 3]  # the harness's hidden_layer_indices
PROMPTS = 6  # decoded prompts, PROMPT_LENGTH tokens each, NEW_TOKENS new tokens
PROMPT_LENGTH, NEW_TOKENS = 4, 40


def tiny_target(embedding: torch.Tensor) -> LlamaForCausalLM:
    """The tiny Llama target (seed 0, transformers' default initialisation) with the fixtures' token embedding."""
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=TARGET_LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB)  # fmt: skip
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        target.get_input_embeddings().weight.copy_(embedding)
    return target


def reference_batch(target, sequences: torch.Tensor) -> dict[str, torch.Tensor]:
    """A batch as the reference's `generate_eagle3_data` hands it over: features of position i, x_{i+1} and the
    target's logits at i+1 (both zero-padded at the end), the loss mask (0 on the padded last position)."""
    with torch.no_grad():
        out = target(sequences, output_hidden_states=True)
    features = torch.cat([out.hidden_states[i] for i in FEATURE_LAYERS], dim=-1)
    input_ids = torch.cat([sequences[:, 1:], torch.zeros_like(sequences[:, :1])], dim=1)
    logits = torch.cat([out.logits[:, 1:], torch.zeros_like(out.logits[:, :1])], dim=1)
    loss_mask = torch.ones(*sequences.shape, 1)
    loss_mask[:, -1] = 0.0
    return {"input_ids": input_ids, "hidden_states": features, "target": logits, "loss_mask": loss_mask}


def train_reference_drafter(modules, model, target, generator, steps: int = 300, batch: int = 8) -> list[float]:
    """Train `model` in place with the reference's training pass and optimizer (3 blocks, M drawn by its
    `random.randint` (seeded), rank loss from step 0, lr 3e-3 with 10 warm-up steps, linear decay) on the target's
    own greedy continuations of random prompts. Returns the losses."""
    sys.modules["specforge.utils"] = types.SimpleNamespace(print_on_rank0=lambda *a, **k: None)
    optimizer = importlib.import_module("specforge.optimizer").BF16Optimizer(
        model, lr=3e-3, max_grad_norm=0.5, warmup_steps=10, total_steps=steps, scheduler_type="linear"
    )
    wrapper = modules["core"].OnlineSpecBlockModel(model, length=K, rank_start_step=0, num_ttt_blocks=3)
    random.seed(0)
    weights = 0.8 ** torch.arange(K, dtype=torch.float32)
    losses = []
    for step in range(steps):
        prompts = torch.randint(0, VOCAB, (batch, PROMPT_LENGTH), generator=generator)
        with torch.no_grad():
            sequences = target.generate(prompts, do_sample=False, max_new_tokens=28, min_new_tokens=28)
        data = reference_batch(target, sequences)
        plosses, _, _ = wrapper(attention_mask=None, global_step=step, **data)
        loss = (weights * torch.stack(plosses[:-1])).sum() + plosses[-1]
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def tree_buffers(n_nodes, tokens, parents, sample_token, device, k_slots, max_blocks):
    """What `build_tree_buffers_triton` returns, without Triton: tree tokens [1, N+1] (the root first), the
    ancestor mask [1, 1, N+1, N+1], depths [N+1], and every root-to-leaf path padded with -1, sorted."""
    num = n_nodes
    parent = np.zeros(num + 1, dtype=np.int64)
    parent[1:] = np.where(parents[:num] >= 0, parents[:num] + 1, 0)
    depth = np.zeros(num + 1, dtype=np.int64)
    mask = np.eye(num + 1, dtype=np.float32)
    for i in range(1, num + 1):
        depth[i] = depth[parent[i]] + 1
        mask[i] = mask[parent[i]]
        mask[i, i] = 1.0
    is_parent = np.zeros(num + 1, dtype=bool)
    is_parent[parent[1:]] = True
    rows = []
    for leaf in np.nonzero(~is_parent)[0]:
        path, node = [], int(leaf)
        while node:
            path.append(node)
            node = int(parent[node])
        rows.append([0, *path[::-1]] + [-1] * (int(depth.max()) - len(path)))
    rows.sort(key=lambda row: tuple(x if x >= 0 else num + 6 for x in row))
    ids = np.concatenate([[int(sample_token.item())], tokens[:num]]).astype(np.int64)
    return (torch.from_numpy(ids)[None], torch.from_numpy(mask)[None, None], torch.from_numpy(depth),
            torch.tensor(rows, dtype=torch.long))  # fmt: skip


class _PromptTokenizer:
    """Tokenizer stand-in: the prompt ids, an end-of-sequence id the target does not reach, ids as text."""

    eos_token_id = -1

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def apply_chat_template(self, conversation, tokenize=False, add_generation_prompt=True) -> str:
        return ""

    def __call__(self, text, return_tensors=None, add_special_tokens=False):
        return types.SimpleNamespace(input_ids=self.ids, to=lambda device: types.SimpleNamespace(input_ids=self.ids))

    def decode(self, ids, skip_special_tokens=False) -> str:
        return " ".join(str(int(i)) for i in ids)


def keep_crop(cache: DynamicCache, max_length: int) -> None:
    """transformers 4.x `DynamicCache.crop(max_length)`: keep `max_length` tokens (5.x removes -n for n < 0)."""
    remove = cache.get_seq_length() - max_length
    if remove > 0:
        _CROP(cache, -remove)


_CROP = DynamicCache.crop


def record_feeds(model, feeds: list[dict]) -> None:
    """Make `model` (the harness's inference model) append to `feeds`, for every forward that feeds it committed
    positions and drafts block 1 from the last (`update_cache_and_draft`, which `prefill_and_draft` calls, and block
    1's `forward_with_cache`): the tokens fed, the rotary position of the first one's slot 0, the cache entries it
    attends to besides its own, and the block-1 logits [K, draft vocabulary]."""

    def update_cache_and_draft(hidden_3h, input_ids, cache, start_position):
        cached = cache[0][2]
        out = type(model).update_cache_and_draft(model, hidden_3h, input_ids, cache, start_position)
        feeds.append({"tokens": input_ids[0].tolist(), "position": start_position + 1, "cached": cached,
                      "logits": out[0][0].clone()})  # fmt: skip
        return out

    def forward_with_cache(hidden, input_ids, cache, position_id, use_draft_condition=False, **kwargs):
        cached = cache[0][2]
        out = type(model).forward_with_cache(model, hidden, input_ids, cache, position_id, use_draft_condition, **kwargs)
        if not use_draft_condition:  # block 1 (follow-up blocks feed no committed position)
            feeds.append({"tokens": input_ids[0].tolist(), "position": position_id + 1, "cached": cached,
                          "logits": out[0][0].clone()})  # fmt: skip
        return out

    model.update_cache_and_draft, model.forward_with_cache = update_cache_and_draft, forward_with_cache


def harness_decode(
    harness, folder: Path, target, prompts: list[torch.Tensor], feature_layers: list[int] = FEATURE_LAYERS,
    new_tokens: int = NEW_TOKENS, rank_topk: int = 10, feeds: list[list[dict]] | None = None,
) -> list[list[list[int]]]:  # fmt: skip
    """The harness's greedy loop at its defaults (two block steps, 90 tree tokens, rank features over the top
    `rank_topk`) for each prompt: per iteration the tokens it commits (the tree root, the accepted draft tokens; the
    bonus token is the next root). `feeds`, when given, receives per prompt what `record_feeds` records."""
    os.environ.update(TREE_BUILD_TRITON="0", TREE_FINALIZE_CUDA="0", TREE_ATTN_TRITON="0", DRAFT_COMPILE="0",
                      RANK_TOPK=str(rank_topk))  # fmt: skip
    algorithms = harness_module(harness, "specblock")
    for key, value in algorithms.SpecBlockAlgorithm._PARETO_DEFAULTS.items():
        os.environ.setdefault(key, value)
    torch.cuda.Event, torch.cuda.synchronize = _NoEvent, lambda *args, **kwargs: None
    harness.build_tree_buffers_triton = tree_buffers
    DynamicCache.crop = keep_crop
    algorithm = algorithms.SpecBlockAlgorithm(model_path="target", draft_model_path=str(folder), device="cpu",
                                              total_tokens=90, max_blocks=2, beam_width=10)  # fmt: skip
    config = LlamaConfig.from_pretrained(folder)
    config.rope_theta = config.rope_parameters["rope_theta"]  # what it reads (transformers 4.x; 5.x: rope_parameters)
    model = harness_module(harness, "specblock_inference_model").SpecBlockInferenceModel(config).float().eval()
    result = model.load_state_dict(load_file(folder / "model.safetensors"), strict=False)
    assert result.missing_keys == ["input_layer.embed_tokens.weight"] and not result.unexpected_keys, result
    model.load_vocab_mapping(str(folder / "vocab_mapping.pt"))
    model.input_layer.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight)
    model.prepare_for_inference()
    algorithm.draft_model, algorithm.target_model = model, target
    algorithm.hidden_layer_indices = list(feature_layers)
    out = []
    try:
        for prompt in prompts:
            if feeds is not None:
                feeds.append([])
                record_feeds(model, feeds[-1])
            algorithm.tokenizer = _PromptTokenizer(prompt[None])
            algorithm._verify_mask_buf = torch.full((1, 1, 256, 4096), float("-inf"))  # harness: bfloat16
            algorithm._block_forward_events = collections.defaultdict(list)
            with torch.no_grad():
                final = list(algorithm._generate_once_streaming([], max_new_tokens=new_tokens, temperature=0.0))[-1]
            out.append([row["new_tokens"][:-1] for row in final["iteration_details"]])
    finally:
        DynamicCache.crop = _CROP
    return out
