"""Public API of transformers_specblock: checkpoints, Auto classes, config derivation, the generate() entries and
their outputs (scores / logits / streamers / stats), and that stock generation is left untouched."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from safetensors import safe_open
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, GenerationMixin
from transformers.generation.streamers import BaseStreamer

import transformers_specblock
from conftest import make_drafter, make_target
from deep_oracle import install_deep_oracle
from transformers_specblock import CUSTOM_GENERATE_DIR, SpecBlockConfig, SpecBlockDraftModel, SpecBlockStats
from transformers_specblock.generation import integration as specblock_generation

VOCAB = 128
PROMPT = torch.tensor([[0, 5, 17, 33, 2, 9]])


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return make_target("llama", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def drafter(target):
    """A random drafter: its drafts are almost never accepted, so every iteration commits one token."""
    return make_drafter(target)


def make_oracle(target) -> SpecBlockDraftModel:
    """A drafter that proposes EVERY token as a child of the root (one slot, width = vocabulary, budget = vocabulary).

    Whatever the target's next token is, it is in the tree, so greedy acceptance must commit exactly 2 tokens per
    iteration (1 drafted + the bonus): the multi-token paths of the loop are exercised with a random target.
    """
    vocab = target.config.vocab_size
    return make_drafter(
        target, block_size=1, max_blocks=1, tree_policy="fixed", fixed_width=vocab, tree_budget=vocab
    )


@pytest.fixture(scope="module")
def oracle(target):
    return make_oracle(target)


@pytest.fixture(scope="module")
def deep_drafter(target):
    """A real SpecBlock drafter (3 slots of width 2 per block, block 1 + one round of follow-up blocks) that
    `use_deep_oracle` turns into an oracle: its trees also hold the target's greedy continuation 1-4 tokens deep."""
    return make_drafter(target, block_size=3, max_blocks=2, tree_policy="fixed", fixed_width=2, tree_budget=24)


def use_deep_oracle(monkeypatch, target, drafter, prompt=PROMPT, **kwargs):
    """Graft the target's own greedy continuation of `prompt` (under `kwargs`: the same logits processors) into
    `drafter`'s trees for the next `generate` calls (see tests/deep_oracle.py)."""
    reference = greedy(target, prompt, max_new_tokens=40, **kwargs)[0]
    return install_deep_oracle(monkeypatch, drafter, reference)


def assert_deep_chunks(drafter, generators) -> None:
    """Every iteration but the last (which max_new_tokens or a stop may cut) committed at least the oracle's chunk
    (its grafted depth + the bonus token: 4, 2, 5, 3, ...), so most commit 3+ tokens; the trees really held
    follow-up blocks."""
    accepted = drafter.last_stats.accepted_per_iteration
    depths = generators[-1].depths
    short = [(i, a) for i, a in enumerate(accepted[:-1]) if a < depths[i % len(depths)] + 1]
    assert not short and sum(a >= 3 for a in accepted) > len(accepted) / 2, (short, accepted)
    assert generators and max(b for g in generators for b in g.stats.blocks_per_iteration) > 1


def greedy(model, input_ids=PROMPT, max_new_tokens=9, **kwargs):
    return model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)


def assert_patched(installed: bool) -> None:
    patched = GenerationMixin._assisted_decoding is specblock_generation._assisted_decoding
    assert patched == installed
    assert (GenerationMixin._validate_generation_mode is specblock_generation._validate_generation_mode) == installed


# -------------------------------------------------------------------------------------------------------------------
# Checkpoints
# -------------------------------------------------------------------------------------------------------------------
def _scrambled_drafter(target, draft_vocab_size):
    """A drafter whose weights and vocabulary maps differ from any fresh initialisation."""
    d = make_drafter(target, seed=3, draft_vocab_size=draft_vocab_size)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.05 * torch.randn_like(p))
    if draft_vocab_size is not None:
        g = torch.Generator().manual_seed(11)
        kept = torch.randperm(target.config.vocab_size, generator=g)[:draft_vocab_size].sort().values
        d.d2t.copy_(kept)
        d.t2d.zero_()
        d.t2d[kept] = True
    return d


