"""Tables of `specblock-bench` runs on one target, one column per prompt set: speed-up over plain (total time), the
per-prompt median beside it, tau and each drafter's drafting share (docs/benchmarks.md, the Qwen sections)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
NAMES = {
    "plain_control": "plain again (A/A control)",
    "prompt_lookup": "transformers' prompt lookup",
    "lookup_tree": "lookup tree (no weights)",
    "eagle3": "EAGLE-3",
    "eagle3_depth6": "EAGLE-3, 6 levels deep",
    "specblock": "SpecBlock",
    "specblock_one_block": "SpecBlock, 1 block round",
    "specblock_two_blocks": "SpecBlock, 2 block rounds",
    "specblock_three_blocks": "SpecBlock, 3 block rounds",
}
SET_TITLES = {"humaneval": "HumanEval", "mt_bench": "MT-Bench", "sharegpt": "ShareGPT"}


def method_key(run: dict, key: str) -> str | None:
    """The run's name for a method: `key`, or `key@auto` where the run named the budget."""
    return next((name for name in (key, f"{key}@auto") if name in run["methods"]), None)


def per_prompt_median(run: dict, method: str) -> tuple[float, int, int]:
    """Median over prompts of plain's seconds per token over the method's, on how many prompts the method was
    faster, and how many prompts there were."""
    rows = run["per_prompt"]
    plain = {r["prompt_id"]: r["seconds"] / r["new_tokens"] for r in rows if r["method"] == "plain"}
    ratios = [plain[r["prompt_id"]] / (r["seconds"] / r["new_tokens"]) for r in rows if r["method"] == method]
    return statistics.median(ratios), sum(q > 1 for q in ratios), len(ratios)


def method_cell(run: dict, method: str) -> str:
    """'1.26x (median 1.24, 8/8), tau 1.40, drafting 0.12' for a method of a run."""
    stats = run["methods"][method]
    median, faster, prompts = per_prompt_median(run, method)
    text = f"{stats['speedup']:.2f}x (median {median:.2f}, {faster}/{prompts})"
    if stats.get("tau") is not None:
        text += f", tau {stats['tau']:.2f}"
    if stats.get("drafter_forwards_per_iter"):  # (a method with a drafter)
        text += f", drafting {stats['drafting_share']:.2f}"
    return text


def left_greedy(run: dict) -> str:
    """'2 (gap 0.06)': on how many prompts the methods' outputs left plain greedy, summed over the methods, and the
    largest gap between the float32 target's top two logits where one did (a near-tie when small)."""
    methods = [m for name, m in run["methods"].items() if name != "plain"]
    count = sum(m.get("left_greedy") or 0 for m in methods)
    gaps = [m["max_fp32_gap"] for m in methods if m.get("max_fp32_gap") is not None]
    return f"{count} (gap {max(gaps):.2f})" if count and gaps else str(count)


def run_table(runs: dict[str, str], root: str, methods: tuple[str, ...] = tuple(NAMES)) -> str:
    """One row per method (of `methods`), one column per run (title -> folder under docs/results holding
    results.json); `root` is docs/results as seen from the page."""
    loaded = {title: json.loads((RESULTS / folder / "results.json").read_text()) for title, folder in runs.items()}
    first = next(iter(loaded.values()))
    lines = ["| method | " + " | ".join(loaded) + " |", "|---" * (len(loaded) + 1) + "|"]
    lines.append("| plain | " + " | ".join(f"{r['methods']['plain']['tokens_per_s']:.2f} tok/s" for r in loaded.values())
                 + " |")  # fmt: skip
    for key in methods:
        if all(method_key(r, key) for r in loaded.values()):
            lines.append(f"| {NAMES[key]} | " + " | ".join(method_cell(r, method_key(r, key)) for r in loaded.values()) + " |")
    settings = first["settings"]
    left = ", ".join(f"{title} {left_greedy(run)}" for title, run in loaded.items())
    return "\n".join([
        *lines, "",
        f"{settings['target_model']}, {settings['dtype']}, greedy, batch 1, {settings['num_prompts']} prompts x "
        f"{settings['max_new_tokens']} new tokens per set, every method interleaved per prompt; {settings['hardware']}. "
        "Speed-up over plain in total time; in brackets the per-prompt median of the ratio and on how many prompts the "
        "method was faster; drafting: the share of decoding time spent drafting. Prompts on which a method's output left "
        f"plain greedy, and the largest float32 logit gap where it did: {left}. Results: "
        + ", ".join(f"[`{folder}`]({root}/{folder}/results.json)" for folder in runs.values()) + ".",
    ])  # fmt: skip


