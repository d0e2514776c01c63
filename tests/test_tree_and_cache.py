"""Tree structure, masks, pruning and KV-cache compaction."""

from __future__ import annotations

import itertools

import numpy
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from conftest import make_drafter, make_target
from transformers_specblock.generation import CANDIDATE_GENERATOR_MAPPING, get_candidate_generator
from transformers_specblock.generation.acceptance import greedy_accept
from transformers_specblock.generation.cache_utils import compact_cache
from transformers_specblock.generation.tree import DraftTree, HostTree, tree_verification_mask
from transformers_specblock.models.specblock.modeling_specblock import (
    block_causal_mask,
    followup_block_mask,
    host_block_causal_mask,
)


@st.composite
def random_trees(draw) -> DraftTree:
    """Trees in topological order whose children never score above their parent."""
    n = draw(st.integers(1, 40))
    tree = DraftTree.root_only(draw(st.integers(0, 99)))
    for i in range(1, n):
        parent = draw(st.integers(0, i - 1))
        log_p = -draw(st.floats(0, 5, allow_nan=False))
        tree.add_nodes(
            torch.tensor([draw(st.integers(0, 99))]), torch.tensor([parent]),
            tree.depths[[parent]] + 1, tree.scores[[parent]] + log_p,
        )  # fmt: skip
    return tree


def naive_ancestors(tree: DraftTree, i: int) -> set[int]:
    out = {i}
    while tree.parents[i] >= 0:
        i = int(tree.parents[i])
        out.add(i)
    return out


@settings(max_examples=60, deadline=None, derandomize=True)
@given(random_trees())
def test_ancestor_matrix_and_paths(tree):
    anc = tree.ancestor_matrix()
    paths = tree.path_tokens() if tree.max_depth > 0 else None
    for i in range(len(tree)):
        assert set(anc[i].nonzero().squeeze(1).tolist()) == naive_ancestors(tree, i)
        if paths is not None:
            chain = sorted(naive_ancestors(tree, i) - {0}, key=lambda j: int(tree.depths[j]))
            assert paths[i, : len(chain)].tolist() == tree.tokens[chain].tolist()


@settings(max_examples=60, deadline=None, derandomize=True)
@given(random_trees(), st.integers(1, 45))
def test_prune_keeps_best_nodes_and_their_ancestors(tree, budget):
    pruned = tree.prune(budget)
    assert len(pruned) == min(len(tree), budget + 1)
    assert pruned.tokens[0] == tree.tokens[0] and pruned.parents[0] == -1
    assert bool((pruned.parents[1:] < torch.arange(1, len(pruned))).all())  # parents come first
    assert bool((pruned.depths[1:] == pruned.depths[pruned.parents[1:]] + 1).all())
    # the kept nodes are the highest-scoring ones
    if len(pruned) < len(tree):
        assert pruned.scores.min() >= torch.sort(tree.scores, descending=True).values[budget] - 1e-6


@settings(max_examples=40, deadline=None, derandomize=True)
@given(random_trees(), st.integers(0, 6))
def test_verification_mask_is_prefix_plus_ancestors(tree, prefix):
    visible = torch.ones(prefix, dtype=torch.bool)
    if prefix:
        visible[0] = False  # a left-padding position stays hidden
    mask = tree_verification_mask(tree, visible, torch.float32)[0, 0]
    assert mask.shape == (len(tree), prefix + len(tree))
    allowed = mask == 0
    assert bool((allowed[:, :prefix] == visible).all())
    assert bool((allowed[:, prefix:] == tree.ancestor_matrix()).all())
    assert bool((mask[~allowed] == torch.finfo(torch.float32).min).all())