@pytest.mark.parametrize("draft_vocab_size", [None, 64])
def test_saved_checkpoint_holds_no_target_embedding(tmp_path, target, draft_vocab_size):
    d = _scrambled_drafter(target, draft_vocab_size)
    d.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    assert path.is_file()
    embedding = target.get_input_embeddings().weight.detach()
    with safe_open(str(path), "pt") as f:
        keys = list(f.keys())
        tensors = {k: f.get_tensor(k) for k in keys}
    assert "d2t" in keys and "t2d" in keys
    assert torch.equal(tensors["d2t"], d.d2t) and torch.equal(tensors["t2d"], d.t2d)
    for key in keys:
        assert "embed" not in key.lower() and "target" not in key.lower(), key
    for key, tensor in tensors.items():
        for candidate in (tensor, tensor.T if tensor.dim() == 2 else tensor):
            if candidate.shape == embedding.shape:
                assert not torch.allclose(candidate.float(), embedding.float()), f"{key} stores the target embedding"
    # the saved tensors are exactly the drafter's own state (plus nothing else)
    assert set(keys) == set(d.state_dict().keys())


@pytest.mark.parametrize("draft_vocab_size", [None, 64])
def test_from_pretrained_round_trip(tmp_path, target, draft_vocab_size):
    d = _scrambled_drafter(target, draft_vocab_size)
    d.save_pretrained(tmp_path)
    loaded = SpecBlockDraftModel.from_pretrained(tmp_path)
    assert not loaded.training
    original_state, loaded_state = d.state_dict(), loaded.state_dict()
    assert original_state.keys() == loaded_state.keys()
    for key, value in original_state.items():
        assert loaded_state[key].dtype == value.dtype, key
        assert torch.equal(loaded_state[key], value), key
    ignore = {"transformers_version": None, "_name_or_path": None}
    assert loaded.config.to_dict() | ignore == d.config.to_dict() | ignore

    # a reloaded drafter is unbound until bind_target (or generate) binds it
    with pytest.raises(RuntimeError, match="bind_target"):
        _ = loaded.target_embedding
    loaded.bind_target(target)

    # same drafts: the teacher-forced forward matches bit for bit ...
    torch.manual_seed(5)
    ids = torch.randint(0, VOCAB, (1, 7))
    features = torch.randn(1, 7, 3 * target.config.hidden_size)
    with torch.no_grad():
        a, b = d(ids, features), loaded(ids, features)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.rank_logits, b.rank_logits)

    # ... and generation commits the same tokens from the same trees
    out_a = greedy(target, assistant_model=d, max_new_tokens=10)
    stats_a = d.last_stats
    out_b = greedy(target, assistant_model=loaded, max_new_tokens=10)
    stats_b = loaded.last_stats
    assert torch.equal(out_a, out_b)
    assert torch.equal(out_a, greedy(target, max_new_tokens=10))
    assert stats_a.nodes_per_iteration == stats_b.nodes_per_iteration
    assert stats_a.accepted_per_iteration == stats_b.accepted_per_iteration


def test_auto_classes(tmp_path, target):
    d = make_drafter(target, block_size=3, tree_budget=12)
    d.save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(config, SpecBlockConfig)
    assert config.model_type == "specblock"
    assert (config.block_size, config.vocab_size) == (3, VOCAB)
    model = AutoModel.from_pretrained(tmp_path)
    assert isinstance(model, SpecBlockDraftModel) and model.generation_config.tree_budget == 12
    for key, value in d.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


# -------------------------------------------------------------------------------------------------------------------
# SpecBlockConfig.from_target_config
# -------------------------------------------------------------------------------------------------------------------
SMALL = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_attention_heads=6, num_key_value_heads=2)

FAMILIES = [
    ("llama", lambda L: transformers.LlamaConfig(**SMALL, num_hidden_layers=L), 8),
    ("qwen2", lambda L: transformers.Qwen2Config(**SMALL, num_hidden_layers=L), 12),
    ("qwen3", lambda L: transformers.Qwen3Config(**SMALL, num_hidden_layers=L, head_dim=16), 10),
    ("mistral", lambda L: transformers.MistralConfig(**SMALL, num_hidden_layers=L), 7),
    ("gemma3_text", lambda L: transformers.Gemma3TextConfig(**SMALL, num_hidden_layers=L, head_dim=16), 9),
]


