"""The suffix cache (issue 30): the automaton against brute force, the frequency-scored tree, exactness with the
store on (greedy and sampling), the store carrying across calls, its bounds, reset, saving, bad settings and a
target with another vocabulary."""

from __future__ import annotations

import gc
import json
import random
import threading

import pytest
import torch

from conftest import load_example, make_drafter, make_target
from scripted_clock import ScriptedMachine
from test_dflash import make_dflash
from test_eagle3 import make_eagle3
from test_sampling_lossless import ALPHA, exact_marginals, fit_pvalues, sample_counts
from transformers_specblock import LookupTreeConfig, LookupTreeModel
from transformers_specblock.generation.suffix_cache import SuffixCandidates, SuffixSettings, SuffixStore, suffix_cache_for
from transformers_specblock.generation.suffix_index import Matcher, SuffixAutomaton, draft_below

SUFFIX = dict(prompt_lookup_num_tokens=0, ngram_cache_num_tokens=0, suffix_cache_num_tokens=24)


def _occurrences(sequences: list[list[int]], needle: list[int]) -> int:
    return sum(
        seq[i : i + len(needle)] == needle for seq in sequences for i in range(len(seq) - len(needle) + 1)
    )


def test_automaton_counts_and_longest_matches_agree_with_brute_force():
    rng = random.Random(0)
    for _ in range(60):
        sequences = [[rng.randint(0, 3) for _ in range(rng.randint(1, 14))] for _ in range(rng.randint(1, 4))]
        index = SuffixAutomaton()
        for sequence in sequences:
            index.add_sequence(sequence)
        assert len(index) <= 2 * sum(map(len, sequences)) + 1
        for sequence in sequences:  # every substring's state counts its occurrences in all sequences
            for i in range(len(sequence)):
                for j in range(i + 1, len(sequence) + 1):
                    state = 0
                    for token in sequence[i:j]:
                        state = index.next[state][token]
                    assert index.count[state] == _occurrences(sequences, sequence[i:j])
        context, matcher = [rng.randint(0, 3) for _ in range(20)], Matcher()
        for k, token in enumerate(context):  # the matcher holds the longest suffix that occurs
            matcher.feed(index, token)
            longest = max((n for n in range(1, k + 2) if _occurrences(sequences, context[k + 1 - n : k + 1])), default=0)
            assert matcher.length == longest


def test_no_match_crosses_from_one_request_into_the_next():
    index = SuffixAutomaton()
    index.add_sequence([1, 2, 3])
    index.add_sequence([4, 5])
    matcher = Matcher()
    for token in [3, 4]:
        matcher.feed(index, token)
    assert matcher.length == 1  # [3, 4] never occurred inside one request


def test_draft_below_is_frequency_scored_best_first():
    index = SuffixAutomaton()
    for sequence in ([7, 1, 2, 3], [7, 1, 2, 3], [7, 1, 2, 4], [7, 1, 5, 6]):
        index.add_sequence(sequence)
    matcher = Matcher()
    for token in [9, 7, 1]:
        matcher.feed(index, token)
    assert matcher.length == 2
    nodes = draft_below(index, matcher.state, max_nodes=8, min_prob=0.2)
    # after [7, 1]: 2 (3 of 4 times) then 3 (2 of 3) or 4 (1 of 3); 5 (1 of 4) then 6
    assert [(t, p) for t, p, _ in nodes] == [(2, -1), (3, 0), (5, -1), (4, 0), (6, 2)]  # ties: first found first
    assert [round(q, 3) for _, _, q in nodes] == [0.75, 0.5, 0.25, 0.25, 0.25]
    assert [t for t, _, _ in draft_below(index, matcher.state, 8, min_prob=0.3)] == [2, 3]  # the rest is dropped
    assert len(draft_below(index, matcher.state, 2, 0.0)) == 2  # the size limit


