"""Append a campaign run's new held-out evaluations to ``docs/results/campaign/DRAFTER.jsonl`` (appendable, committed).

    python examples/campaign_curve.py specblock /work/campaign [--weights]

Reads every run folder of the drafter under the campaign folder (``DRAFTER`` and ``DRAFTER-from-step-N``, see
``examples/campaign.sh``): the ``trainer_state.json`` of the run itself if it finished, else of its newest complete
checkpoint. One JSON line per evaluation: the campaign step, the drafter's training tokens in total (the shipped
drafter's before the campaign + the campaign's), the campaign's training seconds (wall clock, and the process's CPU
time: what a run spent on a shared machine), the learning rate of the last training log, held-out slot-0 top-1
and the estimated greedy-chain length, plus the run and the host it ran on. Lines already in the file (same run and
step) are not written again. ``--weights`` also copies the newest checkpoint's drafter, in bfloat16, to
``docs/results/campaign/DRAFTER/`` with ``campaign.json`` (its campaign step, tokens and training seconds): what
``campaign.sh`` continues from when no checkpoint survives. Its config and model card record the campaign up to that step, with the
drafter it started from nested (``training.records.checkpoint_training_info``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

import torch

from transformers_specblock.hub.provenance import load_training_record
from transformers_specblock.training.records import checkpoint_training_info, record_training_info
from transformers_specblock.training.run import DRAFTERS, save_drafter
from transformers_specblock.training.trainer import SESSION_KEY, last_complete_checkpoint

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs/results/campaign"
SHIPPED = json.loads((RESULTS / "shipped.json").read_text())  # the shipped drafters' training tokens and accuracy
SHIPPED_TOKENS = {name: SHIPPED[name]["tokens"] for name in ("specblock", "eagle3")}


def run_folders(root: Path, drafter: str) -> list[tuple[Path, int]]:
    """(run folder, campaign step it started from), oldest first."""
    runs = [(root / drafter, 0)] if (root / drafter).is_dir() else []
    for path in root.glob(f"{drafter}-from-step-*"):
        runs.append((path, int(re.fullmatch(rf"{drafter}-from-step-(\d+)", path.name).group(1))))
    return sorted(runs, key=lambda run: run[1])


def state_of(run: Path) -> tuple[dict, Path] | None:
    """The run's newest trainer state and where it lives (the run if finished, else its newest complete checkpoint)."""
    checkpoint = last_complete_checkpoint(run)
    candidates = [Path(p) / "trainer_state.json" for p in (checkpoint,) if p] + [run / "trainer_state.json"]
    states = [(json.loads(p.read_text()), p.parent) for p in candidates if p.is_file()]
    return max(states, key=lambda s: s[0]["global_step"]) if states else None


def campaign_before(run: Path) -> tuple[int, float, float]:
    """Campaign tokens, wall and CPU seconds before a run that started from committed weights (its predecessor's
    folder lost with its machine): the ``campaign.json`` committed with them, else (weights committed before it
    recorded seconds: the campaign's first run) the training record of the run's frozen start drafter."""
    campaign = json.loads((run / "start_drafter" / "campaign.json").read_text())
    if "train_cpu_seconds" in campaign:
        return campaign["campaign_tokens"], campaign["train_seconds"], campaign["train_cpu_seconds"]
    record = load_training_record(run / "start_drafter")  # training_record.json; older drafters: their config.json
    info = record["training"] if record else json.loads((run / "start_drafter" / "config.json").read_text())
    info = info.get("training_info", info)
    return info["train_tokens"], info["train_time_minutes"] * 60, info["train_cpu_minutes"] * 60


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("drafter", choices=sorted(SHIPPED_TOKENS))
    parser.add_argument("root", type=Path, nargs="?", default=Path("/work/campaign"))
    parser.add_argument("--weights", action="store_true")
    options = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    curve = RESULTS / f"{options.drafter}.jsonl"
    lines = [json.loads(line) for line in curve.read_text().splitlines()] if curve.is_file() else []
    known = {(line["run"], line["step"]) for line in lines}
    tokens_before = seconds_before = cpu_before = steps_before = 0
    newest = None
    added = 0
    with curve.open("a") as sink:
        for run, first_step in run_folders(options.root, options.drafter):
            found = state_of(run)
            if found is None:
                continue
            state, where = found
            if first_step != steps_before:  # the run it continues is gone: count the campaign from its start drafter
                tokens_before, seconds_before, cpu_before = campaign_before(run)
            history = state["log_history"]
            hosts = [entry[SESSION_KEY].get("hardware") for entry in history if SESSION_KEY in entry]
            tokens = seconds = cpu = 0
            rate = None
            for entry in history:
                tokens = entry.get("num_input_tokens_seen", tokens)
                seconds = entry.get("train_seconds", seconds)
                cpu = entry.get("train_cpu_seconds", cpu)
                rate = entry.get("learning_rate", rate)
                if "eval_acc_slot0" not in entry or (run.name, first_step + entry["step"]) in known:
                    continue
                line = {
                    "run": run.name, "step": first_step + entry["step"],
                    "tokens": SHIPPED_TOKENS[options.drafter] + tokens_before + tokens,
                    "campaign_tokens": tokens_before + tokens, "train_seconds": seconds_before + seconds,
                    "train_cpu_seconds": cpu_before + cpu, "learning_rate": float(rate) if rate else None,
                    "eval_acc_slot0": entry["eval_acc_slot0"], "eval_accept_length": entry.get("eval_accept_length"),
                    "hosts": sorted({h for h in hosts if h}),
                }  # fmt: skip
                sink.write(json.dumps(line) + "\n")
                known.add((run.name, line["step"]))
                added += 1
            tokens_before, seconds_before, cpu_before = tokens_before + tokens, seconds_before + seconds, cpu_before + cpu
            steps_before = first_step + state["global_step"]
            newest = (where, steps_before, tokens_before, seconds_before, cpu_before)
    print(f"{curve}: {added} new evaluations")
    if options.weights and newest is not None:
        where, step, tokens, seconds, cpu = newest
        target = RESULTS / options.drafter
        drafter = DRAFTERS[options.drafter][1].from_pretrained(where)
        record_training_info(drafter, checkpoint_training_info(where))  # its card: the campaign up to this step
        save_drafter(drafter, target, torch.bfloat16)
        info = {"campaign_steps": step, "campaign_tokens": tokens, "train_seconds": round(seconds, 1),
                "train_cpu_seconds": round(cpu, 1), "from": str(where)}
        tmp = target / "campaign.json.tmp"
        tmp.write_text(json.dumps(info) + "\n")
        os.replace(tmp, target / "campaign.json")
        print(f"weights of {where} (campaign step {step}) -> {target}")


if __name__ == "__main__":
    main()