@pytest.mark.parametrize("family, build, num_layers", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_from_target_config_families(family, build, num_layers):
    target_config = build(num_layers)
    assert target_config.model_type == family
    config = SpecBlockConfig.from_target_config(target_config)
    assert config.vocab_size == 96
    assert config.draft_vocab_size == 96
    assert config.hidden_size == 48 and config.target_hidden_size == 48
    assert config.target_num_hidden_layers == num_layers
    assert config.target_layer_ids == [2, num_layers // 2, num_layers - 3]
    assert config.target_model_type == family
    assert config.num_attention_heads == 6 and config.num_key_value_heads == 2
    expected_head_dim = getattr(target_config, "head_dim", None) or 48 // 6
    assert config.head_dim == expected_head_dim
    assert config.intermediate_size == 80
    assert config.max_position_embeddings == target_config.max_position_embeddings
    assert config.rope_parameters["rope_type"] == "default"
    assert config.rope_parameters["rope_theta"] > 0
    # a drafter can actually be built from the derived config
    model = SpecBlockDraftModel(config)
    assert model.lm_head.weight.shape == (96, 48)
    assert model.condition_proj.weight.shape == (48, 3 * 48)


def test_from_target_config_gemma3_uses_global_rope_theta():
    text = transformers.Gemma3TextConfig(**SMALL, num_hidden_layers=8, head_dim=16)
    global_theta = text.rope_parameters["full_attention"]["rope_theta"]
    local_theta = text.rope_parameters["sliding_attention"]["rope_theta"]
    assert global_theta != local_theta
    config = SpecBlockConfig.from_target_config(text)
    assert config.rope_parameters["rope_theta"] == pytest.approx(global_theta)


def test_from_target_config_multimodal_gemma3_reads_text_config():
    wrapper = transformers.Gemma3Config(text_config=dict(**SMALL, num_hidden_layers=8, head_dim=16))
    config = SpecBlockConfig.from_target_config(wrapper)
    assert (config.vocab_size, config.hidden_size, config.target_num_hidden_layers) == (96, 48, 8)
    assert config.target_layer_ids == [2, 4, 5]


def test_from_target_config_overrides_win():
    target_config = transformers.LlamaConfig(**SMALL, num_hidden_layers=8)
    config = SpecBlockConfig.from_target_config(
        target_config,
        hidden_size=96,
        num_hidden_layers=1,
        block_size=3,
        target_layer_ids=[1, 3, 8],
        draft_vocab_size=40,
    )
    assert config.hidden_size == 96
    assert config.head_dim == 96 // 6  # re-derived from the overridden hidden size
    assert config.target_hidden_size == 48  # still the target's
    assert config.num_hidden_layers == 1 and config.block_size == 3
    assert config.target_layer_ids == [1, 3, 8]
    assert config.draft_vocab_size == 40
    explicit = SpecBlockConfig.from_target_config(target_config, hidden_size=96, head_dim=24)
    assert explicit.head_dim == 24


def test_from_target_config_unsupported_type():
    gpt2 = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=64)
    with pytest.raises(ValueError, match="gpt2"):
        SpecBlockConfig.from_target_config(gpt2)


# -------------------------------------------------------------------------------------------------------------------
# Stock behaviour is untouched
# -------------------------------------------------------------------------------------------------------------------
def _stock_runs(target, assistant):
    """Every non-SpecBlock generation mode this package could disturb."""
    torch.manual_seed(123)
    sampled = target.generate(PROMPT, max_new_tokens=6, do_sample=True, top_k=20)
    assisted = target.generate(
        PROMPT, max_new_tokens=8, do_sample=False, assistant_model=assistant,
        return_dict_in_generate=True, output_scores=True,
    )  # fmt: skip
    torch.manual_seed(7)
    assisted_sampled = target.generate(PROMPT, max_new_tokens=6, do_sample=True, assistant_model=assistant)
    return {
        "greedy": greedy(target, max_new_tokens=8),
        "sampled": sampled,
        "assisted": assisted.sequences,
        "assisted_scores": torch.cat(assisted.scores),
        "assisted_sampled": assisted_sampled,
        "prompt_lookup": greedy(target, torch.tensor([[0, 5, 17, 5, 17, 5, 17, 33]]), 8, prompt_lookup_num_tokens=3),
    }


def test_stock_generation_unchanged(target):
    assistant = make_target("llama", vocab_size=VOCAB, seed=7, num_hidden_layers=2)
    assert_patched(True)
    with_package = _stock_runs(target, assistant)
    transformers_specblock.uninstall()
    try:
        assert_patched(False)
        stock = _stock_runs(target, assistant)
    finally:
        transformers_specblock.install()
    assert_patched(True)
    assert with_package.keys() == stock.keys()
    for key in stock:
        assert torch.equal(with_package[key], stock[key]), key
    # the assisted run really was the stock assisted loop, equal to plain greedy
    assert torch.equal(with_package["assisted"], with_package["greedy"])


# -------------------------------------------------------------------------------------------------------------------
# Patch-free routes
# -------------------------------------------------------------------------------------------------------------------
def _run_route(route, target, assistant, **kwargs):
    kwargs.setdefault("max_new_tokens", 9)
    kwargs.setdefault("do_sample", False)
    if route == "patched":
        return target.generate(PROMPT, assistant_model=assistant, **kwargs)
    if route == "function":
        return transformers_specblock.generate(target, PROMPT, assistant_model=assistant, **kwargs)
    if route == "custom_generate":
        return target.generate(
            PROMPT, assistant_model=assistant, custom_generate=CUSTOM_GENERATE_DIR, trust_remote_code=True, **kwargs
        )
    raise ValueError(route)


@pytest.mark.parametrize("installed", [True, False], ids=["installed", "uninstalled"])
@pytest.mark.parametrize("route", ["function", "custom_generate"])
def test_patch_free_routes(target, oracle, route, installed):
    expected = greedy(target)
    oracle.last_stats = None
    if not installed:
        transformers_specblock.uninstall()
    try:
        assert_patched(installed)
        out = _run_route(route, target, oracle)
    finally:
        transformers_specblock.install()
    assert torch.equal(out, expected)
    stats = oracle.last_stats
    assert isinstance(stats, SpecBlockStats)
    assert stats.new_tokens == 9
    assert stats.iterations == 4 and stats.accepted_per_iteration == [2, 2, 2, 2]


def test_patched_route_uses_tree_decoding(target, oracle):
    oracle.last_stats = None
    out = greedy(target, assistant_model=oracle)
    assert torch.equal(out, greedy(target))
    assert oracle.last_stats is not None and oracle.last_stats.accepted_per_iteration == [2, 2, 2, 2]


# -------------------------------------------------------------------------------------------------------------------
# Scores and logits
# -------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["deep", "random"])
@pytest.mark.parametrize("route", ["patched", "function"])
@pytest.mark.parametrize("repetition_penalty", [None, 1.3], ids=["plain", "rep1.3"])
def test_scores_and_logits_match_stock(
    target, drafter, deep_drafter, monkeypatch, kind, route, repetition_penalty
):
    assistant = deep_drafter if kind == "deep" else drafter
    kwargs = dict(return_dict_in_generate=True, output_scores=True, output_logits=True, max_new_tokens=12)
    if repetition_penalty is not None:
        kwargs["repetition_penalty"] = repetition_penalty
    if kind == "deep":  # the oracle follows the penalised greedy continuation: chunks of 3+ tokens get accepted
        generators = use_deep_oracle(monkeypatch, target, assistant, repetition_penalty=repetition_penalty)
    stock = greedy(target, **kwargs)
    out = _run_route(route, target, assistant, **kwargs)
    if kind == "deep":
        assert_deep_chunks(assistant, generators)
    assert torch.equal(out.sequences, stock.sequences)
    new = out.sequences.shape[1] - PROMPT.shape[1]
    assert new == 12
    assert len(out.scores) == len(out.logits) == new
    for score, logit, ref_score, ref_logit in zip(out.scores, out.logits, stock.scores, stock.logits):
        assert score.shape == (1, VOCAB) and logit.shape == (1, VOCAB)
        torch.testing.assert_close(logit.float(), ref_logit.float(), atol=1e-4, rtol=0)
        torch.testing.assert_close(score.float(), ref_score.float(), atol=1e-4, rtol=0)
    # each processed score picks the committed token
    picked = torch.stack([s[0].argmax() for s in out.scores])
    assert torch.equal(picked, out.sequences[0, PROMPT.shape[1] :])
    if repetition_penalty is not None:  # the penalty really changed something: scores are not the raw logits
        assert any(not torch.allclose(s, l) for s, l in zip(out.scores, out.logits))


def test_scores_only_and_logits_only(target, deep_drafter, monkeypatch):
    generators = use_deep_oracle(monkeypatch, target, deep_drafter)
    stock = greedy(target, return_dict_in_generate=True, output_scores=True, max_new_tokens=12)
    scores_only = greedy(
        target, assistant_model=deep_drafter, return_dict_in_generate=True, output_scores=True, max_new_tokens=12
    )
    assert_deep_chunks(deep_drafter, generators)
    assert scores_only.logits is None and len(scores_only.scores) == 12
    for score, ref in zip(scores_only.scores, stock.scores):
        torch.testing.assert_close(score, ref, atol=1e-4, rtol=0)
    logits_only = greedy(
        target, assistant_model=deep_drafter, return_dict_in_generate=True, output_logits=True, max_new_tokens=12
    )
    assert logits_only.scores is None and len(logits_only.logits) == 12


# -------------------------------------------------------------------------------------------------------------------
# Streamers
# -------------------------------------------------------------------------------------------------------------------
class RecordingStreamer(BaseStreamer):
    def __init__(self):
        self.puts: list[torch.Tensor] = []
        self.ends = 0

    def put(self, value):
        assert self.ends == 0, "put() after end()"
        self.puts.append(value.detach().clone())

    def end(self):
        self.ends += 1


@pytest.mark.parametrize("route", ["patched", "function", "custom_generate"])
@pytest.mark.parametrize("kind", ["deep", "random"])
def test_streamer_sees_prompt_then_chunks(target, drafter, deep_drafter, monkeypatch, route, kind):
    assistant = deep_drafter if kind == "deep" else drafter
    generators = use_deep_oracle(monkeypatch, target, assistant) if kind == "deep" else None
    streamer = RecordingStreamer()
    out = _run_route(route, target, assistant, max_new_tokens=10, streamer=streamer)
    assert torch.equal(out, greedy(target, max_new_tokens=10))
    assert streamer.ends == 1
    assert len(streamer.puts) >= 2
    assert torch.equal(streamer.puts[0].reshape(-1), PROMPT[0])
    chunks = [p.reshape(-1) for p in streamer.puts[1:]]
    assert torch.equal(torch.cat(chunks), out[0, PROMPT.shape[1] :])
    # one put for the prefill's token, then one per verification holding exactly what it committed (the last
    # one cut where max_new_tokens stops inside it)
    accepted = assistant.last_stats.accepted_per_iteration
    assert [c.numel() for c in chunks[:-1]] == [1, *accepted[:-1]]
    assert 1 <= chunks[-1].numel() <= accepted[-1]
    if kind == "deep":  # accepted drafts arrive as chunks of 3+ tokens: 1 + 4 + 2 + (3 of 5)
        assert_deep_chunks(assistant, generators)
        assert [c.numel() for c in chunks] == [1, 4, 2, 3]


def test_stock_streamer_unchanged(target):
    streamer = RecordingStreamer()
    out = greedy(target, max_new_tokens=5, streamer=streamer)
    assert streamer.ends == 1
    assert torch.equal(streamer.puts[0].reshape(-1), PROMPT[0])
    assert torch.equal(torch.cat([p.reshape(-1) for p in streamer.puts[1:]]), out[0, PROMPT.shape[1] :])


# -------------------------------------------------------------------------------------------------------------------
# last_stats
# -------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kind, max_new_tokens, exact",
    [("random", 7, True), ("deep", 12, True), ("deep", 10, False)],
    ids=["random-exact", "deep-exact", "deep-stops-mid-chunk"],
)
def test_last_stats_consistency(target, drafter, deep_drafter, monkeypatch, kind, max_new_tokens, exact):
    assistant = deep_drafter if kind == "deep" else drafter
    generators = use_deep_oracle(monkeypatch, target, assistant) if kind == "deep" else None
    previous = assistant.last_stats
    out = greedy(target, assistant_model=assistant, max_new_tokens=max_new_tokens)
    stats = assistant.last_stats
    assert isinstance(stats, SpecBlockStats) and stats is not previous
    new_tokens = out.shape[1] - PROMPT.shape[1]
    assert stats.new_tokens == new_tokens == max_new_tokens
    committed = sum(stats.accepted_per_iteration) + 1  # + the token the prefill produced
    if exact:
        assert committed == new_tokens
    else:  # the last chunk was cut by max_new_tokens
        assert committed > new_tokens
        assert committed - new_tokens < stats.accepted_per_iteration[-1]
    assert committed >= new_tokens
    assert stats.iterations == len(stats.accepted_per_iteration) == len(stats.nodes_per_iteration) > 0
    assert all(a >= 1 for a in stats.accepted_per_iteration)
    assert all(0 <= n <= assistant.generation_config.tree_budget for n in stats.nodes_per_iteration)
    assert math.isclose(stats.tau, sum(stats.accepted_per_iteration) / len(stats.accepted_per_iteration))
    assert stats.drafter_forwards >= stats.iterations
    assert stats.drafter_time_s > 0 and stats.target_time_s > 0 and stats.total_time_s > 0
    assert stats.total_time_s >= stats.drafter_time_s + stats.target_time_s
    assert 0.0 <= stats.drafting_share <= 1.0
    as_dict = stats.as_dict()
    assert as_dict["tau"] == stats.tau and as_dict["drafting_share"] == stats.drafting_share
    assert as_dict["accepted_per_iteration"] == stats.accepted_per_iteration
    if kind == "deep":  # chunks of 4, 2 and 5 tokens (the last one cut to 3 when stopping mid-chunk)
        assert_deep_chunks(assistant, generators)
        assert stats.accepted_per_iteration == [4, 2, 5] and stats.tau > 3


