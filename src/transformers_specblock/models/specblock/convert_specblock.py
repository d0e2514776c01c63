"""The SpecBlock reference checkpoint layout (shiweijiezero/SpecBlock, specforge/modeling/draft/
_llama3_specblock_base.py and llama3_specblock.py) in and out of `SpecBlockDraftModel`.

`architectures` ``LlamaForCausalLMSpecBlock`` or ``LlamaForCausalLMSpecBlockShift``; config fields
`diffspec_draft_token_num` (K, code default 7), `rank_classes` (4), `num_ttt_blocks` (block rounds, harness default
3), `draft_vocab_size`. Keys (reference -> ours): `input_layer.condition_proj` -> `condition_proj`,
`input_layer.{condition,token,query}_norm` -> `{condition,token,query}_norm`, `input_layer.position_queries` ->
`slot_queries`, `input_layer.fuse` -> `fusion`, `layers.{i}.*` (Llama layers), `shift_proj.{i}` -> `layer_shifts.{i}`,
`norm`, `lm_head`, `rank_head.{0,2}.weight` (no biases), `d2t` (offsets) / `t2d`. Embeddings are not saved (an
`input_layer.embed_tokens.weight` that is present is ignored, as the reference harness overwrites it with the
target's). A `vocab_mapping.pt` beside the weights (`{d2t, t2d}`) is read with `torch.load(weights_only=True)` and wins,
as in the harness. The reference computes head_dim = hidden_size // heads, RMSNorm eps 1e-5 unless configured, plain
RoPE unless the scaling is llama3, rank features normalised within the top-20 logits and a bias-free rank head:
the loaded config says so (`rank_head_bias=False`, `rank_top1_over_vocab=False`); its follow-up blocks sit at block 1's
rotary positions (`followup_positions="block1"`).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import PretrainedConfig

from ..tree_drafter.checkpoint_io import (
    PublishedCheckpoint,
    check_fits_target,
    check_state_dict,
    draft_vocab_from_offsets,
    expected_shapes,
    load_tensor_pickle,
    offsets_from_draft_vocab,
    require_fields,
    resolve_file,
    rope_fields,
    rope_parameters_from,
    write_checkpoint,
)
from ..tree_drafter.configuration_tree_drafter import default_target_layer_ids
from .configuration_specblock import SpecBlockConfig

ARCHITECTURES = ("LlamaForCausalLMSpecBlock", "LlamaForCausalLMSpecBlockShift")
REFERENCE_RANK_BOUNDS = [1, 4, 10]  # rank 1 / 2-4 / 5-10 / >10 (the reference's 4 classes)
REFERENCE_RANK_HIDDEN = 256
REFERENCE_FEATURE_TOP_K = 20
# reference key prefix -> ours
RENAMES = {
    "input_layer.condition_proj.": "condition_proj.",
    "input_layer.condition_norm.": "condition_norm.",
    "input_layer.token_norm.": "token_norm.",
    "input_layer.position_queries.": "slot_queries.",
    "input_layer.query_norm.": "query_norm.",
    "input_layer.fuse.": "fusion.",
    "shift_proj.": "layer_shifts.",
}
IGNORED_EMBEDDING = "input_layer.embed_tokens.weight"


def detect_specblock_layout(config: dict[str, Any]) -> str | None:
    """"specblock_reference" when a `config.json` describes a SpecBlock reference checkpoint, else None."""
    architecture = (config.get("architectures") or [None])[0]
    return "specblock_reference" if architecture in ARCHITECTURES else None


def specblock_config_from(
    config: dict[str, Any], target_config: PretrainedConfig, source: str, **overrides: Any
) -> SpecBlockConfig:
    """Our `SpecBlockConfig` for a reference `config.json` and the target it drafts for."""
    require_fields(config, source)
    text = target_config.get_text_config()
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    target_hidden = config.get("target_hidden_size") or hidden
    check_fits_target(config["vocab_size"], target_hidden, target_config, source)
    if target_hidden != hidden:
        raise ValueError(
            f"{source}: target_hidden_size={target_hidden} != hidden_size={hidden}: the reference feeds the target's "
            "embedding to a layer of the drafter's width, so such a checkpoint cannot run."
        )
    if config.get("rank_classes", 4) != len(REFERENCE_RANK_BOUNDS) + 1:
        raise ValueError(
            f"{source}: rank_classes={config['rank_classes']}; only the reference's 4 rank classes (rank 1 / 2-4 / "
            "5-10 / >10) are known."
        )
    settings = dict(
        vocab_size=config["vocab_size"],
        hidden_size=hidden,
        target_hidden_size=target_hidden,
        target_num_hidden_layers=text.num_hidden_layers,
        target_layer_ids=default_target_layer_ids(text.num_hidden_layers),  # the harness always captures these
        target_model_type=text.model_type,
        num_hidden_layers=config.get("num_hidden_layers", 1),
        num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads") or heads,
        head_dim=hidden // heads,  # the reference ignores a config head_dim
        intermediate_size=config["intermediate_size"],
        hidden_act=config.get("hidden_act", "silu"),
        rms_norm_eps=config.get("rms_norm_eps", 1e-5),
        rope_parameters=rope_parameters_from(config, source, ignore_scaling_except_llama3=True),
        max_position_embeddings=config.get("max_position_embeddings", 8192),
        draft_vocab_size=config.get("draft_vocab_size", 32000),
        block_size=config.get("diffspec_draft_token_num", 7),
        rank_bucket_upper_bounds=REFERENCE_RANK_BOUNDS,
        rank_head_hidden_size=REFERENCE_RANK_HIDDEN,
        rank_head_bias=False,
        rank_feature_top_k=REFERENCE_FEATURE_TOP_K,
        rank_top1_over_vocab=False,
        followup_positions="block1",
        pad_token_id=text.pad_token_id,
        bos_token_id=text.bos_token_id,
        eos_token_id=text.eos_token_id,
    )
    settings.update(overrides)
    return SpecBlockConfig(**settings)


def _vocab_mapping(
    path_or_id: str | os.PathLike, hub_kwargs: dict[str, Any], state_dict: dict[str, torch.Tensor], source: str
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(d2t, t2d) offsets: `vocab_mapping.pt` when present (it must agree with the weights' own buffers), else the
    weights' buffers."""
    d2t, t2d = state_dict.pop("d2t", None), state_dict.pop("t2d", None)
    path = resolve_file(path_or_id, "vocab_mapping.pt", hub_kwargs)
    if path is None:
        return d2t, t2d
    mapping = load_tensor_pickle(path)
    if not isinstance(mapping, dict) or not {"d2t", "t2d"} <= set(mapping):
        raise ValueError(f"{path} must hold a dict with tensors 'd2t' and 't2d'.")
    for name, own in (("d2t", d2t), ("t2d", t2d)):
        if own is not None and not torch.equal(own.to(mapping[name].dtype), mapping[name]):
            raise ValueError(
                f"{source}: key {name!r} differs from {name!r} in vocab_mapping.pt beside it; the reference harness "
                "would use vocab_mapping.pt. Remove the one that is stale."
            )
    return mapping["d2t"], mapping["t2d"]


