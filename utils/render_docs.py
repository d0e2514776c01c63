"""Render every figure of README.md and the docs from the results files under docs/results (and the commands'
argument tables from their dataclasses), between ``<!-- BEGIN generated: NAME -->`` and ``<!-- END generated -->``
markers, plus the tree picture docs/figures/tree.svg.

    python utils/render_docs.py           # rewrite the generated parts
    python utils/render_docs.py --check   # exit 1, naming the files, if a generated part differs from its source
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from campaign_figure import campaign_aims, campaign_status, campaign_svg  # noqa: E402
from cost_figure import cost_svg  # noqa: E402
from docs_tables import command_reference  # noqa: E402
from paired_tables import paired_table, variants_by_prompt  # noqa: E402
from qwen_tables import alone_table, depth_table, run_table, training_table  # noqa: E402
from tau_tables import calibration, penalty_sweep, tau_by_arm, tau_by_set  # noqa: E402
from tree_figure import mask_svg, tree_svg  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
# The current runs the pages cite: (folder under docs/results, date run). Everything else under docs/results is older.
SINGLE_STREAM = {"bfloat16": ("glance-2026-12-06d-avx512bf16", "2026-12-06"),
                 "float32": ("glance-2026-12-06b-avx2", "2026-12-06")}
BATCHES = ("batch-control", "bfloat16", "2026-12-02")
TARGET_COST = ("target-cost/amd-epyc.json", "2026-12-03")
SUFFIX_STREAMS = ("suffix-streams-bf16", "2026-12-02")
QWEN_WEIGHTLESS = {"HumanEval": "qwen-weightless-bf16/humaneval", "MT-Bench": "qwen-weightless-bf16/mt_bench"}
QWEN_WEIGHTLESS_15B = {title: f"qwen-weightless-1.5b-bf16/{folder}" for title, folder in
                       (("HumanEval", "humaneval"), ("MT-Bench", "mt_bench"), ("ShareGPT", "sharegpt"))}  # fmt: skip
QWEN_GLANCE = {"HumanEval": "qwen-glance-2026-12-07/bfloat16-humaneval",
               "MT-Bench": "qwen-glance-2026-12-07/bfloat16-mt_bench"}  # fmt: skip
QWEN_SHIPPED_METHODS = ("prompt_lookup", "lookup_tree", "eagle3", "specblock_one_block")
QWEN_TRAINING = {"SpecBlock, 1 decoder layer (shipped)": "qwen-train-2026-12-07/specblock-trainer_state.json",
                 "SpecBlock, 2 decoder layers": "qwen-train-2026-12-07/specblock-2layers-trainer_state.json",
                 "EAGLE-3 (shipped)": "qwen-train-2026-12-07/eagle3-trainer_state.json"}  # fmt: skip
QWEN_ALONE = {"SpecBlock, 1 block round (shipped)": "qwen-ship-2026-12-07/specblock-one-block",
              "SpecBlock, 2 block rounds": "qwen-ship-2026-12-07/specblock-two-blocks",
              "SpecBlock, 3 block rounds": "qwen-ship-2026-12-07/specblock-three-blocks",
              "SpecBlock, 2 decoder layers, 1 block round": "qwen-ship-2026-12-07/specblock-2layers-one-block",
              "EAGLE-3, 3 levels (shipped)": "qwen-ship-2026-12-07/eagle3-depth3",
              "EAGLE-3, 6 levels": "qwen-ship-2026-12-07/eagle3-depth6"}  # fmt: skip
ADAPTATION = ("adaptation-stream", "2026-12-04")
QWEN_ADAPTATION = ("qwen-adaptation-2026-12-07", "2026-12-07")
GPU_TRAINING = ("gpu-h200-2026-11-30", "2026-11-30")
CAMPAIGN_TAU = [  # (row label, folder under docs/results): the drafters shipped before the campaign, now, and its newest
    # (tokens in all and campaign CPU-hours from docs/results/campaign/*.jsonl and the drafters' cards)
    ("EAGLE-3 shipped before the campaign (0.67M tokens)", "campaign/tau-eagle3-shipped"),
    ("EAGLE-3 campaign step 1310 (1.82M tokens, 3.1 campaign CPU-h), shipped until 2026-12-05",
     "campaign/tau-eagle3-campaign-step1310"),
    ("EAGLE-3 campaign step 2500 (2.85M tokens, 4.5 campaign CPU-h)", "campaign/tau-eagle3-campaign-step2500"),
    ("EAGLE-3 campaign step 4250 (4.38M tokens, 6.7 campaign CPU-h), shipped now", "campaign/tau-eagle3-campaign-step4250"),
    ("EAGLE-3 campaign step 5080 (5.11M tokens, 7.7 campaign CPU-h)", "campaign/tau-eagle3-campaign-step5080"),
    ("SpecBlock shipped before the campaign (0.34M tokens), package construction, 2 block rounds",
     "campaign/tau-specblock-shipped"),
    ("SpecBlock campaign step 1560 (1.70M tokens, 4.6 campaign CPU-h), shipped until 2026-12-06: reference "
     "construction, 1 block round", "campaign/tau-specblock-campaign-step1560-shipped-settings"),
    ("SpecBlock campaign step 1560, reference construction, 2 block rounds",
     "campaign/tau-specblock-campaign-step1560-reference-2-rounds"),
    ("SpecBlock campaign step 2810 (2.79M tokens, 7.2 campaign CPU-h), reference construction, 1 block round",
     "campaign/tau-specblock-campaign-step2810-shipped-settings"),
    ("SpecBlock campaign step 2810, reference construction, 2 block rounds",
     "campaign/tau-specblock-campaign-step2810-reference-2-rounds"),
    ("SpecBlock campaign step 3310 (3.22M tokens, 8.7 campaign CPU-h), reference construction, 1 block round",
     "campaign/tau-specblock-campaign-step3310-shipped-settings"),
    ("SpecBlock campaign step 3310, reference construction, 2 block rounds",
     "campaign/tau-specblock-campaign-step3310-reference-2-rounds"),
    ("SpecBlock campaign step 3780 (3.63M tokens, 9.7 campaign CPU-h), shipped until step 4480 replaced it: reference "
     "construction, 1 block round", "campaign/tau-specblock-campaign-step3780-shipped-settings"),
    ("SpecBlock campaign step 3780, reference construction, 2 block rounds",
     "campaign/tau-specblock-campaign-step3780-reference-2-rounds"),
    ("SpecBlock campaign step 4110 (3.92M tokens, 10.3 campaign CPU-h), reference construction, 1 block round",
     "campaign/tau-specblock-campaign-step4110-shipped-settings"),
    ("SpecBlock campaign step 4110, reference construction, 2 block rounds",
     "campaign/tau-specblock-campaign-step4110-reference-2-rounds"),
    ("SpecBlock campaign step 4480 (3.89M tokens, 12.1 campaign CPU-h), reference construction, 1 block round",
     "campaign/tau-specblock-campaign-step4480-shipped-settings"),
    ("SpecBlock campaign step 4480, reference construction, 1 block round grown best first: shipped until step 5560 "
     "replaced it",
     "campaign/tau-specblock-campaign-step4480-best-first"),
    ("SpecBlock campaign step 4480, reference construction, 2 block rounds",
     "campaign/tau-specblock-campaign-step4480-reference-2-rounds"),
    ("SpecBlock campaign step 4480, reference construction, 2 block rounds, the last grown best first",
     "campaign/tau-specblock-campaign-step4480-best-first-2-rounds"),
    ("SpecBlock campaign step 5010 (4.37M tokens, 13.3 campaign CPU-h), reference construction, 1 block round grown "
     "best first", "campaign/tau-specblock-campaign-step5010-best-first"),
    ("SpecBlock campaign step 5320 (4.64M tokens, 13.9 campaign CPU-h), reference construction, 1 block round grown "
     "best first", "campaign/tau-specblock-campaign-step5320-best-first"),
    ("SpecBlock campaign step 5560 (4.85M tokens, 14.4 campaign CPU-h), reference construction, 1 block round grown "
     "best first: shipped now", "campaign/tau-specblock-campaign-step5560-best-first"),
    ("SpecBlock campaign step 6000 (5.23M tokens, 15.9 campaign CPU-h), reference construction, 1 block round grown "
     "best first", "campaign/tau-specblock-campaign-step6000-best-first"),
]  # fmt: skip
TAU_BY_TOKENS = [  # the training guide's tau against training tokens (docs/training.md): (row label, folder)
    ("EAGLE-3, 0.67M tokens (shipped before the campaign)", "campaign/tau-eagle3-shipped"),
    ("EAGLE-3, 1.82M tokens (step 1310)", "campaign/tau-eagle3-campaign-step1310"),
    ("EAGLE-3, 2.85M tokens (step 2500)", "campaign/tau-eagle3-campaign-step2500"),
    ("EAGLE-3, 4.38M tokens (step 4250, shipped)", "campaign/tau-eagle3-campaign-step4250"),
    ("EAGLE-3, 5.11M tokens (step 5080)", "campaign/tau-eagle3-campaign-step5080"),
    ("SpecBlock, 0.34M tokens (shipped before the campaign; package trees, 2 block rounds)",
     "campaign/tau-specblock-shipped"),
    ("SpecBlock, 2.79M tokens (step 2810)", "campaign/tau-specblock-campaign-step2810-best-first"),
    ("SpecBlock, 3.89M tokens (step 4480)", "campaign/tau-specblock-campaign-step4480-best-first"),
    ("SpecBlock, 4.37M tokens (step 5010)", "campaign/tau-specblock-campaign-step5010-best-first"),
    ("SpecBlock, 4.85M tokens (step 5560, shipped)", "campaign/tau-specblock-campaign-step5560-best-first"),
    ("SpecBlock, 5.23M tokens (step 6000)", "campaign/tau-specblock-campaign-step6000-best-first"),
]  # fmt: skip
CAMPAIGN_STEP_TAU = {  # README under docs/results -> its generated tau tables: (row label, folder under docs/results)
    "docs/results/campaign/README.md": {
        "tau-step3310": [
            ("SpecBlock step 3310, reference trees, 1 block round (shipped settings)",
             "campaign/tau-specblock-campaign-step3310-shipped-settings"),
            ("SpecBlock step 3310, reference trees, 2 block rounds",
             "campaign/tau-specblock-campaign-step3310-reference-2-rounds"),
        ],
        "tau-step3780": [
            ("SpecBlock step 3780 (9.7 campaign CPU-h), reference trees, 1 block round (shipped settings)",
             "campaign/tau-specblock-campaign-step3780-shipped-settings"),
            ("SpecBlock step 3780, reference trees, 2 block rounds",
             "campaign/tau-specblock-campaign-step3780-reference-2-rounds"),
            ("EAGLE-3 step 5080 (7.7 campaign CPU-h)", "campaign/tau-eagle3-campaign-step5080"),
        ],
        "tau-step4110": [
            ("SpecBlock step 4110 (10.3 campaign CPU-h), reference trees, 1 block round (shipped settings)",
             "campaign/tau-specblock-campaign-step4110-shipped-settings"),
            ("SpecBlock step 4110, reference trees, 2 block rounds",
             "campaign/tau-specblock-campaign-step4110-reference-2-rounds"),
        ],
        "tau-step4480": [
            ("SpecBlock step 4480 (12.1 campaign CPU-h), reference trees, 1 block round",
             "campaign/tau-specblock-campaign-step4480-shipped-settings"),
            ("SpecBlock step 4480, 1 block round, grown best first",
             "campaign/tau-specblock-campaign-step4480-best-first"),
            ("SpecBlock step 4480, reference trees, 2 block rounds",
             "campaign/tau-specblock-campaign-step4480-reference-2-rounds"),
            ("SpecBlock step 4480, 2 block rounds, the last grown best first",
             "campaign/tau-specblock-campaign-step4480-best-first-2-rounds"),
            ("SpecBlock step 4480, 1 block round grown best first from the top 8 of every slot (package construction, "
             "`tree_policy=\"fixed\"`, `fixed_width=8`)", "campaign/tau-specblock-campaign-step4480-best-first-fixed-width-8"),
        ],
        "tau-step5010": [
            ("SpecBlock step 4480 (12.1 campaign CPU-h), 1 block round, grown best first (shipped until step 5560)",
             "campaign/tau-specblock-campaign-step4480-best-first"),
            ("SpecBlock step 5010 (13.3 campaign CPU-h), 1 block round, grown best first",
             "campaign/tau-specblock-campaign-step5010-best-first"),
            ("SpecBlock step 5320 (13.9 campaign CPU-h), 1 block round, grown best first",
             "campaign/tau-specblock-campaign-step5320-best-first"),
            ("SpecBlock step 5560 (14.4 campaign CPU-h), 1 block round, grown best first (shipped)",
             "campaign/tau-specblock-campaign-step5560-best-first"),
            ("SpecBlock step 6000 (15.9 campaign CPU-h), 1 block round, grown best first",
             "campaign/tau-specblock-campaign-step6000-best-first"),
        ],
        "tau-equal-cpu": [
            ("SpecBlock step 2810 (7.2 campaign CPU-h), reference trees, 1 block round",
             "campaign/tau-specblock-campaign-step2810-shipped-settings"),
            ("SpecBlock step 2810, 1 block round, grown best first",
             "campaign/tau-specblock-campaign-step2810-best-first"),
            ("SpecBlock step 2810, reference trees, 2 block rounds",
             "campaign/tau-specblock-campaign-step2810-reference-2-rounds"),
            ("EAGLE-3 step 5080 (7.7 campaign CPU-h)", "campaign/tau-eagle3-campaign-step5080"),
        ],
    },
    "docs/results/campaign/ship-eagle3-step4250/README.md": {
        "tau-candidate": [
            ("EAGLE-3 shipped: campaign step 1310 (1.82M tokens in all, 3.1 campaign CPU-h)",
             "campaign/tau-eagle3-campaign-step1310"),
            ("EAGLE-3 campaign step 4250 (4.38M tokens in all, 6.7 campaign CPU-h)", "campaign/tau-eagle3-campaign-step4250"),
        ],
    },
    "docs/results/campaign/ship-specblock-step4480-best-first/README.md": {
        "tau-candidate": [
            ("SpecBlock shipped: campaign step 3780 (3.63M tokens in all, 9.7 campaign CPU-h), chain layout",
             "campaign/tau-specblock-campaign-step3780-shipped-settings"),
            ("SpecBlock campaign step 4480 (3.89M tokens in all, 12.1 campaign CPU-h), chain layout",
             "campaign/tau-specblock-campaign-step4480-shipped-settings"),
            ("SpecBlock campaign step 4480, grown best first", "campaign/tau-specblock-campaign-step4480-best-first"),
        ],
    },
    "docs/results/campaign/ship-specblock-step5010/README.md": {
        "tau-candidate": [
            ("SpecBlock shipped: campaign step 4480 (3.89M campaign tokens, 12.1 campaign CPU-h), grown best first",
             "campaign/tau-specblock-campaign-step4480-best-first"),
            ("SpecBlock campaign step 5010 (4.37M campaign tokens, 13.3 campaign CPU-h), grown best first",
             "campaign/tau-specblock-campaign-step5010-best-first"),
        ],
    },
    "docs/results/campaign/ship-specblock-step5560/README.md": {
        "tau-candidate": [
            ("SpecBlock shipped: campaign step 4480 (3.89M campaign tokens, 12.1 campaign CPU-h), grown best first",
             "campaign/tau-specblock-campaign-step4480-best-first"),
            ("SpecBlock campaign step 5560 (4.85M campaign tokens, 14.4 campaign CPU-h), grown best first",
             "campaign/tau-specblock-campaign-step5560-best-first"),
        ],
    },
    "docs/results/campaign/ship-specblock-step3780/README.md": {
        "tau-candidate": [
            ("SpecBlock shipped: campaign step 1560 (1.70M tokens in all, 4.6 campaign CPU-h)",
             "campaign/tau-specblock-campaign-step1560-shipped-settings"),
            ("SpecBlock campaign step 3780 (3.63M tokens in all, 9.7 campaign CPU-h)",
             "campaign/tau-specblock-campaign-step3780-shipped-settings"),
        ],
    },
}  # fmt: skip
SPECBLOCK_DEPTH = ("specblock-depth/tau-blocks.json", [
    ("package (default), 1 block round", "package", "/blocks=1"),
    ("package (default), 2 block rounds (the shipped drafter's settings until 2026-12-04)", "package", ""),
    ("reference, 1 block round (the shipped drafter's settings since)", "reference", "/blocks=1"),
    ("reference, 2 block rounds", "reference", ""),
])  # fmt: skip
CAMPAIGN_SHIP = {  # README under docs/results/campaign -> its compare_drafters runs (candidate against the shipped drafter)
    "ship-eagle3-step4250": [("HumanEval", "campaign/ship-eagle3-step4250/compare-humaneval"),
                             ("MT-Bench", "campaign/ship-eagle3-step4250/compare-mt_bench")],
    "ship-specblock-step4480-best-first": [
        ("HumanEval", "campaign/ship-specblock-step4480-best-first/compare-humaneval"),
        ("MT-Bench", "campaign/ship-specblock-step4480-best-first/compare-mt_bench"),
        ("HumanEval, bfloat16 (AMX)", "campaign/ship-specblock-step4480-best-first/compare-bfloat16-amx-humaneval"),
        ("MT-Bench, bfloat16 (AMX)", "campaign/ship-specblock-step4480-best-first/compare-bfloat16-amx-mt_bench"),
    ],
    "ship-specblock-step5010": [
        ("HumanEval, bfloat16 (AMX)", "campaign/ship-specblock-step5010/compare-bfloat16-amx-humaneval"),
        ("MT-Bench, bfloat16 (AMX)", "campaign/ship-specblock-step5010/compare-bfloat16-amx-mt_bench"),
    ],
    "ship-specblock-step5560": [
        ("HumanEval, bfloat16 (AVX512-BF16)", "campaign/ship-specblock-step5560/compare-bfloat16-avx512bf16-humaneval"),
        ("MT-Bench, bfloat16 (AVX512-BF16)", "campaign/ship-specblock-step5560/compare-bfloat16-avx512bf16-mt_bench"),
        ("ShareGPT held-out, bfloat16 (AVX512-BF16)",
         "campaign/ship-specblock-step5560/compare-bfloat16-avx512bf16-sharegpt"),
    ],
    "ship-specblock-step3780": [("HumanEval", "campaign/ship-specblock-step3780/compare-humaneval"),
                                ("MT-Bench", "campaign/ship-specblock-step3780/compare-mt_bench")],
    "ship-specblock-step3310-2-rounds": [
        (f"{name}{when}", f"campaign/ship-specblock-step3310-2-rounds/compare-{folder}{suffix}")
        for when, suffix in (("", ""), (", last round narrowed", "-narrowed"))
        for name, folder in (("HumanEval", "humaneval"), ("MT-Bench", "mt_bench"))
    ],
}  # fmt: skip
AUTO_VS_FIXED = [(f"fixed {budget} nodes / auto", f"auto-vs-fixed/budget{budget}-mt_bench") for budget in (8, 16)]
AUTO_VS_FIXED_AMX = [(f"{title}, fixed 16 nodes / auto", f"auto-vs-fixed/amx-budget16-{name}") for name, title in
                     (("humaneval", "HumanEval"), ("mt_bench", "MT-Bench"))]  # fmt: skip
AUTO_VS_FIXED_AVX2 = [(f"{title}, fixed {budget} nodes / auto", f"auto-vs-fixed/avx2-float32-budget{budget}-{name}")
                      for budget in (8, 16) for name, title in (("humaneval", "HumanEval"), ("mt_bench", "MT-Bench"))]
BEST_FIRST_CALIBRATION = [("off_chain_penalty -0.6 / as shipped", "best-first-calibration/compare-penalty-bfloat16-sharegpt"),
                          ("the same drafter twice (drafter A/A)",
                           "best-first-calibration/compare-drafter-aa-bfloat16-sharegpt")]  # fmt: skip
FRESH_CHOOSER = ("auto-vs-fixed/fresh-chooser-demo.jsonl",
                 {"current": "now", "current2": "now, second copy (A/A)", "before": "before"})
SHIP_PAIRS = [("candidate", "shipped"), ("shipped_control", "shipped"), ("candidate", "shipped_control"),
              ("candidate", "prompt_lookup"), ("shipped", "prompt_lookup"), ("plain_control", "plain")]  # fmt: skip
SPECBLOCK_SHIP = {  # section -> (runs, method pairs) under docs/results/specblock-ship
    "ship-compare": ([("HumanEval", "specblock-ship/compare-humaneval"), ("MT-Bench", "specblock-ship/compare-mt_bench")],
                     SHIP_PAIRS),
    "ship-fixed": ([("HumanEval, fixed budgets", "specblock-ship/fixed-humaneval")],
                   [("specblock_reference_one_block@8", "specblock@8"), ("specblock_reference@8", "specblock@8"),
                    ("specblock_reference_one_block@16", "specblock@16"), ("specblock_reference_one_block@8", "eagle3@8"),
                    ("plain_control", "plain")]),
    "ship-constructions": ([("HumanEval", "specblock-ship/constructions-humaneval"),
                            ("MT-Bench", "specblock-ship/constructions-mt_bench")],
                           [("specblock_reference_one_block", "specblock"), ("specblock_reference", "specblock"),
                            ("specblock_reference_one_block", "eagle3"), ("plain_control", "plain")]),
}  # fmt: skip
PROMPT_SETS = {"humaneval": "HumanEval", "mt_bench": "MT-Bench"}
METHODS = {"lookup_tree": "lookup tree (no weights)", "eagle3": "EAGLE-3", "specblock": "SpecBlock",
           "dflash": "DFlash", "plain_control": "plain again (A/A control)"}  # fmt: skip
GLANCE_METHODS = {"prompt_lookup": "transformers' prompt lookup", **METHODS}


def load(relative: str) -> dict:
    return json.loads((RESULTS / relative).read_text())


def results_json(folder: str, dtype: str, prompts: str, batch: int) -> dict:
    return load(f"{folder}/{dtype}-{prompts}-b{batch}/results.json")


def cell(method: dict) -> str:
    tau = method["tau"]
    return f"{method['speedup']:.2f}x" + ("" if tau is None else f" (tau {tau:.2f})")


def gpu_inference_runs() -> list[str]:
    """Benchmark results measured on a GPU (none yet: the page says so)."""
    runs = []
    for path in sorted(RESULTS.rglob("results.json")):
        settings = json.loads(path.read_text()).get("settings", {})
        if str(settings.get("device", "")).startswith("cuda"):
            runs.append(str(path.parent.relative_to(RESULTS)))
    return runs


def glance(root: str = "docs/results") -> str:
    """Method x prompt set, speed-up over plain `generate` and tau, batch 1, one column per dtype and prompt set;
    ``root`` is docs/results as seen from the page (README.md links folders, the site links the files)."""
    columns, notes, hosts = [], [], {}
    for dtype, (folder, date) in SINGLE_STREAM.items():
        links = []
        for prompts, title in PROMPT_SETS.items():
            data = results_json(folder, dtype, prompts, 1)
            columns.append((f"{title}, {dtype}", data["methods"]))
            links.append(f"[{title}]({root}/{folder}/{dtype}-{prompts}-b1/results.json)")
        settings = data["settings"]
        hosts[dtype] = settings["hardware"]
        where = f"[`{folder}`]({root}/{folder}/)" if root.startswith("docs/") else f"`{folder}` ({', '.join(links)})"
        notes.append(f"{dtype}: {where}, {date}")
    if len(set(hosts.values())) == 1:
        where_run = f" on {settings['hardware']}"
    else:  # each dtype measured on a host where it is the fast one
        where_run = "".join(f"; {dtype} on {hardware}" for dtype, hardware in hosts.items())
    header = "| method | " + " | ".join(name for name, _ in columns) + " |"
    lines = [header, "|---" * (len(columns) + 1) + "|"]
    for key, name in GLANCE_METHODS.items():
        if key != "plain_control" or all(key in methods for _, methods in columns):
            lines.append(f"| {name} | " + " | ".join(cell(m[key]) if key in m else "-" for _, m in columns) + " |")
    gpu = gpu_inference_runs()
    return "\n".join([
        *lines, "",
        f"Speed-up over plain `generate` in the same run (tau: tokens committed per target forward), batch 1, greedy, "
        f"{settings['num_prompts']} prompts x {settings['max_new_tokens']} new tokens, "
        f"{settings['target_model']}{where_run}; one thread, the drafters shipped when each column was measured, as shipped. "
        f"Results: {'; '.join(notes)}.",
        "",
        ("GPU: " + ", ".join(gpu)) if gpu else "GPU: not measured yet.",
    ])  # fmt: skip


def result_files(folder: str, names: list[str]) -> str:
    """Links to the results files of a run's cells."""
    return ", ".join(f"[{name}](results/{folder}/{name}/results.json)" for name in names)


