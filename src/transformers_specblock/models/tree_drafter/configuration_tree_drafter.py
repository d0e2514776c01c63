"""Configuration shared by the feature-level tree drafters (SpecBlock, EAGLE-3).

`TreeDrafterConfig` holds what every drafter of a frozen target needs: the target it reads (vocabulary, sizes, the
three feature layers), the Llama-style decoder settings of its own layers and the draft vocabulary. Each drafter's
config adds its own architecture and training settings; how a drafter drafts (tree budget, tree shape, free
candidates) lives in its `generation_config` (`TreeGenerationConfig`).
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

from transformers import PretrainedConfig

from ...hub.provenance import load_training_record
from ...hub.shipped import resolve_drafter_path
from .generation_config import DRAFTING_SETTINGS, TreeGenerationConfig

# Target families whose decoder stack and hidden-state layout the drafters understand.
SUPPORTED_TARGET_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3")


def default_target_layer_ids(num_target_layers: int) -> list[int]:
    """EAGLE-3's low / middle / high feature layers: the inputs of layers 2, L//2 and L-3.

    The ids index the target's `hidden_states` tuple (index 0 is the embedding output, i.e. the input of layer 0).
    """
    if num_target_layers < 4:
        raise ValueError(f"A feature-level drafter needs a target with at least 4 layers, got {num_target_layers}.")
    return [2, num_target_layers // 2, num_target_layers - 3]


RECORD_SECTIONS = {"training_info": "training", "eval_results": "evaluation"}
"""Keys older checkpoints kept in config.json -> the section of the training record (``training_record.json``) that
holds them now."""


def misplaced_setting(name: str) -> str:
    """What to do instead of reading or setting a decoding setting on a drafter's config."""
    return (
        f"{name} is a decoding setting of the drafter's `generation_config` (`TreeGenerationConfig`), not of its "
        f"config: read it as `drafter.generation_config.{name}`; set it with `drafter.set_drafting_settings({name}=...)`"
        f", for a block of code with `drafter.tree_settings({name}=...)`, or for one call with `generate(..., "
        f"{name}=...)`."
    )


