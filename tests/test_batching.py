"""Tree decoding at batch size > 1: every row equal to plain batched `generate`, ragged acceptance, rows that finish
at different steps, per-row processors, sampling per row, bad input and the batch-aware budget chooser."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StoppingCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)
from transformers.generation.streamers import BaseStreamer

from conftest import make_drafter, make_target
from deep_oracle import install_deep_oracle
from test_greedy_exactness import letter_tokenizer
from transformers_specblock import DFlashDraftModel, Eagle3DraftModel, LookupTreeModel
from transformers_specblock.generation.budget import AutoBudget
from transformers_specblock.generation.target_cost import TargetCost
from transformers_specblock.generation.rows import host_stop_rule
from transformers_specblock.generation.tree import DraftTree

VOCAB = 24
PAD = 0
LOOKUP = dict(prompt_lookup_num_tokens=4, ngram_cache_num_tokens=3)
DRAFTERS = {
    "specblock": lambda t: make_drafter(t, tree_policy="fixed", fixed_width=3, max_blocks=2, tree_budget=16),
    "eagle3": lambda t: Eagle3DraftModel.from_target(t, tree_top_k=3, tree_depth=3, tree_budget=16),
    "dflash": lambda t: DFlashDraftModel.from_target(
        t, mask_token_id=t.config.vocab_size - 1, block_size=4, num_hidden_layers=2, tree_budget=8
    ),
    "lookup_tree": lambda t: LookupTreeModel.from_target(t, tree_budget=16, **LOOKUP),
    "specblock+lookup": lambda t: make_drafter(t, tree_policy="fixed", fixed_width=2, max_blocks=2, tree_budget=16,
                                               **LOOKUP),  # fmt: skip
}


def left_padded(lengths: list[int], seed: int = 0, vocab: int = VOCAB) -> tuple[torch.LongTensor, torch.LongTensor]:
    """A left-padded batch of random prompts of the given lengths (ids [B, S], attention mask [B, S])."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(1, vocab - 1, (n,), generator=generator)
        mask[row, width - n :] = 1
    return ids, mask


def plain_and_tree(target, drafter, ids, mask, **kwargs):
    settings = dict(do_sample=False, pad_token_id=PAD, **kwargs)
    plain = target.generate(ids, attention_mask=mask, **settings)
    tree = target.generate(ids, attention_mask=mask, assistant_model=drafter, **settings)
    return plain, tree


def oracle_for(monkeypatch, drafter, plain, mask):
    """Graft each row's plain continuation into its trees: chunks of several tokens in most iterations."""
    references = [plain[r, int((mask[r] == 0).sum()) :].tolist() for r in range(plain.shape[0])]
    return install_deep_oracle(monkeypatch, drafter, references)


@pytest.mark.parametrize("name", list(DRAFTERS))
@pytest.mark.parametrize("lengths", [[3, 9], [1, 14, 6], [5, 300, 1, 12, 40, 7, 2, 22]], ids=["B2", "B3", "B8"])
def test_every_row_equals_plain_batched_generate(one_thread, monkeypatch, name, lengths):
    target = make_target("llama", vocab_size=VOCAB, seed=len(lengths))
    drafter = DRAFTERS[name](target)
    ids, mask = left_padded(lengths, seed=len(lengths))
    plain = target.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, max_new_tokens=24)
    oracle_for(monkeypatch, drafter, plain, mask)
    tree = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False, pad_token_id=PAD,
                           max_new_tokens=24)  # fmt: skip
    assert tree.tolist() == plain.tolist()
    stats = drafter.last_stats
    assert stats.iterations == len(stats.accepted_per_iteration) > stats.target_forwards  # rows share forwards
    multi = sum(a >= 3 for a in stats.accepted_per_iteration)
    assert multi >= len(stats.accepted_per_iteration) // 2, stats.accepted_per_iteration


@pytest.mark.parametrize("name", ["specblock+lookup", "eagle3"])
def test_auto_budget_in_a_batch_is_exact(one_thread, name):
    target = make_target("llama", vocab_size=VOCAB, seed=14)
    drafter = DRAFTERS[name](target)
    drafter.generation_config.tree_budget, drafter.generation_config.auto_budget_warmup = "auto", 2
    ids, mask = left_padded([6, 2, 17, 9], seed=14)
    for _ in range(2):  # the second call starts from what the first learnt
        plain, tree = plain_and_tree(target, drafter, ids, mask, max_new_tokens=24)
        assert tree.tolist() == plain.tolist()
    chooser = drafter.serving_state().auto_budget
    assert {1, 2, 4} <= set(chooser.batch_costs)  # every bucket up to the batch's was timed before decoding


