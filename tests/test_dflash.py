"""DFlash drafter: transformers' own chain path (speculation_type="dflash") and this package's tree loop.

Both must reproduce plain greedy decoding exactly; the tree loop must keep the target's sampling distribution; the
drafter's cached context must give the same block as reading the whole context at once; bad settings are refused.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import AutoModel

from conftest import make_target
from test_sampling_lossless import ALPHA, PROMPT, exact_marginals, fit_pvalues, sample_counts
from transformers_specblock import DFlashConfig, DFlashDraftModel
from transformers_specblock.generation.candidate_generators import DFlashCandidateGenerator, get_candidate_generator
from transformers_specblock.generation.candidate_generators.dflash import best_first_tree
from transformers_specblock.utils import CACHE_ARGUMENT

PROMPTS = [torch.tensor([[0, 5, 9, 17, 3]]), torch.tensor([[0, 44, 2, 2, 2, 2, 71, 8, 30]])]


def make_dflash(target, seed: int = 0, **overrides) -> DFlashDraftModel:
    """A random DFlash drafter for `target` (the last vocabulary id as its mask token)."""
    settings = dict(mask_token_id=target.config.vocab_size - 1, block_size=4, num_hidden_layers=2, tree_budget=8)
    torch.manual_seed(seed + 2000)
    return DFlashDraftModel.from_target(target, **{**settings, **overrides})


class ForwardCounter:
    """Counts (and records the inputs / outputs of) the drafter's forward calls."""

    def __init__(self, drafter: DFlashDraftModel) -> None:
        self.calls: list[tuple[dict, torch.Tensor]] = []
        self.handle = drafter.register_forward_hook(self.record, with_kwargs=True)

    def record(self, module, args, kwargs, output) -> None:
        self.calls.append((dict(kwargs), output.last_hidden_state.detach().clone()))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_transformers_chain_path_equals_plain_greedy(family, one_thread):
    target = make_target(family, vocab_size=128)
    drafter = make_dflash(target)
    counter = ForwardCounter(drafter)
    for prompt in PROMPTS:
        plain = target.generate(prompt, do_sample=False, max_new_tokens=40)
        chain = target.generate(prompt, do_sample=False, max_new_tokens=40, assistant_model=drafter,
                                speculation_type="dflash")  # fmt: skip
        assert chain.tolist() == plain.tolist()
    # transformers' DFlashTokenCandidateGenerator called the drafter (with its own DFlashCache, under the name the
    # release passes it), not the tree loop; the drafter read the committed context into that cache
    assert counter.calls and drafter.last_stats is None
    cache = counter.calls[-1][0][CACHE_ARGUMENT]
    assert type(cache).__name__ == "DFlashCache" and cache.get_seq_length() > 0


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("settings", [dict(tree_budget=8), dict(tree_budget=24, tree_top_k=3, block_size=6),
                                      dict(tree_budget="auto", auto_budget_candidates=[0, 2, 8])])  # fmt: skip
def test_tree_greedy_equals_plain(family, settings, one_thread):
    target = make_target(family, vocab_size=128)
    drafter = make_dflash(target, **settings)
    for prompt in PROMPTS:
        plain = target.generate(prompt, do_sample=False, max_new_tokens=40)
        tree = target.generate(prompt, do_sample=False, max_new_tokens=40, assistant_model=drafter)
        assert tree.tolist() == plain.tolist()
        stats = drafter.last_stats
        assert stats.iterations > 0 and stats.drafter_forwards <= stats.iterations  # one block forward per tree
        if settings["tree_budget"] != "auto":
            assert max(stats.nodes_per_iteration) == settings["tree_budget"]


def test_cached_context_equals_one_shot_forward(one_thread):
    """Every block drafted from the cache equals a fresh forward over all committed context at once."""
    target = make_target("llama", vocab_size=128)
    drafter = make_dflash(target, tree_budget=6)
    counter = ForwardCounter(drafter)
    target.generate(PROMPTS[1], do_sample=False, max_new_tokens=30, assistant_model=drafter)
    counter.handle.remove()
    assert len(counter.calls) >= 3
    contexts = []
    for kwargs, block_out in counter.calls:
        contexts.append(kwargs["context_hidden_states"])
        context = torch.cat(contexts, dim=1)
        positions = torch.arange(context.shape[1] + drafter.config.block_size)[None]
        with torch.no_grad():
            fresh = drafter(noise_embeds=kwargs["noise_embeds"], context_hidden_states=context, position_ids=positions)
        torch.testing.assert_close(fresh.last_hidden_state, block_out, rtol=1e-5, atol=1e-5)
        assert kwargs["position_ids"][0, 0] == positions[0, context.shape[1] - contexts[-1].shape[1]]


