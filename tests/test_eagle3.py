"""The in-package EAGLE-3 baseline: config, checkpoints, exact decoding through the shared tree loop, the dynamic
top-k tree, and the training-time-test loss."""

from __future__ import annotations

import itertools

import pytest
import torch
import transformers
from safetensors import safe_open
from transformers import AutoConfig, AutoModel, DynamicCache
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

import test_sampling_lossless as lossless
from conftest import make_target
from transformers_specblock.generation import get_candidate_generator
from transformers_specblock.models.eagle3 import Eagle3Config, Eagle3DraftModel
from transformers_specblock.models.tree_drafter.modeling_tree_drafter import training_stat_names

SMALL_VOCAB = 24


pytestmark = pytest.mark.usefixtures("one_thread")


def make_eagle3(target, seed: int = 0, **overrides) -> Eagle3DraftModel:
    torch.manual_seed(seed + 2000)
    return Eagle3DraftModel.from_target(target, **overrides)


def causal_visibility(num_new: int, past: int) -> torch.BoolTensor:
    return torch.cat([torch.ones(num_new, past, dtype=torch.bool), torch.ones(num_new, num_new).tril().bool()], 1)


# -------------------------------------------------------------------------------------------------------------------
# Config
# -------------------------------------------------------------------------------------------------------------------
def test_model_type_is_not_a_transformers_type():
    assert Eagle3Config.model_type == "eagle3_drafter"
    assert "eagle3_drafter" not in CONFIG_MAPPING_NAMES


@pytest.mark.parametrize(
    "family, build",
    [
        ("llama", lambda: transformers.LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=80,
                                                   num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=8)),
        ("qwen2", lambda: transformers.Qwen2Config(vocab_size=96, hidden_size=48, intermediate_size=80,
                                                   num_attention_heads=6, num_key_value_heads=3, num_hidden_layers=12,
                                                   rope_parameters={"rope_type": "default", "rope_theta": 5e5})),
    ],
)  # fmt: skip
def test_config_from_target(family, build):
    target_config = build()
    config = Eagle3Config.from_target_config(target_config)
    num_layers = target_config.num_hidden_layers
    assert config.target_model_type == family
    assert config.target_layer_ids == [2, num_layers // 2, num_layers - 3]
    sizes = (config.vocab_size, config.draft_vocab_size, config.hidden_size, config.target_hidden_size)
    assert sizes == (96, 96, 48, 48)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
        6, target_config.num_key_value_heads, 8,
    )  # fmt: skip
    assert config.intermediate_size == 80 and config.num_hidden_layers == 1
    theta = float(target_config.rope_parameters["rope_theta"])
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": theta}
    settings = Eagle3DraftModel.default_generation_config(config)  # EAGLE's: total_tokens - 1, top-k 10, depth 7
    assert (settings.tree_budget, settings.tree_top_k, settings.tree_depth) == (59, 10, 7)
    assert (config.ttt_steps, config.ttt_decay) == (7, 0.8)
    custom = Eagle3Config.from_target_config(target_config, draft_vocab_size=32, hidden_size=24)
    assert (custom.draft_vocab_size, custom.hidden_size, custom.head_dim) == (32, 24, 4)


def test_config_rejects_bad_settings():
    target_config = make_target("llama", vocab_size=SMALL_VOCAB).config
    with pytest.raises(ValueError, match="exactly one decoder layer"):
        Eagle3Config.from_target_config(target_config, num_hidden_layers=2)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        Eagle3Config.from_target_config(target_config, draft_vocab_size=SMALL_VOCAB + 1)
    with pytest.raises(ValueError, match="tree_budget"):
        Eagle3Config.from_target_config(target_config, tree_budget=0)
    with pytest.raises(ValueError, match="gpt2"):
        Eagle3Config.from_target_config(transformers.GPT2Config(n_layer=6))


# -------------------------------------------------------------------------------------------------------------------
# Checkpoints
# -------------------------------------------------------------------------------------------------------------------
def _scrambled(target):
    d = make_eagle3(target, seed=3, draft_vocab_size=16, tree_top_k=3, tree_depth=2, tree_budget=12)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.05 * torch.randn_like(p))
        kept = torch.randperm(SMALL_VOCAB, generator=torch.Generator().manual_seed(11))[:16].sort().values
        d.d2t.copy_(kept)
        d.t2d.zero_()
        d.t2d[kept] = True
    return d


