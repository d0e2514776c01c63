"""The drafter-less lookup tree: a weightless `TreeDraftModel` whose trees hold free candidates only."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..tree_drafter.generation_config import LookupTreeGenerationConfig, TreeGenerationConfig
from ..tree_drafter.modeling_tree_drafter import TreeDraftModel
from .configuration_lookup_tree import LookupTreeConfig


class LookupTreeModel(TreeDraftModel):
    """Prompt lookup and an n-gram cache as a tree, with no drafter network (see [`LookupTreeConfig`]).

    ```python
    lookup = LookupTreeModel.from_target(target)
    out = target.generate(**inputs, assistant_model=lookup, max_new_tokens=128)
    ```
    It has no weights (its only tensors are the identity draft-vocabulary buffers every tree drafter carries), reads
    no target features, and never calls a network to draft: the cost of a step is the target's verification.
    """

    config_class = LookupTreeConfig
    generation_config_class = LookupTreeGenerationConfig
    # prompt lookup (10 tokens per chain), the n-gram cache (8) and the suffix cache (32 nodes), under "auto"
    generation_defaults = {"prompt_lookup_num_tokens": 10, "ngram_cache_num_tokens": 8, "suffix_cache_num_tokens": 32}

    def __init__(self, config: LookupTreeConfig) -> None:
        super().__init__(config)
        self.post_init()

    @property
    def device(self) -> torch.device:
        return self.d2t.device

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def check_drafting_settings(self, settings: TreeGenerationConfig) -> None:
        """A lookup tree needs at least one candidate source."""
        super().check_drafting_settings(settings)
        sources = (
            "prompt_lookup_num_tokens", "ngram_cache_num_tokens", "suffix_cache_num_tokens", "suffix_local_num_tokens"
        )
        if not any(getattr(settings, name) for name in sources):
            raise ValueError(f"A lookup tree needs a candidate source: set one of {', '.join(sources)} > 0.")

    def check_target(self, target: PreTrainedModel) -> None:
        """Any target of the vocabulary this lookup tree was made for."""
        vocab = target.get_input_embeddings().num_embeddings
        if vocab != self.config.vocab_size:
            raise ValueError(
                f"This lookup tree was made for a vocabulary of {self.config.vocab_size} tokens, but the target has "
                f"{vocab}. Make one for this target: `LookupTreeModel.from_target(target)`."
            )
