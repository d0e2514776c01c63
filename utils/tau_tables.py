"""Tau tables of docs/training.md, docs/lab-notes/campaign.md and docs/results/specblock-depth/README.md, read from
the JSON the measuring scripts wrote: `examples/evaluate_drafter.py --tree_budget 8 16 32` (`eval_results.json`),
`examples/experiments/tree_construction_tau.py` (its `summary`) and the best-first calibration's files. Every output
behind a cell equals plain greedy."""

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


def penalty_sweep(relative: str) -> str:
    """The off-chain penalty sweep's tau (`{"p<penalty>@<budget>": [tau, identical to plain greedy]}`): a row per
    budget, a column per penalty."""
    cells = {tuple(name[1:].split("@")): value for name, value in json.loads((RESULTS / relative).read_text()).items()}
    if not all(identical for _, identical in cells.values()):
        raise ValueError(f"{relative}: an output left plain greedy; a tau table holds lossless runs only")
    penalties = list(dict.fromkeys(penalty for penalty, _ in cells))
    lines = ["| off_chain_penalty | " + " | ".join(p if float(p) else "0 (shipped)" for p in penalties) + " |",
             "|---" * (len(penalties) + 1) + "|"]  # fmt: skip
    for budget in dict.fromkeys(budget for _, budget in cells):
        lines.append(f"| tau at {budget} nodes | " + " | ".join(f"{cells[p, budget][0]:.3f}" for p in penalties) + " |")
    return "\n".join(lines)


def calibration(relative: str) -> str:
    """`examples/experiments/off_chain_calibration.py`'s cells: per depth and place, the nodes, their mean own draft
    probability, how often the target accepted them, and the log of the ratio."""
    lines = ["| depth, where | nodes | own draft probability (mean) | accepted | log ratio |", "|---|---|---|---|---|"]
    for where, cell in json.loads((RESULTS / relative).read_text())["cells"].items():
        lines.append(f"| {where} | {cell['nodes']} | {cell['predicted']:.3f} | {cell['accepted']:.3f} | "
                     f"{cell['log_ratio']:+.2f} |")  # fmt: skip
    return "\n".join(lines)