def test_rows_equal_their_prompt_decoded_alone(one_thread):
    target = make_target("qwen2", vocab_size=VOCAB, seed=3)
    drafter = DRAFTERS["lookup_tree"](target)
    lengths = [4, 11, 2]
    ids, mask = left_padded(lengths, seed=3)
    _, tree = plain_and_tree(target, drafter, ids, mask, max_new_tokens=20)
    batched_plain = target.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, max_new_tokens=20)
    compared = 0
    for row, n in enumerate(lengths):
        alone = target.generate(ids[row : row + 1, -n:], do_sample=False, max_new_tokens=20)[0, n:]
        if batched_plain[row, -20:].tolist() == alone.tolist():  # where plain batching itself equals it
            assert tree[row, -20:].tolist() == alone.tolist()
            compared += 1
    assert compared >= 2


def test_rows_finish_at_different_steps(one_thread, monkeypatch):
    """EOS on some rows, a stop string hitting one row only: finished rows leave the batch and come back padded."""
    target = make_target("llama", vocab_size=VOCAB, seed=5)
    ids, mask = left_padded([6, 3, 9, 4], seed=5)
    free = target.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, max_new_tokens=30)[:, 9:]
    eos = int(free[1, 4])  # row 1 ends after 5 tokens; others where the token turns up, or not at all
    tokenizer = letter_tokenizer(VOCAB)
    stop = tokenizer.decode(free[2, 10:12].tolist())
    for kwargs in (dict(eos_token_id=eos), dict(eos_token_id=eos, stop_strings=stop, tokenizer=tokenizer)):
        drafter = DRAFTERS["specblock"](target)
        plain = target.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, max_new_tokens=30,
                                **kwargs)  # fmt: skip
        oracle_for(monkeypatch, drafter, plain, mask)
        tree = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False, pad_token_id=PAD,
                               max_new_tokens=30, **kwargs)  # fmt: skip
        assert tree.tolist() == plain.tolist(), kwargs
        lengths = (tree[:, 9:] != PAD).sum(1).tolist()
        assert len(set(lengths)) > 1, lengths  # the rows really finished at different steps
        batch_sizes = drafter.last_stats.target_forwards
        assert drafter.last_stats.iterations < batch_sizes * 4  # finished rows stopped being verified


def test_the_host_stop_rule_answers_as_the_criteria_and_steps_aside_for_others():
    """Max length, max time and EOS are answered on the host exactly as the criteria answer on the device (so a
    greedy tree step reads nothing back for stopping); stop strings or a custom criterion keep the device path."""
    criteria = StoppingCriteriaList([MaxLengthCriteria(12), EosTokenCriteria([3, 7]), MaxTimeCriteria(3600.0)])
    rule = host_stop_rule(criteria)
    generator = torch.Generator().manual_seed(0)
    sequences = torch.randint(0, 10, (200, 14), generator=generator)
    for sequence in sequences:
        length = int(torch.randint(1, 15, (1,), generator=generator))
        expected = bool(criteria(sequence[None, :length], None)[0])
        assert rule(length, int(sequence[length - 1])) == expected
    assert host_stop_rule(StoppingCriteriaList([MaxTimeCriteria(0.0, initial_timestamp=0.0)]))(1, 0)  # expired
    tokenizer = letter_tokenizer(VOCAB)
    assert host_stop_rule(StoppingCriteriaList([*criteria, StopStringCriteria(tokenizer, ["ab"])])) is None

    class Custom(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    assert host_stop_rule(StoppingCriteriaList([*criteria, Custom()])) is None


@pytest.mark.parametrize(
    "kwargs",
    [dict(repetition_penalty=1.4), dict(no_repeat_ngram_size=2), dict(min_new_tokens=12, eos_token_id=5)],
    ids=["repetition", "ngram-ban", "min-new-tokens"],
)
def test_row_wise_processors(one_thread, monkeypatch, kwargs):
    target = make_target("qwen2", vocab_size=VOCAB, seed=7)
    drafter = DRAFTERS["specblock+lookup"](target)
    ids, mask = left_padded([5, 12, 2], seed=7)
    plain, tree = plain_and_tree(target, drafter, ids, mask, max_new_tokens=20, **kwargs)
    assert tree.tolist() == plain.tolist()


def test_prefix_allowed_tokens_fn_sees_the_users_row(one_thread):
    target = make_target("llama", vocab_size=VOCAB, seed=8)
    drafter = DRAFTERS["lookup_tree"](target)
    ids, mask = left_padded([4, 7, 3], seed=8)
    seen: set[int] = set()

    def allowed(batch_id: int, sentence: torch.LongTensor) -> list[int]:
        seen.add(batch_id)
        return list(range(1 + 6 * batch_id, 7 + 6 * batch_id))  # each row its own six tokens

    plain, tree = plain_and_tree(target, drafter, ids, mask, max_new_tokens=12, prefix_allowed_tokens_fn=allowed)
    assert tree.tolist() == plain.tolist()
    assert seen == {0, 1, 2}
    assert all(1 + 6 * r <= t < 7 + 6 * r for r in range(3) for t in tree[r, -12:].tolist())


def test_return_dict_scores_and_logits(one_thread):
    target = make_target("llama", vocab_size=VOCAB, seed=9)
    drafter = DRAFTERS["eagle3"](target)
    ids, mask = left_padded([3, 8], seed=9)
    plain, tree = plain_and_tree(target, drafter, ids, mask, max_new_tokens=10, return_dict_in_generate=True,
                                 output_scores=True, output_logits=True, repetition_penalty=1.3)  # fmt: skip
    assert tree.sequences.tolist() == plain.sequences.tolist()
    assert len(tree.scores) == len(plain.scores) == 10 and tree.scores[0].shape == (2, VOCAB)
    for ours, theirs in zip(tree.scores + tree.logits, plain.scores + plain.logits):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert tree.past_key_values is None  # a batch's cache holds holes and rows that left: not handed out


def test_num_return_sequences_expands_the_batch(one_thread):
    target = make_target("llama", vocab_size=VOCAB, seed=10)
    drafter = DRAFTERS["lookup_tree"](target)
    ids, mask = left_padded([3, 6], seed=10)
    greedy = target.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, max_new_tokens=8)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=True, top_k=1,
                          num_return_sequences=3, pad_token_id=PAD, max_new_tokens=8)  # fmt: skip
    assert out.shape == (6, 6 + 8)
    assert out.tolist() == greedy.repeat_interleave(3, dim=0).tolist()  # top_k=1: every sample is the greedy one


