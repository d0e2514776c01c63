"""Data and target features for a new target (issue 62, items 2-3), on a tiny random Qwen2 target: stored features
equal the ones training computes online, a resumed extraction equals an uninterrupted one, training reads a feature
store, the three splits are disjoint, and no benchmark prompt or solution survives the filter."""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from conftest import make_target
from test_training import make_tokenizer
from transformers_specblock.commands import build_data
from transformers_specblock.commands.cli import train_main
from transformers_specblock.hub.prompts import load_prompts
from transformers_specblock.training import SpecBlockDataCollator, target_argmax, target_features
from transformers_specblock.training.corpus import (
    SPLITS,
    BenchmarkFilter,
    benchmark_items,
    code_records,
    interleave,
    normalized_words,
    prompt_key,
    sharegpt_records,
    split_of,
    split_records,
)
from transformers_specblock.training.data import load_conversations
from transformers_specblock.training.feature_store import extract_features, is_feature_store, read_store_info

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = [2, 3, 3]  # default_target_layer_ids(6): what SpecBlock and EAGLE-3 both read


def chats(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6)))
        answer = " ".join([word] * rng.randint(2, 6)) + f" done {i % 10}"
        turns = [{"from": "human", "value": f"spell {word} {i}"}, {"from": "gpt", "value": answer}]
        out.append({"id": f"chat:{i}", "split_key": f"chat:{i}", "conversations": turns})
    return out


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen_features")
    target = make_target("qwen2", vocab_size=128)
    with torch.no_grad():  # a peaked target, as in test_training
        target.lm_head.weight.mul_(3.0)
    target.save_pretrained(root / "target")
    make_tokenizer().save_pretrained(root / "target")
    tokenizer = AutoTokenizer.from_pretrained(root / "target")  # what training loads (it renders spaces otherwise)
    records = root / "records.jsonl"
    records.write_text("".join(json.dumps(r) + "\n" for r in chats(24)))
    return {"root": root, "target": target, "tokenizer": tokenizer, "records": records}


def extract(ws, folder, **kwargs):
    settings = dict(layer_ids=LAYERS, max_length=64, dtype=torch.float32, shard_tokens=200)
    return extract_features(ws["target"], ws["tokenizer"], ws["records"], folder, **{**settings, **kwargs})


def stored_sequences(folder) -> list[dict[str, torch.Tensor]]:
    info = read_store_info(folder)
    out = []
    for shard in info["shards"]:
        tensors = load_file(Path(folder) / shard["file"])
        offsets = tensors["offsets"].tolist()
        for start, end in zip(offsets, offsets[1:]):
            out.append({k: v[start:end] for k, v in tensors.items() if k != "offsets"})
    return out


