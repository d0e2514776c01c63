"""Verify: one target forward over every row's draft tree (tree attention mask, position = root + depth)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from ..utils import CACHE_ARGUMENT
from .tree_batch import TreeBatch


@dataclass
class Verification:
    """Target outputs for every node of every row (node 0 = the row's root).

    logits:   [B, N+1, V] raw next-token logits, in the target's dtype (greedy acceptance reads their argmax as is;
              scores, processors and sampling take float32, as transformers' generate does)
    features: [B, N+1, 3 * H] the drafter's three target hidden states, concatenated ([B, N+1, 0] if it reads none)
    """

    logits: torch.Tensor
    features: torch.Tensor


def target_features(outputs, feature_layers: list[int], shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """[B, P, 3 * H] the drafter's hidden states of a target output, concatenated ([B, P, 0] when it reads none)."""
    if not feature_layers:
        return torch.zeros(*shape, 0, device=device)
    # layers of a target spread with device_map may return their states on other devices: gather them on one
    return torch.cat([outputs.hidden_states[i].to(device) for i in feature_layers], dim=-1)


def verify_trees(
    target: PreTrainedModel,
    trees: TreeBatch,
    cache: DynamicCache,
    prefix_visible: torch.BoolTensor,
    root_positions: torch.LongTensor,
    feature_layers: list[int],
) -> Verification:
    """Run the target once over every row's [root + drafted nodes] with the rows' tree masks and
    `position = root_positions[row] + depth` (prefix_visible [B, S]: the cached entries each row sees)."""
    device = target.device
    if trees.size == 1:  # roots alone: a plain decoding step, masked from the 2D mask as transformers' generate does
        mask = torch.cat([prefix_visible, trees.real.to(prefix_visible.device)], dim=1).long()
    else:
        mask = trees.attention_mask(prefix_visible, target.dtype)
    outputs = target(
        input_ids=trees.tokens.to(device),
        attention_mask=mask.to(device),
        position_ids=(root_positions[:, None].to(trees.depths.device) + trees.depths).to(device),
        **{CACHE_ARGUMENT: cache},
        use_cache=True,
        output_hidden_states=feature_layers or False,
    )
    features = target_features(outputs, feature_layers, tuple(trees.tokens.shape), device)
    return Verification(logits=outputs.logits, features=features)