# -------------------------------------------------------------------------------------------------------------------
# Placement and padding
# -------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_target_dir(tmp_path_factory, target):
    path = tmp_path_factory.mktemp("tiny_target")
    target.save_pretrained(path)
    return path


@pytest.mark.parametrize("device_map", ["cpu", "auto"])
def test_device_map_loaded_target(saved_target_dir, target, device_map):
    loaded = AutoModelForCausalLM.from_pretrained(saved_target_dir, device_map=device_map)
    assert loaded.device.type == "cpu"
    assert loaded.config._attn_implementation in ("sdpa", "eager")
    expected = greedy(loaded)
    assert torch.equal(expected, greedy(target))  # the weights survived the round trip
    assistant = make_oracle(loaded)
    assert torch.equal(greedy(loaded, assistant_model=assistant), expected)
    assert assistant.last_stats.accepted_per_iteration == [2, 2, 2, 2]
    assert torch.equal(transformers_specblock.generate(loaded, PROMPT, assistant_model=assistant, max_new_tokens=9),
                       expected)  # fmt: skip


@pytest.mark.parametrize("route", ["patched", "function", "custom_generate"])
@pytest.mark.parametrize("kind", ["deep", "random"])
def test_left_padding_batch_of_one(target, drafter, deep_drafter, monkeypatch, route, kind):
    assistant = deep_drafter if kind == "deep" else drafter
    # the oracle knows only the unpadded prompt's continuation: it is accepted only if the padding is ignored
    generators = use_deep_oracle(monkeypatch, target, assistant) if kind == "deep" else None
    padded = torch.cat([torch.tensor([[3, 3, 3]]), PROMPT], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(PROMPT)], dim=1)
    expected = target.generate(padded, attention_mask=mask, max_new_tokens=8, do_sample=False)
    if route == "patched":
        out = target.generate(padded, attention_mask=mask, max_new_tokens=8, do_sample=False, assistant_model=assistant)
    elif route == "function":
        out = transformers_specblock.generate(
            target, padded, attention_mask=mask, max_new_tokens=8, do_sample=False, assistant_model=assistant
        )
    else:
        out = target.generate(
            padded, attention_mask=mask, max_new_tokens=8, do_sample=False, assistant_model=assistant,
            custom_generate=CUSTOM_GENERATE_DIR, trust_remote_code=True,
        )  # fmt: skip
    assert out.shape == (1, padded.shape[1] + 8)
    assert torch.equal(out[:, : padded.shape[1]], padded)
    assert torch.equal(out[:, padded.shape[1] :], expected[:, padded.shape[1] :])
    # the padding is really ignored: the new tokens equal the unpadded prompt's
    assert torch.equal(out[:, padded.shape[1] :], greedy(target, max_new_tokens=8)[:, PROMPT.shape[1] :])
    if kind == "deep":
        assert_deep_chunks(assistant, generators)


