"""Greedy tree decoding must reproduce the target's own greedy output token for token."""

from __future__ import annotations

import itertools

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Split
from transformers import PreTrainedTokenizerFast, StoppingCriteria, StoppingCriteriaList

from conftest import make_drafter, make_target

SMALL_VOCAB = 24  # small enough that an untrained drafter's candidates are often right: long accepted chunks
SHAPES = [  # (block_size, max_blocks, tree_budget, tree_policy)
    (1, 1, 1, "fixed"),
    (1, 3, 4, "fixed"),
    (2, 2, 8, "fixed"),
    (3, 1, 64, "fixed"),
    (3, 3, 16, "rank"),
    (4, 1, 2, "fixed"),
    (4, 2, 32, "fixed"),
    (4, 3, 64, "fixed"),
    (4, 3, 24, "rank"),
    (4, 2, 64, "rank"),
]


def _generate_pair(target, drafter, prompt, **kwargs):
    reference = target.generate(prompt, do_sample=False, **kwargs)
    tree = target.generate(prompt, assistant_model=drafter, do_sample=False, **kwargs)
    return reference, tree


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "K{}-blocks{}-budget{}-{}".format(*s))
def test_greedy_equals_target(family, shape):
    block_size, max_blocks, budget, policy = shape
    accepted_chunks = []
    for seed in range(3):
        target = make_target(family, vocab_size=SMALL_VOCAB, seed=seed)
        drafter = make_drafter(
            target, seed=seed, block_size=block_size, max_blocks=max_blocks, tree_budget=budget,
            tree_policy=policy, fixed_width=4, branch_widths=[2, 4, 6, 3],
        )  # fmt: skip
        prompt = torch.randint(1, SMALL_VOCAB, (1, 5 + seed), generator=torch.Generator().manual_seed(seed))
        reference, tree = _generate_pair(target, drafter, prompt, max_new_tokens=30)
        assert tree.tolist() == reference.tolist(), f"seed {seed}"
        accepted_chunks += drafter.last_stats.accepted_per_iteration
    if budget > 1:  # the drafts were really used: some iterations committed several tokens
        assert max(accepted_chunks) >= 2


BEST_FIRST_SHAPES = [  # (tree_construction, max_blocks, tree_budget, tree_policy)
    ("package", 1, 16, "rank"),
    ("package", 2, 24, "rank"),
    ("package", 3, 8, "fixed"),
    ("reference", 1, 16, "rank"),
    ("reference", 2, 32, "rank"),
]


@pytest.mark.parametrize("shape", BEST_FIRST_SHAPES, ids=lambda s: "{}-blocks{}-budget{}-{}".format(*s))
def test_best_first_blocks_equal_target(shape, one_thread):
    """`block_expansion="best_first"` (the last round's blocks grown best first) in both tree constructions."""
    construction, max_blocks, budget, policy = shape
    accepted_chunks = []
    for seed in range(3):
        target = make_target("llama", vocab_size=SMALL_VOCAB, seed=seed)
        drafter = make_drafter(
            target, seed=seed, block_size=4, max_blocks=max_blocks, tree_budget=budget, tree_policy=policy,
            fixed_width=4, branch_widths=[2, 4, 6, 3], tree_construction=construction, block_expansion="best_first",
        )  # fmt: skip
        prompt = torch.randint(1, SMALL_VOCAB, (1, 5 + seed), generator=torch.Generator().manual_seed(seed))
        reference, tree = _generate_pair(target, drafter, prompt, max_new_tokens=30)
        assert tree.tolist() == reference.tolist(), f"seed {seed}"
        accepted_chunks += drafter.last_stats.accepted_per_iteration
    assert max(accepted_chunks) >= 2


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_with_logits_processors(family):
    """Repetition penalty, n-gram ban and a minimum length act on each tree node's own path prefix."""
    settings = [
        dict(repetition_penalty=1.5),
        dict(no_repeat_ngram_size=2),
        dict(repetition_penalty=0.7, no_repeat_ngram_size=3, min_new_tokens=10),
    ]
    for seed, extra in itertools.product(range(3), settings):
        target = make_target(family, vocab_size=SMALL_VOCAB, seed=seed, eos_token_id=3)
        drafter = make_drafter(target, seed=seed, tree_policy="fixed", fixed_width=4, max_blocks=2, tree_budget=32)
        prompt = torch.randint(4, SMALL_VOCAB, (1, 6), generator=torch.Generator().manual_seed(seed))
        reference, tree = _generate_pair(target, drafter, prompt, max_new_tokens=25, **extra)
        assert tree.tolist() == reference.tolist(), f"seed {seed}, {extra}"


