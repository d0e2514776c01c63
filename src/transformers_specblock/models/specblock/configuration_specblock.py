"""SpecBlock drafter configuration."""

from __future__ import annotations

from typing import Any

from ..tree_drafter.configuration_tree_drafter import TreeDrafterConfig


class SpecBlockConfig(TreeDrafterConfig):
    r"""Configuration of a [`SpecBlockDraftModel`].

    A SpecBlock drafter reads three hidden states of a frozen target model and, per drafter forward, proposes a block
    of `block_size` mutually dependent future tokens. Blocks are chained into a token tree that the target verifies in
    one forward; how the tree is grown (`max_blocks` rounds, `branch_widths` per rank class, `tree_budget` nodes) is
    decoding, set in the drafter's `generation_config` (`TreeGenerationConfig`). The target, decoder and draft
    vocabulary settings are [`TreeDrafterConfig`]'s (a SpecBlock drafter has 2 decoder layers by default).

    Args:
        block_size: K, the number of slots (future tokens) one drafter forward proposes per position.
        rank_bucket_upper_bounds: Upper rank bound of every rank-head class but the last; the default (1, 4, 10) gives
            the classes rank 1 / 2-4 / 5-10 / >10.
        prefill_chunk_size: Prompt positions the drafter reads per forward (it keeps K entries per position, so a
            long prompt in one forward would need a (P*K)^2 mask); the result does not depend on it.
        rank_head_hidden_size: Hidden width of the rank head MLP.
        rank_head_bias: The rank head's two linear layers have biases (the SpecBlock reference's have none).
        rank_feature_top_k: The rank features' log-probabilities and entropy are normalised over the top this many
            draft logits (>= 10; 20 in training, also the reference's training code).
        rank_top1_over_vocab: The top-1 probability feature is normalised over the whole draft vocabulary (default);
            False = over the top `rank_feature_top_k` logits, as the SpecBlock reference computes it.
        followup_positions: Rotary positions of a follow-up block: "start_node" (default; its start token at the start
            node's position, root + depth, slot k k further: how this package trains) or "block1" (at block 1's
            positions whatever the start depth: how the SpecBlock reference trains and drafts); see
            `SpecBlockDraftModel.followup_start_positions`.

    Training setting (`training_settings`: an attribute set by training from its arguments, recorded in the
    training record, never written to config.json): `fusion_identity_init`, initialise a new drafter's fusion
    layer's condition part to identity (the token and slot-query parts stay random), so the features reach the
    decoder directly; only a new drafter's weights read it.
    """

    model_type = "specblock"
    drafter_name = "SpecBlock"
    training_settings = {"fusion_identity_init": False}

    def __init__(
        self,
        num_hidden_layers: int = 2,
        block_size: int = 4,
        rank_bucket_upper_bounds: list[int] | tuple[int, ...] = (1, 4, 10),
        prefill_chunk_size: int = 256,
        rank_head_hidden_size: int = 256,
        rank_head_bias: bool = True,
        rank_feature_top_k: int = 20,
        rank_top1_over_vocab: bool = True,
        followup_positions: str = "start_node",
        **kwargs: Any,
    ) -> None:
        self.followup_positions = followup_positions
        self.rank_head_bias = rank_head_bias
        self.rank_feature_top_k = rank_feature_top_k
        self.rank_top1_over_vocab = rank_top1_over_vocab
        self.block_size = block_size
        self.rank_bucket_upper_bounds = list(rank_bucket_upper_bounds)
        self.prefill_chunk_size = prefill_chunk_size
        self.rank_head_hidden_size = rank_head_hidden_size
        super().__init__(num_hidden_layers=num_hidden_layers, **kwargs)

    @property
    def num_rank_classes(self) -> int:
        return len(self.rank_bucket_upper_bounds) + 1

    def validate_settings(self) -> None:
        """Raise a ValueError naming the first inconsistent setting."""
        super().validate_settings()
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}.")
        bounds = self.rank_bucket_upper_bounds
        if not bounds or bounds[0] < 1 or any(b <= a for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"rank_bucket_upper_bounds must be increasing ranks >= 1, got {bounds}.")
        if self.prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size must be >= 1, got {self.prefill_chunk_size}.")
        if not isinstance(self.rank_feature_top_k, int) or self.rank_feature_top_k < 10:
            raise ValueError(
                f"rank_feature_top_k must be an int >= 10 (10 log-probabilities are features), got "
                f"{self.rank_feature_top_k!r}."
            )
        if self.followup_positions not in ("start_node", "block1"):
            raise ValueError(f'followup_positions must be "start_node" or "block1", got {self.followup_positions!r}.')
