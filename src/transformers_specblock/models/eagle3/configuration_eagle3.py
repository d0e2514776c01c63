"""EAGLE-3 drafter configuration (the in-package baseline SpecBlock is measured against)."""

from __future__ import annotations

from typing import Any

from ..tree_drafter.configuration_tree_drafter import TreeDrafterConfig


class Eagle3Config(TreeDrafterConfig):
    r"""Configuration of an [`Eagle3DraftModel`] (EAGLE-3, Li et al. 2025, arXiv 2503.01840).

    An EAGLE-3 drafter fuses three hidden states of a frozen target (`fc`: 3H -> H), runs ONE Llama-style decoder
    layer whose attention reads concat(RMSNorm(target token embedding), RMSNorm(hidden)), and predicts the next token
    over a reduced draft vocabulary. At inference it grows a dynamic top-k tree (one drafter forward per depth level)
    that the target verifies in one forward of at most `tree_budget` drafted nodes. The target, decoder, draft
    vocabulary settings are [`TreeDrafterConfig`]'s (EAGLE-3 has exactly one decoder layer); its decoding settings,
    the tree's `tree_top_k` and `tree_depth` among them, are its `generation_config`'s (`TreeGenerationConfig`; the
    default budget is EAGLE's 59 = `total_tokens - 1`).

    Training settings (`training_settings`: attributes set by training from its arguments, recorded in the training
    record, never written to config.json): `ttt_steps`, the training-time-test unroll length (EAGLE-3: 7), and
    `ttt_decay`, the weight decay per unroll step of the training loss (step s weighs `ttt_decay ** s`; 0.8).

    Args:
        own_token_embedding: The drafter holds its own token embedding `embed_tokens` [vocab_size, hidden_size]
            instead of reading the target's (published checkpoints that saved one; see `convert_eagle3`).
        norm_before_residual: The attention block's residual is the NORMED hidden (vLLM / speculators option).
        fc_norm: RMSNorm each of the three target features before `fc` (SpecForge option, weights `fc_norm.{0,1,2}`).
        norm_output: Logits read the final RMSNorm of the output (default); False = `lm_head` on the raw output
            (SpecForge option).
    """

    model_type = "eagle3_drafter"
    drafter_name = "EAGLE-3"
    training_settings = {"ttt_steps": 7, "ttt_decay": 0.8}

    def __init__(
        self,
        num_hidden_layers: int = 1,
        own_token_embedding: bool = False,
        norm_before_residual: bool = False,
        fc_norm: bool = False,
        norm_output: bool = True,
        **kwargs: Any,
    ) -> None:
        self.own_token_embedding = own_token_embedding
        self.norm_before_residual = norm_before_residual
        self.fc_norm = fc_norm
        self.norm_output = norm_output
        super().__init__(num_hidden_layers=num_hidden_layers, **kwargs)

    @property
    def token_embedding_size(self) -> int:
        """Width of the token embedding the layer reads: the drafter's own (H) or the target's (H_target)."""
        return self.hidden_size if self.own_token_embedding else self.target_hidden_size

    def validate_settings(self) -> None:
        """Raise a ValueError naming the first inconsistent setting."""
        super().validate_settings()
        if self.num_hidden_layers != 1:
            raise ValueError(
                f"An EAGLE-3 drafter has exactly one decoder layer, got num_hidden_layers={self.num_hidden_layers}."
            )
        if not isinstance(self.ttt_steps, int) or self.ttt_steps < 1:
            raise ValueError(f"ttt_steps must be a positive int, got {self.ttt_steps!r}.")
        if not 0.0 < self.ttt_decay <= 1.0:
            raise ValueError(f"ttt_decay must lie in (0, 1], got {self.ttt_decay}.")
