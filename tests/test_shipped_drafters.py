"""The shipped drafters are package data and load by name; a local folder of the same name wins."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import transformers_specblock
from transformers_specblock import DFlashDraftModel, Eagle3DraftModel, SpecBlockConfig, SpecBlockDraftModel
from transformers_specblock.hub import SHIPPED_DRAFTERS, resolve_drafter_path, shipped_drafter_path

from conftest import make_drafter, make_target

SPECBLOCK, EAGLE3, DFLASH = (f"{kind}-smollm2-135m-instruct" for kind in ("specblock", "eagle3", "dflash"))
PACKAGE_DIR = Path(transformers_specblock.__file__).resolve().parent


def smollm2_shaped_target(seed: int = 0) -> LlamaForCausalLM:
    """A random Llama with the sizes the shipped drafters check (vocab 49152, hidden 576, 30 layers); narrow MLP."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        intermediate_size=64, tie_word_embeddings=True, bos_token_id=0, eos_token_id=None, pad_token_id=None,
        initializer_range=0.2,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def target_shaped_for(drafter, seed: int = 0):
    """A random target of the architecture and sizes `drafter` checks (its vocabulary, hidden size, layer count and
    model type; heads of 64 dimensions); narrow MLP."""
    config = drafter.config
    torch.manual_seed(seed)
    heads = config.target_hidden_size // 64
    target_config = AutoConfig.for_model(
        config.target_model_type, vocab_size=config.vocab_size, hidden_size=config.target_hidden_size,
        num_hidden_layers=config.target_num_hidden_layers, num_attention_heads=heads,
        num_key_value_heads=next(k for k in (2, 3, 1) if heads % k == 0), intermediate_size=64,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=None, pad_token_id=None, initializer_range=0.2,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(target_config).eval()


def test_shipped_drafters_live_inside_the_package():
    assert set(SHIPPED_DRAFTERS) >= {DFLASH, EAGLE3, SPECBLOCK}
    for name in SHIPPED_DRAFTERS:
        folder = shipped_drafter_path(name)
        assert folder.parent == PACKAGE_DIR / "hub" / "shipped"
        assert {"config.json", "model.safetensors", "README.md"} <= {p.name for p in folder.iterdir()}
    with pytest.raises(ValueError, match="shipped drafters are dflash-smollm2-135m-instruct, eagle3-"):
        shipped_drafter_path("specblock-llama")


@pytest.mark.parametrize("name", SHIPPED_DRAFTERS)
def test_every_shipped_drafter_loads_by_name_and_keeps_plain_greedy(name, one_thread):
    """By name, on a random target of its target's shape (Qwen2 or Llama), as shipped ("auto" budget, free
    candidates): the output is plain greedy's, in float32."""
    drafter = AutoModel.from_pretrained(shipped_drafter_path(name)).eval()
    assert type(drafter).from_pretrained(name).name_or_path == str(shipped_drafter_path(name))
    target = target_shaped_for(drafter)
    assert target.config.model_type == drafter.config.target_model_type
    prompt = torch.tensor([[0, 11, 42, 7, 300, 5, 11, 42]])
    expected = target.generate(prompt, max_new_tokens=12, do_sample=False)
    out = target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=drafter)
    assert torch.equal(out, expected)
    stats = drafter.last_stats  # the tree loop decoded the call
    assert stats.iterations > 0 and stats.new_tokens == out.shape[1] - prompt.shape[1]