def test_best_first_tree_is_the_top_subtree():
    """The heap tree holds exactly the `budget` best paths of the full candidate tree (brute force)."""
    generator = torch.Generator().manual_seed(0)
    depth, top_k, budget = 4, 3, 17
    log_probs = torch.randn(depth, top_k, generator=generator).sort(dim=-1, descending=True).values - 3
    token_ids = torch.randint(0, 50, (depth, top_k), generator=generator)
    paths = [p for d in range(1, depth + 1) for p in itertools.product(range(top_k), repeat=d)]
    path_score = {p: float(sum(log_probs[i, r] for i, r in enumerate(p))) for p in paths}
    expected = sorted(path_score.values(), reverse=True)[:budget]
    tree = best_first_tree(log_probs, token_ids, budget).to_device("cpu", root=torch.tensor([7]))
    assert tree.num_drafted == budget and int(tree.tokens[0]) == 7
    torch.testing.assert_close(tree.scores[1:].sort(descending=True).values, torch.tensor(expected))
    assert bool((tree.parents[1:] < torch.arange(1, budget + 1)).all())  # parents come first
    assert bool((tree.scores[1:] <= tree.scores[tree.parents[1:]]).all())
    for node in range(1, budget + 1):  # a node's token is a candidate of its depth's position
        assert int(tree.tokens[node]) in token_ids[int(tree.depths[node]) - 1].tolist()
    for node in range(budget + 1):  # siblings distinct
        kids = tree.tokens[tree.parents == node]
        assert kids.unique().numel() == kids.numel()


def test_tree_sampling_matches_target_distribution(one_thread):
    target = make_target("llama", vocab_size=8, seed=3, initializer_range=0.08)
    drafter = make_dflash(target, mask_token_id=0, block_size=4, tree_top_k=3, tree_budget=8)
    counts = sample_counts(target, drafter, seed=0)
    assert drafter.last_stats.iterations >= 1
    pvalues = fit_pvalues(counts, exact_marginals(target))
    assert min(pvalues) > ALPHA, f"p-values {pvalues}"


def test_save_and_auto_load_round_trip(tmp_path, one_thread):
    target = make_target("llama", vocab_size=128)
    drafter = make_dflash(target)
    drafter.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path)
    assert isinstance(loaded, DFlashDraftModel) and loaded.config.mask_token_id == 127
    card = (tmp_path / "README.md").read_text()  # the generated card says what a DFlash drafter reads
    assert "reads the outputs of target layers [1, 3], its input embedding and its `lm_head`" in card
    plain = target.generate(PROMPTS[0], do_sample=False, max_new_tokens=20)
    for speculation_type in (None, "dflash"):
        out = target.generate(PROMPTS[0], do_sample=False, max_new_tokens=20, assistant_model=loaded,
                              speculation_type=speculation_type)  # fmt: skip
        assert out.tolist() == plain.tolist()


def test_bad_settings_are_refused():
    target = make_target("llama", vocab_size=128)
    with pytest.raises(ValueError, match="needs mask_token_id"):
        DFlashDraftModel.from_target(target, tree_budget=8)
    with pytest.raises(ValueError, match="mask_token_id 500 lies outside"):
        make_dflash(target, mask_token_id=500)
    with pytest.raises(ValueError, match="block_size must be an int >= 2"):
        make_dflash(target, block_size=1)
    with pytest.raises(ValueError, match="exceeds the 4 nodes a block of 2"):  # depth 1, top-4: 4 nodes at most
        make_dflash(target, block_size=2, tree_top_k=4, tree_budget=8)
    with pytest.raises(ValueError, match="exceeds the 6 nodes"):  # "auto" checks its largest candidate
        make_dflash(target, block_size=3, tree_top_k=2, tree_budget="auto")
    with pytest.raises(ValueError, match="must equal the target's"):
        make_dflash(target, hidden_size=32)
    with pytest.raises(ValueError, match=r"target_layer_ids \[9\] must name decoder layers 0..5"):
        make_dflash(target, target_layer_ids=[9])
    drafter = make_dflash(target, block_size=3, tree_top_k=2, tree_budget=4)
    with pytest.raises(ValueError, match="tree_budget=7 exceeds the 6 nodes"):
        get_candidate_generator(drafter, tree_budget=7)
    assert isinstance(get_candidate_generator(drafter, tree_budget=6), DFlashCandidateGenerator)
    with pytest.raises(ValueError, match="tree_budget=5 exceeds the 2 nodes .* top_k=1"):  # an explicit top_k counts
        get_candidate_generator(drafter, tree_budget=5, top_k=1)


