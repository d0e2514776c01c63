"""EAGLE-3 drafter configuration (the in-package baseline SpecBlock is measured against)."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from .budget import check_tree_budget
from .configuration_specblock import default_target_layer_ids, derive_from_target


class Eagle3Config(PretrainedConfig):
    r"""Configuration of an [`Eagle3DraftModel`] (EAGLE-3, Li et al. 2025, arXiv 2503.01840).

    An EAGLE-3 drafter fuses three hidden states of a frozen target (`fc`: 3H -> H), runs ONE Llama-style decoder
    layer whose attention reads concat(RMSNorm(target token embedding), RMSNorm(hidden)), and predicts the next token
    over a reduced draft vocabulary. At inference it grows a dynamic top-k tree (one drafter forward per depth level)
    that the target verifies in one forward of at most `tree_budget` drafted nodes.

    Args:
        vocab_size: Target vocabulary size (the drafter reads the target's input embedding).
        hidden_size: Drafter hidden size (defaults to the target's, as in EAGLE-3).
        target_hidden_size: Target hidden size.
        target_num_hidden_layers: Number of decoder layers of the target.
        target_layer_ids: Indices into the target's `hidden_states` tuple used as low/middle/high features
            (default: the inputs of layers 2, L//2 and L-3).
        target_model_type: `model_type` of the target the drafter was built for.
        num_hidden_layers: Decoder layers of the drafter; EAGLE-3 has exactly one.
        num_attention_heads / num_key_value_heads / head_dim / intermediate_size / hidden_act / rms_norm_eps /
        rope_parameters / max_position_embeddings / attention_bias / attention_dropout / mlp_bias:
            Llama-style settings of that decoder layer.
        draft_vocab_size: Size of the reduced draft vocabulary (`None` = the full target vocabulary).
        tree_top_k: Children kept per expanded node and frontier width per depth level (EAGLE default 10).
        tree_depth: Expansion rounds after the root's top-k (one drafter forward each; EAGLE default 7), so the tree
            is at most `tree_depth + 1` levels deep.
        tree_budget: Drafted nodes the target verifies per iteration at most (EAGLE's `total_tokens - 1`; default 59,
            i.e. `total_tokens = 60`).
        ttt_steps: Training-time-test unroll length (EAGLE-3: 7).
        ttt_decay: Weight decay per unroll step of the training loss (step s weighs `ttt_decay ** s`).
    """

    model_type = "eagle3_drafter"

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
        tree_top_k: int = 10,
        tree_depth: int = 7,
        tree_budget: int | str = 59,
        ttt_steps: int = 7,
        ttt_decay: float = 0.8,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("tie_word_embeddings", False)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.target_hidden_size = target_hidden_size if target_hidden_size is not None else hidden_size
        self.target_num_hidden_layers = target_num_hidden_layers
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(target_num_hidden_layers)
        self.target_layer_ids = list(target_layer_ids)
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
        self.tree_top_k = tree_top_k
        self.tree_depth = tree_depth
        self.tree_budget = tree_budget
        self.ttt_steps = ttt_steps
        self.ttt_decay = ttt_decay
        super().__init__(**kwargs)
        self.validate_settings()

    def validate_settings(self) -> None:
        """Raise a ValueError naming the first inconsistent setting."""
        if self.num_hidden_layers != 1:
            raise ValueError(
                f"An EAGLE-3 drafter has exactly one decoder layer, got num_hidden_layers={self.num_hidden_layers}."
            )
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in [1, vocab_size={self.vocab_size}], got {self.draft_vocab_size}."
            )
        if not isinstance(self.tree_top_k, int) or self.tree_top_k < 1:
            raise ValueError(f"tree_top_k must be a positive int, got {self.tree_top_k!r}.")
        if not isinstance(self.tree_depth, int) or self.tree_depth < 0:
            raise ValueError(f"tree_depth must be an int >= 0, got {self.tree_depth!r}.")
        check_tree_budget(self.tree_budget)
        if not isinstance(self.ttt_steps, int) or self.ttt_steps < 1:
            raise ValueError(f"ttt_steps must be a positive int, got {self.ttt_steps!r}.")
        if not 0.0 < self.ttt_decay <= 1.0:
            raise ValueError(f"ttt_decay must lie in (0, 1], got {self.ttt_decay}.")
        if len(self.target_layer_ids) != 3:
            raise ValueError(f"target_layer_ids must name 3 hidden states, got {self.target_layer_ids}.")
        if max(self.target_layer_ids) > self.target_num_hidden_layers or min(self.target_layer_ids) < 0:
            raise ValueError(
                f"target_layer_ids {self.target_layer_ids} fall outside the target's hidden states "
                f"0..{self.target_num_hidden_layers}."
            )

    @classmethod
    def from_target_config(cls, target_config: PretrainedConfig, **overrides: Any) -> "Eagle3Config":
        """Derive a drafter config for a Llama-, Mistral-, Qwen2/3- or Gemma3-family target config.

        The decoder layer copies the target's attention / MLP shape, as EAGLE-3 does; `overrides` win.
        """
        return cls(**derive_from_target(target_config, "EAGLE-3", overrides))