def test_save_load_round_trip_without_target_embedding(tmp_path):
    target = make_target("llama", vocab_size=SMALL_VOCAB, seed=1)
    d = _scrambled(target)
    d.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert not any("embed" in key for key in keys), keys
    assert {"d2t", "t2d", "fc.weight", "lm_head.weight", "layer.self_attn.q_proj.weight"} <= keys
    assert (tmp_path / "README.md").exists()

    loaded = Eagle3DraftModel.from_pretrained(tmp_path)
    strip = lambda c: {k: v for k, v in c.to_dict().items() if k != "_name_or_path"}  # noqa: E731
    assert strip(loaded.config) == strip(d.config)
    for key, value in d.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    prompt = torch.tensor([[0, 5, 17, 3, 9]])
    out_a = target.generate(prompt, assistant_model=d, do_sample=False, max_new_tokens=12)
    out_b = target.generate(prompt, assistant_model=loaded, do_sample=False, max_new_tokens=12)
    assert torch.equal(out_a, out_b)
    assert d.last_stats.nodes_per_iteration == loaded.last_stats.nodes_per_iteration

    config = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(config, Eagle3Config) and config.model_type == "eagle3_drafter"
    model = AutoModel.from_pretrained(tmp_path)
    assert isinstance(model, Eagle3DraftModel)
    for key, value in d.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def test_fresh_vocabulary_maps():
    target = make_target("llama", vocab_size=SMALL_VOCAB)
    d = make_eagle3(target, draft_vocab_size=10)
    assert d.d2t.tolist() == list(range(10))
    assert d.t2d.tolist() == [True] * 10 + [False] * (SMALL_VOCAB - 10)


# -------------------------------------------------------------------------------------------------------------------
# Exact decoding through the shared tree loop
# -------------------------------------------------------------------------------------------------------------------
SHAPES = [  # (top_k, depth, tree_budget)
    (1, 1, 1),
    (1, 4, 4),
    (2, 2, 8),
    (2, 4, 32),
    (3, 1, 2),
    (3, 3, 16),
    (4, 2, 12),
    (4, 4, 32),
]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "k{}-depth{}-budget{}".format(*s))
def test_greedy_equals_target(family, shape):
    top_k, depth, budget = shape
    chunks = []
    for seed in range(3):
        target = make_target(family, vocab_size=SMALL_VOCAB, seed=seed)
        d = make_eagle3(target, seed=seed, tree_top_k=top_k, tree_depth=depth, tree_budget=budget)
        prompt = torch.randint(1, SMALL_VOCAB, (1, 5 + seed), generator=torch.Generator().manual_seed(seed))
        extra = dict(repetition_penalty=1.5) if seed == 2 else {}
        reference = target.generate(prompt, do_sample=False, max_new_tokens=30, **extra)
        tree = target.generate(prompt, assistant_model=d, do_sample=False, max_new_tokens=30, **extra)
        assert tree.tolist() == reference.tolist(), f"seed {seed}"
        stats = d.last_stats
        assert max(stats.nodes_per_iteration) <= budget
        # one observe forward per verified iteration + one forward per expansion round that can survive pruning
        rounds = min(depth, budget - 1)
        assert stats.iterations * (1 + min(rounds, 1)) <= stats.drafter_forwards <= stats.iterations * (1 + rounds)
        chunks += stats.accepted_per_iteration
    assert max(chunks) >= 2, "no iteration accepted a drafted token: the test lost its teeth"


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_with_logits_processors(family):
    settings = [dict(repetition_penalty=0.7), dict(no_repeat_ngram_size=2, min_new_tokens=10)]
    for seed, extra in itertools.product(range(2), settings):
        target = make_target(family, vocab_size=SMALL_VOCAB, seed=seed, eos_token_id=3)
        d = make_eagle3(target, seed=seed, tree_top_k=4, tree_depth=3, tree_budget=24)
        prompt = torch.randint(4, SMALL_VOCAB, (1, 6), generator=torch.Generator().manual_seed(seed))
        reference = target.generate(prompt, do_sample=False, max_new_tokens=25, **extra)
        tree = target.generate(prompt, assistant_model=d, do_sample=False, max_new_tokens=25, **extra)
        assert tree.tolist() == reference.tolist(), f"seed {seed}, {extra}"