def test_left_padding_with_different_pad_tokens_is_ignored(target, deep_drafter, monkeypatch):
    generators = use_deep_oracle(monkeypatch, target, deep_drafter)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(PROMPT)], dim=1)
    outs, accepted = [], []
    for pads in ([3, 3, 3], [90, 1, 44]):
        padded = torch.cat([torch.tensor([pads]), PROMPT], 1)
        outs.append(greedy(target, padded, 12, attention_mask=mask, assistant_model=deep_drafter))
        assert_deep_chunks(deep_drafter, generators)
        accepted.append(deep_drafter.last_stats.accepted_per_iteration)
    assert torch.equal(outs[0][:, 9:], outs[1][:, 9:])
    assert torch.equal(outs[0][:, 9:], greedy(target, max_new_tokens=12)[:, PROMPT.shape[1] :])
    assert accepted[0] == accepted[1] == [4, 2, 5]


# -------------------------------------------------------------------------------------------------------------------
# Stopping mid-chunk (eos) matches stock
# -------------------------------------------------------------------------------------------------------------------
# new tokens 0 | 1 2 3 4 | 5 6 | 7 8 9 10 11: the prefill's token, then the deep oracle's chunks of 4, 2 and 5
@pytest.mark.parametrize("position, chunks", [(2, [2]), (4, [4]), (5, [4, 1]), (9, [4, 2, 3])],
                         ids=["2nd-of-4", "last-of-4", "1st-of-2", "3rd-of-5"])  # fmt: skip
