"""Paired speed tables: one benchmark run (`specblock-bench` or `examples/compare_drafters.py`), methods compared
prompt by prompt, read from its results.json and per_prompt.jsonl. A per-prompt ratio is the two methods' tokens per
second on the same prompt, timed one after the other in one process, so a slow burst of the machine moves both; its
median, range and the count of prompts where the first is faster say what one slow prompt cannot decide."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def _per_prompt(folder: str) -> dict[str, dict[str, dict]]:
    """{prompt id: {method: row}} of a run's per_prompt.jsonl."""
    rows: dict[str, dict[str, dict]] = {}
    for line in (RESULTS / folder / "per_prompt.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row["prompt_id"], {})[row["method"]] = row
    return rows


def paired_table(runs: list[tuple[str, str]], pairs: list[tuple[str, str]]) -> str:
    """Per (label, folder under docs/results) run and per (method, against) pair present in it: both methods'
    speed-up over plain `generate` and tau over all prompts, and the per-prompt ratio of their tokens per second."""
    lines = ["| run | method / against | speed-up over plain | tau | per prompt: median ratio (range) | faster on |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for label, folder in runs:
        methods = json.loads((RESULTS / folder / "results.json").read_text())["methods"]
        rows = _per_prompt(folder)
        for method, against in pairs:
            if method not in methods or against not in methods:
                continue
            rate = {name: [row[name]["new_tokens"] / row[name]["seconds"] for row in rows.values()]
                    for name in (method, against)}  # fmt: skip
            ratios = [a / b for a, b in zip(rate[method], rate[against])]
            tau = [methods[name]["tau"] for name in (method, against)]
            lines.append(
                f"| {label} | {method} / {against} | {methods[method]['speedup']:.2f}x / {methods[against]['speedup']:.2f}x"
                f" | {' / '.join('-' if t is None else f'{t:.2f}' for t in tau)}"
                f" | {statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})"
                f" | {sum(r > 1 for r in ratios)} of {len(ratios)} |"
            )
    return "\n".join(lines)


def variants_by_prompt(rows_file: str, variants: dict[str, str]) -> str:
    """An interleaved A/B's JSON lines (seconds per method, `plain` among them, and tau per variant; several repeats
    of each prompt): per prompt, each variant's median speed-up over plain and median tau. ``variants``: the rows'
    names -> column titles."""
    rows = [json.loads(line) for line in (RESULTS / rows_file).read_text().splitlines()]
    lines = ["| prompt | " + " | ".join(variants.values()) + " |", "|---" * (len(variants) + 1) + "|"]
    for prompt in dict.fromkeys(row["id"] for row in rows):
        same = [row for row in rows if row["id"] == prompt]
        cells = [f"{statistics.median(row['plain'] / row[name] for row in same):.2f}x "
                 f"({statistics.median(row['tau'][name] for row in same):.2f})" for name in variants]  # fmt: skip
        lines.append(f"| {prompt} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
