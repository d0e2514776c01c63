"""Print a Markdown table of drafters' tau at fixed budgets from the `eval_results.json` that
`examples/evaluate_drafter.py --tree_budget 8 16 32 --report_dir DIR` writes: one row per drafter and prompt set.

    python examples/tau_table.py "trained on ShareGPT=docs/results/data-ab/tau-sharegpt" "...=..."
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PROMPT_SETS = ("mt_bench", "humaneval", "sharegpt")
BUDGETS = (8, 16, 32)


def tau_rows(label: str, folder: Path) -> list[str]:
    """The table rows of one drafter (a note where its run has not finished)."""
    path = folder / "eval_results.json"
    if not path.exists():
        return [f"| {label} | (run not finished) | | | | |"]
    results = json.loads(path.read_text())
    rows = []
    for name in PROMPT_SETS:
        cells = {r["tree_budget"]: r for r in results if r["dataset"] == name}
        if not cells:
            rows.append(f"| {label} | {name} | not measured | | | |")
            continue
        same = all(r["identical_to_plain_greedy"] for r in cells.values())
        taus = " | ".join(f"{cells[b]['tau']:.2f}" if b in cells else "" for b in BUDGETS)
        rows.append(f"| {label} | {name} | {taus} | {same} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="LABEL=REPORT_DIR, one per drafter")
    args = parser.parse_args()
    print("| drafter | prompt set | tau @ 8 | tau @ 16 | tau @ 32 | identical to plain greedy |")
    print("|---|---|---|---|---|---|")
    for run in args.runs:
        label, _, folder = run.partition("=")
        print("\n".join(tau_rows(label, Path(folder))))


if __name__ == "__main__":
    main()