def test_eos_inside_a_chunk(target, deep_drafter, monkeypatch, position, chunks):
    generators = use_deep_oracle(monkeypatch, target, deep_drafter)
    reference = greedy(target, max_new_tokens=12)
    eos = int(reference[0, PROMPT.shape[1] + position])
    assert eos not in reference[0, PROMPT.shape[1] : PROMPT.shape[1] + position].tolist()
    stock = greedy(target, max_new_tokens=12, eos_token_id=eos, pad_token_id=1)
    streamer = RecordingStreamer()
    out = greedy(target, max_new_tokens=12, eos_token_id=eos, pad_token_id=1, assistant_model=deep_drafter,
                 streamer=streamer)  # fmt: skip
    assert torch.equal(out, stock)
    assert out.shape[1] == PROMPT.shape[1] + position + 1 and int(out[0, -1]) == eos
    stats = deep_drafter.last_stats
    assert stats.new_tokens == position + 1
    assert [p.numel() for p in streamer.puts[2:]] == chunks  # nothing after the eos was streamed
    assert stats.accepted_per_iteration == [4, 2, 5][: len(chunks)] and generators[0].grafted


# -------------------------------------------------------------------------------------------------------------------
# 16-bit drafters and sliding-window targets
# -------------------------------------------------------------------------------------------------------------------


