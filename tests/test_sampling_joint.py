"""Sampling through the tree keeps the target's distribution: the JOINT distribution of whole outcomes (the first
token from the prefill, then 3-4 tokens through tree acceptance), with logits processors, `min_new_tokens`, EOS, a
stop string and a left-padded prompt, and in bfloat16 / float16 (where the acceptance arithmetic stays float32).

The reference is exact: every outcome's probability, enumerating prefixes with stock `generate` (one new token,
`output_scores`: the processed scores transformers samples from) and transformers' own `StopStringCriteria`. The
counts of tree-sampled outcomes are compared with a chi-square test at ALPHA, cells with an expected count below 5
pooled; a biased acceptor (rejection without renormalising the residual) must be rejected at the same level.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare
from transformers import StopStringCriteria

import transformers_specblock.generation.decoding as decoding
from conftest import make_drafter, make_target
from test_greedy_exactness import letter_tokenizer
from test_sampling_lossless import ALPHA, NUM_SAMPLES, biased_accept, exact_marginals, fit_pvalues, sample_counts
from transformers_specblock.generation.acceptance import sample_accept

Outcome = tuple[int, ...]


def exact_outcomes(target, prompt, mask, steps: int, settings: dict, tokenizer=None) -> dict[Outcome, float]:
    """Probability of every outcome (the new tokens, ending early at EOS or a stop string) of sampling `steps`
    tokens with `settings` (passed to `generate`; `min_new_tokens` counted from the prompt)."""
    settings = dict(settings)
    min_new, stops = settings.pop("min_new_tokens", 0), settings.pop("stop_strings", None)
    eos = settings.get("eos_token_id")
    stop_criteria = StopStringCriteria(tokenizer, stops) if stops else None
    live, finished = {(): 1.0}, {}
    for k in range(steps):
        following = {}
        for prefix, prefix_weight in live.items():  # one row per call: stock generate refuses some batched processors
            ids = torch.cat([prompt, torch.tensor([prefix], dtype=torch.long).view(1, k)], 1)
            # an explicit mask: generate would otherwise take generated pad-id tokens (0) for padding
            given = torch.ones_like(prompt) if mask is None else mask
            attention = torch.cat([given, torch.ones(1, k, dtype=torch.long)], 1)
            with torch.no_grad():
                out = target.generate(
                    ids, attention_mask=attention, do_sample=True, max_new_tokens=1, output_scores=True,
                    return_dict_in_generate=True, min_new_tokens=max(0, min_new - k), pad_token_id=0, **settings,
                )  # fmt: skip
            probs = out.scores[0][0].float().softmax(-1).double()
            for token in probs.nonzero().squeeze(1).tolist():
                outcome, weight = (*prefix, token), prefix_weight * float(probs[token])
                extended = torch.cat([ids[0], torch.tensor([token])])[None]
                stopped = token == eos or (stop_criteria is not None and bool(stop_criteria(extended, None)[0]))
                (finished if stopped else following)[outcome] = weight
        live = following
    return finished | live


def tree_outcomes(target, drafter, prompt, mask, steps: int, settings: dict, num_samples: int, seed: int, **extra):
    """Counts of outcomes of `num_samples` tree-sampled generations."""
    torch.manual_seed(seed)
    counts: Counter[Outcome] = Counter()
    for _ in range(num_samples):
        out = target.generate(prompt, attention_mask=mask, assistant_model=drafter, do_sample=True,
                              max_new_tokens=steps, pad_token_id=0, **settings, **extra)  # fmt: skip
        counts[tuple(out[0, prompt.shape[1] :].tolist())] += 1
    return counts


def joint_pvalue(counts: Counter, exact: dict[Outcome, float]) -> float:
    outside = [o for o in counts if o not in exact]
    assert not outside, f"outcomes the target cannot produce were sampled: {outside[:5]}"
    total = sum(counts.values())
    assert abs(sum(exact.values()) - 1) < 1e-6
    cells = sorted(exact, key=exact.get, reverse=True)
    expected = [exact[o] * total for o in cells]
    big = [i for i, e in enumerate(expected) if e >= 5]
    small = [i for i, e in enumerate(expected) if e < 5]
    observed = [counts[cells[i]] for i in big] + ([sum(counts[cells[i]] for i in small)] if small else [])
    wanted = torch.tensor([expected[i] for i in big] + ([sum(expected[i] for i in small)] if small else []),
                          dtype=torch.float64)
    assert len(observed) >= 10, "too few cells for a joint test"
    return chisquare(observed, (wanted / wanted.sum() * total).numpy()).pvalue


# ------------------------------------------------------------------------------------------------ joint, plain
JOINT_VOCAB, JOINT_STEPS, JOINT_SAMPLES = 4, 5, 2400
JOINT_PROMPT, JOINT_MASK = torch.tensor([[1, 2, 3, 1]]), None  # no pad id (0) inside


@pytest.fixture(scope="module")
def joint_setup():
    target = make_target("llama", vocab_size=JOINT_VOCAB, seed=3, initializer_range=0.08)
    drafter = make_drafter(target, tree_policy="fixed", fixed_width=2, branch_widths=[2, 2, 2, 0], block_size=3,
                           max_blocks=2, tree_budget=16)  # fmt: skip
    settings = dict(temperature=1.0, top_k=None, top_p=None)
    return target, drafter, settings, exact_outcomes(target, JOINT_PROMPT, JOINT_MASK, JOINT_STEPS, settings)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.slow  # thousands of sampled generations: minutes on 2 shared cores
def test_joint_distribution_of_the_first_tree_accepted_tokens(joint_setup):
    target, drafter, settings, exact = joint_setup
    counts = tree_outcomes(target, drafter, JOINT_PROMPT, JOINT_MASK, JOINT_STEPS, settings, JOINT_SAMPLES, seed=0)
    # tokens 2..5 came through tree acceptance, mostly several per iteration
    assert max(drafter.last_stats.accepted_per_iteration) >= 2
    pvalue = joint_pvalue(counts, exact)
    assert pvalue > ALPHA, f"joint p-value {pvalue}"


@pytest.mark.usefixtures("one_thread")
@pytest.mark.slow  # thousands of sampled generations: minutes on 2 shared cores
def test_biased_acceptor_fails_the_joint_test(joint_setup, monkeypatch):
    target, drafter, settings, exact = joint_setup
    monkeypatch.setattr(decoding, "sample_accept", biased_accept)
    counts = tree_outcomes(target, drafter, JOINT_PROMPT, JOINT_MASK, JOINT_STEPS, settings, JOINT_SAMPLES, seed=0)
    assert joint_pvalue(counts, exact) < ALPHA, "the biased acceptor went unnoticed"


# ------------------------------------------------------------------------------------------------ with processors
PROC_VOCAB, PROC_STEPS, PROC_SAMPLES, EOS = 8, 4, 2400, 3
PROMPTS = {  # (prompt, attention mask): the same text, then behind two left-padding positions
    "unpadded": (torch.tensor([[1, 5, 2, 7]]), None),
    "left_padded": (torch.tensor([[0, 0, 1, 5, 2, 7]]), torch.tensor([[0, 0, 1, 1, 1, 1]])),
}
PROCESSORS = dict(temperature=0.9, top_k=6, top_p=0.95, repetition_penalty=1.6, min_new_tokens=2,
                  eos_token_id=EOS, stop_strings="cb")  # fmt: skip
@pytest.mark.usefixtures("one_thread")
@pytest.mark.slow  # thousands of sampled generations: minutes on 2 shared cores
@pytest.mark.parametrize("padding, repetition_penalty", [
    ("unpadded", 1.6), ("left_padded", None), ("left_padded", 1.6),
])  # fmt: skip
def test_joint_distribution_with_processors_eos_and_a_stop_string(padding, repetition_penalty):
    prompt, mask = PROMPTS[padding]
    processors = {**PROCESSORS, "repetition_penalty": repetition_penalty}
    tokenizer = letter_tokenizer(PROC_VOCAB)
    target = make_target("llama", vocab_size=PROC_VOCAB, seed=3, initializer_range=0.08)
    drafter = make_drafter(target, tree_policy="fixed", fixed_width=3, branch_widths=[3, 2, 2, 0], block_size=3,
                           max_blocks=2, tree_budget=16)  # fmt: skip
    exact = exact_outcomes(target, prompt, mask, PROC_STEPS, processors, tokenizer)
    assert all(o[0] != EOS and (len(o) < 2 or o[1] != EOS) for o in exact)  # min_new_tokens=2 holds back EOS
    stopped = sum(p for o, p in exact.items() if len(o) < PROC_STEPS)
    assert stopped > 0.05, f"EOS / the stop string end only {stopped:.3f} of the outcomes early: no teeth"
    counts = tree_outcomes(target, drafter, prompt, mask, PROC_STEPS, processors, PROC_SAMPLES, seed=1,
                           tokenizer=tokenizer)  # fmt: skip
    assert any(len(o) < PROC_STEPS and o[-1] != EOS for o in counts), "no sample stopped at the stop string"
    pvalue = joint_pvalue(counts, exact)
    assert pvalue > ALPHA, f"joint p-value {pvalue}"


@pytest.mark.usefixtures("one_thread")
def test_repetition_penalty_with_a_left_padded_prompt_greedy():
    """transformers gives the penalty the rows' left padding as a tensor; tree rows must see their row's."""
    target = make_target("llama", vocab_size=128)
    drafter = make_drafter(target)
    prompt, mask = torch.tensor([[0, 0, 1, 5, 9, 17]]), torch.tensor([[0, 0, 1, 1, 1, 1]])
    plain = target.generate(prompt, attention_mask=mask, do_sample=False, max_new_tokens=20, repetition_penalty=1.3)
    tree = target.generate(prompt, attention_mask=mask, do_sample=False, max_new_tokens=20, repetition_penalty=1.3,
                           assistant_model=drafter)  # fmt: skip
    assert tree.tolist() == plain.tolist()


# ------------------------------------------------------------------------------------------------ 16-bit targets
@pytest.mark.usefixtures("one_thread")
@pytest.mark.slow  # thousands of sampled generations: minutes on 2 shared cores
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sampling_keeps_the_distribution_in_16_bits_with_float32_acceptance(dtype, monkeypatch):
    target = make_target("llama", vocab_size=8, seed=3, initializer_range=0.08).to(dtype)
    drafter = make_drafter(target, tree_policy="fixed", fixed_width=3, block_size=3, max_blocks=2, tree_budget=16)
    seen = []

    def spying_accept(tree, processed, generator=None):
        seen.append(processed.dtype)
        return sample_accept(tree, processed, generator)

    monkeypatch.setattr(decoding, "sample_accept", spying_accept)
    counts = sample_counts(target, drafter, seed=0)
    assert drafter.dtype == dtype and seen and set(seen) == {torch.float32}, seen
    pvalues = fit_pvalues(counts, exact_marginals(target))  # the 16-bit target's own exact marginals
    assert min(pvalues) > ALPHA, f"p-values {pvalues}"
    assert NUM_SAMPLES >= 1200