def test_eager_target_and_generator_overrides():
    target = make_target("llama", vocab_size=SMALL_VOCAB, seed=1, attn="eager")
    d = make_eagle3(target, tree_top_k=4, tree_depth=3, tree_budget=24)
    d.config._attn_implementation = "eager"
    prompt = torch.randint(1, SMALL_VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
    reference = target.generate(prompt, do_sample=False, max_new_tokens=30)
    assert target.generate(prompt, assistant_model=d, do_sample=False, max_new_tokens=30).tolist() == reference.tolist()
    generator = get_candidate_generator(d, top_k=2, depth=5, tree_budget=7)
    assert (generator.top_k, generator.depth, generator.tree_budget) == (2, 5, 7)
    assert get_candidate_generator(d, top_k=10**6).top_k == SMALL_VOCAB  # clamped to the draft vocabulary


@pytest.fixture(scope="module")
def sampling_setup():
    target = make_target("llama", vocab_size=lossless.VOCAB, seed=3, initializer_range=0.08)
    d = make_eagle3(target, tree_top_k=3, tree_depth=2, tree_budget=10)
    return target, d, lossless.exact_marginals(target)


def test_sampling_matches_target_distribution(sampling_setup, monkeypatch):
    target, d, marginals = sampling_setup
    monkeypatch.setattr(lossless, "NUM_SAMPLES", 800)
    counts = lossless.sample_counts(target, d, seed=0)
    assert d.last_stats.iterations >= 1
    pvalues = lossless.fit_pvalues(counts, marginals)
    assert min(pvalues) > lossless.ALPHA, f"p-values {pvalues}"


# -------------------------------------------------------------------------------------------------------------------
# The dynamic tree
# -------------------------------------------------------------------------------------------------------------------
def _observed_generator(top_k, depth, budget, seed=0):
    """(drafter, generator, features, tokens, target): the caller keeps the target alive (a drafter binds it weakly)."""
    target = make_target("llama", vocab_size=SMALL_VOCAB, seed=seed)
    d = make_eagle3(target, seed=seed, tree_top_k=top_k, tree_depth=depth, tree_budget=budget)
    d.bind_target(target)
    generator = get_candidate_generator(d)
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(6, 3 * target.config.hidden_size, generator=g)
    tokens = torch.randint(0, SMALL_VOCAB, (6,), generator=g)
    with torch.no_grad():
        generator.observe(features[:4], tokens[:4], first_position=1)  # two observe calls: the cache persists
        generator.observe(features[4:], tokens[4:], first_position=5)
    return d, generator, features, tokens, target


@pytest.mark.parametrize("top_k, depth, budget", [(1, 3, 100), (3, 0, 100), (3, 3, 100), (4, 2, 100), (3, 4, 9)])
def test_tree_shape_forwards_and_cache(top_k, depth, budget):
    d, generator, _, tokens, _target = _observed_generator(top_k, depth, budget)
    committed = generator.cache.get_seq_length()
    assert committed == 6
    before = generator.stats.drafter_forwards
    with torch.no_grad():
        tree = generator.draft_tree(tokens)
    rounds = generator.stats.blocks_per_iteration[-1]
    assert generator.stats.drafter_forwards - before == rounds
    assert rounds == min(depth, budget - 1) or budget < top_k + rounds * top_k * top_k  # stopped: could not survive
    assert generator.cache.get_seq_length() == committed  # temporary entries cropped
    assert tree.num_drafted == min(budget, top_k + rounds * top_k * top_k)
    assert tree.max_depth <= rounds + 1
    assert bool((tree.depths[1:] == tree.depths[tree.parents[1:]] + 1).all())
    assert bool((tree.scores[1:] <= tree.scores[tree.parents[1:]]).all())
    for node in range(len(tree)):  # siblings are distinct tokens (greedy acceptance relies on it)
        kids = tree.children_of(node)
        assert len(set(tree.tokens[kids].tolist())) == kids.numel()


def test_tree_scores_match_sequential_drafting():
    """Every node's log-prob, recomputed by drafting its path alone (context, then one ancestor per step, each fed
    the hidden of the position that produced it), equals the score increment the batched tree assigned it; and the
    expanded nodes are the top-k of their level."""
    top_k, depth = 4, 3
    d, generator, features, tokens, _target = _observed_generator(top_k, depth, budget=1000, seed=2)
    with torch.no_grad():
        tree = generator.draft_tree(tokens)
        for node in range(1, len(tree)):
            path = []
            cur = node
            while cur > 0:
                path.append(cur)
                cur = int(tree.parents[cur])
            path.reverse()
            cache = DynamicCache()
            out = d.draft_step(d.fuse_features(features)[None], tokens[None], torch.arange(1, 7)[None],
                               causal_visibility(6, 0)[None], cache)  # fmt: skip
            hidden = out.hidden_states[:, -1:]
            log_probs = out.logits[0, -1].float().log_softmax(-1)
            for step, ancestor in enumerate(path[:-1]):  # feed the ancestors one by one
                out = d.draft_step(hidden, tree.tokens[ancestor].view(1, 1), torch.tensor([[6 + step + 1]]),
                                   torch.ones(1, 1, 7 + step, dtype=torch.bool), cache)  # fmt: skip
                hidden = out.hidden_states
                log_probs = out.logits[0, -1].float().log_softmax(-1)
            increment = tree.scores[node] - (tree.scores[path[-2]] if len(path) > 1 else 0.0)
            draft_id = int((d.d2t == tree.tokens[node]).nonzero())
            torch.testing.assert_close(increment, log_probs[draft_id], atol=1e-5, rtol=0)
    # expanded nodes at each level are the top-k by cumulative score among that level's nodes
    for level in range(1, depth + 1):
        nodes = (tree.depths == level).nonzero().squeeze(1)
        best = set(nodes[tree.scores[nodes].topk(top_k).indices].tolist())
        has_kids = {n for n in nodes.tolist() if tree.children_of(n).numel() > 0}
        assert has_kids == best
        if level > 1:  # the frontier mixes parents, so a node paired with the wrong hidden / ancestors would show
            assert len(set(tree.parents[sorted(best)].tolist())) >= 3


# -------------------------------------------------------------------------------------------------------------------
# Training-time test
# -------------------------------------------------------------------------------------------------------------------
def _training_batch(target, batch=2, length=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, SMALL_VOCAB, (batch, length), generator=g)
    layer_ids = [2, 3, 3]
    with torch.no_grad():
        out = target(input_ids, output_hidden_states=True)
    features = torch.cat([out.hidden_states[i] for i in layer_ids], dim=-1)
    attention_mask = torch.ones(batch, length, dtype=torch.bool)
    attention_mask[batch - 1, length - 3 :] = batch == 1  # right padding (on the last row of a batch)
    loss_mask = attention_mask.clone()
    loss_mask[:, :3] = False  # "prompt" tokens
    return dict(
        input_ids=input_ids, features=features, attention_mask=attention_mask, loss_mask=loss_mask,
        target_logits=out.logits, target_argmax=out.logits.argmax(-1),
    )  # fmt: skip


def test_step0_loss_is_hand_computed_soft_ce():
    target = make_target("llama", vocab_size=SMALL_VOCAB, seed=4)
    d = make_eagle3(target, draft_vocab_size=16)
    kept = torch.randperm(SMALL_VOCAB, generator=torch.Generator().manual_seed(5))[:16].sort().values
    d.d2t.copy_(kept)
    d.t2d.zero_()
    d.t2d[kept] = True
    batch = _training_batch(target, batch=1, length=7, seed=1)
    batch["attention_mask"][:] = True
    batch["loss_mask"] = torch.tensor([[0, 0, 1, 1, 1, 0, 1]], dtype=torch.bool)
    argmax = batch["target_argmax"].clone()
    argmax[0, 3] = int((~d.t2d).nonzero()[0])  # target's pick outside the draft vocabulary: skipped
    batch["target_argmax"] = argmax
    full_logits = batch["target_logits"]
    batch["target_logits"] = full_logits[..., kept]  # the target's logits over the draft vocabulary
    out = d(**batch, ttt_steps=3)

    # step 0 via the inference path: positions 0..5, causal, hidden = fc(features)
    with torch.no_grad():
        ref = d.draft_step(d.fuse_features(batch["features"][:, :6]), batch["input_ids"][:, 1:],
                           torch.arange(1, 7)[None], causal_visibility(6, 0)[None])  # fmt: skip
    terms = []
    for i in range(5):  # slot i predicts x_{i+2}, whose target distribution is position i+1
        j = i + 1
        if not bool(batch["loss_mask"][0, j + 1]) or not bool(d.t2d[argmax[0, j]]):
            continue
        p = full_logits[0, j, kept].softmax(-1)
        terms.append(-(p * ref.logits[0, i].log_softmax(-1)).sum())
    assert len(terms) == 2  # i = 1 (x_3) and i = 4 (x_6); i = 2 skipped: argmax outside the draft vocabulary
    torch.testing.assert_close(out.step_losses[0], torch.stack(terms).mean(), atol=1e-5, rtol=1e-5)
    expected = sum(0.8**s * out.step_losses[s] for s in range(3))
    torch.testing.assert_close(out.loss, expected)
    assert out.stats.shape[0] == len(training_stat_names(3))
    # target logits over the full vocabulary give the same loss (the draft columns are taken)
    full = d(**{**batch, "target_logits": full_logits}, ttt_steps=3)
    torch.testing.assert_close(full.loss, out.loss)


def test_ttt_steps_equal_inference_chains():
    """Step s of slot i in the TTT pass equals drafting a chain at inference: context 0..i, then the ground-truth
    tokens x_{i+2}..x_{i+1+s} fed one per forward, each with the previous output's hidden, seeing its ancestors."""
    target = make_target("qwen2", vocab_size=SMALL_VOCAB, seed=6)
    d = make_eagle3(target)
    batch = _training_batch(target, batch=1, length=9, seed=3)
    steps = 4
    with torch.no_grad():
        out = d(**batch, ttt_steps=steps, return_all_steps=True)
        ids, feats = batch["input_ids"][0], batch["features"][0]
        for i in range(0, 6):
            cache = DynamicCache()
            chain = d.draft_step(d.fuse_features(feats[: i + 1])[None], ids[1 : i + 2][None],
                                 torch.arange(1, i + 2)[None], causal_visibility(i + 1, 0)[None], cache)  # fmt: skip
            torch.testing.assert_close(out.all_logits[0][0, i], chain.logits[0, -1], atol=1e-5, rtol=1e-4)
            hidden = chain.hidden_states[:, -1:]
            for s in range(1, steps):
                if i + 1 + s > 8:
                    break
                chain = d.draft_step(hidden, ids[i + 1 + s].view(1, 1), torch.tensor([[i + 1 + s]]),
                                     torch.ones(1, 1, i + 1 + s, dtype=torch.bool), cache)  # fmt: skip
                hidden = chain.hidden_states
                torch.testing.assert_close(out.all_logits[s][0, i], chain.logits[0, -1], atol=1e-5, rtol=1e-4)


def _entropy_floor(batch, steps: int, decay: float = 0.8) -> float:
    """The loss a perfect drafter reaches: the weighted, masked mean entropy of the target's distributions."""
    p = batch["target_logits"].float().softmax(-1)
    entropy = -(p * p.clamp(min=1e-30).log()).sum(-1)  # [B, T]
    counted = batch["loss_mask"] & batch["attention_mask"]
    length = entropy.shape[1]
    floor = 0.0
    for s in range(steps):
        j = torch.arange(1 + s, length - 1)  # target positions whose predicted token x_{j+1} exists
        mask = counted[:, j + 1]
        floor += decay**s * float((entropy[:, j] * mask).sum() / mask.sum())
    return floor


def test_ttt_loss_decreases():
    target = make_target("llama", vocab_size=SMALL_VOCAB, seed=7)
    d = make_eagle3(target, ttt_steps=4).train()
    batch = _training_batch(target, batch=4, length=12, seed=4)
    floor = _entropy_floor(batch, steps=4)
    optimizer = torch.optim.AdamW(d.parameters(), lr=1e-2, betas=(0.9, 0.95))
    losses = []
    for _ in range(30):
        loss = d(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(d.parameters(), 0.5)
        optimizer.step()
        losses.append(float(loss.detach()))
    assert min(losses) >= floor - 1e-4  # soft CE never goes below the target's entropy
    assert losses[-1] - floor < 0.3 * (losses[0] - floor), (floor, losses)
    assert all(b < a for a, b in zip(losses[:-1], losses[1:])), losses
    # the target embedding stays frozen and out of the drafter's parameters
    assert target.get_input_embeddings().weight.grad is None
    assert all("embed" not in name for name, _ in d.named_parameters())
