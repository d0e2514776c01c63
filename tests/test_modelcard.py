"""Model cards come from records the code writes when things happen: the license given at training, the base
model's recorded Hub id (never a local path), the hardware detected at training time, the data source read from
the data itself, every training session (kept in the training record, ``training_record.json``, next to the
weights: config.json holds the architecture only); the shipped cards are exactly what the generator makes of their
config and record, and every figure in a card's metadata is read from a results file and names its setting."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard

from conftest import make_drafter, make_target
from test_training import common_args, make_tokenizer, write_conversations
from transformers_specblock import SpecBlockDraftModel
from transformers_specblock.commands.card import card_for_folder
from transformers_specblock.commands.card import main as card_main
from transformers_specblock.commands.cli import train_main
from transformers_specblock.hub import provenance
from transformers_specblock.hub.modelcard import CARD_MARKER, is_generated_card
from transformers_specblock.hub.provenance import (
    absolute_paths_in,
    describe_device,
    describe_hardware,
    resolve_base_model_id,
    scrub_paths,
)
from transformers_specblock.training.data import REGENERATED_KEY, describe_training_data, regeneration_record
from transformers_specblock.training.records import checkpoint_training_info, parse_train_command

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A tiny random Llama target saved in a local folder that records no Hub id, and a small chat file."""
    root = tmp_path_factory.mktemp("cards")
    make_target("llama", vocab_size=128).save_pretrained(root / "target")
    make_tokenizer().save_pretrained(root / "target")
    return {"root": root, "target": str(root / "target"), "data": str(write_conversations(root / "chats.jsonl", 8))}


def record_of(folder: Path) -> dict:
    return json.loads((folder / "training_record.json").read_text())


def train(ws, out, *extra):
    """(card, record): the model card and the training record (plus the config's base_model_id) of a 1-step run."""
    train_main(common_args(ws, out, "--max_steps", "1", *extra))
    config = json.loads((out / "config.json").read_text())
    assert "training_info" not in config and "eval_results" not in config  # the architecture only
    record = record_of(out)
    return ModelCard.load(out / "README.md"), {
        "training_info": record["training"], "eval_results": record.get("evaluation", []),
        "base_model_id": config["base_model_id"],
    }  # fmt: skip


def yaml_of(card: ModelCard) -> str:
    return str(card).split("\n---\n", 1)[0]


# ------------------------------------------------------------------------------------------------ license
def test_license_is_the_one_given_at_training_and_survives_a_resume(ws):
    out = ws["root"] / "mit"
    card, config = train(ws, out, "--license", "mit", "--save_strategy", "steps", "--save_steps", "1")
    assert card.data.license == "mit" and "license: mit" in yaml_of(card)
    assert config["training_info"]["license"] == "mit"
    # a resume without --license keeps it, and the card lists both sessions with their own commands
    args = common_args(ws, out, "--max_steps", "2", "--resume_from_checkpoint", str(out / "checkpoint-1"))
    train_main(args)
    card, info = ModelCard.load(out / "README.md"), record_of(out)["training"]
    assert card.data.license == "mit"
    assert [s["steps"] for s in info["sessions"]] == ["0-1", "1-2"]
    assert "--license mit" in info["sessions"][0]["command"] and "--resume_from_checkpoint" in info["command"]
    assert info["train_steps"] == 2 and "over 1 runs" not in card.text and "2 optimizer steps" in card.text


def test_time_up_to_a_checkpoint_counts_after_a_resume(ws):
    """The training time of a resumed run includes the steps after the last log before the checkpoint."""
    out = ws["root"] / "time"
    extra = ["--logging_steps", "50", "--save_strategy", "steps", "--save_steps", "1"]  # no log before step 2
    train_main(common_args(ws, out, "--max_steps", "1", *extra))
    state = json.loads((out / "checkpoint-1" / "trainer_state.json").read_text())
    before = [e["train_seconds"] for e in state["log_history"] if "train_seconds" in e]
    assert before and before[-1] > 0  # written with the checkpoint, not only by a log
    train_main(common_args(ws, out, "--max_steps", "2", *extra, "--resume_from_checkpoint", str(out / "checkpoint-1")))
    total = json.loads((out / "all_results.json").read_text())["train_seconds"]
    assert total >= before[-1]
    info = record_of(out)["training"]
    assert info["train_time_minutes"] == round(total / 60, 1) and info["train_steps"] == 2


