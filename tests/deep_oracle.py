"""A drafter whose trees hold the target's own continuation several tokens deep, so tests see multi-token commits.

`install_deep_oracle(monkeypatch, drafter, reference)` registers, for this one drafter, a candidate generator (in
`generation.candidate_generators.CANDIDATE_GENERATOR_MAPPING`, where `generate` looks it up) that wraps the
drafter's real one: the real SpecBlock generator reads the committed context and drafts its tree (block 1 and
follow-up blocks); the wrapper then grafts the next ``depth`` tokens of ``reference`` (the target's greedy
continuation, computed by the test with stock `generate`) onto it: along the branch of the tree that already
matches the reference, as a chain under its deepest matching node (never a duplicate sibling). Depths cycle
through ``depths``, so with (3, 1, 4, 2) iterations commit chunks of 4, 2, 5, 3, ... tokens (accepted drafts + the
target's bonus token) unless the loop is wrong.
"""

from __future__ import annotations

import torch

from transformers_specblock.generation.candidate_generators import CANDIDATE_GENERATOR_MAPPING, TreeCandidateGenerator
from transformers_specblock.generation.tree import DraftTree


class DeepOracleGenerator(TreeCandidateGenerator):
    def __init__(self, inner: TreeCandidateGenerator, reference: list[int], depths: tuple[int, ...]) -> None:
        super().__init__(inner.drafter, inner.tree_budget)
        self.inner, self.reference, self.depths = inner, list(reference), depths
        self.stats = inner.stats  # drafter forwards / time / blocks per iteration of the real drafting
        self.committed = 0  # visible tokens committed so far (prompt included)
        self.grafted: list[int] = []  # oracle nodes added per iteration

    def observe(self, target_features: torch.Tensor, next_tokens: torch.LongTensor, first_position: int) -> None:
        self.inner.observe(target_features, next_tokens, first_position)
        self.committed = first_position + next_tokens.shape[0]  # rotary position of the last one + 1

    def draft_tree(self, sequence: torch.LongTensor) -> DraftTree:
        root_token = int(sequence[-1])
        assert root_token == self.reference[self.committed - 1], "the oracle lost track of the committed tokens"
        depth = self.depths[len(self.grafted) % len(self.depths)]
        self.inner.tree_budget = max(1, self.tree_budget - depth)  # room for the grafted chain within the budget
        tree = self.inner.draft_tree(sequence)
        node, added = 0, 0
        for level, token in enumerate(self.reference[self.committed : self.committed + depth], 1):
            children = tree.children_of(node).tolist()
            match = next((c for c in children if int(tree.tokens[c]) == token), None)
            if match is None:
                one = torch.ones(1, dtype=torch.long)
                match = int(tree.add_nodes(one * token, one * node, one * level, torch.zeros(1))[0])
                added += 1
            node = match
        self.grafted.append(added)
        return tree


def install_deep_oracle(monkeypatch, drafter, reference, depths=(3, 1, 4, 2)) -> list[DeepOracleGenerator]:
    """Make `generate(assistant_model=drafter)` draft with a `DeepOracleGenerator` (other drafters are untouched);
    returns the list the generators of later `generate` calls are appended to. For a batch, `reference` is a list of
    per-row references (each row's visible prompt and continuation): a call makes one generator per row, in order."""
    per_row = [reference] if not isinstance(reference[0], (list, tuple)) else list(reference)
    model_type = drafter.config.model_type
    real = CANDIDATE_GENERATOR_MAPPING[model_type]
    real = getattr(real, "real_generator", real)  # installed twice in one test: wrap the real one, not the oracle
    made: list[DeepOracleGenerator] = []

    def factory(candidate_drafter, **overrides):
        generator = real(candidate_drafter, **overrides)
        if candidate_drafter is drafter:
            row_reference = per_row[len(made) % len(per_row)]
            generator = DeepOracleGenerator(generator, [int(t) for t in row_reference], depths)
            made.append(generator)
        return generator

    factory.real_generator = real
    monkeypatch.setitem(CANDIDATE_GENERATOR_MAPPING, model_type, factory)
    return made