def test_bfloat16_drafter_forward():
    bf16_target = make_target("llama", vocab_size=VOCAB).to(torch.bfloat16)
    assistant = make_drafter(bf16_target)
    assert assistant.dtype == torch.bfloat16
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, 5))
    features = torch.randn(1, 5, 3 * bf16_target.config.hidden_size, dtype=torch.bfloat16)
    with torch.no_grad():
        out = assistant(ids, features)
    assert out.logits.shape == (1, 5, assistant.config.block_size, VOCAB)
    assert torch.isfinite(out.rank_logits.float()).all()


def test_bfloat16_target_generate():
    # eager attention: tree verification and step-by-step decoding then agree exactly in bf16 on this model
    bf16_target = make_target("llama", vocab_size=VOCAB, attn="eager").to(torch.bfloat16)
    assistant = make_drafter(bf16_target)
    out = greedy(bf16_target, assistant_model=assistant, max_new_tokens=8)
    assert torch.equal(out, greedy(bf16_target, max_new_tokens=8))
    assert assistant.last_stats.new_tokens == 8


def tiny_mistral(**overrides):
    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, initializer_range=0.2, bos_token_id=0, eos_token_id=None, pad_token_id=None,
        **overrides,
    )  # fmt: skip
    mistral = transformers.MistralForCausalLM(config).eval()
    mistral.config._attn_implementation = "sdpa"
    return mistral


