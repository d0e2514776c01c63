"""How many training tokens SpecBlock would need to reach the campaign's aims, by log-linear fits.

    python examples/campaign_extrapolation.py   # writes docs/results/campaign/extrapolation.json

Held-out slot-0 accuracy: fits accuracy = a + b * ln(tokens) over the SpecBlock points there are: the from-scratch
ShareGPT arm of the data A/B (docs/results/data-ab/curves.json), the shipped drafter and the campaign
(docs/results/campaign/). Beside it, the slope per doubling of the one long curve (DFlash on an H200, 13.2M tokens)
over its first and last doublings: where a curve bends down, the fit's answer is a lower bound.

Tau at 16 nodes: fits the mean over the three prompt sets of the campaign steps' tau measurements
(docs/results/campaign/tau-specblock-campaign-stepN-*), one fit per tree setting, against the tokens the campaign
had trained at step N.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from transformers_specblock.utils import write_atomically

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs/results"
AIMS = (0.35, 0.45)
TAU_AIM, TAU_BUDGET = 2.4, 16
TAU_SETTINGS = {  # folder suffix -> tree setting
    r"shipped(-settings)?": "reference construction, 1 block round, chain layout",
    r"best-first": "reference construction, 1 block round grown best first (shipped)",
    r"reference-2-rounds": "reference construction, 2 block rounds",
}


def log_fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(a, b) of accuracy = a + b * ln(tokens)."""
    slope, intercept = np.polyfit(np.log([t for t, _ in points]), [acc for _, acc in points], 1)
    return float(intercept), float(slope)


def tokens_at(step: int, campaign: list[dict]) -> float:
    """The drafter's training tokens in all at a campaign step, interpolated between its held-out evaluations."""
    steps, tokens = zip(*sorted((p["step"], p["tokens"]) for p in campaign))
    return float(np.interp(step, steps, tokens))


def tau_extrapolation(campaign: list[dict]) -> dict:
    """Per tree setting: the measured (step, tokens, mean tau at TAU_BUDGET nodes), the fit, tokens to TAU_AIM."""
    fits = {}
    for suffix, setting in TAU_SETTINGS.items():
        points = []
        for folder in RESULTS.glob("campaign/tau-specblock-campaign-step*"):
            match = re.fullmatch(rf"tau-specblock-campaign-step(\d+)-{suffix}", folder.name)
            if not match or not (folder / "eval_results.json").exists():  # not measured, or still being measured
                continue
            rows = json.loads((folder / "eval_results.json").read_text())
            taus = [row["tau"] for row in rows if row["tree_budget"] == TAU_BUDGET]
            step = int(match.group(1))
            points.append({"step": step, "tokens": round(tokens_at(step, campaign)), "tau": round(np.mean(taus), 3)})
        points.sort(key=lambda p: p["step"])
        intercept, slope = log_fit([(p["tokens"], p["tau"]) for p in points])
        fits[setting] = {
            "points": points,
            "tau_per_doubling": round(slope * math.log(2), 3),
            "tokens_to_reach": round(math.exp((TAU_AIM - intercept) / slope)),
        }
    return fits


def extrapolate() -> dict:
    """The fits and their answers, from the results files under docs/results."""
    curves = json.loads((RESULTS / "data-ab/curves.json").read_text())
    shipped = json.loads((RESULTS / "campaign/shipped.json").read_text())["specblock"]
    records = [json.loads(line) for line in (RESULTS / "campaign/specblock.jsonl").read_text().splitlines()]
    campaign = [p for p in records if not p.get("abandoned")]
    points = [(p["tokens"], p["eval_acc_slot0"]) for p in curves["sharegpt"]["points"]]
    points.append((shipped["tokens"], shipped["eval_acc_slot0"]))
    points += [(p["tokens"], p["eval_acc_slot0"]) for p in campaign]
    intercept, slope = log_fit(points)
    state = json.loads((RESULTS / "gpu-h200-2026-11-30/dflash-trainer_state.json").read_text())
    history = state["log_history"]
    long_curve = [(e["num_input_tokens_seen"], e["eval_acc_slot0"]) for e in history if "eval_acc_slot0" in e]
    halves = {
        "first 4M tokens": [p for p in long_curve if p[0] <= 4.5e6],
        "last doubling (6.6M-13.2M)": [p for p in long_curve if p[0] >= 6.5e6],
    }
    return {
        "about": __doc__.split("\n\n")[0],
        "specblock_points": len(points),
        "specblock_points_per_doubling": round(100 * slope * math.log(2), 2),
        "tokens_to_reach": {f"{aim:.0%}": round(math.exp((aim - intercept) / slope)) for aim in AIMS},
        "dflash_h200_points_per_doubling": {
            name: round(100 * log_fit(part)[1] * math.log(2), 2) for name, part in halves.items()
        },
        f"tau_at_{TAU_BUDGET}_nodes": {"aim": TAU_AIM, "fits": tau_extrapolation(campaign)},
    }


def main() -> None:
    result = extrapolate()
    path = RESULTS / "campaign/extrapolation.json"
    write_atomically(path, json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