def batches() -> str:
    folder, dtype, date = BATCHES
    lines = []
    for prompts, title in PROMPT_SETS.items():
        runs = {b: results_json(folder, dtype, prompts, b)["methods"] for b in (1, 4, 16)}
        lines += [f"**{title}** ({dtype}, {date})", "", "| method | B = 1 | B = 4 | B = 16 |", "|---|---|---|---|"]
        for key, name in METHODS.items():
            lines.append(f"| {name} | " + " | ".join(cell(runs[b][key]) for b in runs) + " |")
        lines.append("")
    settings = results_json(folder, dtype, "humaneval", 4)["settings"]
    lines.append(
        f"{settings['num_prompts']} prompts x {settings['max_new_tokens']} new tokens per cell, {settings['repeats']} "
        f"rounds at B > 1 (the methods' order rotated), {settings['hardware']}. Results: "
        f"`{folder}` ({result_files(folder, [f'{dtype}-{p}-b{b}' for p in PROMPT_SETS for b in (1, 4, 16)])})."
    )
    return "\n".join(lines)


def exactness() -> str:
    folder, date = SINGLE_STREAM["bfloat16"]
    lines = ["| prompts | method | outputs leaving plain greedy | largest float32 logit gap there |",
             "|---|---|---|---|"]  # fmt: skip
    for prompts, title in PROMPT_SETS.items():
        data = results_json(folder, "bfloat16", prompts, 1)
        total = data["settings"]["num_prompts"]
        for key, name in METHODS.items():
            method = data["methods"][key]
            gap = "-" if method["max_fp32_gap"] is None else f"{method['max_fp32_gap']:.3f}"
            lines.append(f"| {title} | {name} | {method['left_greedy']} of {total} | {gap} |")
    files = result_files(folder, [f"bfloat16-{prompts}-b1" for prompts in PROMPT_SETS])
    return "\n".join(lines + ["", f"bfloat16, batch 1, {date}: `{folder}` ({files})."])