# ------------------------------------------------------------------------------------------------ features
def test_stored_features_equal_the_online_ones(workspace):
    folder = workspace["root"] / "store-f32"
    info = extract(workspace, folder)
    assert is_feature_store(folder) and info["num_sequences"] == 24 and len(info["shards"]) > 2
    assert info["bytes_per_token"] == 4 * 64 * 4 + 9 and info["target_layer_ids"] == LAYERS
    stored = stored_sequences(folder)
    # online, as SpecBlockTrainer.target_batch computes them: a right-padded batch through the frozen target
    rows = [{"input_ids": s["input_ids"].long(), "loss_mask": s["loss_mask"]} for s in stored]
    batch = SpecBlockDataCollator(pad_token_id=0)(rows)
    features, final = target_features(workspace["target"], batch["input_ids"], batch["attention_mask"], LAYERS)
    argmax = target_argmax(final, workspace["target"].lm_head.weight)
    for row, seq in enumerate(stored):
        n = len(seq["input_ids"])
        alone = target_features(workspace["target"], seq["input_ids"][None].long(), torch.ones(1, n), LAYERS)
        assert torch.equal(seq["features"], alone[0][0]) and torch.equal(seq["final_hidden"], alone[1][0])
        # in a padded batch other kernel shapes round differently
        torch.testing.assert_close(seq["features"], features[row, :n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(seq["final_hidden"], final[row, :n], atol=1e-4, rtol=1e-4)
        assert torch.equal(seq["target_argmax"].long(), argmax[row, :n])
        assert torch.equal(seq["loss_mask"].bool(), batch["loss_mask"][row, :n])
    # bfloat16 storage: the online states rounded to bfloat16
    info16 = extract(workspace, workspace["root"] / "store-bf16", dtype=torch.bfloat16)
    assert info16["bytes_per_token"] == 4 * 64 * 2 + 9
    for row, seq in enumerate(stored_sequences(workspace["root"] / "store-bf16")):
        n = len(seq["input_ids"])
        assert seq["features"].dtype == torch.bfloat16
        torch.testing.assert_close(seq["features"].float(), features[row, :n].to(torch.bfloat16).float(),
                                   atol=2e-2, rtol=1e-2)  # fmt: skip


def test_a_resumed_extraction_equals_an_uninterrupted_one(workspace):
    full, resumed = workspace["root"] / "full", workspace["root"] / "resumed"
    extract(workspace, full)
    first = extract(workspace, resumed, max_shards=2)  # "interrupted" after two shards
    assert len(first["shards"]) == 2
    (resumed / ".shard-00002.safetensors.abc.tmp").write_bytes(b"half a shard")  # what a kill leaves behind
    extract(workspace, resumed)
    a, b = read_store_info(full), read_store_info(resumed)
    assert [s["ids"] for s in a["shards"]] == [s["ids"] for s in b["shards"]]
    assert a["num_tokens"] == b["num_tokens"] and not list(resumed.glob(".*.tmp"))
    for shard in a["shards"]:
        x, y = load_file(full / shard["file"]), load_file(resumed / shard["file"])
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    again = extract(workspace, resumed)  # nothing left: unchanged
    assert again["shards"] == b["shards"]
    with pytest.raises(ValueError, match="target_layer_ids"):
        extract(workspace, resumed, layer_ids=[1, 2, 3])


def test_training_reads_the_store_as_it_computes_online(workspace):
    ws, root = workspace, workspace["root"]
    store = root / "store-train"
    extract(ws, store)
    common = [
        "--target_model", str(root / "target"), "--max_length", "64", "--block_size", "3", "--num_blocks", "2",
        "--drafter_num_layers", "1", "--per_device_train_batch_size", "4", "--learning_rate", "3e-3",
        "--warmup_steps", "0", "--logging_steps", "1", "--save_strategy", "no", "--seed", "0",
        "--dataloader_num_workers", "0", "--use_cpu", "--disable_tqdm", "true", "--report_to", "none",
        "--max_steps", "1", "--draft_vocab_size", "40", "--eval_dataset", "none",
    ]  # fmt: skip
    assert len(load_conversations(str(store))) == 24
    train_main([*common, "--dataset", str(ws["records"]), "--output_dir", str(root / "online")])
    train_main([*common, "--feature_store", str(store), "--output_dir", str(root / "from-store")])

    def first_loss(out):
        history = json.loads((out / "trainer_state.json").read_text())["log_history"]
        return next(e["loss"] for e in history if "loss" in e)

    assert first_loss(root / "from-store") == pytest.approx(first_loss(root / "online"), rel=1e-4)
    # the card's data line counts the stored conversations (not 0 for a folder)
    record = json.loads((root / "from-store" / "training_record.json").read_text())["training"]
    assert record["data"].startswith("24 conversations of the feature store 'store-train' over 'records.jsonl'")
    with pytest.raises(ValueError, match="max_length"):
        train_main([*common, "--max_length", "32", "--feature_store", str(store), "--output_dir", str(root / "bad")])


# --------------------------------------------------------------------------------------- splits and benchmarks
@pytest.fixture(scope="module")
def bench():
    return BenchmarkFilter(benchmark_items())


def test_every_benchmark_prompt_and_solution_is_caught(bench):
    sources = {item.source.split(":")[0] for item in bench.items}
    assert {"humaneval", "mt_bench", "sharegpt-report"} <= sources
    report = load_prompts("sharegpt")["prompt"]
    assert len(report) > 100 and len(load_prompts("humaneval")) == 164 and len(load_prompts("mt_bench")) == 80
    prompts = list(report) + list(load_prompts("humaneval")["prompt"]) + list(load_prompts("mt_bench")["prompt"])
    for text in prompts + [item.text for item in bench.items if item.prompt]:
        assert bench.match([text]) is not None, text[:80]
    for item in bench.items:  # solutions and reference answers, in an assistant turn, unless too short to tell
        if len(normalized_words(item.text)) >= 8:
            assert bench.match(["Write it.", item.text], user=[True, False]) is not None, item.source


def test_near_duplicates_of_benchmark_prompts_are_dropped(bench):
    humaneval = next(i.text for i in bench.items if i.source == "humaneval:HumanEval/0:prompt")
    solution = next(i.text for i in bench.items if i.source == "humaneval:HumanEval/12:full")
    mt_bench = next(i.text for i in bench.items if i.source.startswith("mt_bench:") and len(i.text) > 200)
    report = load_prompts("sharegpt")["prompt"][3]
    words = mt_bench.split()
    reworded = " ".join(w if k % 25 else "indeed" for k, w in enumerate(words))  # every 25th word replaced
    poisoned = {
        "respaced": "  ".join(humaneval.upper().split()),
        "reworded": reworded,
        "repunctuated": mt_bench.replace(",", " ;").replace(".", "!!"),
        "quoted": f"My friend asked me this, please help:\n\n> {report}\n\nThanks a lot!",
        "in code": "# utilities\nimport os\n\n" + solution + "\n\ndef other():\n    return os.getcwd()\n",
        "short": "ich VERSTEHE nur bahnhof!",  # an MT-Bench second turn of four words, exactly
    }
    clean = chats(40)
    records = clean + [
        {"id": f"bad:{name}", "split_key": name, "conversations": [{"from": "human", "value": text},
                                                                    {"from": "gpt", "value": "sure"}]}
        for name, text in poisoned.items()
    ]  # fmt: skip
    records[-2]["conversations"] = [{"from": "human", "value": "Write the module."}, {"from": "gpt", "value": solution}]
    kept, dropped = bench.filter(records)
    assert [r["id"] for r in kept] == [r["id"] for r in clean]
    assert sorted(d["id"] for d in dropped) == sorted(f"bad:{name}" for name in poisoned)


def test_the_three_splits_are_disjoint_and_deterministic():
    records = chats(3000)
    for i in range(0, 3000, 7):  # the same opening prompt under other conversations (ShareGPT repeats texts)
        records.append({**records[i], "id": f"dup:{i}", "split_key": f"dup:{i}"})
    splits = split_records(records)
    again = split_records(list(reversed(records)))  # by hash, not by position
    assert all(sorted(r["id"] for r in splits[s]) == sorted(r["id"] for r in again[s]) for s in SPLITS)
    sizes = {s: len(splits[s]) for s in SPLITS}
    assert 40 < sizes["report"] < 120 and 40 < sizes["select"] < 120, sizes
    for a in SPLITS:
        for b in SPLITS:
            if a < b:
                assert not {r["id"] for r in splits[a]} & {r["id"] for r in splits[b]}
                assert not {r["split_key"] for r in splits[a]} & {r["split_key"] for r in splits[b]}
                assert not {prompt_key(r) for r in splits[a]} & {prompt_key(r) for r in splits[b]}
    assert all(r["split"] == s == split_of(r["split_key"]) for s in SPLITS for r in splits[s])
    mixed = interleave([splits["train"][:5], [{"id": "code:x"}, {"id": "code:y"}]])
    assert len(mixed) == 7 and {r["id"] for r in mixed[:4]} & {"code:x", "code:y"}


def test_sharegpt_source_holds_no_report_slice_record(bench):
    records, dropped = bench.filter(sharegpt_records())  # what the sources stage keeps
    assert any(d["benchmark_match"].startswith("sharegpt-report:") for d in dropped)  # re-cased / re-spaced copies
    rows = load_prompts("sharegpt")
    report, report_ids = {" ".join(p.lower().split()) for p in rows["prompt"]}, set(rows["id"])
    assert len(records) > 15000
    assert not any(r["id"].split(":", 1)[1] in report_ids for r in records)
    turns = {" ".join(t["value"].lower().split()) for r in records for t in r["conversations"] if t["from"] == "human"}
    assert not turns & report


def test_code_records_split_by_file_without_duplicates_tests_or_huge_files(tmp_path):
    body = "\n".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(200))
    files = {
        "pkg/mod.py": body,
        "pip/_vendor/pkg/mod.py": body,  # a vendored copy: same key, deduplicated
        "pkg/tests/test_mod.py": body,
        "pkg/huge.py": "x = 1\n" * 100_000,
        "pkg/small.py": "import os\n" * 40,
    }
    listed = []
    for key, text in files.items():
        path = tmp_path / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if "tests" not in key:  # python_source_files leaves test folders out; here the list is given
            listed.append((key.replace("pip/_vendor/", ""), path))
    out = list(code_records(listed, chunk_chars=1000))
    keys = {r["split_key"] for r in out}
    assert keys == {"code:pkg/mod.py", "code:pkg/small.py"}
    pieces = [r for r in out if r["split_key"] == "code:pkg/mod.py"]
    assert len(pieces) > 3 and all(len(r["conversations"][1]["value"]) < 1200 for r in pieces)
    assert "".join(r["conversations"][1]["value"].removeprefix("```python\n").removesuffix("\n```") + "\n\n"
                   for r in pieces).split() == body.split()  # fmt: skip


def test_regeneration_appends_answers_and_resumes(workspace, tmp_path):
    sources = tmp_path / "sources"
    sources.mkdir()
    records = [{**r, "id": f"sharegpt:{r['id']}_0"} for r in chats(5)]
    (sources / "sharegpt.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    options = argparse.Namespace(target_model=str(workspace["root"] / "target"), max_new_tokens=6,
                                 max_prompt_chars=2000, regenerate_minutes=10.0)  # fmt: skip
    target = workspace["target"]
    target.generation_config.eos_token_id = None
    build_data.regenerate(tmp_path, options, target, workspace["tokenizer"])
    answers = build_data.read_jsonl(sources / "regenerated.jsonl")
    assert len(answers) == 5 and all(a["new_tokens"] == 6 and a["source"] == "regenerated" for a in answers)
    assert {a["split_key"] for a in answers} == {r["split_key"] for r in records}
    with (sources / "regenerated.jsonl").open("a") as f:
        f.write('{"id": "half a li')  # an interrupted write
    build_data.regenerate(tmp_path, options, target, workspace["tokenizer"])
    assert build_data.read_jsonl(sources / "regenerated.jsonl") == answers


def test_the_splits_stage_writes_disjoint_splits_free_of_benchmark_prompts(bench, tmp_path):
    humaneval = next(i.text for i in bench.items if i.source == "humaneval:HumanEval/7:prompt")
    sharegpt = [{**r, "id": f"sharegpt:{r['id']}_0", "source": "sharegpt"} for r in chats(400)]
    sharegpt.append({"id": "sharegpt:leak_0", "source": "sharegpt", "split_key": "sharegpt:leak",
                     "conversations": [{"from": "human", "value": "Please solve:\n" + humaneval},
                                       {"from": "gpt", "value": "ok"}]})  # fmt: skip
    code = [{**r, "id": f"code:{r['id']}", "split_key": f"code:{r['split_key']}", "source": "code"} for r in chats(300, 1)]
    regenerated = [{**r, "id": f"regenerated:{r['id']}", "source": "regenerated"} for r in sharegpt[:50]]
    (tmp_path / "sources").mkdir()
    for name, records in (("sharegpt", sharegpt), ("code", code), ("regenerated", regenerated)):
        build_data.write_jsonl_atomically(tmp_path / "sources" / f"{name}.jsonl", records)
    stats = build_data.build_splits(tmp_path, bench)
    assert stats["benchmark_matches_dropped_at_split_time"] == 1
    splits = {s: build_data.read_jsonl(tmp_path / "splits" / f"{s}.jsonl") for s in SPLITS}
    assert sum(map(len, splits.values())) == len(sharegpt) + len(code) + len(regenerated) - 1
    where = {r["id"]: s for s, records in splits.items() for r in records}
    assert "sharegpt:leak_0" not in where and len(where) == sum(map(len, splits.values()))
    assert all(where[r["id"]] == where[r["id"].removeprefix("regenerated:")] for r in regenerated)
    assert all(bench.filter(records)[1] == [] for records in splits.values())
    assert {r["source"] for r in splits["train"][:6]} == {"sharegpt", "code", "regenerated"}  # interleaved
