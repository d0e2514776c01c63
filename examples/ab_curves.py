"""Held-out curves of the short training A/Bs (``examples/data_ab.sh``) into one committed JSON file.

    python examples/ab_curves.py /work/campaign/ab docs/results/data-ab/curves.json

For every arm folder under ROOT (a run of ``specblock-train``; finished, or its newest complete checkpoint): each
evaluation's step, training tokens so far, CPU seconds so far, held-out slot-0 top-1 and estimated greedy-chain
length. Arms already in the file and no longer on this machine are kept.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from campaign_curve import state_of

from transformers_specblock.utils import write_atomically


def arm_curve(state: dict) -> dict:
    """One arm's evaluations from its trainer state."""
    points, tokens, cpu = [], 0, 0.0
    for entry in state["log_history"]:
        tokens = entry.get("num_input_tokens_seen", tokens)
        cpu = entry.get("train_cpu_seconds", cpu)
        if "eval_acc_slot0" in entry:
            points.append({
                "step": entry["step"], "tokens": tokens, "train_cpu_seconds": cpu,
                "eval_acc_slot0": round(entry["eval_acc_slot0"], 4),
                "eval_accept_length": round(entry["eval_accept_length"], 4),
            })  # fmt: skip
    return {"global_step": state["global_step"], "max_steps": state["max_steps"], "points": points}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("output", type=Path)
    options = parser.parse_args()
    curves = json.loads(options.output.read_text()) if options.output.is_file() else {}
    for arm in sorted(p for p in options.root.iterdir() if p.is_dir() and not p.name.startswith("data-")):
        found = state_of(arm)
        if found is not None:
            curves[arm.name] = arm_curve(found[0])
    write_atomically(options.output, json.dumps(curves, indent=1) + "\n")
    for arm, curve in curves.items():
        last = curve["points"][-1] if curve["points"] else {}
        print(f"{arm}: step {curve['global_step']}/{curve['max_steps']}, last eval {last}")


if __name__ == "__main__":
    main()
