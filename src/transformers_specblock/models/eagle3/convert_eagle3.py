"""Published EAGLE-3 checkpoint layouts in and out of `Eagle3DraftModel`.

Read (detected from `config.json`, weights in `model.safetensors` or `pytorch_model.bin`):

* ``"eagle"``: SafeAILab EAGLE (eagle/model/cnets.py): `architectures` ``["LlamaForCausalLM"]``, one layer,
  `draft_vocab_size`; head_dim = hidden_size // heads (EAGLE ignores a config `head_dim`).
* ``"specforge"``: SpecForge / SGLang ``LlamaForCausalLMEagle3`` (also vLLM's ``Eagle3LlamaForCausalLM``); head_dim
  from the config when present; optional `fc_norm`, `norm_output`.
* ``"speculators"``: vLLM speculators (`speculators_model_type` "eagle3", a nested `transformer_layer_config`,
  top-level `norm_before_residual`, `target_hidden_size`, `eagle_aux_hidden_state_layer_ids`, `fc_norm`; its
  `norm_output` / `norm_before_fc`, which this drafter does not compute, are refused).

Keys: `fc.weight`, `midlayer.*` (or `layers.0.*`), `norm.weight`, `lm_head.weight`, `d2t` (offsets), `t2d`, an
optional `embed_tokens.weight` (then it is used, as their code does; else the target's) and `fc_norm.{0,1,2}.weight`.
Write (checked by running speculators 0.9.0 and SpecForge 0.2.0 on them: tests/peers/): ``"eagle3"``, the SpecForge
layout (``LlamaForCausalLMEagle3``), which SGLang and vLLM both load, with both engines' layer-id fields; and
``"speculators"``, vLLM speculators' own format with its layer-id field (its converter reads none from the other
layouts). Both carry `embed_tokens.weight` (the bound target's unless the drafter has its own).
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
    hf_layer_ids_from,
    layer_id_fields,
    offsets_from_draft_vocab,
    require_fields,
    rope_fields,
    rope_parameters_from,
    write_checkpoint,
)
from ..tree_drafter.configuration_tree_drafter import default_target_layer_ids
from .configuration_eagle3 import Eagle3Config

LAYOUTS = ("eagle", "specforge", "speculators")
SPECULATORS_FIELDS = (  # top-level fields of speculators' Eagle3SpeculatorConfig (0.9.0) besides the layer config
    "draft_vocab_size", "target_hidden_size", "norm_before_residual", "eagle_aux_hidden_state_layer_ids",
    "norm_before_fc", "fc_norm", "norm_output",
)
SPECFORGE_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
EXPORT_ARCHITECTURE = "LlamaForCausalLMEagle3"


def detect_eagle3_layout(config: dict[str, Any]) -> str | None:
    """Which published EAGLE-3 layout a `config.json` describes (None: not one of them)."""
    if config.get("speculators_model_type") == "eagle3":
        return "speculators"
    architecture = (config.get("architectures") or [None])[0]
    if config.get("model_type") != "llama" or "draft_vocab_size" not in config:
        return None
    if architecture in SPECFORGE_ARCHITECTURES:
        return "specforge"
    if architecture == "LlamaForCausalLM":
        return "eagle"
    return None


def _flatten(config: dict[str, Any]) -> dict[str, Any]:
    """A speculators config's decoder settings lifted to the top level (the EAGLE-3 fields stay)."""
    layer = dict(config.get("transformer_layer_config") or {})
    layer.update({name: config[name] for name in SPECULATORS_FIELDS if config.get(name) is not None})
    return layer


def _speculators_norms(config: dict[str, Any], source: str) -> dict[str, bool]:
    """Our norm settings for speculators' top-level norm fields, refusing the ones this drafter cannot compute.

    speculators (models/eagle3/core.py): `norm_output: true` feeds the NORMED output to the next step ("Eagle 3.1"),
    where ours and SpecForge's feed the pre-norm output (its logits always read the final norm: our
    `norm_output=True`); `norm_before_fc` is one RMSNorm over the concatenated features (`input_norm.weight`);
    `fc_norm` is one RMSNorm per feature, as ours."""
    for name, meaning in (
        ("norm_output", "feeds the normed output to the next draft step"),
        ("norm_before_fc", "normalises the concatenated target features with one RMSNorm before fc"),
    ):
        if config.get(name):
            raise ValueError(
                f"{source}: speculators' {name}=true ({meaning}) is not implemented by this package's EAGLE-3 drafter, "
                "which would compute something else; it is refused rather than loaded wrongly."
            )
    return {"fc_norm": bool(config.get("fc_norm", False)), "norm_output": True}