@pytest.mark.parametrize("kind", ["lookup_tree", "specblock", "eagle3", "dflash"])
def test_greedy_equals_target_with_the_suffix_cache(kind, one_thread):
    vocab, from_store = 24, 0
    settings = dict(suffix_cache_num_tokens=12, suffix_local_num_tokens=8, prompt_lookup_num_tokens=4)
    for seed in range(2):
        target = make_target("llama", vocab_size=vocab, seed=seed)
        if kind == "specblock":
            drafter = make_drafter(target, seed=seed, tree_budget=16, **settings)
        elif kind == "eagle3":
            drafter = make_eagle3(target, seed=seed, tree_budget=16, tree_top_k=3, tree_depth=3, **settings)
        elif kind == "dflash":
            drafter = make_dflash(target, seed=seed, tree_budget=16, **settings)
        else:
            drafter = LookupTreeModel.from_target(target, tree_budget=16, **settings)
        prompts = torch.randint(1, vocab, (3, 10), generator=torch.Generator().manual_seed(seed))
        for prompt in [prompts[0], prompts[1], prompts[0], prompts[2], prompts[1]]:  # requests repeat
            reference = target.generate(prompt[None], do_sample=False, max_new_tokens=30)
            out = target.generate(prompt[None], assistant_model=drafter, do_sample=False, max_new_tokens=30)
            assert out.tolist() == reference.tolist(), f"seed {seed}"
            assert max(drafter.last_stats.nodes_per_iteration) <= 16
            from_store += drafter.last_stats.accepted_by_source["suffix_cache"]
            gc.collect()
    assert from_store > 0  # the store really took part


def test_sampling_keeps_the_target_distribution_with_the_suffix_cache(one_thread):
    target = make_target("llama", vocab_size=8, seed=3, initializer_range=0.08)
    drafter = LookupTreeModel.from_target(
        target, tree_budget=16, suffix_cache_num_tokens=6, suffix_local_num_tokens=3, suffix_cache_min_token_prob=0.05,
        suffix_cache_max_requests=64, **{k: v for k, v in SUFFIX.items() if k != "suffix_cache_num_tokens"},
    )  # fmt: skip
    counts = sample_counts(target, drafter, seed=0)  # 1200 calls: the store holds the last ones, evicting
    assert suffix_cache_for(drafter).tokens > 0 and sum(drafter.last_stats.nodes_per_iteration) > 0
    pvalues = fit_pvalues(counts, exact_marginals(target))
    assert min(pvalues) > ALPHA, f"p-values {pvalues}"


def _served(target, drafter, prompt: torch.LongTensor, tokens: int = 40) -> torch.LongTensor:
    out = target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=tokens)
    gc.collect()  # the call's candidate generator is dropped: its request joins the store
    return out


def test_the_store_carries_across_calls_and_reset_forgets(one_thread):
    target = make_target("llama", vocab_size=64, seed=1)
    prompt = torch.randint(1, 64, (1, 8), generator=torch.Generator().manual_seed(5))
    drafter = LookupTreeModel.from_target(target, tree_budget=32, **SUFFIX)
    first = _served(target, drafter, prompt, tokens=60)
    fresh_tau = drafter.last_stats.tau
    store = suffix_cache_for(drafter)
    assert len(store) == 1 and store.requests[0] == first[0].tolist()  # the whole text, the last bonus token too
    repeat = torch.cat([prompt, first[:, 8:20]], dim=1)  # a second request quoting the first answer
    _served(target, drafter, repeat, tokens=30)
    stats = drafter.last_stats
    assert stats.accepted_by_source["suffix_cache"] > 0 and stats.tau > 3 * fresh_tau
    assert max(stats.accepted_per_iteration) >= 10  # long chains of the remembered answer
    store.reset()
    _served(target, drafter, repeat)
    assert drafter.last_stats.accepted_by_source["suffix_cache"] == 0  # forgotten (the store only holds this call)
    other = LookupTreeModel.from_target(target, tree_budget=32, **SUFFIX)
    _served(target, other, repeat)
    assert other.last_stats.accepted_by_source["suffix_cache"] == 0  # a fresh drafter object has its own store


def test_eviction_keeps_the_store_under_its_bounds():
    store = SuffixStore(max_tokens=100, max_requests=5)
    rng = random.Random(0)
    requests = [[rng.randint(0, 50) for _ in range(rng.randint(5, 40))] for _ in range(40)]
    for request in requests:
        store.add(request)
        assert store.tokens <= 100 and len(store) <= 5
        assert store.tokens == sum(map(len, store.requests)) and len(store.index) <= 2 * store.tokens + 1
        assert list(store.requests) == requests[requests.index(store.requests[0]) : requests.index(request) + 1]
    assert store.index.tokens == store.tokens  # the index holds exactly the kept requests
    store.add(list(range(500)))  # longer than the store: its last 100 tokens are kept
    assert list(store.requests) == [list(range(400, 500))]


