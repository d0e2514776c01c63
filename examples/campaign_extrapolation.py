"""How many training tokens SpecBlock's held-out slot-0 accuracy would need to reach an aim, by a log-linear fit.

    python examples/campaign_extrapolation.py   # writes docs/results/campaign/extrapolation.json

Fits accuracy = a + b * ln(tokens) over the SpecBlock points there are: the from-scratch ShareGPT arm of the data
A/B (docs/results/data-ab/curves.json), the shipped drafter and the campaign (docs/results/campaign/). Beside it, the
slope per doubling of the one long curve (DFlash on an H200, 13.2M tokens) over its first and last doublings: where
a curve bends down, the fit's answer is a lower bound.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from transformers_specblock.utils import write_atomically

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs/results"
AIMS = (0.35, 0.45)


def log_fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(a, b) of accuracy = a + b * ln(tokens)."""
    slope, intercept = np.polyfit(np.log([t for t, _ in points]), [acc for _, acc in points], 1)
    return float(intercept), float(slope)


def main() -> None:
    curves = json.loads((RESULTS / "data-ab/curves.json").read_text())
    shipped = json.loads((RESULTS / "campaign/shipped.json").read_text())["specblock"]
    campaign = [json.loads(line) for line in (RESULTS / "campaign/specblock.jsonl").read_text().splitlines()]
    points = [(p["tokens"], p["eval_acc_slot0"]) for p in curves["sharegpt"]["points"]]
    points.append((shipped["tokens"], shipped["eval_acc_slot0"]))
    points += [(p["tokens"], p["eval_acc_slot0"]) for p in campaign if not p.get("abandoned")]
    intercept, slope = log_fit(points)
    state = json.loads((RESULTS / "gpu-h200-2026-11-30/dflash-trainer_state.json").read_text())
    history = state["log_history"]
    long_curve = [(e["num_input_tokens_seen"], e["eval_acc_slot0"]) for e in history if "eval_acc_slot0" in e]
    halves = {
        "first 4M tokens": [p for p in long_curve if p[0] <= 4.5e6],
        "last doubling (6.6M-13.2M)": [p for p in long_curve if p[0] >= 6.5e6],
    }
    result = {
        "about": __doc__.split("\n\n")[0],
        "specblock_points": len(points),
        "specblock_points_per_doubling": round(100 * slope * math.log(2), 2),
        "tokens_to_reach": {f"{aim:.0%}": round(math.exp((aim - intercept) / slope)) for aim in AIMS},
        "dflash_h200_points_per_doubling": {
            name: round(100 * log_fit(part)[1] * math.log(2), 2) for name, part in halves.items()
        },
    }
    path = RESULTS / "campaign/extrapolation.json"
    write_atomically(path, json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