def reference_drafting_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The decoding settings a reference `config.json` describes: its block rounds (`num_ttt_blocks`)."""
    return {"max_blocks": config.get("num_ttt_blocks", 3)}


def convert_published_specblock(
    model_class: type, checkpoint: PublishedCheckpoint, target_config: PretrainedConfig, overrides: dict[str, Any]
) -> tuple[SpecBlockConfig, dict[str, torch.Tensor]]:
    """(our config, our state dict) for a reference checkpoint (`PublishedCheckpointMixin.convert_published`),
    strictly: every key must be known and every shape must fit."""
    source = checkpoint.source
    ours = specblock_config_from(checkpoint.config, target_config, source, **overrides)
    state_dict = dict(checkpoint.state_dict)
    d2t, t2d = _vocab_mapping(checkpoint.path, checkpoint.hub_kwargs, state_dict, source)
    embedding = state_dict.pop(IGNORED_EMBEDDING, None)
    if embedding is not None and tuple(embedding.shape) != (ours.vocab_size, ours.hidden_size):
        raise ValueError(f"{source}: key {IGNORED_EMBEDDING!r} has shape {list(embedding.shape)}, not [vocab, hidden].")
    renamed = {}
    for key, tensor in state_dict.items():
        for prefix, new in RENAMES.items():
            if key.startswith(prefix):
                key = new + key[len(prefix) :]
        renamed[key] = tensor
    expected = {k: v for k, v in expected_shapes(model_class, ours).items() if k not in ("d2t", "t2d")}
    check_state_dict(renamed, expected, source, "SpecBlock reference", _reference_name)
    if ours.draft_vocab_size == ours.vocab_size:  # the harness maps draft ids 1:1 then, whatever the buffers hold
        d2t, t2d = None, None
    renamed["d2t"], renamed["t2d"] = draft_vocab_from_offsets(d2t, t2d, ours.vocab_size, ours.draft_vocab_size, source)
    return ours, renamed


def _reference_name(key: str) -> str:
    """Our key -> the reference's."""
    for old, new in RENAMES.items():
        if key.startswith(new):
            return old + key[len(new) :]
    return key


