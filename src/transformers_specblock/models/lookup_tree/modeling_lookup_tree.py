"""The drafter-less lookup tree: a weightless `TreeDraftModel` whose trees hold free candidates only."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

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

    def __init__(self, config: LookupTreeConfig) -> None:
        super().__init__(config)
        self.post_init()

    @property
    def device(self) -> torch.device:
        return self.d2t.device

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def check_target(self, target: PreTrainedModel) -> None:
        """Any target of the vocabulary this lookup tree was made for."""
        vocab = target.get_input_embeddings().num_embeddings
        if vocab != self.config.vocab_size:
            raise ValueError(
                f"This lookup tree was made for a vocabulary of {self.config.vocab_size} tokens, but the target has "
                f"{vocab}. Make one for this target: `LookupTreeModel.from_target(target)`."
            )