def test_a_continued_drafter_keeps_its_record_and_settings_and_drops_the_old_evaluation(ws):
    """A run from --init_drafter nests the record of the drafter it started from (the card shows both runs, the
    tokens add up), keeps its decoding settings, drops the evaluation rows that measured the old weights; a checkpoint of the run yields the
    record the finished run writes (what a drafter published while its run goes on carries)."""
    first = ws["root"] / "first"
    train(ws, first)
    record = record_of(first)
    record["evaluation"] = [{"dataset": "mt_bench", "tau": 9.99}]  # as if measured
    (first / "training_record.json").write_text(json.dumps(record))
    settings = json.loads((first / "generation_config.json").read_text())
    settings["prompt_lookup_num_tokens"] = 7  # its own decoding settings, not the defaults
    (first / "generation_config.json").write_text(json.dumps(settings))
    out = ws["root"] / "continued"
    card, config = train(ws, out, "--init_drafter", str(first), "--save_strategy", "steps", "--save_steps", "1")
    info, earlier = config["training_info"], config["training_info"]["started_from"]
    # the record names no folder of this machine: the drafter a run started from by its last two path components
    assert earlier["drafter"] == f"<local>:{first.parent.name}/{first.name}" and str(ws["root"]) not in str(info)
    assert earlier["train_steps"] == 1 and "started_from" not in earlier
    assert info["total_train_tokens"] == info["train_tokens"] + earlier["train_tokens"] > info["train_tokens"]
    assert info["train_cpu_minutes"] >= 0 and not config["eval_results"]
    assert json.loads((out / "generation_config.json").read_text())["prompt_lookup_num_tokens"] == 7
    assert "over 2 runs, each continuing the one before; 2 optimizer steps" in card.text
    assert str(first) not in card.text and "--output_dir" not in card.text  # commands stay in the record
    assert "9.99" not in card.text and "_No evaluation recorded yet._" in card.text
    from_checkpoint = checkpoint_training_info(out / "checkpoint-1")
    for key in ("command", "data", "hardware", "train_tokens", "train_steps", "total_train_tokens", "started_from"):
        assert scrub_paths(from_checkpoint[key]) == info[key], key
    model_args, data_args, _ = parse_train_command(from_checkpoint["command"])
    assert model_args.init_drafter == str(first) and data_args.dataset == ws["data"]


def test_no_license_field_without_the_argument(ws):
    card, config = train(ws, ws["root"] / "nolicense")
    assert card.data.license is None and "license" not in yaml_of(card)
    assert "license" not in config["training_info"]


# ------------------------------------------------------------------------------------------------ base model
def test_base_model_is_a_recorded_hub_id_never_a_local_path(ws):
    card, config = train(ws, ws["root"] / "local")  # a local folder that records no Hub id
    assert card.data.base_model is None and config["base_model_id"] is None
    assert ws["target"] not in card.text and str(ws["root"]) not in card.text  # no local path anywhere in the card
    assert absolute_paths_in(record_of(ws["root"] / "local")) == []  # nor in the record
    card, config = train(ws, ws["root"] / "explicit", "--base_model_id", "org/tiny-llama")
    assert card.data.base_model == "org/tiny-llama" and config["base_model_id"] == "org/tiny-llama"
    assert 'target_id = "org/tiny-llama"' in card.text and 'dtype=dtype, device_map="auto"' in card.text
    with pytest.raises(ValueError, match="owner/name"):
        train(ws, ws["root"] / "bad_id", "--base_model_id", str(ws["root"] / "target"))


