"""Bad input must fail loudly with a message that names what is wrong, never silently fall back."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import GenerationConfig

import transformers_specblock
from conftest import make_drafter, make_target
from transformers_specblock import CUSTOM_GENERATE_DIR, SpecBlockConfig, SpecBlockDraftModel
from transformers_specblock.models.tree_drafter import TreeGenerationConfig
from transformers_specblock.utils import CACHE_ARGUMENT

VOCAB = 128
PROMPT = torch.tensor([[0, 5, 17, 33, 2, 9]])
ROUTES = ["patched", "function", "custom_generate"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return make_target("llama", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def drafter(target):
    return make_drafter(target)


def run(route, target, assistant, input_ids=PROMPT, **kwargs):
    kwargs.setdefault("max_new_tokens", 4)
    if route == "patched":
        return target.generate(input_ids, assistant_model=assistant, **kwargs)
    if route == "function":
        return transformers_specblock.generate(target, input_ids, assistant_model=assistant, **kwargs)
    if route == "custom_generate":
        return target.generate(
            input_ids, assistant_model=assistant, custom_generate=CUSTOM_GENERATE_DIR, trust_remote_code=True, **kwargs
        )
    raise ValueError(route)


# -------------------------------------------------------------------------------------------------------------------
# A drafter built for another target
# -------------------------------------------------------------------------------------------------------------------
MISMATCHES = [
    ("vocab_size", dict(vocab_size=96), 96, VOCAB),
    ("hidden_size", dict(hidden_size=32), 32, 64),
    ("num_hidden_layers", dict(num_hidden_layers=8), 8, 6),
]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name, other, drafter_value, target_value", MISMATCHES, ids=[m[0] for m in MISMATCHES])
def test_drafter_for_another_target(target, route, name, other, drafter_value, target_value):
    other_settings = dict(other)
    vocab = other_settings.pop("vocab_size", VOCAB)
    foreign = make_drafter(make_target("llama", vocab_size=vocab, **other_settings))
    foreign.last_stats = None
    with pytest.raises(ValueError) as info:
        run(route, target, foreign)
    message = str(info.value)
    assert f"{name}={drafter_value}" in message
    assert f"{name}={target_value}" in message
    assert foreign.last_stats is None


# -------------------------------------------------------------------------------------------------------------------
# Unsupported generation settings
# -------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("route", ROUTES)
def test_batches_and_several_return_sequences_on_every_route(target, drafter, route):
    """Batches (and num_return_sequences, which expands the batch) decode on every route, equal to plain."""
    batch = torch.cat([PROMPT, torch.tensor([[0, 44, 2, 8, 8, 1]])])
    assert run(route, target, drafter, batch).tolist() == target.generate(batch, max_new_tokens=4).tolist()
    sampled = run(route, target, drafter, do_sample=True, top_k=1, num_return_sequences=2)
    assert sampled.tolist() == target.generate(PROMPT, max_new_tokens=4).repeat(2, 1).tolist()


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("do_sample", [False, True], ids=["beam_search", "beam_sample"])
def test_beam_search_is_refused_not_ignored(target, drafter, route, do_sample):
    drafter.last_stats = None
    with pytest.raises(ValueError, match="num_beams"):
        run(route, target, drafter, num_beams=2, do_sample=do_sample)
    assert drafter.last_stats is None


@pytest.mark.parametrize("route", ROUTES)
def test_static_cache(target, drafter, route):
    with pytest.raises(ValueError, match="(?i)static") as info:
        run(route, target, drafter, cache_implementation="static")
    assert "DynamicCache" in str(info.value)


@pytest.mark.parametrize("route", ROUTES)
def test_prefilled_cache(target, drafter, route):
    from transformers import DynamicCache

    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(PROMPT[:, :3], past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match=f"pre-filled `{CACHE_ARGUMENT}`"):
        run(route, target, drafter, past_key_values=cache)


@pytest.mark.parametrize("route", ROUTES)
def test_no_cache_names_the_setting_not_a_static_cache(target, drafter, route):
    with pytest.raises(ValueError, match="drop use_cache=False") as info:
        run(route, target, drafter, use_cache=False)
    assert "static" not in str(info.value)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("implementation", ["flash_attention_2", "flex_attention"])
def test_attention_without_tree_masks(route, implementation):
    flash_target = make_target("llama", vocab_size=VOCAB)
    assistant = make_drafter(flash_target)
    # no flash kernel is installed here: the refusal must come before the target needs one
    flash_target.config._attn_implementation = implementation
    with pytest.raises(ValueError) as info:
        run(route, flash_target, assistant)
    message = str(info.value)
    assert implementation in message
    assert "sdpa" in message and "eager" in message


@pytest.mark.parametrize("route", ROUTES)
def test_empty_prompt(target, drafter, route):
    with pytest.raises(ValueError, match="(?i)empty"):
        run(route, target, drafter, PROMPT[:, :0])


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("flag", ["output_attentions", "output_hidden_states"])
def test_attention_and_hidden_state_outputs(target, drafter, route, flag):
    with pytest.raises(ValueError, match=flag):
        run(route, target, drafter, return_dict_in_generate=True, **{flag: True})


@pytest.mark.parametrize("route", ROUTES)
def test_right_padding_mask(target, drafter, route):
    mask = torch.ones_like(PROMPT)
    mask[0, -2:] = 0
    with pytest.raises(ValueError, match="attention_mask"):
        run(route, target, drafter, attention_mask=mask)


# -------------------------------------------------------------------------------------------------------------------
# Corrupted or mismatched checkpoints
# -------------------------------------------------------------------------------------------------------------------
@pytest.fixture
def saved_drafter(tmp_path, drafter):
    drafter.save_pretrained(tmp_path)
    return tmp_path


TRUNCATED = {  # where the file is cut -> what safetensors says about it
    "header": "invalid header length",  # inside the JSON header
    "half": "incomplete metadata, file not fully covered",  # the header promises more bytes than the file has
    "all_but_tail": "incomplete metadata, file not fully covered",
}


@pytest.mark.parametrize("keep", list(TRUNCATED))
def test_truncated_checkpoint(saved_drafter, keep):
    path = saved_drafter / "model.safetensors"
    data = path.read_bytes()
    cut = {"header": 50, "half": len(data) // 2, "all_but_tail": len(data) - 64}[keep]
    path.write_bytes(data[:cut])
    with pytest.raises(SafetensorError, match=f"Error while deserializing header: {TRUNCATED[keep]}"):
        SpecBlockDraftModel.from_pretrained(saved_drafter)


def test_slot_queries_shape_mismatch(saved_drafter, caplog):
    assert json.loads((saved_drafter / "config.json").read_text())["block_size"] == 4
    path = saved_drafter / "model.safetensors"
    tensors = load_file(str(path))
    assert tensors["slot_queries.weight"].shape[0] == 4
    tensors["slot_queries.weight"] = tensors["slot_queries.weight"][:3].clone()
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"misshapen key.*slot_queries.weight \(checkpoint \[3, 64\], model \[4, 64\]\)"):
        SpecBlockDraftModel.from_pretrained(saved_drafter)
    # the load report transformers logs names the tensor and both shapes too
    report = caplog.text
    assert "slot_queries.weight" in report and "MISMATCH" in report


@pytest.mark.parametrize("flaw", ["duplicate", "out_of_range", "t2d_mismatch"])
@pytest.mark.parametrize("cls_name", ["SpecBlockDraftModel", "Eagle3DraftModel"])
def test_corrupted_draft_vocab_is_refused_at_load(tmp_path, target, cls_name, flaw):
    cls = getattr(transformers_specblock, cls_name)
    drafter = cls.from_target(target, draft_vocab_size=16)
    drafter.save_pretrained(tmp_path)
    cls.from_pretrained(tmp_path)  # the intact checkpoint loads
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    if flaw == "duplicate":  # two draft ids on one target id: two identical siblings in every tree
        tensors["d2t"][3] = tensors["d2t"][2]
    elif flaw == "out_of_range":
        tensors["d2t"][0] = target.config.vocab_size
    else:
        tensors["t2d"][:] = False
    save_file(tensors, str(path), metadata={"format": "pt"})
    expected = {"duplicate": "already used target id", "out_of_range": "outside the target vocabulary",
                "t2d_mismatch": "t2d does not mark"}[flaw]  # fmt: skip
    with pytest.raises(ValueError, match=f"Invalid draft vocabulary.*{expected}"):
        cls.from_pretrained(tmp_path)


def test_loaded_drafter_bound_to_target_of_other_vocab(saved_drafter):
    loaded = SpecBlockDraftModel.from_pretrained(saved_drafter)
    other = make_target("llama", vocab_size=96)
    with pytest.raises(ValueError) as info:
        loaded.bind_target(other)
    assert "vocab_size=128" in str(info.value) and "vocab_size=96" in str(info.value)
    with pytest.raises(ValueError) as info:
        other.generate(PROMPT, max_new_tokens=3, assistant_model=loaded)
    assert "vocab_size=128" in str(info.value) and "vocab_size=96" in str(info.value)


# -------------------------------------------------------------------------------------------------------------------
# Unbound drafters
# -------------------------------------------------------------------------------------------------------------------
def test_unbound_drafter_draft_blocks(drafter):
    fresh = SpecBlockDraftModel(drafter.config).eval()
    k = fresh.config.block_size
    with pytest.raises(RuntimeError, match="bind_target"):
        fresh.draft_blocks(
            torch.zeros(1, 1, fresh.config.hidden_size),
            PROMPT[:, :1],
            torch.ones(1, 1, dtype=torch.long),
            torch.ones(1, k, k, dtype=torch.bool),
        )
    with pytest.raises(RuntimeError, match="bind_target"):
        fresh(PROMPT, torch.zeros(1, PROMPT.shape[1], 3 * fresh.config.target_hidden_size))


@pytest.mark.parametrize("route", ROUTES)
def test_generate_binds_an_unbound_drafter(target, drafter, route):
    fresh = SpecBlockDraftModel(drafter.config).eval()
    with pytest.raises(RuntimeError):
        _ = fresh.target_embedding
    out = run(route, target, fresh, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, target.generate(PROMPT, max_new_tokens=6, do_sample=False))
    assert fresh.target_embedding is target.get_input_embeddings()
    assert fresh.last_stats is not None and fresh.last_stats.new_tokens == 6


def test_generate_rebinds_to_the_calling_target(target, drafter):
    twin = make_target("llama", vocab_size=VOCAB, seed=5)  # same sizes, other weights
    assistant = make_drafter(target)
    assert assistant.target_embedding is target.get_input_embeddings()
    out = twin.generate(PROMPT, max_new_tokens=5, do_sample=False, assistant_model=assistant)
    assert torch.equal(out, twin.generate(PROMPT, max_new_tokens=5, do_sample=False))
    assert assistant.target_embedding is twin.get_input_embeddings()


# -------------------------------------------------------------------------------------------------------------------
# Invalid config values
# -------------------------------------------------------------------------------------------------------------------
BASE = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, target_num_hidden_layers=6)

INVALID = [
    ("block_size", dict(block_size=0)),
    ("block_size", dict(block_size=-2)),
    ("prefill_chunk_size", dict(prefill_chunk_size=0)),
    ("draft_vocab_size", dict(draft_vocab_size=VOCAB + 1)),
    ("draft_vocab_size", dict(draft_vocab_size=0)),
    ("target_layer_ids", dict(target_layer_ids=[1, 2])),
    ("target_layer_ids", dict(target_layer_ids=[2, 3, 7])),
]
# decoding settings (the drafter's `generation_config`); the first ones are wrong whatever the drafter
INVALID_DECODING = [
    ("tree_budget", dict(tree_budget=0)),
    ("tree_budget", dict(tree_budget=-5)),
    ("max_blocks", dict(max_blocks=0)),
    ("max_followups", dict(max_followups=0)),
    ("tree_policy", dict(tree_policy="widest")),
    ("block_expansion", dict(block_expansion="product")),
    ("fixed_width", dict(fixed_width=0)),
    ("tree_top_k", dict(tree_top_k=0)),
    ("tree_depth", dict(tree_depth=-1)),
    ("branch_widths", dict(branch_widths=[])),
    ("branch_widths", dict(branch_widths=[2, 4])),  # not one width per rank class of this drafter
    ("branch_widths", dict(branch_widths=[2, 4, 6, 0, 1])),
]


@pytest.mark.parametrize("name, bad", INVALID, ids=[f"{n}={list(b.values())[0]}" for n, b in INVALID])
def test_invalid_config_values(name, bad):
    with pytest.raises(ValueError, match=name):
        SpecBlockConfig(**BASE, **bad)


@pytest.mark.parametrize("name, bad", INVALID[::2], ids=[n for n, _ in INVALID[::2]])
def test_invalid_overrides_in_from_target(target, name, bad):
    with pytest.raises(ValueError, match=name):
        make_drafter(target, **bad)


@pytest.mark.parametrize("name, bad", INVALID_DECODING, ids=[f"{n}={list(b.values())[0]}" for n, b in INVALID_DECODING])
def test_invalid_decoding_settings(target, drafter, name, bad):
    if INVALID_DECODING.index((name, bad)) < 9:  # wrong for any drafter: the generation config refuses it alone
        with pytest.raises(ValueError, match=name):
            TreeGenerationConfig(**bad)
    with pytest.raises(ValueError, match=name):
        make_drafter(target, **bad)
    with pytest.raises(ValueError, match=name):
        drafter.set_drafting_settings(**bad)
    with pytest.raises(ValueError, match=name):
        target.generate(PROMPT, assistant_model=drafter, max_new_tokens=2, do_sample=False, **bad)
    assert drafter.generation_config.drafting_settings() == make_drafter(target).generation_config.drafting_settings()


def test_a_decoding_setting_on_the_config_is_refused_and_says_where_it_lives(drafter):
    """Set on the config, a decoding setting would be read by nothing: reading or setting it there is refused."""
    for name in ("tree_budget", "max_blocks", "tree_top_k"):
        with pytest.raises(AttributeError, match=rf"{name} is a decoding setting.*set_drafting_settings\({name}="):
            setattr(drafter.config, name, 1)
        with pytest.raises(AttributeError, match=rf"drafter.generation_config.{name}"):
            getattr(drafter.config, name)
        assert not hasattr(drafter.config, name)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_setting'"):
        drafter.config.no_such_setting  # noqa: B018


def test_too_small_target():
    with pytest.raises(ValueError, match="at least 4 layers"):
        SpecBlockConfig(**{**BASE, "target_num_hidden_layers": 3})


def test_valid_edge_values_are_accepted():
    config = SpecBlockConfig(**BASE, block_size=1, draft_vocab_size=VOCAB)
    assert (config.block_size, config.draft_vocab_size) == (1, VOCAB)
    assert TreeGenerationConfig(tree_budget=1, max_blocks=1, tree_depth=0).tree_budget == 1


# --- settings this drafter cannot draft with: refused, naming the setting and the allowed range --------------------
def test_fixed_width_larger_than_draft_vocab(target):
    with pytest.raises(ValueError, match=rf"fixed_width must lie in \[1, draft_vocab_size={VOCAB}\], got {VOCAB + 10}"):
        make_drafter(target, tree_policy="fixed", fixed_width=VOCAB + 10)
    make_drafter(target, tree_policy="fixed", fixed_width=VOCAB)  # the largest allowed


def test_branch_width_larger_than_draft_vocab(target):
    with pytest.raises(ValueError, match=r"branch_widths needs one width in \[0, draft_vocab_size=4\] per rank class"):
        make_drafter(target, draft_vocab_size=4, branch_widths=[6, 6, 6, 6])
    make_drafter(target, draft_vocab_size=4, branch_widths=[4, 4, 4, 0])


def test_stock_assisted_decoding_after_uninstall_says_what_to_do(target, drafter):
    """After `uninstall()`, transformers' own assisted decoding gets the tree drafter: the error says how to route it."""
    transformers_specblock.uninstall()
    try:
        with pytest.raises(AttributeError, match="tree drafter.*transformers_specblock.install()"):
            target.generate(PROMPT, assistant_model=drafter, max_new_tokens=3, do_sample=False)
    finally:
        transformers_specblock.install()
    assert not hasattr(drafter, "generate")  # transformers' hasattr checks still see no generation method
    assert target.generate(PROMPT, assistant_model=drafter, max_new_tokens=3, do_sample=False).shape[1] == 9