def test_resolution_rule(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_drafter_path(SPECBLOCK) == shipped_drafter_path(SPECBLOCK)
    for passed_through in ("HuggingFaceTB/some-drafter", f"user/{SPECBLOCK}", "no-such-drafter", None):
        assert resolve_drafter_path(passed_through) == passed_through
    (tmp_path / SPECBLOCK).mkdir()  # a local folder of that name wins
    assert resolve_drafter_path(SPECBLOCK) == SPECBLOCK


def test_from_pretrained_by_name():
    drafter = SpecBlockDraftModel.from_pretrained(SPECBLOCK)
    assert drafter.config.vocab_size == 49152 and drafter.config.target_hidden_size == 576
    assert drafter.name_or_path == str(shipped_drafter_path(SPECBLOCK))
    assert isinstance(Eagle3DraftModel.from_pretrained(EAGLE3), Eagle3DraftModel)
    assert SpecBlockConfig.from_pretrained(SPECBLOCK).target_num_hidden_layers == 30  # --init_drafter reads this
    assert isinstance(AutoModel.from_pretrained(shipped_drafter_path(EAGLE3)), Eagle3DraftModel)
    dflash = DFlashDraftModel.from_pretrained(DFLASH)
    assert dflash.config.mask_token_id == 16 and dflash.config.block_size == 16  # SmolLM2's <empty_output>


def test_a_local_folder_named_like_a_shipped_drafter_wins(tmp_path, monkeypatch):
    local = make_drafter(make_target("llama"))
    local.save_pretrained(tmp_path / SPECBLOCK)
    monkeypatch.chdir(tmp_path)
    loaded = SpecBlockDraftModel.from_pretrained(SPECBLOCK)
    assert loaded.config.vocab_size == local.config.vocab_size == 128


def test_bench_loads_the_shipped_drafters_by_default(one_thread):
    from transformers_specblock.commands.cli import BenchArguments, build_methods

    target = smollm2_shaped_target()
    args = BenchArguments(target_model="smollm2-135m-instruct", methods="plain,specblock,eagle3,dflash")
    methods = build_methods(args, target)
    drafters = [m.generate_kwargs["assistant_model"] for m in methods]
    assert [type(d) for d in drafters] == [SpecBlockDraftModel, Eagle3DraftModel, DFlashDraftModel]
    names = (SPECBLOCK, EAGLE3, DFLASH)
    assert [d.name_or_path for d in drafters] == [str(shipped_drafter_path(n)) for n in names]
    prompt = torch.tensor([[0, 11, 42, 7, 300, 5]])
    expected = target.generate(prompt, max_new_tokens=8, do_sample=False)
    for drafter in drafters:
        out = target.generate(prompt, max_new_tokens=8, do_sample=False, assistant_model=drafter)
        assert torch.equal(out, expected)


def test_bench_block_rounds_methods_share_one_drafter():
    from transformers_specblock.commands.cli import BenchArguments, build_methods

    names = "specblock_one_block,specblock_two_blocks,specblock_three_blocks"
    methods = build_methods(BenchArguments(target_model="smollm2-135m-instruct", methods=names),
                            smollm2_shaped_target())  # fmt: skip
    assert [m.tree_settings["max_blocks"] for m in methods] == [1, 2, 3]
    assert len({id(m.generate_kwargs["assistant_model"]) for m in methods}) == 1
    deep = build_methods(BenchArguments(target_model="smollm2-135m-instruct", methods="eagle3,eagle3_depth6"),
                         smollm2_shaped_target())  # fmt: skip
    assert [m.tree_settings.get("tree_depth") for m in deep] == [None, 6]


def test_bench_names_the_choices_when_no_drafter_fits():
    from transformers_specblock.commands.cli import BenchArguments, build_methods

    with pytest.raises(FileNotFoundError, match="neither a local drafter folder nor a shipped drafter"):
        build_methods(BenchArguments(target_model="qwen2.5-coder-1.5b-instruct", methods="specblock"), None)


def test_bench_says_when_a_training_folder_holds_no_drafter_yet(tmp_path):
    """A run still training has checkpoints but no config.json at its top: the error names the latest checkpoint."""
    from transformers_specblock.commands.cli import BenchArguments, build_methods

    make_drafter(make_target("llama")).save_pretrained(tmp_path / "checkpoint-20")
    (tmp_path / "checkpoint-100").mkdir()
    args = BenchArguments(target_model="smollm2-135m-instruct", methods="specblock", specblock_model=str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"no config.json.*checkpoint-100"):
        build_methods(args, None)


# config.json is the architecture only, as LlamaConfig's: every key a shipped drafter's config.json may hold, by family
COMMON_CONFIG_KEYS = {
    # PretrainedConfig's own
    "architectures", "model_type", "dtype", "transformers_version", "bos_token_id", "eos_token_id", "pad_token_id",
    "tie_word_embeddings", "initializer_range",
    # the target the drafter reads: its sizes, feature layers, and (as PEFT's base_model_name_or_path) its name
    "vocab_size", "target_hidden_size", "target_num_hidden_layers", "target_layer_ids", "target_model_type",
    "target_name_or_path", "base_model_id",
    # the drafter's own Llama-style layers and draft vocabulary
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
    "hidden_act", "rms_norm_eps", "rope_parameters", "max_position_embeddings", "attention_bias", "attention_dropout",
    "mlp_bias", "draft_vocab_size",
}  # fmt: skip
ARCHITECTURE_KEYS = {  # by family (a shipped drafter's name starts with it)
    "specblock": COMMON_CONFIG_KEYS | {"block_size", "rank_bucket_upper_bounds", "prefill_chunk_size",
                                       "rank_head_hidden_size", "rank_head_bias", "rank_feature_top_k",
                                       "rank_top1_over_vocab", "followup_positions"},
    "eagle3": COMMON_CONFIG_KEYS | {"own_token_embedding", "norm_before_residual", "fc_norm", "norm_output"},
    "dflash": COMMON_CONFIG_KEYS | {"block_size", "mask_token_id", "layer_types"},
}
NOT_ARCHITECTURE = {"training_info", "eval_results", "ttt_steps", "ttt_decay", "loss_decay_gamma", "num_anchors",
                    "fusion_identity_init"}  # fmt: skip


@pytest.mark.parametrize("name", SHIPPED_DRAFTERS)
def test_shipped_config_json_holds_architecture_keys_only(name):
    """Provenance, evaluation and training settings live in training_record.json; config.json stays small."""
    import json

    family = name.split("-")[0]
    folder = shipped_drafter_path(name)
    config = json.loads((folder / "config.json").read_text())
    assert set(config) <= ARCHITECTURE_KEYS[family], sorted(set(config) - ARCHITECTURE_KEYS[family])
    assert not set(config) & NOT_ARCHITECTURE
    assert (folder / "config.json").stat().st_size < 2000
    record = json.loads((folder / "training_record.json").read_text())
    assert record["training"]["train_tokens"] > 0 and record["evaluation"]
    assert set(record["training_settings"]) <= NOT_ARCHITECTURE
    # what was moved out is still there for the code that reads it
    drafter = {"specblock": SpecBlockDraftModel, "eagle3": Eagle3DraftModel, "dflash": DFlashDraftModel}[family]
    drafter = drafter.from_pretrained(name)
    assert drafter.config.training_info == record["training"]
    for setting, value in record["training_settings"].items():
        assert getattr(drafter.config, setting) == value
    assert json.loads(drafter.config.to_json_string()).keys() <= ARCHITECTURE_KEYS[family]


ABSOLUTE = ("/work/", "/root/", "/tmp/", "/home/", "/Users/", "/mnt/", "/scratch/")  # and any absolute path below


def test_no_absolute_path_in_any_shipped_file():
    """No folder of a development machine in a shipped card, config or record (the package ships them)."""
    from transformers_specblock.hub.provenance import absolute_paths_in

    for name in SHIPPED_DRAFTERS:
        for path in shipped_drafter_path(name).iterdir():
            if path.suffix not in (".json", ".md"):
                continue
            text = path.read_text(encoding="utf-8")
            assert not [marker for marker in ABSOLUTE if marker in text], path
            assert absolute_paths_in(text) == [], (path, absolute_paths_in(text)[:3])
