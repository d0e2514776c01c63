"""SpecBlock: block-iterative tree speculative decoding inside Hugging Face transformers' `generate`.

Importing the package registers the drafter configs / models with the Auto classes and routes
`generate(assistant_model=<TreeDraftModel>)` (a SpecBlock, EAGLE-3 or DFlash drafter, or the drafter-less lookup
tree) to the tree decoding loop; with a `speculation_type` (e.g. "dflash") transformers' own path runs. Every other
assistant, and no assistant, keeps transformers' stock behaviour; `uninstall()` restores the stock methods.

Layout (imports flow one way): `utils` <- `hub` <- `models` <- `generation` <- `training` <- `commands`.
"""

import os

from transformers import AutoConfig, AutoModel

from .generation import (
    DraftTree,
    Eagle3CandidateGenerator,
    RowStats,
    SpecBlockCandidateGenerator,
    SpecBlockStats,
    TreeGenerateOutput,
    TreeLogitsProcessor,
    generate,
    get_candidate_generator,
    install,
    tree_speculative_decoding,
    uninstall,
)
from .hub import load_model, load_packaged_model, load_prompts
from .models import (
    DFlashConfig,
    DFlashDraftModel,
    Eagle3Config,
    Eagle3DraftModel,
    Eagle3Output,
    LookupTreeConfig,
    LookupTreeModel,
    SpecBlockConfig,
    SpecBlockDraftModel,
    SpecBlockOutput,
    TreeDrafterConfig,
    TreeDraftModel,
)
from .models.tree_drafter import (
    DFlashGenerationConfig,
    Eagle3GenerationConfig,
    LookupTreeGenerationConfig,
    SpecBlockGenerationConfig,
    TreeGenerationConfig,
)

CUSTOM_GENERATE_DIR = os.path.dirname(os.path.abspath(__file__))
"""Folder to pass as `generate(custom_generate=...)` (it holds `custom_generate/generate.py`)."""

for _config, _model in (
    (SpecBlockConfig, SpecBlockDraftModel), (Eagle3Config, Eagle3DraftModel), (LookupTreeConfig, LookupTreeModel),
    (DFlashConfig, DFlashDraftModel),
):
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModel.register(_config, _model, exist_ok=True)
install()

__all__ = [
    "CUSTOM_GENERATE_DIR",
    "DFlashConfig",
    "DFlashDraftModel",
    "DFlashGenerationConfig",
    "DraftTree",
    "Eagle3CandidateGenerator",
    "Eagle3Config",
    "Eagle3DraftModel",
    "Eagle3GenerationConfig",
    "Eagle3Output",
    "LookupTreeConfig",
    "LookupTreeGenerationConfig",
    "LookupTreeModel",
    "RowStats",
    "SpecBlockCandidateGenerator",
    "SpecBlockConfig",
    "SpecBlockDraftModel",
    "SpecBlockGenerationConfig",
    "SpecBlockOutput",
    "SpecBlockStats",
    "TreeDraftModel",
    "TreeDrafterConfig",
    "TreeGenerateOutput",
    "TreeGenerationConfig",
    "TreeLogitsProcessor",
    "generate",
    "get_candidate_generator",
    "install",
    "load_model",
    "load_packaged_model",
    "load_prompts",
    "tree_speculative_decoding",
    "uninstall",
]