class TreeDrafterConfig(PretrainedConfig):
    r"""Settings every tree drafter of a frozen target shares (subclassed by each drafter's config).

    Args:
        vocab_size: Target vocabulary size (the drafter reads the target's input embedding).
        hidden_size: Drafter hidden size (defaults to the target's).
        target_hidden_size: Target hidden size.
        target_num_hidden_layers: Number of decoder layers of the target.
        target_layer_ids: Indices into the target's `hidden_states` tuple used as low/middle/high features
            (default: the inputs of layers 2, L//2 and L-3, as EAGLE-3).
        target_model_type: `model_type` of the target the drafter was built for.
        num_hidden_layers / num_attention_heads / num_key_value_heads / head_dim / intermediate_size / hidden_act /
        rms_norm_eps / rope_parameters / max_position_embeddings / attention_bias / attention_dropout / mlp_bias:
            Llama-style decoder settings of the drafter.
        draft_vocab_size: Size of the reduced draft vocabulary (`None` = the full target vocabulary).
        legacy decoding settings (`DRAFTING_SETTINGS`, e.g. `tree_budget`): accepted for checkpoints written before
            they moved to the drafter's `generation_config` (`TreeGenerationConfig`), which they initialise; never
            written to config.json again.
        training settings (`training_settings`, e.g. EAGLE-3's `ttt_steps`): how a run trains the drafter, not its
            architecture. Training sets them from its arguments (`training.arguments`); kept as attributes for the
            training code, recorded in the training record, never written to config.json.
        legacy records (`training_info`, `eval_results`): accepted from checkpoints written before they moved to the
            training record (``training_record.json`` next to the weights, `training_record`), which they fill.

    `config.json` holds the architecture only, as `LlamaConfig`'s does: the target the drafter reads (its sizes, layer
    ids and, as PEFT's `base_model_name_or_path`, its name), the drafter's own layers and draft vocabulary. Where the
    drafter came from and how it measured (`training_record`: ``training``, ``evaluation``, ``training_settings``)
    is written by `save_pretrained` to ``training_record.json`` and read back by `from_pretrained`.
    """

    drafter_name = "tree"
    training_settings: ClassVar[dict[str, Any]] = {}
    """Training settings of this drafter family and their defaults (not architecture: never in config.json)."""

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 4096,
        target_hidden_size: int | None = None,
        target_num_hidden_layers: int = 32,
        target_layer_ids: list[int] | None = None,
        target_model_type: str | None = None,
        num_hidden_layers: int = 1,
        num_attention_heads: int = 32,
        num_key_value_heads: int = 8,
        head_dim: int | None = None,
        intermediate_size: int | None = None,
        hidden_act: str = "silu",
        rms_norm_eps: float = 1e-6,
        rope_parameters: dict[str, Any] | None = None,
        max_position_embeddings: int = 8192,
        attention_bias: bool = False,
        attention_dropout: float = 0.0,
        mlp_bias: bool = False,
        initializer_range: float = 0.02,
        draft_vocab_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("tie_word_embeddings", False)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.target_hidden_size = target_hidden_size if target_hidden_size is not None else hidden_size
        self.target_num_hidden_layers = target_num_hidden_layers
        self.target_layer_ids = (
            list(target_layer_ids) if target_layer_ids is not None else default_target_layer_ids(target_num_hidden_layers)
        )
        self.target_model_type = target_model_type
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self.intermediate_size = intermediate_size if intermediate_size is not None else 4 * hidden_size
        self.hidden_act = hidden_act
        self.rms_norm_eps = rms_norm_eps
        self.rope_parameters = dict(rope_parameters) if rope_parameters else {"rope_type": "default", "rope_theta": 1e4}
        self.max_position_embeddings = max_position_embeddings
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.mlp_bias = mlp_bias
        self.initializer_range = initializer_range
        self.draft_vocab_size = draft_vocab_size if draft_vocab_size is not None else vocab_size
        legacy = {name: kwargs.pop(name) for name in DRAFTING_SETTINGS if name in kwargs}
        self.legacy_drafting_settings = TreeGenerationConfig(**legacy).drafting_settings(legacy) if legacy else {}
        record: dict[str, Any] = {}
        for key, section in RECORD_SECTIONS.items():
            value = kwargs.pop(key, None)
            if value:  # an older checkpoint's record (empty ones are dropped)
                record[section] = value
        given = {name: kwargs.pop(name) for name in self.training_settings if name in kwargs}
        for name, default in self.training_settings.items():
            setattr(self, name, given.get(name, default))
        if given:  # an older checkpoint's settings (or ones given here): what its training used
            record["training_settings"] = given
        self.training_record = record
        super().__init__(**kwargs)
        self.validate_settings()

    @property
    def training_info(self) -> dict[str, Any] | None:
        """The record of the run(s) that trained the drafter (``training_record["training"]``), or None."""
        return self.training_record.get("training")

    @training_info.setter
    def training_info(self, value: dict[str, Any] | None) -> None:
        self._set_record_section("training", value)

    @property
    def eval_results(self) -> list[dict[str, Any]]:
        """Measured results of these weights (``training_record["evaluation"]``): each row names its setting."""
        return self.training_record.get("evaluation") or []

    @eval_results.setter
    def eval_results(self, value: list[dict[str, Any]] | None) -> None:
        self._set_record_section("evaluation", value)

    def _set_record_section(self, section: str, value: Any) -> None:
        record = dict(self.training_record)
        if value:
            record[section] = value
        else:
            record.pop(section, None)
        self.training_record = record

    def current_training_settings(self) -> dict[str, Any]:
        """This drafter family's training settings as the config holds them now (for the training record)."""
        return {name: getattr(self, name) for name in self.training_settings}

    def __setattr__(self, key: str, value: Any) -> None:
        if key in DRAFTING_SETTINGS:  # it would be read by nothing
            raise AttributeError(misplaced_setting(key))
        super().__setattr__(key, value)

    def __getattr__(self, key: str) -> Any:  # only where the normal lookup failed
        if key in DRAFTING_SETTINGS:
            raise AttributeError(misplaced_setting(key))
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {key!r}")

    def validate_settings(self) -> None:
        """Raise a ValueError naming the first inconsistent shared setting (subclasses check their own after)."""
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, vocab_size={self.vocab_size}], got {self.draft_vocab_size}.")
        self._validate_target_layer_ids()

    @property
    def feature_layers(self) -> list[int]:
        """Indices into the target's `hidden_states` tuple the drafter reads (index 0 = the embedding output)."""
        return list(self.target_layer_ids)

    def _validate_target_layer_ids(self) -> None:
        if len(self.target_layer_ids) != 3:
            raise ValueError(f"target_layer_ids must name 3 hidden states, got {self.target_layer_ids}.")
        if max(self.target_layer_ids) > self.target_num_hidden_layers or min(self.target_layer_ids) < 0:
            raise ValueError(
                f"target_layer_ids {self.target_layer_ids} fall outside the target's hidden states "
                f"0..{self.target_num_hidden_layers}."
            )

    def to_dict(self) -> dict[str, Any]:
        """`PretrainedConfig.to_dict` of the architecture only: without legacy decoding settings (they live in
        `generation_config.json`), training settings, the training record (``training_record.json``) and the
        ``use_cache`` the `Trainer` sets on every model it trains (a drafter's cache follows `generate`)."""
        output = super().to_dict()
        hidden = ("legacy_drafting_settings", "training_record", "_training_record_read", "use_cache")
        for key in (*hidden, *self.training_settings, *RECORD_SECTIONS):
            output.pop(key, None)
        return output

    @classmethod
    def from_target_config(cls, target_config: PretrainedConfig, **overrides: Any) -> "TreeDrafterConfig":
        """Derive a drafter config for a Llama-, Mistral-, Qwen2/3- or Gemma3-family target config: the drafter's
        decoder copies the target's attention / MLP shape; `overrides` win."""
        return cls(**derive_from_target(target_config, cls.drafter_name, overrides))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any) -> "TreeDrafterConfig":
        """`PretrainedConfig.from_pretrained`; a shipped drafter's name resolves as in `TreeDraftModel.from_pretrained`
        (a local folder of that name wins; a Hub id is passed through unchanged). The training record saved next to
        it (``training_record.json``, where there is one) becomes `training_record`, its training settings the
        config's (an older checkpoint's config.json records and settings are moved there on load)."""
        path = resolve_drafter_path(pretrained_model_name_or_path)
        loaded = super().from_pretrained(path, *args, **kwargs)
        config = loaded[0] if isinstance(loaded, tuple) else loaded
        hub_kwargs = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
        record = load_training_record(path, subfolder=kwargs.get("subfolder", ""), **hub_kwargs) if path else None
        if record is not None:
            config.attach_training_record(record)
        return loaded

    def attach_training_record(self, record: dict[str, Any]) -> None:
        """Take `record` (a training record as saved) as this config's, and its training settings as the config's;
        what an older config.json carried stays where the record has nothing of its own."""
        merged = {**self.training_record, **record}
        for name, value in (merged.get("training_settings") or {}).items():
            if name in self.training_settings:
                setattr(self, name, value)
        self.training_record = merged
        self.__dict__["_training_record_read"] = True

    @property
    def name_or_path(self) -> str | None:
        return PretrainedConfig.name_or_path.fget(self)

    @name_or_path.setter
    def name_or_path(self, value: Any) -> None:
        """`PreTrainedModel.from_pretrained` names the folder here also when `AutoConfig` built the config (which
        reads config.json alone): the training record saved next to it is read then, so that a drafter loaded with
        `AutoModel` keeps its record (and `save_pretrained` writes it again)."""
        PretrainedConfig.name_or_path.fset(self, value)
        if not self.__dict__.get("_training_record_read") and isinstance(value, str) and os.path.isdir(value):
            record = load_training_record(value)
            if record is not None:
                self.attach_training_record(record)