def test_mistral_target_inside_its_window_decodes_exactly(monkeypatch):
    """Sliding-window target, whole generation inside the window: decoded (with a full-attention cache) exactly,
    multi-token chunks included (docs/design.md, Known limits)."""
    mistral = tiny_mistral()
    assert mistral.config.sliding_window == 4096
    assistant = SpecBlockDraftModel.from_target(mistral, block_size=3, max_blocks=2, tree_policy="fixed",
                                                fixed_width=2, tree_budget=16)  # fmt: skip
    generators = use_deep_oracle(monkeypatch, mistral, assistant)
    streamer = RecordingStreamer()
    out = greedy(mistral, assistant_model=assistant, max_new_tokens=12, streamer=streamer)
    assert torch.equal(out, greedy(mistral, max_new_tokens=12))
    assert_deep_chunks(assistant, generators)
    assert torch.equal(torch.cat([p.reshape(-1) for p in streamer.puts[1:]]), out[0, PROMPT.shape[1] :])


def test_mistral_target_beyond_its_window_is_refused():
    mistral = tiny_mistral(sliding_window=16)  # prompt 6 + 8 new tokens + a 16-node tree do not fit in 16
    assistant = SpecBlockDraftModel.from_target(mistral, tree_budget=16)
    assistant.last_stats = None
    streamer = RecordingStreamer()
    with pytest.raises(ValueError, match=r"sliding-window attention \(window 16\).*\(14 \+ 16\)"):
        greedy(mistral, assistant_model=assistant, max_new_tokens=8, streamer=streamer)
    # refused before anything was decoded: generate() streamed only the prompt
    assert [p.reshape(-1).tolist() for p in streamer.puts] == [PROMPT[0].tolist()] and assistant.last_stats is None
    with assistant.tree_settings(tree_budget=2):  # 14 + 2 fits: decoded, exactly
        out = greedy(mistral, assistant_model=assistant, max_new_tokens=8)
    assert torch.equal(out, greedy(mistral, max_new_tokens=8)) and assistant.last_stats.new_tokens == 8


def test_model_card_evaluation_table_has_a_fixed_column_order():
    from transformers_specblock.hub.modelcard import build_model_card

    drafter = make_drafter(make_target("llama"))
    drafter.config.eval_results = [
        {"tau": 1.5, "dataset": "mt_bench", "extra": "x"},
        {"dataset": "humaneval", "tau": 1.25},  # keys in another order, one missing
    ]
    text = str(build_model_card(drafter))
    assert "| dataset | tau | extra |" in text
    assert "| mt_bench | 1.5 | x |" in text and "| humaneval | 1.25 |  |" in text