def export_specblock_reference(drafter: Any, folder: str | os.PathLike) -> None:
    """Write `drafter` (a `SpecBlockDraftModel`) as the reference saves it: `config.json`, `model.safetensors`
    (no embeddings) and `vocab_mapping.pt`. Refused where the reference would compute something else."""
    config: SpecBlockConfig = drafter.config
    state = drafter.state_dict()
    problems = []
    if config.rank_head_bias and any(bool(state[f"rank_head.{i}.bias"].any()) for i in (0, 2)):
        problems.append("its rank head has biases (the reference's has none)")
    if config.rank_top1_over_vocab or config.rank_feature_top_k != REFERENCE_FEATURE_TOP_K:
        problems.append(
            "its rank features differ (the reference normalises them within the top-20 logits: "
            "rank_top1_over_vocab=False, rank_feature_top_k=20)"
        )
    fixed = {
        "followup_positions": (config.followup_positions, "block1"),
        "rank_bucket_upper_bounds": (config.rank_bucket_upper_bounds, REFERENCE_RANK_BOUNDS),
        "rank_head_hidden_size": (config.rank_head_hidden_size, REFERENCE_RANK_HIDDEN),
        "head_dim": (config.head_dim, config.hidden_size // config.num_attention_heads),
        "target_hidden_size": (config.target_hidden_size, config.hidden_size),
        "target_layer_ids": (config.target_layer_ids, default_target_layer_ids(config.target_num_hidden_layers)),
        "attention_bias": (config.attention_bias, False),
        "mlp_bias": (config.mlp_bias, False),
    }
    problems += [f"{name}={ours} (the reference needs {need})" for name, (ours, need) in fixed.items() if ours != need]
    if config.rope_parameters.get("rope_type") not in ("default", "llama3"):
        problems.append(f"its RoPE type {config.rope_parameters['rope_type']!r} (the reference applies only llama3)")
    if problems:
        raise ValueError(f"This SpecBlock drafter cannot be exported in the reference layout: {'; '.join(problems)}.")
    out_state = {
        _reference_name(key): tensor
        for key, tensor in state.items()
        if key not in ("d2t", "t2d") and not (key.startswith("rank_head.") and key.endswith(".bias"))
    }
    mapping = {"d2t": offsets_from_draft_vocab(drafter.d2t), "t2d": drafter.t2d.bool().cpu()}
    out_state.update(mapping)
    out = {
        "architectures": [ARCHITECTURES[0]],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "num_hidden_layers": config.num_hidden_layers,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "diffspec_draft_token_num": config.block_size,
        "rank_classes": config.num_rank_classes,
        "num_ttt_blocks": drafter.generation_config.max_blocks,
        "tie_word_embeddings": False,
        "torch_dtype": str(drafter.dtype).removeprefix("torch."),
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        **rope_fields(config.rope_parameters),
    }
    write_checkpoint(folder, out, out_state)
    torch.save(mapping, os.path.join(folder, "vocab_mapping.pt"))
