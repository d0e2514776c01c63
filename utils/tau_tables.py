"""Tau tables of docs/training.md and docs/results/specblock-depth/README.md, read from the JSON the measuring scripts
wrote: `examples/evaluate_drafter.py --tree_budget 8 16 32` (`eval_results.json`) and
`examples/experiments/tree_construction_tau.py` (its `summary`). Every output behind a cell equals plain greedy."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
SETS = {"mt_bench": "MT-Bench", "humaneval": "HumanEval", "sharegpt": "ShareGPT held-out"}


def _table(first: str, budgets: tuple[int, ...], rows: list[tuple[str, list[list[float]]]]) -> str:
    """Rows of (label, tau per prompt set per budget) as a Markdown table, budgets joined by " / " in a cell."""
    lines = [f"| {first} (tau at {' / '.join(map(str, budgets))} nodes) | " + " | ".join(SETS.values()) + " |",
             "|---" * (len(SETS) + 1) + "|"]  # fmt: skip
    for label, per_set in rows:
        lines.append(f"| {label} | " + " | ".join(" / ".join(f"{t:.2f}" for t in taus) for taus in per_set) + " |")
    return "\n".join(lines)


def tau_by_set(drafters: list[tuple[str, str]], budgets: tuple[int, ...] = (8, 16, 32)) -> str:
    """One row per (label, folder under docs/results holding an evaluate_drafter.py eval_results.json)."""
    rows = []
    for label, folder in drafters:
        results = json.loads((RESULTS / folder / "eval_results.json").read_text())
        assert all(r["identical_to_plain_greedy"] for r in results), f"{folder}: an output left plain greedy"
        tau = {(r["dataset"], r["tree_budget"]): r["tau"] for r in results}
        rows.append((label, [[tau[name, b] for b in budgets] for name in SETS]))
    return _table("drafter", budgets, rows)


def tau_by_arm(path: str, arms: list[tuple[str, str, str]], budgets: tuple[int, ...] = (16, 32)) -> str:
    """One row per (label, construction, arm suffix such as "/blocks=1" or "") of a tree_construction_tau.py run
    (arms named DRAFTER/CONSTRUCTION/BUDGET[SUFFIX]), with its prompt count and host below."""
    result = json.loads((RESULTS / path).read_text())
    drafter = next(iter(result["drafters"]))
    rows = []
    for label, construction, suffix in arms:
        per_set = [[result["summary"][name][f"{drafter}/{construction}/{b}{suffix}"] for b in budgets] for name in SETS]
        assert all(e["all_equal_greedy"] for entries in per_set for e in entries), f"{path}: an output left greedy"
        rows.append((label, [[e["tau"] for e in entries] for entries in per_set]))
    prompts = result["summary"]["mt_bench"][f"{drafter}/{arms[0][1]}/{budgets[0]}{arms[0][2]}"]["prompts"]
    return _table("arm", budgets, rows) + (
        f"\n\n{prompts} prompts per set, {result['max_new_tokens']} new tokens, {result['hardware']}."
    )