def test_block_masks():
    mask = block_causal_mask(num_positions=2, block_size=3, past_length=4, device=torch.device("cpu"))
    assert mask.shape == (6, 10)
    assert bool(mask[:, :4].all())
    # position 1 slot 0 sees all of position 0 and its own slot 0 only
    assert mask[3, 4:].tolist() == [True, True, True, True, False, False]
    # position 0 slot 1 sees slots 0..1 of itself, nothing of position 1
    assert mask[1, 4:].tolist() == [True, True, False, False, False, False]
    for num_positions, past_length in ((1, 0), (2, 4), (5, 3)):  # the host-built decoding mask is the same
        host = host_block_causal_mask(num_positions, 3, past_length)
        assert host.tolist() == block_causal_mask(num_positions, 3, past_length, torch.device("cpu")).tolist()
    inherited = numpy.array([[True, False, False], [True, True, False]])
    follow = followup_block_mask(inherited, block_size=2, prefix_length=5, device="cpu")[0]  # [1, R, S]: one sequence
    assert follow.shape == (4, 5 + 3 + 4)
    assert follow[2, 5:8].tolist() == [True, True, False]  # block 1 inherits its own visible entries
    assert follow[1, 8:].tolist() == [True, True, False, False]  # never another new block


def test_slot_inputs_are_kept_between_forwards_until_a_weight_changes():
    """The slots' share of the fusion is kept without gradients and computed afresh after an in-place update (an
    optimizer step, online adaptation, loading weights) or a move to another dtype; with gradients it is never kept."""
    target = make_target("llama", vocab_size=64, seed=2)
    drafter = make_drafter(target)

    def fresh() -> torch.Tensor:
        hidden, target_hidden = drafter.config.hidden_size, drafter.config.target_hidden_size
        query = drafter.query_norm(drafter.slot_queries.weight[:3])
        return torch.nn.functional.linear(query, drafter.fusion.weight[:, hidden + target_hidden :])

    with torch.no_grad():
        kept = drafter.slot_inputs(3)
        assert drafter.slot_inputs(3) is kept and torch.equal(kept, fresh())
        assert drafter.slot_inputs(2).shape[0] == 2 and drafter.slot_inputs(3) is not kept  # another slot count
        for change in (lambda: drafter.slot_queries.weight.add_(0.5), lambda: drafter.query_norm.weight.mul_(2.0),
                       lambda: drafter.fusion.load_state_dict({"weight": drafter.fusion.weight * 3})):  # fmt: skip
            before = drafter.slot_inputs(3)
            change()
            after = drafter.slot_inputs(3)
            assert not torch.equal(after, before) and torch.equal(after, fresh())
        drafter.to(torch.bfloat16)
        assert drafter.slot_inputs(3).dtype == torch.bfloat16 and torch.equal(drafter.slot_inputs(3), fresh())
    drafter.float()
    with torch.enable_grad():
        assert drafter.slot_inputs(3).requires_grad and drafter.slot_inputs(3) is not drafter.slot_inputs(3)


def test_tree_forward_equals_branch_by_branch():
    """One forward over a tree with the tree mask gives each branch's logits and hidden states."""
    target = make_target("llama", vocab_size=64, seed=2)
    prompt = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(2))
    tree = DraftTree.root_only(11)
    tree.add_nodes(torch.tensor([5, 9, 13, 17]), torch.tensor([0, 0, 1, 1]), torch.tensor([1, 1, 2, 2]),
                   torch.tensor([-0.1, -0.2, -0.3, -0.4]))  # fmt: skip
    cache = DynamicCache()
    with torch.no_grad():
        target(prompt, past_key_values=cache, use_cache=True)
        out = target(
            tree.tokens[None], attention_mask=tree_verification_mask(tree, torch.ones(7, dtype=torch.bool), torch.float32),
            position_ids=(7 + tree.depths)[None], past_key_values=cache, output_hidden_states=[3],
        )  # fmt: skip
        for node, branch in {3: [11, 5, 13], 4: [11, 5, 17], 2: [11, 9]}.items():
            full = target(torch.cat([prompt, torch.tensor([branch])], 1), output_hidden_states=[3])
            torch.testing.assert_close(out.logits[0, node], full.logits[0, -1], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(out.hidden_states[3][0, node], full.hidden_states[3][0, -1], atol=1e-4, rtol=1e-4)


def test_compacted_cache_continues_exactly():
    """After keeping an accepted tree path in the cache, decoding continues as if the path had been fed alone."""
    target = make_target("qwen2", vocab_size=64, seed=3)
    prompt = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(3))
    tree = DraftTree.root_only(4)
    tree.add_nodes(torch.tensor([8, 20, 30, 40, 50]), torch.tensor([0, 0, 2, 2, 3]), torch.tensor([1, 1, 2, 2, 3]),
                   -torch.arange(1.0, 6.0))  # fmt: skip
    cache = DynamicCache()
    with torch.no_grad():
        target(prompt, past_key_values=cache, use_cache=True)
        target(
            tree.tokens[None], attention_mask=tree_verification_mask(tree, torch.ones(6, dtype=torch.bool), torch.float32),
            position_ids=(6 + tree.depths)[None], past_key_values=cache,
        )  # fmt: skip
        holds = compact_cache(cache, 6, [[0, 2, 3, 5]])  # root -> 20 -> 30 -> 50
        assert holds.tolist() == [[True] * 4]
        assert cache.get_seq_length() == 6 + 4
        nxt = torch.tensor([[7]])
        continued = target(nxt, past_key_values=cache, position_ids=torch.tensor([[10]])).logits[0, -1]
        fresh = target(torch.cat([prompt, torch.tensor([[4, 20, 30, 50, 7]])], 1)).logits[0, -1]
    torch.testing.assert_close(continued, fresh, atol=1e-4, rtol=1e-4)


