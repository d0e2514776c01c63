"""DFlash drafter configuration (block diffusion drafter, z-lab 2026, arXiv 2602.06036)."""

from __future__ import annotations

from typing import Any

from ..tree_drafter.configuration_tree_drafter import TreeDrafterConfig


def dflash_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The public DFlash choice of target layers: one per drafter layer, evenly spread over layers 1 .. L-3 (the
    middle layer for a one-layer drafter). Ids name decoder layers whose OUTPUT is read (`hidden_states[i + 1]`)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def max_tree_nodes(depth: int, top_k: int) -> int:
    """Nodes of the full tree with `top_k` children per node over `depth` levels: the most a block can propose."""
    return sum(top_k**d for d in range(1, depth + 1))


class DFlashConfig(TreeDrafterConfig):
    r"""Configuration of a [`DFlashDraftModel`].

    A DFlash drafter fills a block in one forward: the last committed token (the anchor) and `block_size - 1`
    copies of `mask_token_id`, embedded with the target's own input embedding, attend bidirectionally to each other
    and to the fused target context (`fc` over the hidden states of `target_layer_ids`, then RMSNorm), injected as
    keys / values into every drafter layer; the target's `lm_head` reads the outputs. The same drafter runs in
    transformers' `generate(..., speculation_type="dflash")` (a chain) and in this package's tree loop (a best-first
    tree over the per-position candidates, DDTree-style; its `tree_top_k` candidates per position are a decoding
    setting of the drafter's `generation_config`).

    Unlike the other drafters, `target_layer_ids` follows DFlash and transformers: zero-based decoder layer ids whose
    output is read (`hidden_states[i + 1]`), any number of them (`feature_layers` gives the hidden-states indices).

    Args:
        block_size: Anchor + masked positions per drafter forward (16 in the published drafters); a tree is at most
            `block_size - 1` deep.
        mask_token_id: Target token id whose (target) embedding marks a masked position. Required.

    Training settings (`training_settings`: attributes set by training from its arguments, recorded in the training
    record, never written to config.json): `loss_decay_gamma`, the training weight of block offset k >= 1 is
    exp(-(k - 1) / gamma) (7; 0 = no decay), and `num_anchors`, training blocks per sequence (anchors sampled
    without replacement among the supervised positions, re-drawn every step; 32).
    """

    model_type = "dflash_drafter"
    drafter_name = "DFlash"
    training_settings = {"loss_decay_gamma": 7.0, "num_anchors": 32}

    def __init__(
        self,
        num_hidden_layers: int = 1,
        target_num_hidden_layers: int = 32,
        target_layer_ids: list[int] | None = None,
        block_size: int = 16,
        mask_token_id: int | None = None,
        layer_types: list[str] | None = None,
        **kwargs: Any,
    ) -> None:
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self.layer_types = list(layer_types) if layer_types is not None else ["full_attention"] * num_hidden_layers
        if target_layer_ids is None:
            target_layer_ids = dflash_target_layer_ids(target_num_hidden_layers, num_hidden_layers)
        super().__init__(
            num_hidden_layers=num_hidden_layers,
            target_num_hidden_layers=target_num_hidden_layers,
            target_layer_ids=target_layer_ids,
            **kwargs,
        )

    @property
    def feature_layers(self) -> list[int]:
        """Indices into the target's `hidden_states` tuple: the outputs of the `target_layer_ids` layers."""
        return [i + 1 for i in self.target_layer_ids]

    def _validate_target_layer_ids(self) -> None:
        ids, layers = self.target_layer_ids, self.target_num_hidden_layers
        if not ids or min(ids) < 0 or max(ids) >= layers:
            raise ValueError(f"target_layer_ids {ids} must name decoder layers 0..{layers - 1} of the target.")

    def validate_settings(self) -> None:
        """Raise a ValueError naming the first inconsistent setting."""
        super().validate_settings()
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise ValueError(
                f"block_size must be an int >= 2 (the anchor and at least one mask), got {self.block_size!r}."
            )
        if self.mask_token_id is None:
            raise ValueError(
                "A DFlash drafter needs mask_token_id: the id of a target token whose embedding marks a masked block "
                "position. Pass mask_token_id=<id> of a token the target never emits (an unused special token; the "
                "published drafters use a reserved one)."
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} lies outside the vocabulary [0, {self.vocab_size}).")
        if self.hidden_size != self.target_hidden_size:
            raise ValueError(
                f"A DFlash drafter reads the target's embeddings and feeds the target's lm_head, so its hidden_size "
                f"({self.hidden_size}) must equal the target's ({self.target_hidden_size})."
            )
        if self.draft_vocab_size != self.vocab_size:
            raise ValueError("A DFlash drafter drafts over the target's full vocabulary (draft_vocab_size=vocab_size).")
        kinds = self.layer_types
        if len(kinds) != self.num_hidden_layers or any(kind != "full_attention" for kind in kinds):
            raise ValueError(
                f"layer_types must be 'full_attention' for each of the {self.num_hidden_layers} layers (sliding-window "
                f"DFlash layers are not supported), got {self.layer_types}."
            )
        if self.loss_decay_gamma < 0:
            raise ValueError(f"loss_decay_gamma must be >= 0 (0 = no decay), got {self.loss_decay_gamma}.")
        if not isinstance(self.num_anchors, int) or self.num_anchors < 1:
            raise ValueError(f"num_anchors must be a positive int, got {self.num_anchors!r}.")