def eagle3_config_from(
    config: dict[str, Any],
    layout: str,
    target_config: PretrainedConfig,
    has_embedding: bool,
    source: str,
    **overrides: Any,
) -> Eagle3Config:
    """Our `Eagle3Config` for a published EAGLE-3 `config.json` and the target it drafts for."""
    norms = {"fc_norm": bool(config.get("fc_norm", False)), "norm_output": bool(config.get("norm_output", True))}
    if layout == "speculators":
        config = _flatten(config)
        norms = _speculators_norms(config, source)
    require_fields(config, source)
    text = target_config.get_text_config()
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    if config.get("num_hidden_layers", 1) != 1:
        raise ValueError(
            f"{source}: num_hidden_layers={config['num_hidden_layers']}; only one-layer EAGLE-3 drafters load."
        )
    if not (config.get("eagle_config") or {}).get("use_aux_hidden_state", True):
        raise ValueError(f"{source}: eagle_config.use_aux_hidden_state is false (no fused target features).")
    target_hidden = config.get("target_hidden_size") or hidden
    check_fits_target(config["vocab_size"], target_hidden, target_config, source)
    if target_hidden != hidden and not has_embedding:
        raise ValueError(
            f"{source}: target_hidden_size={target_hidden} differs from hidden_size={hidden}, so the drafter needs its "
            "own token embedding, and the checkpoint has no 'embed_tokens.weight'."
        )
    head_dim = hidden // heads if layout == "eagle" else (config.get("head_dim") or hidden // heads)
    layer_ids = hf_layer_ids_from(config, source) or default_target_layer_ids(text.num_hidden_layers)
    settings = dict(
        vocab_size=config["vocab_size"],
        hidden_size=hidden,
        target_hidden_size=target_hidden,
        target_num_hidden_layers=text.num_hidden_layers,
        target_layer_ids=layer_ids,
        target_model_type=text.model_type,
        num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        intermediate_size=config["intermediate_size"],
        hidden_act=config.get("hidden_act", "silu"),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_parameters=rope_parameters_from(config, source),
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        attention_bias=bool(config.get("attention_bias", False)),
        mlp_bias=bool(config.get("mlp_bias", False)),
        draft_vocab_size=config.get("draft_vocab_size") or config["vocab_size"],
        own_token_embedding=has_embedding,
        norm_before_residual=bool(config.get("norm_before_residual", False)),
        **norms,
        pad_token_id=text.pad_token_id,
        bos_token_id=text.bos_token_id,
        eos_token_id=text.eos_token_id,
    )
    settings.update(overrides)
    return Eagle3Config(**settings)


def eagle3_state_dict_from(
    state_dict: dict[str, torch.Tensor],
    config: Eagle3Config,
    expected: dict[str, tuple[int, ...]],
    source: str,
    layout: str,
) -> dict[str, torch.Tensor]:
    """Published EAGLE-3 keys -> ours (`midlayer.` / `layers.0.` -> `layer.`, offsets -> target ids), strictly:
    every key must be known and every shape must fit `expected` (our names -> shapes)."""
    layer_prefix = "layers.0." if any(key.startswith("layers.0.") for key in state_dict) else "midlayer."
    renamed: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        if key.endswith("rotary_emb.inv_freq"):  # recomputed from the config (not a trained weight)
            continue
        renamed["layer." + key[len(layer_prefix) :] if key.startswith(layer_prefix) else key] = tensor
    d2t, t2d = renamed.pop("d2t", None), renamed.pop("t2d", None)
    check_state_dict(
        renamed,
        {k: v for k, v in expected.items() if k not in ("d2t", "t2d")},
        source,
        f"EAGLE-3 ({layout})",
        lambda key: layer_prefix + key[len("layer.") :] if key.startswith("layer.") else key,
    )
    vocab = draft_vocab_from_offsets(d2t, t2d, config.vocab_size, config.draft_vocab_size, source)
    renamed["d2t"], renamed["t2d"] = vocab
    return renamed


def convert_published_eagle3(
    model_class: type, checkpoint: PublishedCheckpoint, target_config: PretrainedConfig, overrides: dict[str, Any]
) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    """(our config, our state dict) for a published EAGLE-3 checkpoint (see `PublishedCheckpointMixin`)."""
    embedding, target_embedding = checkpoint.state_dict.get("embed_tokens.weight"), checkpoint.target_embedding
    if embedding is not None and target_embedding is not None and embedding.shape == target_embedding.shape:
        if torch.equal(embedding, target_embedding.detach().to(device=embedding.device, dtype=embedding.dtype)):
            # the target's own embedding, as exports write it (for the engines that need it): read the target's
            checkpoint.state_dict = {k: v for k, v in checkpoint.state_dict.items() if k != "embed_tokens.weight"}
    has_embedding = "embed_tokens.weight" in checkpoint.state_dict
    source, layout = checkpoint.source, checkpoint.layout
    ours = eagle3_config_from(checkpoint.config, layout, target_config, has_embedding, source, **overrides)
    expected = expected_shapes(model_class, ours)
    return ours, eagle3_state_dict_from(checkpoint.state_dict, ours, expected, source, layout)