DEPTH = ("eagle3", "eagle3_depth6", "specblock_one_block", "specblock_two_blocks", "specblock_three_blocks")


def depth_table(runs: dict[str, str]) -> str:
    """SpecBlock's block rounds against EAGLE-3's depth: per run, speed-up, tau, drafter forwards and nodes per
    verified tree, drafting share."""
    loaded = {title: json.loads((RESULTS / folder / "results.json").read_text()) for title, folder in runs.items()}
    lines = ["| method | set | speed-up | tau | drafter forwards per tree | nodes per tree | drafting share |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for key in DEPTH:
        for title, run in loaded.items():
            if key in run["methods"]:
                m = run["methods"][key]
                lines.append(f"| {NAMES[key]} | {title} | {m['speedup']:.2f}x | {m['tau']:.2f} | "
                             f"{m['drafter_forwards_per_iter']:.2f} | {m['nodes_per_iter']:.1f} | "
                             f"{m['drafting_share']:.3f} |")  # fmt: skip
    return "\n".join(lines)


def training_table(runs: dict[str, str]) -> str:
    """The drafters trained at equal CPU time (title -> trainer_state.json under docs/results): tokens, CPU time,
    tokens per CPU second, and the last 25 steps' training-batch slot-0 accuracy and greedy-chain length estimate."""
    lines = ["| drafter | steps | tokens | CPU minutes | tokens per CPU second | slot-0 accuracy | chain length |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for title, path in runs.items():
        state = json.loads((RESULTS / path).read_text())
        logs = [entry for entry in state["log_history"] if "acc_slot0" in entry]
        last = logs[-5:]  # logged every 5 steps: the last 25
        cpu = logs[-1]["train_cpu_seconds"]
        lines.append(
            f"| {title} | {state['global_step']} | {logs[-1]['num_input_tokens_seen']:,} | {cpu / 60:.0f} | "
            f"{logs[-1]['num_input_tokens_seen'] / cpu:.0f} | {statistics.mean(e['acc_slot0'] for e in last):.3f} | "
            f"{statistics.mean(e['accept_length'] for e in last):.2f} |"
        )
    return "\n".join(lines)


def alone_table(variants: dict[str, str], root: str) -> str:
    """The drafters alone (free candidates off) at fixed budgets: one row per drafter and budget, one column per
    prompt set (title -> folder under docs/results holding examples/evaluate_drafter.py's eval_results.json)."""
    loaded = {title: json.loads((RESULTS / folder / "eval_results.json").read_text())
              for title, folder in variants.items()}  # fmt: skip
    sets = list(dict.fromkeys(row["dataset"] for rows in loaded.values() for row in rows))
    lines = ["| drafter | nodes | " + " | ".join(SET_TITLES.get(s, s) for s in sets) + " |",
             "|---" * (len(sets) + 2) + "|"]  # fmt: skip
    for title, rows in loaded.items():
        for budget in dict.fromkeys(row["tree_budget"] for row in rows):
            cells = {row["dataset"]: row for row in rows if row["tree_budget"] == budget}
            lines.append(f"| {title} | {budget} | " + " | ".join(
                f"tau {cells[s]['tau']:.2f}, {cells[s]['speedup_vs_plain']:.2f}x, "
                f"drafting {cells[s]['drafting_share']:.2f}" for s in sets) + " |")  # fmt: skip
    first = next(iter(loaded.values()))[0]
    left = sum(not row["identical_to_plain_greedy"] for rows in loaded.values() for row in rows)
    return "\n".join([
        *lines, "",
        f"The drafter's own tree at a fixed number of nodes, free candidates off (no prompt lookup, n-gram or suffix "
        f"cache). {first['prompts']} prompts x {first['max_new_tokens']} new tokens per set, every budget interleaved "
        f"per prompt with plain `generate`; {first['hardware']}. tau: tokens committed per target forward; then the "
        f"speed-up over plain and the share of decoding time spent drafting. Rows with an output that left plain "
        f"greedy (bfloat16 near-ties): {left} of {sum(len(rows) for rows in loaded.values())}. Results: "
        + ", ".join(f"[`{folder}`]({root}/{folder}/eval_results.json)" for folder in variants.values()) + ".",
    ])  # fmt: skip