def test_greedy_accept_walks_the_matching_path():
    tree = DraftTree.root_only(0)
    tree.add_nodes(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 0, 2, 2]), torch.tensor([1, 1, 2, 2]),
                   -torch.arange(1.0, 5.0))  # fmt: skip
    logits = torch.zeros(5, 6)
    logits[0, 2] = logits[2, 4] = logits[4, 5] = 1.0  # target: root->2, node(2)->4, node(4)->5
    path, bonus = greedy_accept(tree, logits)
    assert path.tolist() == [2, 4] and bonus.tolist() == [5]
    logits[0] = 0
    logits[0, 3] = 1.0  # a token that is no child of the root
    path, bonus = greedy_accept(tree, logits)
    assert path.tolist() == [] and bonus.tolist() == [3]


def test_drafter_cache_keeps_only_committed_entries(monkeypatch):
    """After a whole generate (follow-up blocks and rejected branches included), the drafter's KV cache holds
    exactly the K slot entries of each committed position it has read, equal to reading those positions at once."""
    target = make_target("llama", vocab_size=32, seed=1)
    drafter = make_drafter(target, tree_policy="fixed", fixed_width=3, max_blocks=3, tree_budget=30)
    prompt = torch.randint(0, 32, (1, 9), generator=torch.Generator().manual_seed(1))
    model_type = drafter.config.model_type
    real, generators = CANDIDATE_GENERATOR_MAPPING[model_type], []

    def keep(*args, **kwargs):
        generators.append(real(*args, **kwargs))
        return generators[-1]

    monkeypatch.setitem(CANDIDATE_GENERATOR_MAPPING, model_type, keep)
    out = target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=12)
    stats, (generator,) = drafter.last_stats, generators
    assert stats.iterations >= 4 and max(generator.stats.blocks_per_iteration) > 1  # follow-up blocks were drafted
    # max_blocks=3 costs at most 3 drafter forwards per verification (observe + 2 follow-up rounds)
    assert stats.iterations <= stats.drafter_forwards <= 3 * (stats.iterations + 1)
    block = drafter.config.block_size
    read = generator.committed_entries // block  # committed positions the drafter has read (the last chunk is not)
    assert generator.cache.get_seq_length() == generator.committed_entries == read * block
    assert out.shape[1] - 1 - sum(stats.accepted_per_iteration[-1:]) == read  # all but the last chunk were read
    with torch.no_grad():
        hidden = target(out, output_hidden_states=True).hidden_states
    features = torch.cat([hidden[i][0] for i in drafter.config.feature_layers], dim=-1)
    fresh = get_candidate_generator(drafter)
    fresh.observe(features[:read], out[0, 1 : read + 1], first_position=1)
    assert fresh.cache.get_seq_length() == generator.cache.get_seq_length()
    for kept, once in zip(generator.cache.layers, fresh.cache.layers):
        torch.testing.assert_close(kept.keys, once.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(kept.values, once.values, rtol=1e-4, atol=1e-5)


def test_prompt_read_in_chunks_equals_one_forward():
    target = make_target("llama", vocab_size=24, seed=3)
    drafter = make_drafter(target, max_blocks=2)
    torch.manual_seed(3)
    features = torch.randn(11, 3 * drafter.config.target_hidden_size)
    tokens = torch.randint(1, 24, (11,))
    whole = get_candidate_generator(drafter)
    whole.observe(features, tokens, first_position=1)
    with drafter.tree_settings(prefill_chunk_size=3):
        chunked = get_candidate_generator(drafter)
        chunked.observe(features, tokens, first_position=1)
    assert chunked.stats.drafter_forwards == 4 and whole.stats.drafter_forwards == 1
    assert chunked.committed_entries == whole.committed_entries == 11 * drafter.config.block_size
    for a, b in zip(chunked.root_block, whole.root_block):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    tree_a, tree_b = chunked.draft_tree(torch.tensor([5])), whole.draft_tree(torch.tensor([5]))
    assert tree_a.tokens.tolist() == tree_b.tokens.tolist() and tree_a.parents.tolist() == tree_b.parents.tolist()

    prompt = torch.randint(1, 24, (1, 9), generator=torch.Generator().manual_seed(4))
    reference = target.generate(prompt, max_new_tokens=16, do_sample=False)
    with drafter.tree_settings(prefill_chunk_size=2):
        out = target.generate(prompt, assistant_model=drafter, max_new_tokens=16, do_sample=False)
    assert out.tolist() == reference.tolist()


# --- pruning never drops an ancestor, whatever the float scores (issue: follow-up chains with log-prob 0.0) ---
ADVERSARIAL_LOG_PROBS = [0.0, -0.0, -5e-324, -1e-45, -1e-40, -1e-12, -3e-8, -1e-7, -0.5, -17.0, float("-inf")]


@st.composite
def adversarial_trees(draw) -> DraftTree:
    """Trees whose scores come from float sums with log-probs of 0.0, subnormals, values below one ulp of the start
    score and ties; the scores need not be monotone along a path (a buggy or NaN-producing drafter)."""
    n = draw(st.integers(2, 40))
    tree = DraftTree.root_only(0)
    for i in range(1, n):
        parent = draw(st.integers(0, i - 1))
        own = draw(st.sampled_from(ADVERSARIAL_LOG_PROBS) | st.floats(-3, 1e-6) | st.just(float("nan")))
        start = draw(st.sampled_from([0.0, -1.0, -2.7182817, -13.0, -1e6]))
        score = (tree.scores[parent] + start) + own if parent else torch.tensor(start + own)
        tree.add_nodes(torch.tensor([i]), torch.tensor([parent]), tree.depths[[parent]] + 1, score.reshape(1))
    return tree


@settings(max_examples=300, deadline=None, derandomize=True)
@given(adversarial_trees(), st.integers(1, 40))
def test_prune_keeps_ancestors_under_adversarial_scores(tree, budget):
    pruned = tree.prune(budget)
    assert len(pruned) == min(len(tree), budget + 1)
    assert bool((pruned.parents[1:] >= 0).all()) and bool((pruned.parents[1:] < torch.arange(1, len(pruned))).all())
    assert bool((pruned.depths[1:] == pruned.depths[pruned.parents[1:]] + 1).all())
    order = tree.pruning_order()
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(tree))
    assert bool((rank[1:] > rank[tree.parents[1:]]).all())  # every prefix of the order is a tree


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    st.lists(st.sampled_from(ADVERSARIAL_LOG_PROBS[:-1]) | st.floats(-8.0, 0.0), min_size=4, max_size=4),
    st.floats(-20.0, -0.01),
    st.integers(1, 12),
)
def test_specblock_block_scores_never_exceed_their_parent(slot_log_probs, start_score, budget):
    """A follow-up block started below score 0 whose slots are (nearly) certain: the chain's scores must still be
    monotone, so pruning to any budget keeps every kept node's ancestors."""
    from transformers_specblock.generation.candidate_generators.specblock import _Round

    target = make_target("llama", vocab_size=24, seed=1)
    generator = get_candidate_generator(make_drafter(target, block_size=4))
    tree = HostTree.root_only(0)
    tree.add_node(3, 0, start_score)
    # greedy token 0 takes the slot's adversarial log-prob; the runner-up token 1 gets the rest
    width = generator.max_width
    rnd = _Round(
        log_probs=[[[lp, -30.0] + [-60.0] * (width - 2) for lp in slot_log_probs]],
        tokens=[[list(range(width)) for _ in slot_log_probs]], widths=[[2] * 4], classes=[[1] * 4],
        hidden=torch.zeros(1, 4, 4), entry_offsets=[0], inherited=numpy.zeros((1, 0), dtype=bool), start_nodes=[1],
    )  # fmt: skip
    generator._expand(tree, rnd)
    device_tree = tree.to_device("cpu")
    assert bool((device_tree.scores[1:] <= device_tree.scores[device_tree.parents[1:]]).all())
    for pruned in (tree.prune(budget).to_device("cpu"), device_tree.prune(budget)):
        assert bool((pruned.depths[1:] == pruned.depths[pruned.parents[1:]] + 1).all())


