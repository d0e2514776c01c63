"""The benchmark harness on tiny random models: every method runs, metrics are consistent, resume works."""

from __future__ import annotations

import copy
import json
import logging
import sys

import datasets
import pytest
import torch

from conftest import make_drafter, make_target
from test_greedy_exactness import letter_tokenizer
from transformers_specblock import Eagle3DraftModel, LookupTreeModel
from transformers_specblock.commands.benchmark import Method, run_benchmark
from transformers_specblock.commands.report import markdown_tables, write_report
from transformers_specblock.commands.exactness import NEAR_TIE_GAP
from transformers_specblock.hub.provenance import describe_device

VOCAB = 24


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_setup():
    target = make_target("llama", vocab_size=VOCAB, seed=2)
    tokenizer = letter_tokenizer(VOCAB)
    specblock = make_drafter(target, tree_policy="fixed", fixed_width=4, max_blocks=2, tree_budget=24)
    torch.manual_seed(7)
    eagle3 = Eagle3DraftModel.from_target(target, tree_top_k=3, tree_depth=3, tree_budget=16)
    assistant = make_target("llama", vocab_size=VOCAB, seed=9, num_hidden_layers=2)
    prompts = datasets.Dataset.from_list(
        [
            {"id": f"p{i}", "category": ["writing", "coding"][i % 2], "prompt": text, "text": text}
            for i, text in enumerate(["abcab", "hgfhgf", "mnomno", "qrsqr"])
        ]
    )
    methods = [
        Method("prompt_lookup", {"prompt_lookup_num_tokens": 3}),
        Method("assisted", {"assistant_model": assistant}),
        Method("specblock", {"assistant_model": specblock}),
        Method("specblock_fixed_tree", {"assistant_model": specblock}, {"tree_policy": "fixed", "fixed_width": 2}),
        Method("specblock_one_block", {"assistant_model": specblock}, {"max_blocks": 1}),
        Method("eagle3", {"assistant_model": eagle3}),
    ]
    return target, tokenizer, prompts, methods, specblock


def test_every_method_runs_and_metrics_are_consistent(tmp_path):
    target, tokenizer, prompts, methods, specblock = tiny_setup()
    results = run_benchmark(target, tokenizer, prompts, methods, max_new_tokens=16, output_dir=tmp_path)
    summary = results.summary()
    assert set(summary) == {"plain", *(m.name for m in methods)}
    for name, row in summary.items():
        assert row["identical_to_reference"], name  # greedy: every method reproduces plain generate
        assert row["left_greedy"] == 0 and row["max_fp32_gap"] is None, name
        assert row["tokens_per_s"] > 0 and row["num_prompts"] == len(prompts)
    assert summary["plain"]["speedup"] == pytest.approx(1.0)
    for row in results.prompts:
        if row.iterations:  # tree methods: tau x iterations = tokens committed by verifications (+1 from prefill)
            assert row.tau * row.iterations == pytest.approx(row.new_tokens - 1)
            assert row.target_calls == row.iterations + 1  # one verification forward per iteration, plus prefill
        if row.method == "plain":  # one forward per new token (the prefill gives the first)
            assert row.target_calls == row.new_tokens
    assert summary["plain"]["tokens_per_target_call"] == pytest.approx(1.0)
    for name in ("prompt_lookup", "specblock", "eagle3"):  # chains too: fewer target forwards than tokens
        assert summary[name]["tokens_per_target_call"] > 1.0, name
    assert summary["assisted"]["tokens_per_target_call"] >= 1.0  # a random assistant: at least the target's own token
    for name in ("specblock", "specblock_fixed_tree", "specblock_one_block", "eagle3"):
        split = summary[name]["time_per_iter_ms"]
        total = sum(r.seconds for r in results.prompts if r.method == name) * 1e3
        iters = sum(r.iterations for r in results.prompts if r.method == name)
        assert sum(split.values()) == pytest.approx(total / iters, rel=1e-6)
        assert 0.0 < summary[name]["drafting_share"] < 1.0
    assert summary["specblock_one_block"]["drafter_forwards_per_iter"] == pytest.approx(1.0, abs=0.2)
    assert summary["specblock"]["drafter_forwards_per_iter"] > summary["specblock_one_block"]["drafter_forwards_per_iter"]
    settings = specblock.generation_config
    assert settings.max_blocks == 2 and settings.fixed_width == 4  # the ablation settings restored

    write_report(results, tmp_path)
    payload = json.loads((tmp_path / "results.json").read_text())
    assert set(payload["per_category"]) == {"writing", "coding"}
    for key in ("speedup", "tau", "tokens_per_target_call", "tokens_per_s", "drafting_share", "drafter_forwards_per_iter", "nodes_per_iter",
                "identical_to_reference", "left_greedy", "max_fp32_gap"):  # fmt: skip
        assert key in payload["methods"]["specblock"]
    assert (tmp_path / "speedup_tau.png").stat().st_size > 0
    assert (tmp_path / "time_per_iteration.png").stat().st_size > 0
    assert "| specblock |" in (tmp_path / "results.md").read_text()


