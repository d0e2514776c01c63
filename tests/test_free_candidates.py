"""Free candidates (prompt lookup, n-gram cache) in the tree: the sources, merging without duplicate siblings, the
learnt source scores, exactness with every source on (greedy and sampling), the lookup tree and bad settings."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import make_drafter, make_target
from test_eagle3 import make_eagle3
from test_sampling_lossless import ALPHA, exact_marginals, fit_pvalues, sample_counts
from transformers_specblock import LookupTreeModel
from transformers_specblock.generation.lookup import NgramCache, PromptLookup, SourceScores, prompt_lookup_chains
from transformers_specblock.generation.tree import SOURCE_BITS, DraftTree, HostTree

LOOKUP = dict(prompt_lookup_num_tokens=6, prompt_lookup_branches=3, ngram_cache_num_tokens=5)


def test_prompt_lookup_finds_recent_longest_matches_first():
    text = torch.tensor([1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3])
    # the 3-gram [1, 2, 3] occurred at 4 (followed by 8 5 1) and at 0 (followed by 9 1 2): most recent first
    assert prompt_lookup_chains(text, 3, 3, 1, 4) == [(3, [8, 5, 1]), (3, [9, 1, 2])]
    assert prompt_lookup_chains(text, 3, 3, 1, 1) == [(3, [8, 5, 1])]
    # shorter n-grams find the same places again: no duplicate branches
    assert prompt_lookup_chains(text, 2, 1, 1, 4) == [(1, [8, 5]), (1, [9, 1])]
    text = torch.tensor([4, 3, 6, 1, 2, 3, 7, 2, 3])  # [2, 3] once (-> 7), then [3] alone twice more (-> 6, -> 7 dup)
    assert prompt_lookup_chains(text, 2, 2, 1, 4) == [(2, [7, 2]), (1, [6, 1])]
    assert prompt_lookup_chains(torch.tensor([4, 5, 6, 7]), 5, 3, 1, 4) == []  # nothing to copy
    assert prompt_lookup_chains(torch.tensor([7]), 5, 3, 1, 4) == []


def _scan(text: list[int], num_tokens: int, max_n: int, min_n: int, branches: int) -> list[tuple[int, list[int]]]:
    """Prompt lookup by scanning the whole text for its last n-gram (the reference)."""
    chains: list[tuple[int, list[int]]] = []
    for n in range(min(max_n, len(text) - 1), min_n - 1, -1):
        for start in range(len(text) - 1 - n, -1, -1):
            if text[start : start + n] == text[len(text) - n :]:
                chain = text[start + n : start + n + num_tokens]
                if not any(other[: len(chain)] == chain for _, other in chains):
                    chains.append((n, chain))
                    if len(chains) == branches:
                        return chains
    return chains


def test_prompt_lookup_follows_a_growing_text_as_a_scan_of_it_would():
    text = torch.randint(1, 6, (90,), generator=torch.Generator().manual_seed(3)).tolist()
    lookup = PromptLookup(max_ngram_size=3, min_ngram_size=1)
    for length in [*range(1, 30), *range(33, 91, 5)]:  # one token at a time, then several per step
        assert lookup.chains(text[:length], 4, 3) == _scan(text[:length], 4, 3, 1, 3), length


TREE_FIELDS = ("tokens", "parents", "depths", "scores", "sources")


def test_a_host_tree_merges_and_prunes_as_the_device_tree():
    generator = torch.Generator().manual_seed(5)
    host, device = HostTree.root_only(3), DraftTree.root_only(3)
    for i in range(14):
        length = int(torch.randint(1, 6, (1,), generator=generator))
        tokens = torch.randint(1, 5, (length,), generator=generator).tolist()
        scores = ((torch.randn(length, generator=generator) * 2).round() / 2).cumsum(0).tolist()  # ties, rises
        source = list(SOURCE_BITS)[1 + i % 4]
        host.merge_chain(tokens, scores, source)
        device.merge_chain(tokens, scores, source)
    for budget in (1, 3, 8, 100):
        got, expected = host.prune(budget).to_device("cpu"), device.prune(budget)
        for name in ("tokens", "parents", "depths", "scores", "sources"):
            assert torch.equal(getattr(got, name), getattr(expected, name)), (budget, name)
        copy = got.host()
        assert [copy.tokens, copy.parents, copy.depths, copy.scores, copy.sources] == [
            got.tokens.tolist(), got.parents.tolist(), got.depths.tolist(), got.scores.tolist(), got.sources.tolist()
        ]  # fmt: skip
        walked = DraftTree(*[getattr(got, name).clone() for name in TREE_FIELDS]).ancestor_matrix()  # on the device
        assert torch.equal(got.ancestor_matrix(), walked)  # the one the host copy brought


def test_ngram_cache_counts_and_walks():
    cache = NgramCache(order=2)
    text = [1, 2, 3, 1, 2, 4, 1, 2, 3]
    cache.update(text[:5])
    cache.update(text)  # incremental: only the n-grams ending after the last update are added
    assert cache.table[(1, 2)] == {3: 2, 4: 1} and cache.indexed == len(text)
    # from (2, 3): 1, then (3, 1): 2, then (1, 2): 3 (seen twice, against 4 once), then (2, 3) again ...
    assert cache.chain(text, 4) == [1, 2, 3, 1]
    assert cache.chain([9, 9], 4) == []


def _drafter_tree() -> DraftTree:
    tree = DraftTree.root_only(0)
    tree.add_nodes(torch.tensor([5, 6]), torch.tensor([0, 1]), torch.tensor([1, 2]), torch.tensor([-0.5, -1.0]))
    return tree


def test_merge_chain_joins_agreeing_nodes_and_never_duplicates_siblings():
    tree = _drafter_tree()
    tree.merge_chain([5, 7, 8], [-0.1, -0.2, -0.3], "prompt_lookup")
    assert tree.tokens.tolist() == [0, 5, 6, 7, 8] and tree.parents.tolist() == [-1, 0, 1, 1, 3]
    assert tree.sources.tolist() == [0, 1 | 2, 1, 2, 2]  # node 5 was proposed by both
    assert tree.scores[1].item() == pytest.approx(-0.1)  # the better score of the two sources
    tree.merge_chain([5, 6], [-2.0, -3.0], "ngram_cache")  # entirely inside the tree: nothing new
    assert len(tree) == 5 and tree.sources[2].item() == 1 | 4 and tree.scores[2].item() == pytest.approx(-1.0)
    for node in range(len(tree)):
        kids = tree.children_of(node)
        assert len(set(tree.tokens[kids].tolist())) == kids.numel()
    pruned = tree.prune(2)  # sources follow pruning
    assert pruned.tokens.tolist() == [0, 5, 7] and pruned.sources.tolist() == [0, 1 | 2 | 4, 2]


def test_source_scores_learn_from_accepted_paths():
    scores = SourceScores()
    assert scores.log_rates("prompt_lookup:3", 2) == pytest.approx([math.log(0.5), math.log(0.25)])
    tree = _drafter_tree()
    tree.merge_chain([5, 7, 8], [-0.1, -0.2, -0.3], "prompt_lookup")
    children = {(p, t): i for i, (p, t) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist()))}
    accepted = [5, 7]  # then the target wanted another token than 8
    scores.record("prompt_lookup:3", [5, 7, 8], children, accepted)
    scores.record("prompt_lookup:1", [5, 9], children, accepted)  # 9 was pruned away: depth 2 never tried
    assert scores.attempted["prompt_lookup:3"][:3] == [1.0, 1.0, 1.0]
    assert scores.accepted["prompt_lookup:3"][:3] == [1.0, 1.0, 0.0]
    assert scores.attempted["prompt_lookup:1"][:2] == [1.0, 0.0] and scores.accepted["prompt_lookup:1"][0] == 1.0
    rates = scores.log_rates("prompt_lookup:3", 3)
    assert rates[0] == pytest.approx(math.log(2 / 3)) and rates[2] < rates[1] < rates[0]


def _repetitive_prompt(vocab: int, seed: int) -> torch.LongTensor:
    phrase = torch.randint(1, vocab, (6,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([phrase, phrase[:4], phrase, phrase[:3]])[None]


@pytest.mark.parametrize("kind", ["specblock", "eagle3", "lookup_tree"])
@pytest.mark.parametrize("budget", [4, 24])
def test_greedy_equals_target_with_every_source(kind, budget, one_thread):
    vocab, proposed, overlaps = 24, dict.fromkeys(SOURCE_BITS, 0), 0
    for seed in range(3):
        target = make_target("llama", vocab_size=vocab, seed=seed)
        if kind == "specblock":
            drafter = make_drafter(target, seed=seed, tree_budget=budget, **LOOKUP)
        elif kind == "eagle3":
            drafter = make_eagle3(target, seed=seed, tree_budget=budget, tree_top_k=3, tree_depth=3, **LOOKUP)
        else:
            drafter = LookupTreeModel.from_target(target, tree_budget=budget, **LOOKUP)
        prompt = _repetitive_prompt(vocab, seed)
        reference = target.generate(prompt, do_sample=False, max_new_tokens=40)
        out = target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=40)
        assert out.tolist() == reference.tolist(), f"seed {seed}"
        stats = drafter.last_stats
        assert max(stats.nodes_per_iteration) <= budget
        drafted = sum(stats.accepted_per_iteration) - stats.iterations  # accepted tokens that were tree nodes
        assert sum(stats.accepted_by_source.values()) >= drafted  # every accepted node came from some source
        overlaps += sum(stats.accepted_by_source.values()) - drafted  # nodes several sources proposed
        for source, count in stats.accepted_by_source.items():
            proposed[source] += count
    assert proposed["prompt_lookup"] > 0 and proposed["ngram_cache"] > 0  # the sources really took part
    assert (proposed["drafter"] > 0) == (kind != "lookup_tree")
    assert overlaps > 0  # and proposed duplicates of each other's nodes, merged into one


@pytest.mark.parametrize("kind", ["specblock", "lookup_tree"])
def test_sampling_keeps_the_target_distribution_with_free_candidates(kind, one_thread):
    target = make_target("llama", vocab_size=8, seed=3, initializer_range=0.08)
    settings = dict(prompt_lookup_num_tokens=3, prompt_lookup_branches=3, ngram_cache_num_tokens=3, ngram_cache_order=1)
    if kind == "specblock":  # lookup chains land on drafter nodes and beside them
        drafter = make_drafter(target, tree_policy="fixed", fixed_width=3, block_size=3, max_blocks=2, tree_budget=16, **settings)
    else:
        drafter = LookupTreeModel.from_target(target, tree_budget=16, **settings)
    counts = sample_counts(target, drafter, seed=0)
    assert sum(drafter.last_stats.nodes_per_iteration) > 0
    pvalues = fit_pvalues(counts, exact_marginals(target))
    assert min(pvalues) > ALPHA, f"p-values {pvalues}"


def test_bad_lookup_settings_are_refused():
    target = make_target("llama", vocab_size=24)
    drafter = make_drafter(target)
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens must be an int >= 0"):
        with drafter.tree_settings(prompt_lookup_num_tokens=-1):
            pass
    with pytest.raises(ValueError, match="must not exceed prompt_lookup_max_ngram_size"):
        with drafter.tree_settings(prompt_lookup_min_ngram_size=4, prompt_lookup_max_ngram_size=2):
            pass
    with pytest.raises(ValueError, match="needs a candidate source"):
        LookupTreeModel.from_target(target, prompt_lookup_num_tokens=0, ngram_cache_num_tokens=0, suffix_cache_num_tokens=0)  # noqa
    lookup = LookupTreeModel.from_target(make_target("llama", vocab_size=32))
    with pytest.raises(ValueError, match="vocabulary of 32 tokens, but the target has 24"):
        target.generate(torch.tensor([[1, 2, 3]]), assistant_model=lookup, max_new_tokens=4)


def test_lookup_tree_saves_and_loads(tmp_path):
    target = make_target("llama", vocab_size=24)
    lookup = LookupTreeModel.from_target(target, prompt_lookup_num_tokens=7)
    lookup.save_pretrained(tmp_path)
    loaded = LookupTreeModel.from_pretrained(tmp_path)
    assert loaded.generation_config.prompt_lookup_num_tokens == 7 and loaded.generation_config.tree_budget == "auto"
    prompt = _repetitive_prompt(24, 0)
    assert target.generate(prompt, assistant_model=loaded, max_new_tokens=12).tolist() == target.generate(
        prompt, max_new_tokens=12
    ).tolist()


def test_budget_zero_still_verifies_free_candidates_without_a_drafter_call(one_thread):
    """Where "auto" chooses 0 (the drafter does not pay), a drafter with free candidates verifies their tree alone:
    no drafter forward, the drafter's unread context stays queued, and the output is still the target's."""
    from transformers_specblock.generation.candidate_generators import get_candidate_generator
    from transformers_specblock.generation.decoding import _draft

    target = make_target("llama", vocab_size=24, seed=1)
    drafter = make_drafter(target, seed=1, tree_budget="auto", **LOOKUP)
    drafter.bind_target(target)
    generator = get_candidate_generator(drafter)
    prompt = _repetitive_prompt(24, 1)[0]
    generator.queue(torch.zeros(prompt.numel(), 3 * target.config.hidden_size), prompt, first_position=1)
    tree, seconds, catch_up = _draft(generator, prompt, 0, 16, torch.device("cpu"))
    assert catch_up == (0, 0.0)  # nothing read
    assert tree.num_drafted > 0 and seconds is not None and seconds >= 0  # the free candidates' own time
    assert bool((tree.sources[1:] & SOURCE_BITS["drafter"] == 0).all())  # lookup nodes only
    assert generator.stats.drafter_forwards == 0 and len(generator.queued) == 1  # the drafter did not read
    with drafter.tree_settings(auto_budget_candidates=[0, 4], auto_budget_warmup=1):
        reference = target.generate(prompt[None], do_sample=False, max_new_tokens=40)
        out = target.generate(prompt[None], assistant_model=drafter, do_sample=False, max_new_tokens=40)
    assert out.tolist() == reference.tolist()


def test_source_scores_carry_over_between_calls_and_fade(one_thread):
    target = make_target("llama", vocab_size=24, seed=0)
    lookup = LookupTreeModel.from_target(target, tree_budget=8, **LOOKUP)
    prompt = _repetitive_prompt(24, 0)
    target.generate(prompt, assistant_model=lookup, max_new_tokens=20)
    (scores,) = lookup.serving_state().source_scores.values()
    tried = sum(sum(t) for t in scores.attempted.values())
    assert tried > 0
    target.generate(prompt, assistant_model=lookup, max_new_tokens=20)
    learnt = lookup.serving_state().source_scores
    assert learnt[next(iter(learnt))] is scores  # the same learnt scores
    assert sum(sum(t) for t in scores.attempted.values()) > tried
    fading = SourceScores(memory=4.0)
    children = {(0, 5): 1}
    for _ in range(10):
        fading.record("ngram_cache", [5], children, [5])
    assert fading.attempted["ngram_cache"][0] == 4.0 and fading.accepted["ngram_cache"][0] == pytest.approx(4.0)
    for _ in range(10):
        fading.record("ngram_cache", [5], children, [7])  # the kind stops being right: its rate falls to ~0
    assert fading.accepted["ngram_cache"][0] == pytest.approx(4 * 0.75**10)  # each miss keeps 3/4 of the hits
