"""Decoding with a tree drafter: tree, candidate generators (draft), verification, acceptance, cache compaction,
the tree budget, the loop and its entry into `generate`."""

from .acceptance import greedy_accept, greedy_accept_rows, sample_accept
from .auto_choosers import auto_budget_for
from .budget import AutoBudget, best_budget
from .cache_utils import compact_cache, full_attention_cache, truncate_cache
from .candidate_generators import (
    CANDIDATE_GENERATOR_MAPPING,
    DraftingStats,
    Eagle3CandidateGenerator,
    SpecBlockCandidateGenerator,
    TreeCandidateGenerator,
    get_candidate_generator,
)
from .decoding import tree_speculative_decoding
from .integration import generate, install, uninstall
from .logits_process import TreeLogitsProcessor
from .stats import RowStats, SpecBlockStats, TreeGenerateOutput
from .target_cost import TargetCost, measure_target_cost
from .tree import DraftTree, tree_verification_mask
from .tree_batch import TreeBatch
from .verification import Verification, verify_trees

__all__ = [
    "CANDIDATE_GENERATOR_MAPPING",
    "AutoBudget",
    "DraftTree",
    "DraftingStats",
    "Eagle3CandidateGenerator",
    "SpecBlockCandidateGenerator",
    "RowStats",
    "SpecBlockStats",
    "TreeGenerateOutput",
    "TargetCost",
    "TreeCandidateGenerator",
    "TreeBatch",
    "TreeLogitsProcessor",
    "Verification",
    "auto_budget_for",
    "best_budget",
    "compact_cache",
    "full_attention_cache",
    "generate",
    "get_candidate_generator",
    "greedy_accept",
    "greedy_accept_rows",
    "install",
    "measure_target_cost",
    "sample_accept",
    "tree_speculative_decoding",
    "tree_verification_mask",
    "truncate_cache",
    "uninstall",
    "verify_trees",
]