def target_cost() -> str:
    path, date = TARGET_COST
    data = load(path)
    sizes = ("1", "4", "8", "16", "32")
    lines = ["| dtype, batch | plain step (ms) | " + " | ".join(f"{s} nodes" for s in sizes) + " |",
             "|---" * (len(sizes) + 2) + "|"]  # fmt: skip
    for name, curve in data["curves"].items():
        costs = " | ".join(f"{curve['relative'][s]:.2f}x" for s in sizes)
        lines.append(f"| {name} | {curve['plain_step_ms']:.1f} | {costs} |")
    return "\n".join(lines + ["", f"{data['hardware']}, {date}: [`{path}`](results/{path})."])


def embedded_table(folder: str, date: str) -> str:
    """The first table of a results.md that its own script wrote (with the lines above it)."""
    text = (RESULTS / folder / "results.md").read_text().strip()
    first = text.split("\n\n| stream | drafter")[0]  # the adaptation report's first table only
    return f"{first}\n\n{date}: [`{folder}/results.json`](results/{folder}/results.json)."


def adaptation(folder: str, date: str) -> str:
    settings = load(f"{folder}/results.json")["settings"]
    streams = {run.split("/")[0] for run in settings["runs"].split(",")}
    prompts = (
        f"{settings['num_code']} code, {settings['num_chat']} chat and {settings['num_sharegpt']} ShareGPT prompts"
        if "sharegpt" in streams
        else f"{settings['num_code']} code and {settings['num_chat']} chat prompts"
    )
    return embedded_table(folder, date) + (
        f" {settings.get('target_model', 'smollm2-135m-instruct')}, {prompts}, {settings['max_new_tokens']} new tokens "
        f"per call, tree budget {settings['tree_budget']}, {settings.get('dtype', 'float32')}."
    )