def test_resolve_base_model_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_base_model_id("smollm2-135m-instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert resolve_base_model_id("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"  # a Hub id, no such local folder
    folder = tmp_path / "out" / "target"
    folder.mkdir(parents=True)
    assert resolve_base_model_id("out/target") is None  # shaped like owner/name, but a local folder
    assert resolve_base_model_id(str(folder)) is None
    (folder / "config.json").write_text(json.dumps({"_name_or_path": "org/recorded"}))
    assert resolve_base_model_id(str(folder)) == "org/recorded"  # what the folder's config records
    (folder / "config.json").write_text(json.dumps({"_name_or_path": "/home/someone/model"}))
    assert resolve_base_model_id(str(folder)) is None
    snapshot = tmp_path / "hub" / "models--org--cached" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    assert resolve_base_model_id(str(snapshot)) == "org/cached"
    assert resolve_base_model_id(str(folder), explicit="org/given") == "org/given"
    # from_target records it too: the target's name_or_path is a local path here
    target = make_target("llama")
    target.name_or_path = str(folder)
    assert make_drafter(target).config.base_model_id is None
    target.name_or_path = "org/hub-target"
    drafter = make_drafter(target)
    assert drafter.config.base_model_id == "org/hub-target"
    drafter.save_pretrained(tmp_path / "d")
    assert ModelCard.load(tmp_path / "d" / "README.md").data.base_model == "org/hub-target"


# ------------------------------------------------------------------------------------------------ hardware
def test_hardware_is_detected_at_training_time(ws, monkeypatch):
    _, config = train(ws, ws["root"] / "hw")
    expected = describe_hardware("cpu", torch.float32, torch.float32)
    assert config["training_info"]["hardware"] == expected
    cpu = describe_device("cpu")
    info = provenance._cpu_info()
    assert cpu.startswith(provenance._cpu_name(info)) and f", {provenance._usable_cores()} cores" in cpu
    assert cpu.endswith(provenance.cpu_capability(info)) and torch.backends.cpu.get_cpu_capability() in cpu
    assert expected == f"{cpu}; target float32, drafter float32"
    # the CPU's own name and flags, not typed-in ones
    fake = {"model name": "Test CPU 9000", "flags": "fpu avx2 avx512f avx512_bf16"}
    monkeypatch.setattr(provenance, "_cpu_info", lambda: fake)
    monkeypatch.setattr(provenance, "_usable_cores", lambda: 7)
    capability = torch.backends.cpu.get_cpu_capability()
    assert describe_hardware("cpu", torch.bfloat16, torch.float32, mixed_precision="bf16") == (
        f"Test CPU 9000, 7 cores, torch {capability}, native bfloat16 (avx512_bf16); target bfloat16, drafter "
        "float32 (bf16 mixed precision)"
    )
    fake["flags"] = "fpu avx2"
    assert "no native bfloat16 matmul" in describe_device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU")
    assert describe_device("cuda:0") == "NVIDIA Test GPU"
    assert describe_device(torch.device("cuda", 0), num_processes=4) == "4 x NVIDIA Test GPU"
    assert describe_hardware("cuda", torch.bfloat16, torch.float32, target_device="cpu") == (
        f"drafter on NVIDIA Test GPU, target on Test CPU 9000, 7 cores, torch {capability}, no native bfloat16 "
        "matmul; target bfloat16, drafter float32"
    )


# ------------------------------------------------------------------------------------------------ data
def _write(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_data_record_says_whether_answers_were_regenerated_by_the_target(tmp_path):
    turns = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]
    own = regeneration_record("smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "sharegpt-train",
                              max_new_tokens=8, do_sample=False)  # fmt: skip
    other = regeneration_record("big-model", "org/big", "sharegpt-train", max_new_tokens=8, do_sample=False)
    target, target_id = "smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"

    sharegpt = describe_training_data("sharegpt", 100, 512, target, target_id)
    assert sharegpt["self_distilled"] is False and "NOT responses regenerated by the target" in sharegpt["data"]
    assert sharegpt["datasets"] == ["anon8231489123/ShareGPT_Vicuna_unfiltered"]

    mine = _write(tmp_path / "own.jsonl", [{"id": str(i), "conversations": turns, REGENERATED_KEY: own} for i in "ab"])
    record = describe_training_data(mine, None, 64, target, target_id)
    assert record["self_distilled"] is True and "regenerated by the target itself" in record["data"]
    assert record["datasets"] == ["anon8231489123/ShareGPT_Vicuna_unfiltered"]  # the prompts' source
    assert str(tmp_path) not in record["data"]  # the file's name, not its local path

    theirs = _write(tmp_path / "other.jsonl", [{"id": "a", "conversations": turns, REGENERATED_KEY: other}])
    record = describe_training_data(theirs, None, 64, target, target_id)
    assert record["self_distilled"] is False and "another model (org/big)" in record["data"]

    mixed = [{"id": "a", "conversations": turns, REGENERATED_KEY: own}, {"id": "b", "conversations": turns}]
    record = describe_training_data(_write(tmp_path / "mixed.jsonl", mixed), None, 64, target, target_id)
    assert record["self_distilled"] is False and "1 answers regenerated by the target itself" in record["data"]
    plain = describe_training_data(_write(tmp_path / "plain.jsonl", mixed[1:]), None, 64, target, target_id)
    assert plain["self_distilled"] is False and "records no regeneration" in plain["data"]
    assert plain["datasets"] is None


# ------------------------------------------------------------------------------------------------ shipped cards
def shipped_folders() -> list[Path]:
    """The shipped drafters, wherever the checkout keeps them (package data, or models/ of older checkouts)."""
    configs = [*ROOT.glob("src/transformers_specblock/**/config.json"), *ROOT.glob("models/*/config.json")]
    return sorted({c.parent for c in configs if (c.parent / "model.safetensors").is_file()})


def test_qwen_drafters_cards_name_target_data_and_the_equal_cpu_budget():
    folders = [folder for folder in shipped_folders() if "-qwen2.5-coder-" in folder.name]
    assert {folder.name.split("-")[0] for folder in folders} == {"specblock", "eagle3"}
    budgets = set()
    for folder in folders:
        card, record = (folder / "README.md").read_text(encoding="utf-8"), record_of(folder)
        info, evaluation = record["training"], record["evaluation"]
        assert json.loads((folder / "config.json").read_text())["base_model_id"] == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
        assert "the Q4_K_M GGUF" in card and 'load_packaged_model("qwen2.5-coder-0.5b-instruct"' in card
        assert f'.from_pretrained("{folder.name}")' in card
        # the shared feature store, by source; one schedule in CPU time, run to its budget (annealed)
        assert "feature store" in info["data"] and all(f"{source} " in info["data"] for source in ("sharegpt", "code"))
        assert "--feature_store" in info["command"] and "--lr_scheduler_type warmup_stable_decay" in info["command"]
        budgets.add(re.search(r"--max_train_cpu_hours (\S+)", info["command"]).group(1))
        assert abs(info["train_cpu_minutes"] - 60 * float(budgets.copy().pop())) < 3
        assert f"{info['train_tokens'] / 1e6:.2f}M training tokens" in card and "avx512_bf16" in card
        assert f"- Little trained ({info['train_tokens'] / 1e6:.2f}M tokens)" in card  # under 1M: the card says so
        shipped = [row for row in evaluation if row["kind"] == "as_shipped"]
        alone = [row for row in evaluation if row["kind"] == "drafter_alone"]
        assert {row["dataset"] for row in shipped} == {"humaneval", "mt_bench"}
        assert all(row["prompts"] >= 16 and row["max_new_tokens"] >= 128 for row in shipped)
        assert all(row["setting"].startswith("as shipped: bfloat16") for row in shipped)
        assert {row["tree_budget"] for row in alone} == {8, 16, 32} and all(r["free_candidates"] == "off" for r in alone)
    assert len(budgets) == 1, budgets  # both drafters trained for the same CPU time


SHIPPED_SESSIONS = {"specblock": (4, "steps 280-350"), "eagle3": (3, "steps 150-700")}


def test_shipped_cards_are_what_the_generator_makes_of_their_config(tmp_path):
    folders = shipped_folders()
    assert len(folders) >= 3, folders  # the SpecBlock, EAGLE-3 and DFlash drafters
    for folder in folders:
        generated = str(card_for_folder(folder))
        assert (folder / "README.md").read_text(encoding="utf-8") == generated, (
            f"{folder}/README.md is not the generated card: run python -m transformers_specblock.commands.card {folder}"
        )
        if not folder.name.endswith("-smollm2-135m-instruct"):
            continue  # the Qwen drafters: test_qwen_drafters_cards_name_target_data_and_the_equal_cpu_budget
        config, record = json.loads((folder / "config.json").read_text()), record_of(folder)
        info, evaluation = record["training"], record["evaluation"]
        assert config["base_model_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
        assert "license" not in info  # none was given at training
        assert "backfilled" not in info and "backfilled" not in generated  # records complete
        assert len(generated) < 20_000 and "```bash" not in generated  # commands and the chain stay in the record
        # the target exactly as trained and measured: the packaged Q4_1 GGUF dequantized, not the Hub's weights
        assert "the Q4_1 GGUF `SmolLM2-135M-Instruct.Q4_1.gguf`" in generated and "dequantized" in generated
        assert 'load_packaged_model("smollm2-135m-instruct"' in generated
        assert f'.from_pretrained("{folder.name}")' in generated  # the one usage snippet loads it by its name
        # results as shipped, in the host's fast dtype, then the drafter alone, each row naming its setting
        shipped = [row for row in evaluation if row["kind"] == "as_shipped"]
        alone = [row for row in evaluation if row["kind"] == "drafter_alone"]
        assert {row["dataset"] for row in shipped} == {"humaneval", "mt_bench"} and len(shipped) + len(alone) == len(
            evaluation
        )
        assert all(row["setting"].startswith("as shipped: bfloat16") for row in shipped)
        assert all(row["hardware"].endswith("; target float32, drafter float32") for row in alone)
        assert all(row["setting"].startswith("drafter alone: float32, free candidates off, fixed tree_budget")
                   for row in alone)  # fmt: skip
        assert {row["tree_budget"] for row in alone} == {8, 16, 32} and all(r["free_candidates"] == "off" for r in alone)
        assert generated.index("### As shipped") < generated.index("### The drafter alone")
        assert "## Limitations" in generated and "## Training" in generated and "Little trained" not in generated
        if folder.name.startswith("dflash"):  # one run on a GPU, on the target's own answers and ShareGPT's
            assert "H200" in info["hardware"] and "sessions" not in info and info["train_tokens"] == 13225831
            assert "3,456 answers regenerated by the target itself" in info["data"] and info["self_distilled"] is False
            assert "13.23M training tokens" in generated
            continue
        kind = folder.name.split("-")[0]
        # the campaign (ShareGPT's and the target's answers; bfloat16 autocast on hosts with native bfloat16, float32
        # elsewhere), continuing the drafter shipped before,
        # in runs each continuing the previous one (a run went on from committed weights after a machine lost its
        # files): every run's total counts the runs before it, down to the drafter shipped before the campaign
        tokens_before, campaign_steps = {"eagle3": (673750, 4250), "specblock": (337356, 5560)}[kind]
        runs = []
        while "train.jsonl" in info["data"]:
            runs.append(info)
            info = info["started_from"]
        assert sum(run["train_steps"] for run in runs) == campaign_steps and info["train_tokens"] == tokens_before
        for run, before in zip(runs, [*runs[1:], {"total_train_tokens": tokens_before}]):
            assert run["total_train_tokens"] == run["train_tokens"] + before["total_train_tokens"]
            assert "answers regenerated by the target itself" in run["data"]
            precision = "(bf16 mixed precision)" if "avx512_bf16" in run["hardware"] else "drafter float32"
            assert run["hardware"].endswith(precision)
        assert runs[-1]["started_from"]["drafter"] == f"{kind}-smollm2-135m-instruct"
        total = record["training"]["total_train_tokens"]
        assert f"{total / 1e6:.2f}M training tokens over {len(runs) + 1} runs" in generated
        assert "CPU-hours" in generated and "avx512_bf16" in generated  # time and hardware
        if kind == "specblock":  # the reference implementation's trees, one block round, grown best first
            settings = json.loads((folder / "generation_config.json").read_text())
            assert settings["max_blocks"] == 1 and settings["tree_construction"] == "reference"
            assert settings["block_expansion"] == "best_first"
            assert '"tree_construction": "reference", "max_blocks": 1, "block_expansion": "best_first"' in generated
            assert all(row["block_expansion"] == "best_first" for row in alone)
            assert record["training_settings"] == {"fusion_identity_init": True}
        else:
            assert record["training_settings"] == {"ttt_steps": 7, "ttt_decay": 0.8}
        # the drafters shipped before the campaign: trained on this CPU at equal compute on ShareGPT's own answers,
        # resumed over several sessions, every session in the record
        assert info["self_distilled"] is False and "NOT responses regenerated" in info["data"]
        sessions, last = SHIPPED_SESSIONS[kind]
        assert len(info["sessions"]) == sessions and info["sessions"][-1]["steps"] == last.split()[-1]
    assert card_main(["--check", *map(str, folders)]) == 0
    # --check notices a hand edit
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("config.json", "model.safetensors", "README.md", "training_record.json"):
        (copy / name).write_bytes((folders[0] / name).read_bytes())
    (copy / "README.md").write_text((copy / "README.md").read_text() + "\nedited by hand\n")
    assert card_main(["--check", str(copy)]) == 1
    assert card_main([str(copy)]) == 0 and card_main(["--check", str(copy)]) == 0


def _figure_in_results_file(path: Path, metric: str, dataset: str, setting: str) -> float:
    """The drafter-alone figure a card's metadata names, read from the eval_results.json it names: the row of that
    prompt set and fixed budget, measured without free candidates."""
    budget = int(setting.split("fixed tree_budget ")[1].split(",")[0])
    (row,) = [r for r in json.loads(path.read_text()) if r["dataset"] == dataset and r["tree_budget"] == budget]
    assert row["free_candidates"] == "off" and "free candidates off" in setting
    dtype = setting.split("drafter alone: ")[1].split(",")[0]  # the dtype the setting names is the row's
    assert row["hardware"].endswith(f"target {dtype}, drafter {dtype}"), (setting, row["hardware"])
    return row[metric]


GLANCE_ROWS = {  # where each shipped drafter's as-shipped speed-ups are published: (page, generated section, row)
    "specblock-smollm2-135m-instruct": ("README.md", "glance", "SpecBlock"),
    "eagle3-smollm2-135m-instruct": ("README.md", "glance", "EAGLE-3"),
    "dflash-smollm2-135m-instruct": ("README.md", "glance", "DFlash"),
    "specblock-qwen2.5-coder-0.5b-instruct": ("docs/benchmarks.md", "qwen-glance", "SpecBlock, 1 block round"),
    "eagle3-qwen2.5-coder-0.5b-instruct": ("docs/benchmarks.md", "qwen-glance", "EAGLE-3"),
}


def test_every_figure_in_a_shipped_cards_metadata_matches_a_results_file_and_names_its_setting():
    method_of = {"specblock": "specblock", "eagle3": "eagle3", "dflash": "dflash"}
    for folder in shipped_folders():
        card = ModelCard.load(folder / "README.md")
        results = card.data.eval_results
        assert results, folder
        kinds, shipped_speedups = set(), []
        for result in results:
            name, setting = result.metric_name.split(", ", 1)
            kind = "as shipped" if setting.startswith("as shipped: ") else "drafter alone"
            assert setting.startswith(("as shipped: ", "drafter alone: ")), result.metric_name
            kinds.add(kind)
            assert result.metric_type in ("speedup_vs_plain", "tau")
            assert ("speed-up" in name) == (result.metric_type == "speedup_vs_plain")
            path = ROOT / result.metric_config
            assert path.is_file() and result.metric_config.startswith("docs/results/"), result.metric_config
            data = json.loads(path.read_text())
            if kind == "as shipped":  # the README's glance table: the drafter as shipped, in bfloat16
                assert data["settings"]["dataset"] == result.dataset_type and data["settings"]["dtype"] == "bfloat16"
                assert setting.startswith("as shipped: bfloat16") and 'tree_budget "auto", free candidates on' in setting
                run = data["settings"]
                assert f"{run['num_prompts']} prompts x {run['max_new_tokens']} new tokens" in setting
                method = re.search(r"specblock-bench method (\w+)", setting)  # else the family's own method
                measured = data["methods"][method.group(1) if method else method_of[folder.name.split("-")[0]]]
                expected = measured["speedup" if result.metric_type == "speedup_vs_plain" else "tau"]
                if result.metric_type == "speedup_vs_plain":
                    shipped_speedups.append(expected)
            else:
                expected = _figure_in_results_file(path, result.metric_type, result.dataset_type, setting)
            assert result.metric_value == pytest.approx(expected, abs=5e-4), (folder.name, result.metric_name)
        assert kinds == {"as shipped", "drafter alone"}
        # the as-shipped speed-ups are those of the glance table that publishes them
        page, section, label = GLANCE_ROWS[folder.name]
        glance = (ROOT / page).read_text().split(f"<!-- BEGIN generated: {section} -->")[1].split("<!-- END")[0]
        line = next(line for line in glance.splitlines() if line.startswith(f"| {label} |"))
        assert len(shipped_speedups) == 2 and all(f"{value:.2f}x" in line for value in shipped_speedups), line


def test_a_record_without_a_results_file_gets_no_metadata_figure(tmp_path):
    drafter = make_drafter(make_target("llama"))
    drafter.config.eval_results = [{"dataset": "mt_bench", "tau": 1.5}]  # no kind, no setting: listed, not in metadata
    drafter.save_pretrained(tmp_path)
    card = ModelCard.load(tmp_path / "README.md")
    assert not card.data.eval_results and "### Other measurements" in card.text and "| mt_bench | 1.5 |" in card.text


def test_saved_card_equals_the_folder_card(tmp_path):
    drafter = make_drafter(make_target("llama"))
    # keys out of alphabetical order: the saved config.json sorts them, the card must not change
    drafter.config.training_info = {"train_steps": 3, "zeta": 1, "command": "specblock-train ...", "license": "mit"}
    drafter.config.eval_results = [{"tau": 1.5, "zz": 2, "dataset": "d", "backfilled": "hardware"}]
    drafter.save_pretrained(tmp_path)
    assert (tmp_path / "README.md").read_text() == str(card_for_folder(tmp_path))
    assert SpecBlockDraftModel.from_pretrained(tmp_path).config.training_info["license"] == "mit"


def test_the_card_lists_the_decoding_settings_that_differ_from_the_defaults(tmp_path):
    drafter = make_drafter(make_target("llama"))
    drafter.set_drafting_settings(tree_budget="auto")  # the package's defaults (the helper's drafter has budget 32)
    drafter.save_pretrained(tmp_path / "plain")
    assert "Decoding settings (`generation_config.json`; a `generate` keyword overrides one for a call):\n  the " \
           "package's defaults" in (tmp_path / "plain" / "README.md").read_text()  # fmt: skip
    drafter.set_drafting_settings(tree_construction="reference", tree_budget=16)
    drafter.save_pretrained(tmp_path / "changed")
    card = (tmp_path / "changed" / "README.md").read_text()
    assert '{"tree_budget": 16, "tree_construction": "reference"}' in card
    assert card == str(card_for_folder(tmp_path / "changed"))  # read back from generation_config.json


# ------------------------------------------------------------------------------------------------ the user's README
def test_save_pretrained_keeps_a_readme_the_user_wrote(tmp_path):
    """issue 61, bug 4: a README.md the package did not generate survives save_pretrained (and the card command
    without --force); a generated card is replaced as before."""
    drafter = make_drafter(make_target("llama"))
    drafter.save_pretrained(tmp_path)
    generated = (tmp_path / "README.md").read_text()
    assert CARD_MARKER in generated
    drafter.config.eval_results = [{"dataset": "mt_bench", "tau": 1.5}]
    drafter.save_pretrained(tmp_path)  # a generated card is regenerated
    assert (tmp_path / "README.md").read_text() != generated and "| mt_bench | 1.5 |" in (tmp_path / "README.md").read_text()
    mine = "# My drafter\n\nNotes I wrote myself.\n"
    (tmp_path / "README.md").write_text(mine)
    drafter.save_pretrained(tmp_path)
    assert (tmp_path / "README.md").read_text() == mine
    assert SpecBlockDraftModel.from_pretrained(tmp_path).config.eval_results[0]["tau"] == 1.5  # the rest is saved
    assert card_main([str(tmp_path)]) == 0 and (tmp_path / "README.md").read_text() == mine
    assert card_main(["--force", str(tmp_path)]) == 0 and CARD_MARKER in (tmp_path / "README.md").read_text()
    # a card of an older release (before the marker) counts as generated
    old = (ROOT / "tests" / "reference" / "fixtures").glob("*/README.md")
    assert is_generated_card("# SpecBlockDraftModel for x\n\nA drafter, made with\n`transformers-specblock`. It reads three")
    assert not is_generated_card(mine) and not list(old)


def test_the_training_record_survives_autoconfig_loading_and_a_save(tmp_path):
    """AutoModel builds the config from config.json alone; the record next to it is read all the same, so a drafter
    loaded that way and saved keeps its provenance (config.json stays the architecture only)."""
    from transformers import AutoModel

    drafter = make_drafter(make_target("llama"))
    drafter.config.training_info = {"train_tokens": 5, "command": "specblock-train --dataset /home/me/chats.jsonl"}
    drafter.save_pretrained(tmp_path / "a")
    loaded = AutoModel.from_pretrained(str(tmp_path / "a"))
    assert loaded.config.training_info == {"train_tokens": 5, "command": "specblock-train --dataset <local>:me/chats.jsonl"}
    loaded.save_pretrained(tmp_path / "b")
    assert record_of(tmp_path / "b")["training"]["train_tokens"] == 5
    assert "_training_record_read" not in (tmp_path / "b" / "config.json").read_text()
    assert (tmp_path / "b" / "README.md").read_text() == str(card_for_folder(tmp_path / "b"))
