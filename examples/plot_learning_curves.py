"""Learning curves of several training runs on one figure: held-out slot-0 accuracy and estimated greedy-chain length
against training CPU-minutes or training tokens (e.g. drafters trained at equal compute).

Each run is an ``--output_dir`` of ``specblock-train`` with ``--eval_strategy steps``: its ``trainer_state.json``
(the finished run's, else its newest ``checkpoint-N``'s) holds the logged ``train_seconds`` (wall time of the
training loop over all sessions, the minutes here: CPU-minutes for a one-thread run on a core of its own, more where
the core was shared), the tokens seen and the held-out evaluations. ``--x tokens`` plots against training tokens
instead: the same data for every drafter, and not distorted by a shared core.

Run: ``python examples/plot_learning_curves.py out/specblock-v2 out/eagle3-v2 --output curves.png``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from transformers_specblock.utils import import_pyplot


def trainer_state(run: Path) -> dict:
    """The run's final trainer state, else its newest checkpoint's."""
    final = run / "trainer_state.json"
    if final.exists():
        return json.loads(final.read_text())
    checkpoints = sorted(run.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[1]))
    if not checkpoints:
        raise SystemExit(f"{run} has no trainer_state.json: is it a specblock-train --output_dir?")
    return json.loads(checkpoints[-1].read_text())


def curve(history: list[dict], x: str = "minutes") -> list[tuple[float, float, float]]:
    """(training minutes or thousands of tokens, held-out slot-0 accuracy, estimated chain length) per evaluation."""
    minutes_at_step = {e["step"]: e["train_seconds"] / 60 for e in history if "train_seconds" in e}
    points, steps = [], []
    for entry in history:
        if "eval_acc_slot0" not in entry or (points and entry["step"] == steps[-1]):
            continue  # the final evaluation repeats the last step's
        logged = [s for s in minutes_at_step if s <= entry["step"]]
        position = minutes_at_step[max(logged)] if logged else 0.0
        if x == "tokens":
            position = entry["num_input_tokens_seen"] / 1000
        points.append((position, entry["eval_acc_slot0"], entry["eval_accept_length"]))
        steps.append(entry["step"])
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--output", default="learning_curves.png")
    parser.add_argument("--x", choices=("minutes", "tokens"), default="minutes", help="the horizontal axis")
    args = parser.parse_args()
    plt = import_pyplot()
    fig, (acc_ax, tau_ax) = plt.subplots(1, 2, figsize=(10, 3.8))
    for run in args.runs:
        points = curve(trainer_state(run)["log_history"], args.x)
        if not points:
            print(f"{run}: no held-out evaluation logged yet")
            continue
        minutes, acc, length = zip(*points)
        acc_ax.plot(minutes, [100 * a for a in acc], marker="o", label=run.name)
        tau_ax.plot(minutes, length, marker="o", label=run.name)
        unit = "min" if args.x == "minutes" else "k tokens"
        print(f"{run}: " + ", ".join(f"{m:.0f} {unit}: {100 * a:.1f}% / {t:.3f}" for m, a, t in points))
    xlabel = "training CPU-minutes" if args.x == "minutes" else "training tokens (thousands)"
    acc_ax.set(xlabel=xlabel, ylabel="held-out slot-0 top-1 (%)")
    tau_ax.set(xlabel=xlabel, ylabel="estimated greedy-chain length")
    acc_ax.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