def test_resume_skips_finished_prompts(tmp_path, monkeypatch):
    target, tokenizer, prompts, methods, _ = tiny_setup()
    first = run_benchmark(target, tokenizer, prompts.select(range(2)), methods[:1], max_new_tokens=8, output_dir=tmp_path)
    calls = []
    original = type(target).generate
    monkeypatch.setattr(type(target), "generate", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    second = run_benchmark(target, tokenizer, prompts, methods[:1], max_new_tokens=8, output_dir=tmp_path)
    assert len(calls) == 2 + 2 * 2  # one warm-up call per method, then the two new prompts with both methods
    assert [r.prompt_id for r in second.prompts[:4]] == [r.prompt_id for r in first.prompts]
    assert len((tmp_path / "per_prompt.jsonl").read_text().splitlines()) == 8
    calls.clear()
    third = run_benchmark(target, tokenizer, prompts, methods[:1], max_new_tokens=8, output_dir=tmp_path)
    assert calls == [] and len(third.prompts) == 8  # all done: no warm-up, nothing re-run


def test_cli_methods_take_a_tree_budget_and_auto_is_measured_in_warm_up(tmp_path):
    from transformers_specblock.commands.cli import BenchArguments, build_methods

    target, tokenizer, prompts, _, specblock = tiny_setup()
    specblock.save_pretrained(tmp_path / "drafter")
    args = BenchArguments(
        target_model="tiny", specblock_model=str(tmp_path / "drafter"), tree_budget="12",
        methods="plain,specblock@4,specblock_one_block@auto,prompt_lookup,plain_control,specblock_reference_one_block",
    )  # fmt: skip
    methods = build_methods(args, target)
    assert [m.name for m in methods] == ["specblock@4", "specblock_one_block@auto", "prompt_lookup", "plain_control",
                                         "specblock_reference_one_block"]  # fmt: skip
    assert methods[3].generate_kwargs == {} and methods[3].tree_settings == {}  # plain generate, timed as a method
    assert methods[0].tree_settings == {"tree_budget": 4}
    assert methods[1].tree_settings == {"max_blocks": 1, "tree_budget": "auto"}
    assert methods[4].tree_settings == {"tree_construction": "reference", "max_blocks": 1, "tree_budget": 12}
    assert methods[0].generate_kwargs["assistant_model"] is methods[1].generate_kwargs["assistant_model"]
    for bad, message in [("prompt_lookup@4", "only tree methods"), ("plain_control@8", "only tree methods"),
                         ("specblock@0", "positive int"), ("specblock@big", "positive int"),
                         ("medusa", "Unknown method")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            build_methods(BenchArguments(target_model="tiny", methods=bad, specblock_model=str(tmp_path / "drafter")),
                          target)  # fmt: skip

    drafter = methods[1].generate_kwargs["assistant_model"]
    results = run_benchmark(target, tokenizer, prompts.select(range(1)), [*methods[:2], *methods[3:]], max_new_tokens=8)
    assert drafter.serving_state().auto_budget is not None  # the one-off cost measurement ran
    assert all(r.identical_to_reference for r in results.prompts)
    control = next(r for r in results.prompts if r.method == "plain_control")
    assert control.tau is None and control.seconds > 0
    if sys.platform == "linux":
        assert all(r.peak_memory_mb > 0 for r in results.prompts)  # the process' peak RSS


def test_prompts_are_spread_over_categories():
    from transformers_specblock.commands.cli import spread_over_categories

    rows = [{"id": str(i), "category": c, "prompt": "x"} for i, c in enumerate("aaabbbccc")]
    picked = spread_over_categories(datasets.Dataset.from_list(rows), 4)
    assert picked["category"] == ["a", "b", "c", "a"] and picked["id"] == ["0", "3", "6", "1"]
    assert len(spread_over_categories(datasets.Dataset.from_list(rows), None)) == 9


def test_sampling_speedup_is_a_rate_ratio_and_exactness_is_not_claimed():
    target, tokenizer, prompts, methods, _ = tiny_setup()
    results = run_benchmark(
        target, tokenizer, prompts.select(range(2)), [methods[2]], max_new_tokens=12, do_sample=True,
        temperature=1.0, top_k=None, top_p=None, warmup_tokens=0,
    )  # fmt: skip
    summary = results.summary()
    assert summary["specblock"]["speedup"] == pytest.approx(
        summary["specblock"]["tokens_per_s"] / summary["plain"]["tokens_per_s"]
    )
    assert summary["specblock"]["identical_to_reference"] is None and summary["plain"]["identical_to_reference"] is None
    assert "| specblock |" in markdown_tables(results.payload())


def _first_difference(a: list[int], b: list[int]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


def test_a_16bit_run_records_where_outputs_leave_greedy_and_the_float32_gap_there(tmp_path, caplog):
    """A method that is not greedy-exact on purpose (a repetition penalty) diverges; each such row gets the first
    differing position and the float32 logit gap there, measured on a float32 copy of the bfloat16 target."""
    target, tokenizer, prompts, _, _ = tiny_setup()
    target = target.to(torch.bfloat16)
    float32_target = copy.deepcopy(target).float()  # the bfloat16 weights, computing in float32
    penalised = Method("penalised", {"repetition_penalty": 8.0})
    with caplog.at_level(logging.WARNING):
        results = run_benchmark(target, tokenizer, prompts, [penalised], max_new_tokens=12, output_dir=tmp_path,
                                warmup_tokens=0)  # fmt: skip
    assert target.dtype == torch.bfloat16 and results.settings["near_tie_gap"] == NEAR_TIE_GAP
    left = [r for r in results.prompts if r.method == "penalised" and not r.identical_to_reference]
    assert left, "the penalty changed no output: the test proves nothing"
    for row in left:
        inputs = tokenizer(prompts[int(row.prompt_id[1:])]["text"], return_tensors="pt", add_special_tokens=False)
        start = inputs["input_ids"].shape[1]
        reference = target.generate(**inputs, do_sample=False, max_new_tokens=12)[0, start:].tolist()
        tokens = target.generate(**inputs, do_sample=False, max_new_tokens=12, repetition_penalty=8.0)[0, start:]
        position = _first_difference(reference, tokens.tolist())
        with torch.no_grad():  # the float32 target's logits after the common prefix
            logits = float32_target(torch.tensor([inputs["input_ids"][0].tolist() + reference[:position]])).logits
        gap = abs(float(logits[0, -1, reference[position]] - logits[0, -1, tokens[position]]))
        assert row.divergence_position == position and row.fp32_gap == pytest.approx(gap, rel=1e-4)
    assert all(r.fp32_gap is None for r in results.prompts if r.identical_to_reference)
    summary = results.summary()
    assert summary["penalised"]["left_greedy"] == len(left) and not summary["penalised"]["identical_to_reference"]
    assert summary["penalised"]["max_fp32_gap"] == max(r.fp32_gap for r in left)
    assert summary["plain"]["left_greedy"] == 0 and summary["plain"]["max_fp32_gap"] is None
    not_ties = [r for r in left if r.fp32_gap > NEAR_TIE_GAP]
    assert len([m for m in caplog.messages if "not a near-tie" in m]) == len(not_ties) > 0
    table = markdown_tables(results.payload())
    assert "left_greedy | max_fp32_gap |" in table
    assert f"| {len(left)} | {summary['penalised']['max_fp32_gap']:.3g} |" in table

    # rows written before these fields existed still load and resume; their gaps are unknown, not zero
    log = tmp_path / "per_prompt.jsonl"
    old_rows = [json.loads(line) for line in log.read_text().splitlines()]
    log.write_text("".join(json.dumps({k: v for k, v in r.items() if k not in ("divergence_position", "fp32_gap")})
                           + "\n" for r in old_rows))  # fmt: skip
    resumed = run_benchmark(target, tokenizer, prompts, [penalised], max_new_tokens=12, output_dir=tmp_path)
    assert len(resumed.prompts) == len(old_rows) and resumed.summary()["penalised"]["left_greedy"] == len(left)
    assert resumed.summary()["penalised"]["max_fp32_gap"] is None


def test_a_16bit_batch_scores_each_row_alone_and_keeps_its_largest_gap():
    """In a left-padded batch each row's divergence is scored on its own prompt, padding dropped, and the batch keeps
    the largest gap of its rows (the row least explained by a near-tie)."""
    from transformers_specblock.commands.benchmark import _encode, _new_tokens

    target, tokenizer, prompts, _, _ = tiny_setup()
    tokenizer.eos_token = "x"  # the letter tokenizer has no pad token: batches pad with the EOS token
    target = target.to(torch.bfloat16)
    float32_target = copy.deepcopy(target).float()
    penalised = Method("penalised", {"repetition_penalty": 8.0})
    results = run_benchmark(target, tokenizer, prompts, [penalised], max_new_tokens=12, warmup_tokens=0,
                            batch_size=2)  # fmt: skip
    assert results.settings["near_tie_gap"] == NEAR_TIE_GAP
    left = [r for r in results.prompts if r.method == "penalised" and not r.identical_to_reference]
    assert left, "the penalty changed no output: the test proves nothing"
    for batch in left:
        rows = [prompts[int(prompt_id[1:])] for prompt_id in batch.prompt_id.split("+")]
        inputs = _encode(tokenizer, rows, target.device)
        assert not inputs["attention_mask"].all(), "equal prompt lengths: padding is not exercised"
        width, eos = inputs["input_ids"].shape[1], {tokenizer.eos_token_id}
        kwargs = {"do_sample": False, "max_new_tokens": 12, "pad_token_id": tokenizer.eos_token_id}
        reference = _new_tokens(target.generate(**inputs, **kwargs), width, eos)
        tokens = _new_tokens(target.generate(**inputs, **kwargs, repetition_penalty=8.0), width, eos)
        gaps = []  # (position, float32 gap) of each diverging row
        for row, text in enumerate(rows):
            if reference[row] == tokens[row]:
                continue
            position = _first_difference(reference[row], tokens[row])
            prompt = tokenizer(text["text"], add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logits = float32_target(torch.tensor([prompt + reference[row][:position]])).logits[0, -1]
            gaps.append((position, abs(float(logits[reference[row][position]] - logits[tokens[row][position]]))))
        position, gap = max(gaps, key=lambda item: item[1])
        assert batch.divergence_position == position and batch.fp32_gap == pytest.approx(gap, rel=1e-4)


def test_sampling_and_opt_out_measure_no_gaps(monkeypatch):
    from transformers_specblock.commands import benchmark

    monkeypatch.setattr(benchmark, "float32_copy", lambda model: pytest.fail("no float32 copy is needed"))
    target, tokenizer, prompts, _, _ = tiny_setup()
    target = target.to(torch.bfloat16)
    penalised = Method("penalised", {"repetition_penalty": 8.0})
    greedy = run_benchmark(target, tokenizer, prompts.select(range(2)), [penalised], max_new_tokens=8,
                           warmup_tokens=0, measure_near_ties=False)  # fmt: skip
    assert all(r.fp32_gap is None for r in greedy.prompts) and greedy.settings["near_tie_gap"] is None
    sampled = run_benchmark(target, tokenizer, prompts.select(range(2)), [penalised], max_new_tokens=8,
                            warmup_tokens=0, do_sample=True, top_k=None, top_p=None)  # fmt: skip
    assert sampled.summary()["penalised"]["left_greedy"] is None


def test_batched_benchmark_groups_prompts_and_names_refused_methods(tmp_path):
    target, tokenizer, prompts, methods, _ = tiny_setup()
    tokenizer.eos_token = "x"  # the letter tokenizer has no pad token: batches pad with the EOS token
    results = run_benchmark(target, tokenizer, prompts, methods, max_new_tokens=8, batch_size=2, output_dir=tmp_path)
    refused = results.settings["refused"]
    assert set(refused) == {"prompt_lookup", "assisted"}  # transformers' own assisted paths refuse batches
    assert "batch_size = 1" in refused["assisted"]
    summary = results.summary()
    assert set(summary) == {"plain", "specblock", "specblock_fixed_tree", "specblock_one_block", "eagle3"}
    for name, row in summary.items():
        assert row["identical_to_reference"], name  # every row of every batch equals plain batched generate
        assert row["num_prompts"] == 2  # two batches of two prompts
    assert {r.prompt_id for r in results.prompts} == {"p0+p1", "p2+p3"}
    assert all(r.new_tokens == 2 * 8 for r in results.prompts)
    write_report(results, tmp_path)
    assert "prompt_lookup: refused at batch size 2" in (tmp_path / "results.md").read_text()


def test_timed_calls_do_not_copy_answers_the_suffix_cache_remembers(tmp_path):
    """Two methods on one drafter object, the same prompts: the second must not copy the first's answers."""
    from transformers_specblock import LookupTreeModel

    target, tokenizer, prompts, _, _ = tiny_setup()
    lookup = LookupTreeModel.from_target(target, tree_budget=32, suffix_cache_num_tokens=32)
    methods = [Method("first", {"assistant_model": lookup}), Method("second", {"assistant_model": lookup})]
    results = run_benchmark(target, tokenizer, prompts, methods, max_new_tokens=16, output_dir=tmp_path)
    for prompt_id in {r.prompt_id for r in results.prompts}:
        first, second = (next(r for r in results.prompts if r.prompt_id == prompt_id and r.method == m)
                         for m in ("first", "second"))  # fmt: skip
        assert first.tau == second.tau and first.iterations == second.iterations, prompt_id


def test_every_call_warm_up_included_serves_its_prompt_as_a_first_request(monkeypatch):
    """Two methods on one drafter object (a fixed budget and "auto", as `specblock-bench` builds them): the second
    method's warm-up must not find the first one's answer to the same prompt in the suffix cache (it would copy it,
    and "auto" would learn from the warm-up that trees pay)."""
    target, tokenizer, prompts, _, _ = tiny_setup()
    drafter = LookupTreeModel.from_target(target, suffix_cache_num_tokens=8, prompt_lookup_num_tokens=0)
    methods = [Method("lookup_tree@8", {"assistant_model": drafter}, {"tree_budget": 8}),
               Method("lookup_tree", {"assistant_model": drafter}, {"tree_budget": "auto"})]  # fmt: skip
    remembered = []
    original = type(target).generate

    def generate(self, *args, **kwargs):
        if "assistant_model" in kwargs:
            store = drafter.serving_states.suffix_store
            remembered.append(len(store) if store is not None else 0)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(target), "generate", generate)
    run_benchmark(target, tokenizer, prompts.select(range(2)), methods, max_new_tokens=8, warmup_tokens=4)
    assert len(remembered) == 2 + 2 * 2 and remembered == [0] * len(remembered)  # 2 warm-up calls, 2 prompts x 2


def test_repeats_run_rounds_in_rotated_order_and_keep_the_median_round(monkeypatch):
    """`repeats=3`: every method runs three times per prompt, each round starting one method later, and a method's
    row is its median round by time (every round's seconds kept), its outputs checked in every round."""
    target, tokenizer, prompts, methods, _ = tiny_setup()
    methods = methods[2:3]  # plain + specblock
    order = []
    original = type(target).generate

    def generate(self, *args, **kwargs):
        order.append("specblock" if "assistant_model" in kwargs else "plain")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(target), "generate", generate)
    results = run_benchmark(target, tokenizer, prompts.select(range(1)), methods, max_new_tokens=8, warmup_tokens=0,
                            repeats=3)  # fmt: skip
    assert order == ["plain", "specblock", "specblock", "plain", "plain", "specblock"]
    assert results.settings["repeats"] == 3
    for row in results.prompts:
        assert len(row.repeat_seconds) == 3 and row.seconds == sorted(row.repeat_seconds)[1], row.method
        assert row.identical_to_reference


def test_rows_timed_on_another_machine_are_not_resumed(tmp_path):
    """A results folder names the machine that timed its rows (machine.txt); resuming it elsewhere is refused by
    name, so no table mixes two machines' timings or labels one machine's rows with another's name."""
    target, tokenizer, prompts, methods, _ = tiny_setup()
    run_benchmark(target, tokenizer, prompts.select(range(1)), methods[:1], max_new_tokens=4, output_dir=tmp_path)
    record = tmp_path / "machine.txt"
    assert record.read_text().strip() == describe_device(target.device)
    run_benchmark(target, tokenizer, prompts.select(range(2)), methods[:1], max_new_tokens=4, output_dir=tmp_path)
    record.write_text("Some Other CPU, 64 cores, AVX2\n")
    with pytest.raises(ValueError, match="timed on Some Other CPU.*this machine is"):
        run_benchmark(target, tokenizer, prompts, methods[:1], max_new_tokens=4, output_dir=tmp_path)
    older = tmp_path / "older"  # rows written before machine.txt existed: resumed, and no machine is guessed for them
    older.mkdir()
    (older / "per_prompt.jsonl").write_text((tmp_path / "per_prompt.jsonl").read_text())
    run_benchmark(target, tokenizer, prompts.select(range(2)), methods[:1], max_new_tokens=4, output_dir=older)
    assert not (older / "machine.txt").exists()