# -------------------------------------------------------------------------------------------------------------------
# transformers' own assisted-decoding settings and a drafter's generation config
# -------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("route", ROUTES)
def test_num_assistant_tokens_is_the_tree_budget_and_the_chain_only_settings_are_refused(target, drafter, route):
    """`num_assistant_tokens` (tokens drafted per step) sets a fixed tree budget for the call; the confidence
    threshold and the length schedule of a chain drafter are refused with what to use instead."""
    plain = target.generate(PROMPT, max_new_tokens=8, do_sample=False)
    out = run(route, target, drafter, max_new_tokens=8, do_sample=False, num_assistant_tokens=3)
    assert torch.equal(out, plain)
    assert max(drafter.last_stats.nodes_per_iteration) <= 3 < drafter.generation_config.tree_budget
    with pytest.raises(ValueError, match="both set the nodes drafted per step"):
        run(route, target, drafter, num_assistant_tokens=3, tree_budget=5)
    with pytest.raises(ValueError, match="assistant_confidence_threshold.*tree_budget"):
        run(route, target, drafter, assistant_confidence_threshold=0.2)
    with pytest.raises(ValueError, match="num_assistant_tokens_schedule.*auto"):
        run(route, target, drafter, num_assistant_tokens_schedule="heuristic")


def test_an_invalid_setting_is_refused_at_update_and_save_and_never_written(drafter, tmp_path):
    settings = drafter.generation_config
    with pytest.raises(ValueError, match='tree_budget must be a positive int or "auto"'):
        settings.update(tree_budget=0, max_blocks=1)
    assert settings.tree_budget == 32 and settings.max_blocks == 2  # all or nothing
    settings.tree_budget = 0  # set around the checks: refused when saved, nothing written
    with pytest.raises(ValueError, match='tree_budget must be a positive int or "auto"'):
        drafter.save_pretrained(tmp_path / "bad")
    assert not (tmp_path / "bad" / "generation_config.json").exists()
    settings.tree_budget = 32
    with pytest.raises(TypeError, match="SpecBlockGenerationConfig.*generation_config.update"):
        drafter.generation_config = GenerationConfig(max_new_tokens=5)


def test_settings_a_drafter_never_reads_warn_and_are_not_saved(target, tmp_path):
    from test_eagle3 import make_eagle3

    eagle = make_eagle3(target)
    with pytest.warns(UserWarning, match=r"Eagle3GenerationConfig does not read \['branch_widths'\]"):
        eagle.set_drafting_settings(branch_widths=[1, 2, 3, 4])
    with pytest.warns(UserWarning, match=r"does not read .*'max_new_tokens'.*target.generate"):
        eagle.generation_config.update(max_new_tokens=5)
    with pytest.warns(UserWarning):
        eagle.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    assert {"branch_widths", "max_new_tokens", "max_blocks"}.isdisjoint(saved) and saved["tree_depth"] == 7
    assert type(type(eagle).from_pretrained(tmp_path).generation_config).__name__ == "Eagle3GenerationConfig"