def test_bad_batches_are_refused(one_thread):
    target = make_target("llama", vocab_size=VOCAB, seed=11)
    drafter = DRAFTERS["specblock"](target)
    ids, mask = left_padded([3, 6], seed=11)
    right = torch.flip(mask, dims=[1])
    with pytest.raises(ValueError, match=r"rows \[0\] pad on the right.*padding_side = 'left'"):
        target.generate(ids, attention_mask=right, assistant_model=drafter, max_new_tokens=4, pad_token_id=PAD)
    empty = mask.clone()
    empty[1] = 0
    with pytest.raises(ValueError, match=r"rows \[1\] mask every token"):
        target.generate(ids, attention_mask=empty, assistant_model=drafter, max_new_tokens=4, pad_token_id=PAD)

    class Collect(BaseStreamer):
        def put(self, value):
            pass

        def end(self):
            pass

    with pytest.raises(ValueError, match="Streamers support batch size 1"):
        target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=4, pad_token_id=PAD,
                        streamer=Collect())  # fmt: skip
    # the drafter is still usable
    plain, tree = plain_and_tree(target, drafter, ids, mask, max_new_tokens=6)
    assert tree.tolist() == plain.tolist()


def test_online_adaptation_takes_signal_from_every_row(one_thread):
    target = make_target("llama", vocab_size=VOCAB, seed=12)
    ids, mask = left_padded([4, 9, 6], seed=12)
    settings = dict(tree_policy="fixed", fixed_width=3, max_blocks=2, tree_budget=16, online_adaptation="head_only")
    batched = make_drafter(target, **settings)
    target.generate(ids, attention_mask=mask, assistant_model=batched, do_sample=False, pad_token_id=PAD,
                    max_new_tokens=12)  # fmt: skip
    alone = 0
    for row, n in enumerate([4, 9, 6]):
        single = make_drafter(target, **settings)
        target.generate(ids[row : row + 1, -n:], assistant_model=single, do_sample=False, max_new_tokens=12)
        alone += single.last_stats.adaptation.signal
    assert batched.last_stats.adaptation.signal == alone > 0


# --------------------------------------------------------------------------------------------------------------
# sampling: each row keeps the target's distribution


SAMPLE_VOCAB = 8


def exact_first_tokens(target, prompt: torch.LongTensor, steps: int, warpers) -> list[torch.Tensor]:
    """Exact marginals of the first `steps` sampled tokens after `prompt` [T] (enumerating every prefix) under
    the sampling `warpers`."""
    prefixes, weights, marginals = prompt[None], torch.ones(1, dtype=torch.float64), []
    with torch.no_grad():
        for _ in range(steps):
            probs = warpers(prefixes, target(prefixes).logits[:, -1].float()).double().softmax(-1)  # [P, V]
            joint = weights[:, None] * probs
            marginals.append(joint.sum(0))
            prefixes = torch.cat([prefixes.repeat_interleave(SAMPLE_VOCAB, 0),
                                  torch.arange(SAMPLE_VOCAB).repeat(prefixes.shape[0])[:, None]], 1)  # fmt: skip
            weights = joint.flatten()
    return marginals