def gpu_training() -> str:
    folder, date = GPU_TRAINING
    run = load(f"{folder}/dflash-all_results.json")
    log = (RESULTS / folder / "run.log").read_text().splitlines()[0]
    stack = log.split(": ", 1)[1]
    tokens_per_s = run["train_tokens"] / run["train_seconds"]
    return (
        "| drafter | GPU | training time | steps | tokens | tokens/s | held-out accepted length |\n"
        "|---|---|---|---|---|---|---|\n"
        f"| DFlash for SmolLM2-135M-Instruct | one H200 | {run['train_seconds'] / 60:.1f} min | {run['train_steps']} | "
        f"{run['train_tokens'] / 1e6:.1f}M | {tokens_per_s / 1e3:.0f}k | {run['eval_accept_length']:.2f} |\n\n"
        f"{stack}; {date}: [`{folder}/dflash-all_results.json`](results/{folder}/dflash-all_results.json)."
    )  # fmt: skip


SECTIONS = {
    "README.md": {
        "glance": glance,
        "qwen-glance": lambda: run_table(QWEN_GLANCE, "docs/results", QWEN_SHIPPED_METHODS),
    },
    "docs/index.md": {"glance": lambda: glance("results")},
    "docs/benchmarks.md": {
        "glance": lambda: glance("results"),
        "batches": batches,
        "exactness": exactness,
        "target-cost": target_cost,
        "suffix-streams": lambda: embedded_table(*SUFFIX_STREAMS),
        "adaptation": lambda: adaptation(*ADAPTATION),
        "qwen-adaptation": lambda: adaptation(*QWEN_ADAPTATION),
        "gpu-training": gpu_training,
        "qwen-weightless": lambda: run_table(QWEN_WEIGHTLESS, "results"),
        "qwen-weightless-15b": lambda: run_table(QWEN_WEIGHTLESS_15B, "results"),
        "qwen-glance": lambda: run_table(QWEN_GLANCE, "results"),
        "qwen-depth": lambda: depth_table(QWEN_GLANCE),
        "qwen-alone": lambda: alone_table(QWEN_ALONE, "results"),
    },
    "docs/results/qwen-glance-2026-12-07/README.md": {
        "qwen-glance": lambda: run_table(QWEN_GLANCE, ".."),
        "qwen-depth": lambda: depth_table(QWEN_GLANCE),
    },
    "docs/results/qwen-weightless-1.5b-bf16/README.md": {
        "qwen-weightless-15b": lambda: run_table(QWEN_WEIGHTLESS_15B, "..")
    },
    "docs/results/qwen-ship-2026-12-07/README.md": {"qwen-alone": lambda: alone_table(QWEN_ALONE, "..")},
    "docs/results/qwen-train-2026-12-07/README.md": {"qwen-training": lambda: training_table(QWEN_TRAINING)},
    "docs/reference/commands.md": {"commands": command_reference},
    "docs/results/qwen-weightless-bf16/README.md": {"qwen-weightless": lambda: run_table(QWEN_WEIGHTLESS, "..")},
    "docs/training.md": {
        "tau-by-tokens": lambda: tau_by_set(TAU_BY_TOKENS),
        "qwen-training": lambda: training_table(QWEN_TRAINING),
    },
    "docs/lab-notes/campaign.md": {
        "campaign-status": lambda: campaign_status(RESULTS / "campaign"),
        "campaign-tau": lambda: tau_by_set(CAMPAIGN_TAU),
        "campaign-aims": lambda: campaign_aims(RESULTS / "campaign"),
    },
    **{f"docs/results/campaign/{name}/README.md": {"ship-compare": lambda runs=runs: paired_table(runs, SHIP_PAIRS)}
       for name, runs in CAMPAIGN_SHIP.items()},
    "docs/results/best-first-calibration/README.md": {
        "calibration": lambda: calibration("best-first-calibration/sharegpt-budget32.json"),
        "penalty-sweep": lambda: penalty_sweep("best-first-calibration/penalty-sweep-float32-sharegpt/tau.json"),
        "ship-compare": lambda: paired_table(BEST_FIRST_CALIBRATION, SHIP_PAIRS),
    },
    "docs/results/auto-vs-fixed/README.md": {"ship-compare": lambda: paired_table(AUTO_VS_FIXED, SHIP_PAIRS),
                                             "amx-compare": lambda: paired_table(AUTO_VS_FIXED_AMX, SHIP_PAIRS),
                                             "avx2-compare": lambda: paired_table(AUTO_VS_FIXED_AVX2, SHIP_PAIRS),
                                             "fresh-chooser": lambda: variants_by_prompt(*FRESH_CHOOSER)},
    "docs/results/specblock-depth/README.md": {"specblock-depth": lambda: tau_by_arm(*SPECBLOCK_DEPTH)},
    "docs/results/specblock-ship/README.md": {
        name: (lambda runs=runs, pairs=pairs: paired_table(runs, pairs)) for name, (runs, pairs) in SPECBLOCK_SHIP.items()
    },
}
for path, tables in CAMPAIGN_STEP_TAU.items():
    SECTIONS.setdefault(path, {}).update({name: (lambda rows=rows: tau_by_set(rows)) for name, rows in tables.items()})