def _export_problems(config: Eagle3Config, engines: str) -> list[str]:
    """What an EAGLE-3 engine would compute differently from this drafter (empty: it can be exported)."""
    problems = []
    if not config.norm_output:
        problems.append(f"norm_output is off ({engines} always normalise the output before lm_head)")
    if config.token_embedding_size != config.hidden_size:
        problems.append(
            f"the target's embedding is {config.target_hidden_size} wide, not hidden_size={config.hidden_size} "
            "(EAGLE-3 engines feed an embedding of the drafter's width)"
        )
    return problems


def _export_state(drafter: Any, layer_prefix: str) -> dict[str, torch.Tensor]:
    """The drafter's weights under the published names, WITH `embed_tokens.weight`: the drafter's own, else the
    bound target's. speculators (0.9.0) fills a missing embedding from the verifier only over a NaN placeholder that
    transformers' loader does not leave, so it ran on an all-zero embedding; SpecForge's exporter always writes it;
    SGLang and vLLM use it or the target's (the same values)."""
    state = {}
    for key, tensor in drafter.state_dict().items():
        if key not in ("d2t", "t2d"):
            state[layer_prefix + key[len("layer.") :] if key.startswith("layer.") else key] = tensor
    if "embed_tokens.weight" not in state:
        embedding = drafter.bound_embedding
        if embedding is None:
            raise ValueError(
                "An EAGLE-3 export must hold the token embedding (embed_tokens.weight), which this drafter reads from "
                "its target: bind it first with `drafter.bind_target(target)` (from_target and generate do)."
            )
        state["embed_tokens.weight"] = embedding.weight.detach().to(device="cpu", dtype=drafter.dtype)
    state["d2t"], state["t2d"] = offsets_from_draft_vocab(drafter.d2t), drafter.t2d.bool().cpu()
    return state


def _llama_fields(drafter: Any) -> dict[str, Any]:
    config: Eagle3Config = drafter.config
    return {
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": config.attention_bias,
        "mlp_bias": config.mlp_bias,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": str(drafter.dtype).removeprefix("torch."),
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        **rope_fields(config.rope_parameters),
    }


def export_eagle3(drafter: Any, folder: str | os.PathLike) -> None:
    """Write `drafter` (an `Eagle3DraftModel`) in the SpecForge / SGLang layout, loadable by SGLang and vLLM."""
    config: Eagle3Config = drafter.config
    problems = _export_problems(config, "SGLang and vLLM")
    if config.fc_norm:
        problems.append("fc_norm is on (SGLang and vLLM have no fc_norm and would skip its weights)")
    if config.norm_before_residual:
        problems.append("norm_before_residual is on (vLLM reads it, SGLang ignores it)")
    if problems:
        raise ValueError(f"This EAGLE-3 drafter cannot be exported in the EAGLE-3 layout: {'; '.join(problems)}.")
    state = _export_state(drafter, "midlayer.")
    out = {
        "architectures": [EXPORT_ARCHITECTURE],
        **_llama_fields(drafter),
        "draft_vocab_size": config.draft_vocab_size,
        **layer_id_fields(config.target_layer_ids),
    }
    if config.target_hidden_size != config.hidden_size:  # EAGLE reads it as "do not load the target's embedding"
        out["target_hidden_size"] = config.target_hidden_size
    write_checkpoint(folder, out, state)


def _verifier_name(config: Eagle3Config) -> str | None:
    """The target as speculators' `verifier.name_or_path` (which it loads): its Hub id, else a local folder, else
    None (a bare model type would send speculators to the Hub for a repository that does not exist)."""
    name = getattr(config, "base_model_id", None) or getattr(config, "target_name_or_path", None)
    return name if name and (getattr(config, "base_model_id", None) or os.path.isdir(name)) else None


def export_speculators(drafter: Any, folder: str | os.PathLike) -> None:
    """Write `drafter` in vLLM speculators' own EAGLE-3 format (what `speculators convert` produces and vLLM
    serves), with the captured layers in its top-level `eagle_aux_hidden_state_layer_ids` (HF `hidden_states`
    indices), which its converter would otherwise set to its default."""
    config: Eagle3Config = drafter.config
    problems = _export_problems(config, "speculators and vLLM")
    if problems:
        raise ValueError(f"This EAGLE-3 drafter cannot be exported in the speculators format: {'; '.join(problems)}.")
    layer_ids_in_range = layer_id_fields(config.target_layer_ids)  # refuses hidden_states[0], as for SGLang
    out = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": {**_llama_fields(drafter), "architectures": ["LlamaForCausalLM"]},
        "draft_vocab_size": config.draft_vocab_size,
        "norm_before_residual": config.norm_before_residual,
        "norm_before_fc": False,
        "fc_norm": config.fc_norm,
        "norm_output": False,  # speculators' meaning: the next step reads the PRE-norm output (as ours)
        "embed_requires_grad": False,
        "target_hidden_size": config.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": layer_ids_in_range["eagle_aux_hidden_state_layer_ids"],
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": min(drafter.generation_config.tree_depth + 1, 8)}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": _verifier_name(config), "architectures": []},
        },
        "torch_dtype": str(drafter.dtype).removeprefix("torch."),
    }
    write_checkpoint(folder, out, _export_state(drafter, "layers.0."))
