"""Verify: one target forward over the whole draft tree (tree attention mask, position = root + depth)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from .tree import DraftTree, tree_verification_mask


@dataclass
class Verification:
    """Target outputs for every tree node (node 0 = the root).

    logits:   [N+1, V] raw float32 next-token logits
    features: [N+1, 3 * H] the drafter's three target hidden states, concatenated ([N+1, 0] if it reads none)
    """

    logits: torch.Tensor
    features: torch.Tensor


def target_features(outputs, feature_layers: list[int], num_positions: int, device: torch.device) -> torch.Tensor:
    """[P, 3 * H] the drafter's hidden states of a batch-1 target output, concatenated ([P, 0] when it reads none)."""
    if not feature_layers:
        return torch.zeros(num_positions, 0, device=device)
    return torch.cat([outputs.hidden_states[i][0].to(device) for i in feature_layers], dim=-1)


def verify_tree(
    target: PreTrainedModel,
    tree: DraftTree,
    cache: DynamicCache,
    prefix_visible: torch.BoolTensor,
    root_position: int,
    feature_layers: list[int],
) -> Verification:
    """Run the target once over [root + drafted nodes] with a tree mask and `position = root + depth`."""
    device = target.device
    mask = tree_verification_mask(tree, prefix_visible, target.dtype).to(device)
    outputs = target(
        input_ids=tree.tokens[None].to(device),
        attention_mask=mask,
        position_ids=(root_position + tree.depths)[None].to(device),
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=feature_layers or False,
    )
    # layers of a target spread with device_map may return their states on other devices: gather them on one
    features = target_features(outputs, feature_layers, len(tree), device)
    return Verification(logits=outputs.logits[0].float(), features=features)