def test_sampling_keeps_each_rows_distribution(one_thread):
    target = make_target("llama", vocab_size=SAMPLE_VOCAB, seed=13, initializer_range=0.05)
    drafter = make_drafter(target, tree_policy="fixed", fixed_width=4, max_blocks=2, tree_budget=24)
    lengths = [4, 2, 6]
    ids, mask = left_padded(lengths, seed=13, vocab=SAMPLE_VOCAB)
    steps, draws, sampling = 3, 800, dict(temperature=0.8, top_k=6, top_p=0.95)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(6), TopPLogitsWarper(0.95)])
    counts = torch.zeros(3, steps, SAMPLE_VOCAB)
    torch.manual_seed(0)
    multi = 0
    for _ in range(draws):
        out = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=True, pad_token_id=PAD,
                              max_new_tokens=steps, **sampling)  # fmt: skip
        for row in range(3):
            for step, token in enumerate(out[row, -steps:].tolist()):
                counts[row, step, token] += 1
        multi += max(drafter.last_stats.accepted_per_iteration) >= 2
    assert multi > draws // 4  # tree acceptance committed several tokens at once
    for row, n in enumerate(lengths):
        marginals = exact_first_tokens(target, ids[row, -n:], steps, warpers)
        for step in range(steps):
            support = marginals[step] > 0
            expected = (marginals[step][support] * draws).numpy()
            assert counts[row, step][~support].sum() == 0, (row, step)  # nothing outside top-k / top-p
            assert chisquare(counts[row, step][support].numpy(), expected).pvalue > 1e-3, (row, step)


# --------------------------------------------------------------------------------------------------------------
# the budget chooser: the tree shrinks as the batch grows


def chain(length: int) -> DraftTree:
    tree = DraftTree.root_only(0)
    tree.add_nodes(torch.arange(1, length + 1), torch.arange(length), torch.arange(1, length + 1),
                   -0.1 * torch.arange(1.0, length + 1))  # fmt: skip
    return tree


def curve(seconds) -> TargetCost:
    sizes = [0, 1, 2, 3, 4, 8, 16]
    return TargetCost(sizes, [seconds(n) for n in sizes])


@pytest.mark.parametrize(
    "cost, reaches_zero",
    [
        (lambda batch, n: 0.01 * max(1.0, batch * (n + 1) / 4), True),  # CPU-like: every verified row costs
        (lambda batch, n: 0.01 * (1 + 0.002 * batch * (n + 1)), False),  # GPU-like: flat until the device fills
    ],
    ids=["cpu-like", "gpu-like"],
)
def test_auto_budget_falls_as_the_batch_grows(cost, reaches_zero):
    chooser = AutoBudget([0, 2, 4, 8], curve(lambda n: cost(1, n)), warmup=2,
                         measure=lambda batch: curve(lambda n: cost(batch, n)))  # fmt: skip
    for _ in range(8):  # three tokens of every 8-node chain are accepted
        chooser.observe(chain(8), [1, 2, 3], drafting_seconds=0.0002, budget=8)
    chosen = []
    for batch in (1, 2, 4, 8, 16, 32):
        chooser.set_batch_size(batch)
        chosen.append(chooser.choose())
    assert chosen == sorted(chosen, reverse=True), chosen
    assert chosen[0] > 0
    assert (chosen[-1] == 0) == reaches_zero, chosen


def test_the_statistics_come_with_the_output_per_row():
    """return_dict_in_generate=True gives transformers' fields and the call's drafting statistics, one report per
    row in the user's order; `drafter.last_stats` is the same object."""
    from transformers_specblock import TreeGenerateOutput

    target = make_target("llama", vocab_size=64, seed=3)
    drafter = make_drafter(target, tree_budget=8)
    prompts = torch.tensor([[0, 5, 9, 3, 17, 4], [0, 8, 8, 1, 2, 30]])
    out = target.generate(prompts, assistant_model=drafter, do_sample=False, max_new_tokens=7,
                          return_dict_in_generate=True, output_scores=True)  # fmt: skip
    assert isinstance(out, TreeGenerateOutput) and out.drafting_stats is drafter.last_stats
    assert torch.equal(out.sequences, target.generate(prompts, do_sample=False, max_new_tokens=7))
    stats = out.drafting_stats
    assert len(stats.rows) == 2 and sum(row.new_tokens for row in stats.rows) == stats.new_tokens == 14
    assert sum(len(row.accepted_per_iteration) for row in stats.rows) == stats.iterations
    assert sorted(a for row in stats.rows for a in row.accepted_per_iteration) == sorted(stats.accepted_per_iteration)
    assert all(row.tau >= 1 for row in stats.rows) and len(out.scores) == 7
    assert stats.as_dict()["rows"][0]["new_tokens"] == 7