_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "proxies")


def derive_from_target(target_config: PretrainedConfig, drafter_name: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """Config values a drafter takes from its target (vocab, sizes, attention shape, RoPE, special ids); `overrides`
    win. The drafter's decoder copies the target's attention / MLP shape."""
    text_config = target_config.get_text_config()
    model_type = text_config.model_type
    if model_type not in SUPPORTED_TARGET_TYPES:
        raise ValueError(
            f"{drafter_name} drafters support targets of type {SUPPORTED_TARGET_TYPES}, got '{model_type}'. "
            "Open an issue with the model's config if it is a Llama-like decoder."
        )
    hidden = text_config.hidden_size
    num_heads = text_config.num_attention_heads
    derived: dict[str, Any] = {
        "vocab_size": text_config.vocab_size,
        "hidden_size": hidden,
        "target_hidden_size": hidden,
        "target_num_hidden_layers": text_config.num_hidden_layers,
        "target_model_type": model_type,
        "num_attention_heads": num_heads,
        "num_key_value_heads": getattr(text_config, "num_key_value_heads", None) or num_heads,
        "head_dim": getattr(text_config, "head_dim", None) or hidden // num_heads,
        "intermediate_size": text_config.intermediate_size,
        "rms_norm_eps": getattr(text_config, "rms_norm_eps", 1e-6),
        "max_position_embeddings": text_config.max_position_embeddings,
        "rope_parameters": _plain_rope_parameters(text_config),
        "pad_token_id": text_config.pad_token_id,
        "bos_token_id": text_config.bos_token_id,
        "eos_token_id": text_config.eos_token_id,
    }
    derived.update(overrides)
    if "hidden_size" in overrides and "head_dim" not in overrides:
        derived["head_dim"] = derived["hidden_size"] // derived["num_attention_heads"]
    return derived


def _plain_rope_parameters(text_config: PretrainedConfig) -> dict[str, Any]:
    """The target's default-RoPE theta (Gemma3 keeps one per attention type; the global one is used)."""
    rope = getattr(text_config, "rope_parameters", None) or {}
    if "full_attention" in rope:  # per-layer-type rope parameters (Gemma3)
        rope = rope["full_attention"]
    return {"rope_type": "default", "rope_theta": float(rope.get("rope_theta", 1e4))}