def test_eos_inside_accepted_chunk():
    """Several EOS ids; generation stops at the first one even when it sits inside an accepted chunk."""
    truncated = 0
    for seed in range(12):
        target = make_target("llama", vocab_size=SMALL_VOCAB, seed=seed)
        drafter = make_drafter(target, seed=seed, tree_policy="fixed", fixed_width=5, max_blocks=3, tree_budget=64)
        prompt = torch.randint(1, SMALL_VOCAB, (1, 6), generator=torch.Generator().manual_seed(seed))
        plain = target.generate(prompt, do_sample=False, max_new_tokens=30)[0, 6:]
        eos_ids = plain[8:10].tolist()  # tokens the target really emits, mid-generation
        reference, tree = _generate_pair(target, drafter, prompt, max_new_tokens=30, eos_token_id=eos_ids)
        assert tree.tolist() == reference.tolist()
        stats = drafter.last_stats
        truncated += sum(stats.accepted_per_iteration) + 1 > stats.new_tokens
    assert truncated > 0, "no EOS fell inside an accepted chunk: the test lost its teeth"


class StopAfterPair(StoppingCriteria):
    """A custom criterion: stop right after the bigram (a, b)."""

    def __init__(self, a: int, b: int) -> None:
        self.a, self.b = a, b

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        return (input_ids[:, -2] == self.a) & (input_ids[:, -1] == self.b)


def letter_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A character tokenizer whose token i is the letter chr(ord('a') + i) (for stop strings)."""
    vocab = {chr(ord("a") + i): i for i in range(vocab_size)}
    backend = Tokenizer(WordLevel(vocab, unk_token="a"))
    backend.pre_tokenizer = Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="a")


def test_stop_strings_and_custom_criteria_inside_chunks():
    tokenizer = letter_tokenizer(SMALL_VOCAB)
    truncated = 0
    for seed in range(10):
        target = make_target("llama", vocab_size=SMALL_VOCAB, seed=seed)
        drafter = make_drafter(target, seed=seed, tree_policy="fixed", fixed_width=5, max_blocks=3, tree_budget=64)
        prompt = torch.randint(1, SMALL_VOCAB, (1, 6), generator=torch.Generator().manual_seed(seed))
        plain = target.generate(prompt, do_sample=False, max_new_tokens=30)[0, 6:].tolist()
        stop = tokenizer.decode(plain[9:11])  # two letters the target reaches mid-generation
        criteria = StoppingCriteriaList([StopAfterPair(plain[6], plain[7])])
        for kwargs in (dict(stop_strings=stop, tokenizer=tokenizer), dict(stopping_criteria=criteria)):
            reference, tree = _generate_pair(target, drafter, prompt, max_new_tokens=30, **kwargs)
            assert tree.tolist() == reference.tolist(), f"seed {seed}: {kwargs}"
            stats = drafter.last_stats
            truncated += sum(stats.accepted_per_iteration) + 1 > stats.new_tokens
    assert truncated > 0, "no stop fell inside an accepted chunk: the test lost its teeth"


def test_max_length_inside_chunk():
    target = make_target("qwen2", vocab_size=SMALL_VOCAB, seed=4)
    drafter = make_drafter(target, tree_policy="fixed", fixed_width=6, max_blocks=3, tree_budget=64)
    prompt = torch.randint(1, SMALL_VOCAB, (1, 5), generator=torch.Generator().manual_seed(4))
    for max_new in (1, 2, 7, 13):
        reference, tree = _generate_pair(target, drafter, prompt, max_new_tokens=max_new)
        assert tree.shape[1] == 5 + max_new
        assert tree.tolist() == reference.tolist()
    reference, tree = _generate_pair(target, drafter, prompt, max_length=11)
    assert tree.tolist() == reference.tolist()


def test_eager_attention_uses_additive_mask():
    """Eager attention adds the mask: the tree mask must be additive float, or outputs diverge."""
    target = make_target("llama", vocab_size=SMALL_VOCAB, seed=1, attn="eager")
    drafter = make_drafter(target, tree_policy="fixed", fixed_width=4, max_blocks=2, tree_budget=32)
    prompt = torch.randint(1, SMALL_VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
    reference, tree = _generate_pair(target, drafter, prompt, max_new_tokens=30)
    assert tree.tolist() == reference.tolist()
    assert max(drafter.last_stats.accepted_per_iteration) >= 2