def test_saving_the_drafter_does_not_write_the_store(tmp_path, one_thread):
    target = make_target("llama", vocab_size=64, seed=1)
    drafter = LookupTreeModel.from_target(target, tree_budget=16, **SUFFIX)
    _served(target, drafter, torch.tensor([[3, 4, 5, 6]]))
    fresh = LookupTreeModel.from_target(target, tree_budget=16, **SUFFIX)
    drafter.save_pretrained(tmp_path / "served")
    fresh.save_pretrained(tmp_path / "fresh")
    names = sorted(p.name for p in (tmp_path / "served").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "fresh").iterdir())
    for name in names:
        assert (tmp_path / "served" / name).read_bytes() == (tmp_path / "fresh" / name).read_bytes(), name
    loaded = LookupTreeModel.from_pretrained(tmp_path / "served")
    assert "_suffix_store" not in loaded.__dict__
    store = suffix_cache_for(drafter)  # written only when asked, and read back
    store.save(tmp_path / "store.json")
    assert json.loads((tmp_path / "store.json").read_text())["requests"] == list(store.requests)
    suffix_cache_for(loaded).load(tmp_path / "store.json")
    assert list(suffix_cache_for(loaded).requests) == list(store.requests)


def test_bad_suffix_settings_are_refused(one_thread):
    for name, value, message in [
        ("suffix_cache_num_tokens", -1, "suffix_cache_num_tokens must be an int >= 0"),
        ("suffix_cache_max_tokens", 0, "suffix_cache_max_tokens must be an int >= 1"),
        ("suffix_cache_max_requests", -3, "suffix_cache_max_requests must be an int >= 1"),
        ("suffix_cache_spec_factor", 0, "suffix_cache_spec_factor must be a number > 0"),
        ("suffix_cache_min_token_prob", 1.5, r"suffix_cache_min_token_prob must be a probability in \[0, 1\]"),
    ]:
        with pytest.raises(ValueError, match=message):
            LookupTreeConfig(**{name: value})
    target = make_target("llama", vocab_size=24)
    with pytest.raises(ValueError, match="suffix_local_num_tokens"):  # named among the sources a lookup tree needs
        LookupTreeModel.from_target(target, prompt_lookup_num_tokens=0, ngram_cache_num_tokens=0, suffix_cache_num_tokens=0)
    drafter = LookupTreeModel.from_target(target, suffix_cache_max_tokens=8, **SUFFIX)
    with pytest.raises(ValueError, match="suffix_cache_max_tokens=8 cannot hold one request: this prompt alone has 12"):
        target.generate(torch.arange(1, 13)[None], assistant_model=drafter, max_new_tokens=4)
    out = target.generate(torch.arange(1, 5)[None], assistant_model=drafter, max_new_tokens=4)  # still usable
    assert out.shape[1] == 8


def test_targets_of_one_vocabulary_share_the_store_another_vocabulary_is_refused_until_reset(one_thread):
    """The store holds token ids: it belongs to a vocabulary. A second target of the same vocabulary (other weights,
    as a fine-tune; or the same one in bfloat16) shares it, each decoding exactly as plain greedy; a target whose
    vocabulary differs (its size or special-token ids) is refused until reset."""
    first, tuned = make_target("llama", vocab_size=24, seed=0), make_target("llama", vocab_size=24, seed=7)
    drafter = LookupTreeModel.from_target(first, tree_budget=8, **SUFFIX)
    prompt = torch.tensor([[1, 2, 3, 4]])
    for target in (first, tuned, first):
        assert torch.equal(_served(target, drafter, prompt), target.generate(prompt, do_sample=False, max_new_tokens=40))
    _served(first.to(torch.bfloat16), drafter, prompt)
    first.float()
    assert len(suffix_cache_for(drafter)) == 4
    other = make_target("llama", vocab_size=24, seed=7, bos_token_id=3)  # (another size: refused as another target)
    with pytest.raises(ValueError, match="suffix cache holds 4 requests served to a target of another vocabulary"):
        other.generate(prompt, assistant_model=drafter, max_new_tokens=4)
    suffix_cache_for(drafter).reset()
    _served(other, drafter, prompt)
    assert len(suffix_cache_for(drafter)) == 1