@pytest.mark.parametrize("max_blocks", [2, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_generate_with_a_peaked_drafter_equals_plain_greedy(seed, max_blocks, one_thread):
    """A confident drafter (scaled `lm_head`, as training produces) with follow-up blocks and small budgets (these
    seeds made pruning raise inside generate before scores were built parent + own)."""
    target = make_target("llama", vocab_size=48, seed=seed)
    prompt = torch.randint(1, 48, (1, 8), generator=torch.Generator().manual_seed(seed))
    reference = target.generate(prompt, max_new_tokens=20, do_sample=False)
    for scale in (15.0, 300.0):
        drafter = make_drafter(target, seed=seed, block_size=4, max_blocks=max_blocks, branch_widths=[2, 4, 6, 4])
        with torch.no_grad():
            drafter.lm_head.weight.mul_(scale)
        for budget in (2, 5, 7, 8, 11):
            with drafter.tree_settings(tree_budget=budget):
                out = target.generate(prompt, assistant_model=drafter, max_new_tokens=20, do_sample=False)
            assert out.tolist() == reference.tolist(), (scale, budget)
            assert max(drafter.last_stats.nodes_per_iteration) <= budget


@pytest.mark.parametrize("budget", [1, 5, 12, 40])
def test_grow_best_first_is_the_top_subtree_under_its_start_node(budget):
    """Under a start node inside a tree, positions offering different numbers of candidates: the new nodes are the
    `budget` best paths of the full candidate tree (brute force), parents first, siblings distinct."""
    generator = torch.Generator().manual_seed(0)
    widths = [3, 1, 4, 2]
    log_probs = [sorted((-3 * torch.rand(w, generator=generator)).tolist(), reverse=True) for w in widths]
    token_ids = [torch.randperm(30, generator=generator)[:w].tolist() for w in widths]
    tree = HostTree.root_only(7)
    start = tree.add_node(5, tree.add_node(4, 0, -0.5), -1.25)
    new = tree.grow_best_first(start, log_probs, token_ids, budget)
    paths = [p for d in range(1, len(widths) + 1) for p in itertools.product(*(range(w) for w in widths[:d]))]
    expected = sorted((-1.25 + sum(log_probs[i][r] for i, r in enumerate(p)) for p in paths), reverse=True)
    assert [node for node, _ in new] == list(range(3, 3 + min(budget, len(paths))))
    numpy.testing.assert_allclose(sorted((tree.scores[n] for n, _ in new), reverse=True), expected[:budget], rtol=1e-6)
    for node, position in new:
        assert tree.parents[node] < node and tree.depths[node] == tree.depths[start] + position + 1
        assert tree.tokens[node] in token_ids[position]
    children = [(tree.parents[n], tree.tokens[n]) for n, _ in new]
    assert len(set(children)) == len(children)


@pytest.mark.parametrize("budget", [1, 3, 6, 10, 16, 32, 100])
def test_best_first_blocks_hold_the_best_nodes_the_chain_layout_could(budget):
    """`block_expansion="best_first"` lays out the same block as a tree at least as good, node for node: its k-th
    best score is never below the k-th best of the chain layout pruned to the same budget, and with room for
    everything it holds every chain node's path."""
    from transformers_specblock.generation.candidate_generators.specblock import _Round

    target = make_target("llama", vocab_size=24, seed=1)
    generator = get_candidate_generator(make_drafter(target, block_size=4, tree_budget=budget))
    width = generator.max_width
    slot_log_probs = torch.randn(4, width, generator=torch.Generator().manual_seed(budget)).log_softmax(-1)
    top = slot_log_probs.sort(dim=-1, descending=True)
    rnd = _Round(
        log_probs=top.values.tolist(), tokens=top.indices.tolist(), widths=[[3, 2, 4, 2]], classes=[[1] * 4],
        hidden=torch.zeros(1, 4, 4), entry_offsets=[0], inherited=numpy.zeros((1, 0), dtype=bool), start_nodes=[0],
    )  # fmt: skip
    rnd.log_probs, rnd.tokens = [rnd.log_probs], [rnd.tokens]
    chain, best_first = HostTree.root_only(0), HostTree.root_only(0)
    generator._expand(chain, rnd)
    generator._expand_best_first(best_first, rnd)
    chain = chain.prune(budget)
    every_path = 3 + 3 * 2 + 3 * 2 * 4 + 3 * 2 * 4 * 2
    assert best_first.num_drafted == min(budget, every_path)
    ours, theirs = sorted(best_first.scores[1:], reverse=True), sorted(chain.scores[1:], reverse=True)
    assert all(a >= b - 1e-6 for a, b in zip(ours, theirs))
    if budget >= every_path:

        def paths(tree):
            return {tuple(tree.tokens[a] for a in ancestors(tree, n)) for n in range(1, len(tree))}

        def ancestors(tree, node):
            return ancestors(tree, tree.parents[node]) + [node] if node else []

        assert paths(chain) <= paths(best_first)


@pytest.mark.parametrize("construction", ["package", "reference"])
def test_one_best_first_round_continues_branches_off_the_greedy_chain(construction):
    """With one block round grown best first, a slot-0 candidate other than the greedy one gets children (the
    block's later slots) where they score high enough, and the tree fills the budget; the chain layout never
    continues such a branch."""
    target = make_target("llama", vocab_size=24, seed=1)
    drafter = make_drafter(target, block_size=4, max_blocks=1, tree_budget=12, tree_construction=construction)
    k_slots, vocab = 4, drafter.config.draft_vocab_size
    logits = torch.full((1, k_slots, vocab), -9.0)
    logits[0, 0, :2] = torch.tensor([0.0, -0.1])  # slot 0: two near-equal candidates
    logits[0, 1:, 0] = 4.0  # later slots: one confident candidate each
    rank_logits = torch.zeros(1, k_slots, drafter.config.num_rank_classes)
    rank_logits[..., 1] = 1.0  # rank class 1: a few candidates per slot
    children_of_runner_up = {}
    for expansion in ("chain", "best_first"):
        with drafter.tree_settings(block_expansion=expansion):
            generator = get_candidate_generator(drafter)
            generator.root_block = (logits, torch.zeros(1, k_slots, drafter.config.hidden_size), rank_logits)
            tree = generator.grow_tree(torch.tensor([0]))
        tree = tree.prune(12)
        second = int(drafter.d2t[1])  # slot 0's runner-up, in the target's vocabulary
        runner_up = next(n for n in range(1, len(tree)) if tree.parents[n] == 0 and tree.tokens[n] == second)
        children_of_runner_up[expansion] = sum(parent == runner_up for parent in tree.parents)
        if expansion == "best_first":
            assert tree.num_drafted == 12
    assert children_of_runner_up == {"chain": 0, "best_first": 1}
