"""Configuration of the drafter-less lookup tree: prompt lookup, an n-gram cache and the suffix cache as a tree."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from ..tree_drafter.configuration_tree_drafter import AUTO, TreeDrafterConfig


class LookupTreeConfig(TreeDrafterConfig):
    r"""Configuration of a [`LookupTreeModel`]: no drafter network, only the free candidate sources.

    Passed as `assistant_model`, a lookup tree makes `generate` verify a TREE of prompt-lookup chains (several
    matches, several branches) and n-gram-cache chains in one target forward, where transformers' own prompt lookup
    verifies one chain. The free-candidate and budget settings are [`TreeDrafterConfig`]'s; here prompt lookup is on
    by default (10 tokens per chain, up to 4 chains of 3- to 1-gram matches) with the n-gram cache (8 tokens) and the
    suffix cache (a tree of up to 32 nodes from the requests this lookup tree object served before), and the budget
    is "auto" (no tree at all where lookups are not accepted). The target-shape fields only record which
    vocabulary the tree is for: a lookup tree works with any causal LM of that vocabulary.
    """

    model_type = "lookup_tree"
    drafter_name = "lookup tree"

    def __init__(
        self,
        tree_budget: int | str = AUTO,
        prompt_lookup_num_tokens: int = 10,
        ngram_cache_num_tokens: int = 8,
        suffix_cache_num_tokens: int = 32,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            tree_budget=tree_budget, prompt_lookup_num_tokens=prompt_lookup_num_tokens,
            ngram_cache_num_tokens=ngram_cache_num_tokens, suffix_cache_num_tokens=suffix_cache_num_tokens, **kwargs,
        )  # fmt: skip

    def validate_settings(self) -> None:
        super().validate_settings()
        sources = ("prompt_lookup_num_tokens", "ngram_cache_num_tokens", "suffix_cache_num_tokens", "suffix_local_num_tokens")
        if not any(getattr(self, name) for name in sources):
            raise ValueError(f"A lookup tree needs a candidate source: set one of {', '.join(sources)} > 0.")

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
