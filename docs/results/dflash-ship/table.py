"""Print the tau table of both drafters from their eval_results.json (one row per prompt set, columns per budget)."""
import json
from pathlib import Path

base = Path("docs/results/dflash-ship")
runs = {"trained on one H200 (13.2M tokens)": "trained-h200", "trained on a CPU (453k tokens)": "trained-cpu"}
print("| drafter | prompt set | tau @ 8 | tau @ 16 | tau @ 32 | identical to plain greedy |")
print("|---|---|---|---|---|---|")
for label, folder in runs.items():
    path = base / folder / "eval_results.json"
    if not path.exists():
        print(f"| {label} | (run not finished) | | | | |")
        continue
    rows = json.loads(path.read_text())
    for name in ("mt_bench", "humaneval", "sharegpt"):
        cells = {r["tree_budget"]: r for r in rows if r["dataset"] == name}
        if not cells:
            print(f"| {label} | {name} | not measured | | | |")
            continue
        same = all(r["identical_to_plain_greedy"] for r in cells.values())
        print(f"| {label} | {name} | " + " | ".join(f"{cells[b]['tau']:.2f}" for b in (8, 16, 32)) + f" | {same} |")