def test_threads_share_one_store(one_thread):
    """The store takes a lock: requests added from several threads while others match against it all land."""
    store = SuffixStore(max_tokens=400, max_requests=1000)
    settings = SuffixSettings(suffix_cache_num_tokens=8)
    errors: list[BaseException] = []

    def serve(seed: int) -> None:
        try:
            rng = random.Random(seed)
            for _ in range(30):
                candidates = SuffixCandidates(settings, store, None)
                text = [rng.randint(0, 9) for _ in range(3)]
                for _ in range(12):
                    candidates.propose(text)
                    text.append(rng.randint(0, 9))
                candidates.finish(text)
                del candidates
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=serve, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    gc.collect()
    store.flush()
    assert not errors
    assert store.tokens <= 400 and store.index.tokens == store.tokens
    assert sum(map(len, store.requests)) == store.tokens


def test_a_long_remembered_stretch_is_verified_long_under_auto(one_thread, monkeypatch):
    """tree_budget="auto" with the default ladder: once a chain from the store is accepted whole, the next ones are
    verified whole too (neither the chosen budget nor the per-step sizing cuts a chain that keeps being accepted)."""
    target = make_target("llama", vocab_size=64, seed=1)
    # given step times, not the host's (a CPU-like target: 32 nodes cost 1.6 plain steps; the lookups take none)
    ScriptedMachine(monkeypatch).times_target(target, lambda nodes: 0.010 + 0.0002 * nodes)
    prompt = torch.randint(1, 64, (1, 8), generator=torch.Generator().manual_seed(5))
    # the first call teaches nothing (tau 1 everywhere), so whether the second starts with plain steps or with the
    # free candidates' trees is the timings' call: exploring often and freely makes the chain's discovery quick
    # either way; what is tested is what happens after it
    settings = {**SUFFIX, "suffix_cache_num_tokens": 32, "auto_budget_explore_interval": 4,
                "auto_budget_explore_share": 1.0}
    drafter = LookupTreeModel.from_target(target, tree_budget="auto", **settings)
    first = _served(target, drafter, prompt, tokens=100)
    repeat = torch.cat([prompt, first[:, 8:20]], dim=1)
    out = _served(target, drafter, repeat, tokens=80)
    assert out[0].tolist() == first[0, : out.shape[1]].tolist()
    stats = drafter.last_stats
    assert stats.tau > 10 and sorted(stats.accepted_per_iteration)[-2] >= 20, stats.accepted_per_iteration


def test_the_copy_bound_is_hand_computable_and_no_copying_drafter_beats_it(one_thread):
    copy_bound = load_example("suffix_streams").copy_bound
    # prompt 5 1 2 3 4; answer 1 2 3 4 7: the prefill gives "1", one step copies "2 3 4" after the earlier "1" and
    # the target adds "7": 5 tokens in 2 forwards; with 2 nodes "2 3" + "4", then "7": 3 forwards
    request = ([5, 1, 2, 3, 4, 1, 2, 3, 4, 7], 5)
    assert copy_bound([request], node_cap=32) == 5 / 2 and copy_bound([request], node_cap=2) == 5 / 3
    # an answer copied from an earlier request (not from its own prompt) is copyable only after that request
    assert copy_bound([([8, 9, 1, 2, 3, 4], 2), ([7, 1, 2, 3, 4], 1)], node_cap=32) == (4 + 4) / (4 + 2)
    # real decoding: every free source (prompt lookup, n-gram cache, suffix cache within and across requests) at a
    # budget of 8 nodes stays at or under the bound of its own stream, and close to it on this repetitive text
    target = make_target("llama", vocab_size=64, seed=1)
    forwards = []
    target.register_forward_pre_hook(lambda module, args: forwards.append(1))
    drafter = LookupTreeModel.from_target(
        target, tree_budget=8, prompt_lookup_num_tokens=10, ngram_cache_num_tokens=8, suffix_cache_num_tokens=32,
        suffix_local_num_tokens=32,
    )  # fmt: skip
    prompt = torch.randint(1, 64, (1, 8), generator=torch.Generator().manual_seed(5))
    requests, served = [], 0
    for _ in range(3):
        out = _served(target, drafter, prompt, tokens=40)
        requests.append((out[0].tolist(), prompt.shape[1]))
        served += out.shape[1] - prompt.shape[1]
        prompt = torch.cat([prompt[:, :4], out[:, 10:20]], dim=1)  # the next request quotes this answer
    tau, bound = served / len(forwards), copy_bound(requests, node_cap=8)
    assert 1.0 < tau <= bound + 1e-9
