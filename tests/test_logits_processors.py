"""Logits processors inside tree decoding: row-wise ones batched per depth, per-batch-row ones called with the
user's row 0 only, stateful ones refused before anything runs."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, SynthIDTextWatermarkingConfig, WatermarkingConfig

from conftest import make_drafter, make_target

VOCAB = 64
PROMPT = torch.tensor([[0, 5, 17, 33, 2, 9]])
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return make_target("llama", vocab_size=VOCAB, seed=5)


@pytest.fixture(scope="module")
def oracle(target):
    """Every token is a child of the root, so each verification has VOCAB nodes at depth 1 and commits 2 tokens."""
    return make_drafter(target, block_size=1, max_blocks=1, tree_policy="fixed", fixed_width=VOCAB, tree_budget=VOCAB)


def greedy(model, **kwargs):
    return model.generate(PROMPT, max_new_tokens=12, do_sample=False, **kwargs)


def test_prefix_constrained_processor_sees_only_the_users_batch_row(target, oracle):
    """`prefix_allowed_tokens_fn(batch_id, sent)` must only ever get batch_id 0 (the user has one row)."""
    seen_batch_ids = set()
    allowed_per_row = [list(range(0, VOCAB, 3))]  # the user's batch has exactly one row

    def allowed(batch_id: int, sent: torch.Tensor) -> list[int]:
        seen_batch_ids.add(batch_id)
        odd = [t + 1 for t in allowed_per_row[batch_id] if t + 1 < VOCAB]
        return odd if int(sent[-1]) % 2 == 0 else allowed_per_row[batch_id]  # depends on the path too

    reference = greedy(target, prefix_allowed_tokens_fn=allowed)
    out = greedy(target, assistant_model=oracle, prefix_allowed_tokens_fn=allowed)
    assert out.tolist() == reference.tolist()
    assert seen_batch_ids == {0}
    assert oracle.last_stats.tau > 1.5  # multi-token chunks were committed through the constrained tree


class RowCountingProcessor(LogitsProcessor):
    """A user's processor (not a known row-wise one): must be called with one row at a time."""

    def __init__(self) -> None:
        self.batch_sizes: set[int] = set()

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.batch_sizes.add(input_ids.shape[0])
        penalty = torch.zeros_like(scores)
        penalty[:, input_ids[:, -1] % VOCAB] = -5.0  # discourage repeating the previous token
        return scores + penalty


def test_unknown_processor_is_called_one_row_at_a_time(target, oracle):
    custom = RowCountingProcessor()
    reference = greedy(target, logits_processor=LogitsProcessorList([RowCountingProcessor()]))
    out = greedy(target, assistant_model=oracle, logits_processor=LogitsProcessorList([custom]))
    assert out.tolist() == reference.tolist()
    assert custom.batch_sizes == {1}


class StatefulUserProcessor(LogitsProcessor):
    """A user's processor with state: it bans the token equal to its call count (so what it does depends on how often
    it was called before) and records every prefix it was called on."""

    def __init__(self) -> None:
        self.prefixes: list[list[int]] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.prefixes.append(input_ids[-1].tolist())
        scores = scores.clone()
        scores[:, len(self.prefixes) % VOCAB] = -float("inf")
        return scores


@pytest.mark.parametrize("do_sample", [False, True])
def test_an_unknown_processor_runs_on_the_accepted_path_only_as_in_plain_decoding(target, oracle, do_sample):
    plain, tree = StatefulUserProcessor(), StatefulUserProcessor()
    torch.manual_seed(0)
    settings = dict(max_new_tokens=12, do_sample=do_sample)
    reference = target.generate(PROMPT, **settings, logits_processor=LogitsProcessorList([plain]))
    torch.manual_seed(0)
    out = target.generate(PROMPT, **settings, assistant_model=oracle, logits_processor=LogitsProcessorList([tree]))
    assert all(prefix == out[0, : len(prefix)].tolist() for prefix in tree.prefixes)  # prefixes of the output
    assert len(tree.prefixes) == out.shape[1] - PROMPT.shape[1]  # one call per committed token, never a rejected node
    assert [len(p) for p in tree.prefixes] == list(range(PROMPT.shape[1], out.shape[1]))
    if not do_sample:
        assert out.tolist() == reference.tolist() and tree.prefixes == plain.prefixes
    assert oracle.last_stats.tau > 1.5  # trees were still accepted several tokens at a time


def test_row_wise_watermark_matches_stock(target, oracle):
    config = WatermarkingConfig(bias=4.0, context_width=2, seeding_scheme="lefthash")
    reference = greedy(target, watermarking_config=config)
    out = greedy(target, assistant_model=oracle, watermarking_config=config)
    assert out.tolist() == reference.tolist()


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(guidance_scale=1.5), "UnbatchedClassifierFreeGuidanceLogitsProcessor"),
        (
            dict(watermarking_config=SynthIDTextWatermarkingConfig(keys=[7, 11, 13, 17], ngram_len=3)),
            "SynthIDTextWatermarkLogitsProcessor",
        ),
    ],
)
def test_stateful_processors_are_refused_by_name(target, oracle, kwargs, name):
    with pytest.raises(ValueError, match=name):
        greedy(target, assistant_model=oracle, **kwargs)
    assert greedy(target, **kwargs).shape[1] == PROMPT.shape[1] + 12  # they work without an assistant
