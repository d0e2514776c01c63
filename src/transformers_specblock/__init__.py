"""SpecBlock: block-iterative tree speculative decoding inside Hugging Face transformers' `generate`.

Importing the package registers `SpecBlockConfig` / `SpecBlockDraftModel` with the Auto classes and routes
`generate(assistant_model=<SpecBlockDraftModel>)` to the tree decoding loop. Every other assistant, and no assistant,
keeps transformers' stock behaviour.
"""

import os

from transformers import AutoConfig, AutoModel

from .assets import load_packaged_model, load_prompts
from .configuration_eagle3 import Eagle3Config
from .configuration_specblock import SpecBlockConfig
from .drafting_eagle3 import Eagle3CandidateGenerator
from .drafting import SpecBlockCandidateGenerator
from .generation import SpecBlockStats, generate, install, tree_speculative_decoding, uninstall
from .modeling_eagle3 import Eagle3DraftModel, Eagle3Output
from .modeling_specblock import SpecBlockDraftModel, SpecBlockOutput
from .modeling_tree_drafter import TreeDraftModel
from .tree import DraftTree
from .verification import TreeLogitsProcessor

CUSTOM_GENERATE_DIR = os.path.dirname(os.path.abspath(__file__))
"""Folder to pass as `generate(custom_generate=...)` (it holds `custom_generate/generate.py`)."""

AutoConfig.register(SpecBlockConfig.model_type, SpecBlockConfig, exist_ok=True)
AutoModel.register(SpecBlockConfig, SpecBlockDraftModel, exist_ok=True)
install()

__all__ = [
    "CUSTOM_GENERATE_DIR",
    "DraftTree",
    "Eagle3CandidateGenerator",
    "Eagle3Config",
    "Eagle3DraftModel",
    "Eagle3Output",
    "SpecBlockCandidateGenerator",
    "SpecBlockConfig",
    "SpecBlockDraftModel",
    "SpecBlockOutput",
    "SpecBlockStats",
    "TreeDraftModel",
    "TreeLogitsProcessor",
    "generate",
    "install",
    "load_packaged_model",
    "load_prompts",
    "tree_speculative_decoding",
    "uninstall",
]
