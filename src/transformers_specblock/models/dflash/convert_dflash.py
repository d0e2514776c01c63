"""Published DFlash checkpoints (z-lab/dflash `DFlashDraftModel`, e.g. z-lab/Qwen3-8B-DFlash-b16) in and out of
`DFlashDraftModel`.

Read (detected from `config.json`): a Qwen3 config (`model_type` "qwen3", `architectures` ["DFlashDraftModel"])
with `num_target_layers`, `block_size` and `dflash_config` {`mask_token_id`, `target_layer_ids`, optionally
`block_size`} (a value in `dflash_config` wins over a top-level one, as the public code reads them); without
`target_layer_ids` the public default (`dflash_target_layer_ids`). Keys, identical to ours: `fc.weight`,
`hidden_norm.weight`, `layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `layers.{i}.self_attn.{q,k}_norm.weight`,
`layers.{i}.{input,post_attention}_layernorm.weight`, `layers.{i}.mlp.{gate,up,down}_proj.weight`, `norm.weight`.
Refused with a ValueError naming the setting: DFlash2 checkpoints (dynamic convolutions, candidate selector),
sliding-window or causal drafter layers, an output multiplier / logit soft-cap / embedding scale.
Write: the same layout (`save_pretrained(folder, checkpoint_format="dflash")`).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import PretrainedConfig

from ..tree_drafter.checkpoint_io import (
    PublishedCheckpoint,
    check_state_dict,
    expected_shapes,
    rope_fields,
    rope_parameters_from,
    write_checkpoint,
)
from .configuration_dflash import DFlashConfig, dflash_target_layer_ids

ARCHITECTURE = "DFlashDraftModel"
UNSUPPORTED_ARCHITECTURES = ("DFlash2DraftModel",)
VOCAB_BUFFERS = ("d2t", "t2d")  # ours only: the identity draft vocabulary of a full-vocabulary drafter


def detect_dflash_layout(config: dict[str, Any]) -> str | None:
    """"dflash" for a published DFlash `config.json`, "dflash2" for its unsupported successor, else None."""
    if config.get("model_type") == DFlashConfig.model_type:  # this package's own layout
        return None
    architecture = (config.get("architectures") or [None])[0]
    if architecture == ARCHITECTURE and ("dflash_config" in config or "block_size" in config):
        return "dflash"
    if architecture in UNSUPPORTED_ARCHITECTURES:
        return "dflash2"
    return None


def dflash_config_from(
    config: dict[str, Any], target_config: PretrainedConfig, source: str, **overrides: Any
) -> DFlashConfig:
    """Our `DFlashConfig` for a published DFlash `config.json` and the target it drafts for (checked)."""
    draft = config.get("dflash_config") or {}

    def value(name: str, default: Any = None) -> Any:
        return draft.get(name, config.get(name, default))

    neutral_values = {"output_multiplier": 1.0, "final_logit_softcapping": None, "input_embedding_scale": 1.0}
    for name, neutral in neutral_values.items():
        if value(name, neutral) not in (neutral, 0, 0.0):
            raise ValueError(f"{source}: dflash_config.{name}={value(name)} is not supported (plain DFlash has none).")
    layer_types = config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"]
    if config.get("use_sliding_window") or any(kind != "full_attention" for kind in layer_types):
        raise ValueError(f"{source}: sliding-window drafter layers ({layer_types}) are not supported.")
    if config.get("is_causal"):
        raise ValueError(
            f"{source}: is_causal=true (causal drafter attention) is not supported: DFlash attends bidirectionally."
        )
    mask_token_id = value("mask_token_id")
    if mask_token_id is None:
        raise ValueError(f"{source}: dflash_config.mask_token_id is missing; pass mask_token_id=<id> to load it.")
    text = target_config.get_text_config()
    num_target_layers = config.get("num_target_layers", text.num_hidden_layers)
    checks = (
        ("hidden_size", config["hidden_size"], text.hidden_size),
        ("vocab_size", config["vocab_size"], text.vocab_size),
        ("num_target_layers", num_target_layers, text.num_hidden_layers),
    )
    for name, theirs, target_value in checks:
        if theirs != target_value:
            raise ValueError(
                f"{source}: the checkpoint has {name}={theirs}, but the target has {target_value}: it was trained for "
                "another target model."
            )
    heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
    settings = {
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": config.get("num_key_value_heads", heads),
        "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
        "intermediate_size": config["intermediate_size"],
        "hidden_act": config.get("hidden_act", "silu"),
        "rms_norm_eps": config.get("rms_norm_eps", 1e-6),
        "rope_parameters": rope_parameters_from(config, source),
        "max_position_embeddings": config.get("max_position_embeddings", text.max_position_embeddings),
        "attention_bias": config.get("attention_bias", False),
        "target_layer_ids": value("target_layer_ids") or dflash_target_layer_ids(num_target_layers, layers),
        "block_size": int(value("block_size", 16)),
        "mask_token_id": int(mask_token_id),
    }
    return DFlashConfig.from_target_config(target_config, **{**settings, **overrides})


def convert_published_dflash(
    model_class: type, checkpoint: PublishedCheckpoint, target_config: PretrainedConfig, overrides: dict[str, Any]
) -> tuple[DFlashConfig, dict[str, torch.Tensor]]:
    """(our config, our state dict) for a published DFlash checkpoint (`PublishedCheckpointMixin.convert_published`)."""
    if checkpoint.layout == "dflash2":
        raise ValueError(
            f"{checkpoint.source} is a DFlash2 checkpoint (dynamic convolutions and a candidate selector), which this "
            "package does not implement; use a DFlash (v1) drafter."
        )
    config = dflash_config_from(checkpoint.config, target_config, checkpoint.source, **overrides)
    expected = {k: v for k, v in expected_shapes(model_class, config).items() if k not in VOCAB_BUFFERS}
    check_state_dict(checkpoint.state_dict, expected, checkpoint.source, "DFlash")
    state = dict(checkpoint.state_dict)
    state["d2t"] = torch.arange(config.vocab_size)
    state["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    return config, state


def export_dflash(drafter: Any, folder: str | os.PathLike) -> None:
    """Write `drafter` (a `DFlashDraftModel`) in the published DFlash layout (config.json + model.safetensors)."""
    config: DFlashConfig = drafter.config
    out = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "num_hidden_layers": config.num_hidden_layers,
        "num_target_layers": config.target_num_hidden_layers,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": config.attention_bias,
        "attention_dropout": 0.0,
        "vocab_size": config.vocab_size,
        "block_size": config.block_size,
        "dflash_config": {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids)},
        "layer_types": ["full_attention"] * config.num_hidden_layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": str(drafter.dtype).removeprefix("torch."),
        **rope_fields(config.rope_parameters),
    }
    state = {key: tensor for key, tensor in drafter.state_dict().items() if key not in VOCAB_BUFFERS}
    write_checkpoint(folder, out, state)
