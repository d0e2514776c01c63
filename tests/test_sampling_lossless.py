"""Sampling with the drafter must keep the target's distribution exactly.

Significance level: every goodness-of-fit test below uses ALPHA = 1e-3 against the EXACT target distribution
(computed by enumerating prefixes), with seeded generators so a run is reproducible. A deliberately biased
acceptor (rejection without renormalising the residual) must be rejected at the same level, which shows the test
has the power to see a broken acceptance rule.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import transformers_specblock.generation.decoding as generation
from conftest import make_drafter, make_target
from transformers_specblock.generation.acceptance import sample_accept
from transformers_specblock.generation.tree import DraftTree

ALPHA = 1e-3
VOCAB = 8
PROMPT = torch.tensor([[1, 5, 2, 7]])
SAMPLING = dict(temperature=0.8, top_k=6, top_p=0.95)
NUM_SAMPLES = 1200


def _warpers() -> LogitsProcessorList:
    return LogitsProcessorList(
        [TemperatureLogitsWarper(SAMPLING["temperature"]), TopKLogitsWarper(SAMPLING["top_k"]), TopPLogitsWarper(SAMPLING["top_p"])]
    )


def exact_marginals(target, steps: int = 3) -> list[torch.Tensor]:
    """Exact marginal distribution of each of the first `steps` sampled tokens (enumerating all prefixes)."""
    warpers = _warpers()
    prefixes, weights, marginals = PROMPT.clone(), torch.ones(1, dtype=torch.float64), []
    with torch.no_grad():
        for _ in range(steps):
            logits = target(prefixes).logits[:, -1].float()
            probs = warpers(prefixes, logits).softmax(-1).double()  # [P, V]
            joint = weights[:, None] * probs
            marginals.append(joint.sum(0))
            prefixes = torch.cat(
                [prefixes.repeat_interleave(VOCAB, 0), torch.arange(VOCAB).repeat(prefixes.shape[0])[:, None]], 1
            )
            weights = joint.reshape(-1)
    return marginals


def sample_counts(target, drafter, seed: int) -> torch.Tensor:
    """[steps, V] counts of each generated position's token over NUM_SAMPLES tree-sampled generations."""
    torch.manual_seed(seed)
    counts = torch.zeros(3, VOCAB)
    for _ in range(NUM_SAMPLES):
        out = target.generate(PROMPT, assistant_model=drafter, do_sample=True, max_new_tokens=3, **SAMPLING)
        counts[torch.arange(3), out[0, PROMPT.shape[1] :]] += 1
    return counts


def fit_pvalues(counts: torch.Tensor, marginals: list[torch.Tensor]) -> list[float]:
    pvalues = []
    for row, probs in zip(counts, marginals):
        support = probs > 0
        assert row[~support].sum() == 0, "a token outside the target's support was sampled"
        expected = probs[support] / probs[support].sum() * row.sum()
        pvalues.append(chisquare(row[support].numpy(), expected.numpy()).pvalue)
    return pvalues


def biased_accept(tree: DraftTree, processed: torch.Tensor, generator=None):
    """A WRONG acceptor: after rejecting a candidate it samples from p instead of the renormalised residual."""
    probs = processed.softmax(-1)
    node, path = 0, []
    while True:
        kids = tree.children_of(node).tolist()
        accepted = next((c for c in kids if torch.rand(()) < probs[node, tree.tokens[c]]), None)
        if accepted is None:
            return torch.tensor(path, dtype=torch.long), torch.multinomial(probs[node], 1)
        path.append(accepted)
        node = accepted


@pytest.fixture(scope="module")
def setup():
    target = make_target("llama", vocab_size=VOCAB, seed=3, initializer_range=0.08)
    drafter = make_drafter(target, tree_policy="fixed", fixed_width=3, block_size=3, max_blocks=2, tree_budget=16)
    return target, drafter, exact_marginals(target)


def test_tree_sampling_matches_target_distribution(setup):
    target, drafter, marginals = setup
    counts = sample_counts(target, drafter, seed=0)
    # tokens 2 and 3 went through tree acceptance (token 1 comes from the prefill)
    assert drafter.last_stats.iterations >= 1
    pvalues = fit_pvalues(counts, marginals)
    assert min(pvalues) > ALPHA, f"p-values {pvalues}"


def test_biased_acceptor_is_detected(setup, monkeypatch):
    target, drafter, marginals = setup
    monkeypatch.setattr(generation, "sample_accept", biased_accept)
    counts = sample_counts(target, drafter, seed=0)
    pvalues = fit_pvalues(counts, marginals)
    assert min(pvalues[1:]) < ALPHA, f"the biased acceptor went unnoticed: p-values {pvalues}"


@pytest.mark.parametrize("num_children", [1, 3, 6])
def test_multi_candidate_acceptance_is_exact(num_children):
    """Unit level: the token sample_accept emits after the root is distributed exactly as p, for any candidates."""
    generator = torch.Generator().manual_seed(num_children)
    vocab = 10
    logits = torch.randn(num_children + 1, vocab, generator=generator) * 1.5
    logits[0, 9] = -float("inf")  # a zero-probability token the drafter proposes anyway
    tree = DraftTree.root_only(0)
    candidates = torch.tensor([9, 2, 4, 7, 1, 3])[:num_children]
    tree.add_nodes(candidates, torch.zeros(num_children, dtype=torch.long), torch.ones(num_children, dtype=torch.long),
                   -torch.arange(1.0, num_children + 1))  # fmt: skip
    first = torch.zeros(vocab)
    draws = 20000
    for _ in range(draws):
        path, bonus = sample_accept(tree, logits, generator=generator)
        token = tree.tokens[path[0]] if path.numel() else bonus[0]
        first[token] += 1
    probs = logits[0].softmax(-1)
    assert first[9] == 0
    support = probs > 0
    assert chisquare(first[support].numpy(), (probs[support] * draws).numpy()).pvalue > ALPHA


def test_greedy_and_sampling_share_processors():
    """With top_k=1 sampling is deterministic, so it must equal greedy output exactly."""
    target = make_target("qwen2", vocab_size=16, seed=5)
    drafter = make_drafter(target, tree_policy="fixed", fixed_width=4, max_blocks=2, tree_budget=24)
    prompt = torch.tensor([[3, 9, 4]])
    greedy = target.generate(prompt, do_sample=False, max_new_tokens=20)
    for seed in itertools.islice(itertools.count(), 3):
        torch.manual_seed(seed)
        sampled = target.generate(prompt, assistant_model=drafter, do_sample=True, top_k=1, max_new_tokens=20)
        assert sampled.tolist() == greedy.tolist()