FIGURES = {
    "docs/figures/tree.svg": tree_svg,
    "docs/figures/tree-mask.svg": mask_svg,
    "docs/figures/target-cost.svg": lambda: cost_svg(RESULTS / TARGET_COST[0]),
    "docs/figures/campaign.svg": lambda: campaign_svg(RESULTS / "campaign"),
}
BLOCK = re.compile(r"(<!-- BEGIN generated: (?P<name>[\w-]+) -->\n)(?:(?!<!-- BEGIN).)*?(<!-- END generated -->)", re.S)


def render(text: str, sections: dict) -> str:
    if text.count("<!-- BEGIN generated:") != len(BLOCK.findall(text)):
        raise ValueError("a <!-- BEGIN generated: NAME --> marker without its <!-- END generated -->")
    def replace(match: re.Match) -> str:
        name = match.group("name")
        if name not in sections:
            raise KeyError(f"no renderer for the generated block {name!r}")
        return match.group(1) + sections[name]().rstrip("\n") + "\n" + match.group(3)

    return BLOCK.sub(replace, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only report what differs (exit status 1)")
    args = parser.parse_args(argv)
    stale = []
    outputs = {path: render((ROOT / path).read_text(), sections) for path, sections in SECTIONS.items()}
    outputs.update({path: make() for path, make in FIGURES.items()})
    for path, text in outputs.items():
        file = ROOT / path
        if file.exists() and file.read_text() == text:
            continue
        stale.append(path)
        if not args.check:
            file.parent.mkdir(parents=True, exist_ok=True)
            tmp = file.with_suffix(file.suffix + ".tmp")
            tmp.write_text(text)
            tmp.replace(file)
    if stale:
        print(("differs from its source: " if args.check else "rewrote: ") + ", ".join(stale))
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