def test_default_target_layers_follow_dflash():
    """Published rule: one layer per drafter layer, spread over 1 .. L-3 (36-layer Qwen3-8B, 5 layers: 1..33)."""
    config = DFlashConfig(target_num_hidden_layers=36, num_hidden_layers=5, mask_token_id=0, hidden_size=64,
                          num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    assert config.target_layer_ids == [1, 9, 17, 25, 33]
    assert config.feature_layers == [2, 10, 18, 26, 34]  # hidden_states[i + 1]: the outputs of those layers
    assert DFlashConfig(target_num_hidden_layers=30, mask_token_id=0).target_layer_ids == [15]


@pytest.mark.slow  # loads the packaged SmolLM2-135M-Instruct (float32)
def test_smollm2_chain_and_tree_equal_plain_greedy(one_thread):
    from transformers_specblock import load_packaged_model, load_prompts

    target, tokenizer = load_packaged_model("smollm2-135m-instruct")
    mask = tokenizer.convert_tokens_to_ids("<empty_output>")  # a special token the chat model never emits
    drafter = DFlashDraftModel.from_target(target, mask_token_id=mask, num_hidden_layers=2, tree_budget=16)
    assert drafter.config.target_layer_ids == [1, 27]
    for text in load_prompts("mt_bench", num_prompts=2, tokenizer=tokenizer)["text"]:
        inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        plain = target.generate(**inputs, do_sample=False, max_new_tokens=24)
        chain = target.generate(**inputs, do_sample=False, max_new_tokens=24, assistant_model=drafter,
                                speculation_type="dflash")  # fmt: skip
        tree = target.generate(**inputs, do_sample=False, max_new_tokens=24, assistant_model=drafter)
        assert chain.tolist() == plain.tolist() and tree.tolist() == plain.tolist()
        assert max(drafter.last_stats.nodes_per_iteration) == 16


def test_benchmark_methods_dflash_and_dflash_chain(tmp_path, one_thread):
    """`--methods dflash,dflash_chain`: one drafter, our tree and transformers' chain, both equal plain greedy; the
    chain rows carry no tree statistics (not the previous tree run's)."""
    import datasets

    from test_greedy_exactness import letter_tokenizer
    from transformers_specblock.commands.benchmark import run_benchmark
    from transformers_specblock.commands.cli import BenchArguments, build_methods

    target = make_target("llama", vocab_size=24, seed=2)
    make_dflash(target, mask_token_id=23).save_pretrained(tmp_path / "dflash")
    folder = str(tmp_path / "dflash")
    args = BenchArguments(target_model="tiny", methods="plain,dflash@6,dflash_chain", dflash_model=folder)
    methods = build_methods(args, target)
    assert [m.name for m in methods] == ["dflash@6", "dflash_chain"] and methods[0].tree_settings == {"tree_budget": 6}
    assert methods[0].generate_kwargs["assistant_model"] is methods[1].generate_kwargs["assistant_model"]
    assert methods[1].generate_kwargs["speculation_type"] == "dflash"
    prompts = datasets.Dataset.from_list(
        [{"id": f"p{i}", "category": "writing", "prompt": t, "text": t} for i, t in enumerate(["abcab", "hgfhgf"])]
    )
    results = run_benchmark(target, letter_tokenizer(24), prompts, methods, max_new_tokens=12, warmup_tokens=4)
    assert all(r.identical_to_reference for r in results.prompts)
    rows = {r.method: r for r in results.prompts}
    assert rows["dflash@6"].tau is not None and rows["dflash@6"].nodes_verified > 0 and rows["dflash_chain"].tau is None


def test_left_padded_prompt_in_both_paths(one_thread):
    """A left-padded prompt: transformers' chain passes a 2D mask with zeros (turned into a 4D one); our loop drops
    the padding from the context. Both equal plain greedy."""
    target = make_target("llama", vocab_size=128)
    drafter = make_dflash(target)
    ids, mask = torch.tensor([[0, 0, 5, 9, 17, 3]]), torch.tensor([[0, 0, 1, 1, 1, 1]])
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30)
    for speculation_type in (None, "dflash"):
        out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30, assistant_model=drafter,
                              speculation_type=speculation_type)  # fmt: skip
        assert out.tolist() == plain.tolist()
