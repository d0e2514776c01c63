"""The SpecBlock reference code (github shiweijiezero/SpecBlock) imported and run on the CPU for
`make_specblock_fixtures.py`: which of its modules, what stands in for its GPU-only parts, the tiny drafter."""

from __future__ import annotations

import importlib
import os
import sys
import types

import torch

HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 64, 2, 4, 2, 128
VOCAB, DRAFT_VOCAB, K, RANK_CLASSES = 256, 128, 4, 4
POSITIONS = 6  # modeling fixtures: positions of one sequence
FOLLOWUP_M = (2, 3)  # training-time follow-up blocks: block 2 starts from slot M1-1 of block 1, block 3 from M2-1
TREE_HEAD_SCALES = (1.0, 1.0, 6.0, 6.0, 12.0, 12.0, 25.0, 25.0, 50.0, 50.0)  # block-1 tree cases: lm_head x scale


def load_reference(root: str) -> dict[str, types.ModuleType]:
    """The reference modules, imported from `root` without the package `__init__` files."""
    torch._dynamo.config.disable = True
    packages = ("specforge", "specforge.modeling", "specforge.modeling.draft", "specforge.core", "benchmarks_hf",
                "benchmarks_hf.algorithms")  # fmt: skip
    for name in packages:
        module = types.ModuleType(name)
        module.__path__ = [os.path.join(root, *name.split("."))]
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


def harness_module(harness: types.ModuleType, name: str) -> types.ModuleType:
    return importlib.import_module(f"{harness.__name__.rsplit('.', 1)[0]}.{name}")


class _NoEvent:
    """`torch.cuda.Event` stand-in: the harness times its block forwards with CUDA events; nothing to time here."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, *args, **kwargs) -> None:
        pass

    def elapsed_time(self, other) -> float:
        return 0.0


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
