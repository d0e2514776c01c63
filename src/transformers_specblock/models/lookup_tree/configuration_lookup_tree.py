"""Configuration of the drafter-less lookup tree: prompt lookup, an n-gram cache and the suffix cache as a tree."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from ..tree_drafter.configuration_tree_drafter import TreeDrafterConfig


class LookupTreeConfig(TreeDrafterConfig):
    r"""Configuration of a [`LookupTreeModel`]: no drafter network, only the free candidate sources.

    Passed as `assistant_model`, a lookup tree makes `generate` verify a TREE of prompt-lookup chains (several
    matches, several branches) and n-gram-cache chains in one target forward, where transformers' own prompt lookup
    verifies one chain. The free-candidate and budget settings are its `generation_config`'s; there prompt lookup is on
    by default (10 tokens per chain, up to 4 chains of 3- to 1-gram matches) with the n-gram cache (8 tokens) and the
    suffix cache (a tree of up to 32 nodes from the requests this lookup tree object served before), and the budget
    is "auto" (no tree at all where lookups are not accepted). The target-shape fields only record which
    vocabulary the tree is for: a lookup tree works with any causal LM of that vocabulary.
    """

    model_type = "lookup_tree"
    drafter_name = "lookup tree"

    def __init__(self, **kwargs: Any) -> None:  # transformers gives a config class without one a generated __init__
        super().__init__(**kwargs)

    @classmethod
    def from_target_config(cls, target_config: PretrainedConfig, **overrides: Any) -> "LookupTreeConfig":
        """A lookup tree for any causal LM: only its vocabulary size and shape are recorded."""
        text_config = target_config.get_text_config()
        layers = text_config.num_hidden_layers
        derived = {
            "vocab_size": text_config.vocab_size,
            "hidden_size": text_config.hidden_size,
            "target_num_hidden_layers": layers,
            "target_layer_ids": [0, 0, layers] if layers < 4 else None,  # unused: a lookup tree reads no features
            "target_model_type": text_config.model_type,
            "num_attention_heads": 1,
            "num_key_value_heads": 1,
        }
        return cls(**(derived | overrides))
