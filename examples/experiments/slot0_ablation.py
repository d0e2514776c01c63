"""Slot-0 ablation (issue 11, section 4): which recipe change makes SpecBlock's slot 0 learn as fast as EAGLE-3's?

Every variant trains a NEW drafter with ``python -m transformers_specblock.train`` (the real Trainer) on the same
first ``--conversations`` ShareGPT conversations, one epoch, same order, same seed, from one shared features cache
(the target runs once, before the variants), and is then evaluated on the held-out ShareGPT split. Reported per
variant: held-out slot-0 top-1 accuracy, estimated greedy-chain accepted length, training tokens and the CPU
minutes the training process used (user + system time of the child process: tokens per CPU-minute is comparable
across variants even when the machine is shared). Variants (``--variants`` picks a subset):

* ``baseline``: the shipped SpecBlock recipe (K 4, 2 blocks, lr 7e-4 constant after 10 warm-up steps).
* ``k1``: ``--block_size 1 --num_blocks 1``, the diagnosis: slot 0 alone, no follow-up block, no later slots.
  If slot 0 then learns as fast as EAGLE-3's, the gap is the loss; if not, the architecture.
* ``one_block``: K 4 but block 1 only (``--num_blocks 1``): is it the follow-up block?
* ``slot0_loss``: K 4, block 1 only, and only slot 0 in the draft loss (``--slot_decay 0``): is it the later slots'
  loss, or the K-slot layout itself (slot 0 attending to the other slots' cache entries)?
* ``identity``: ``--fusion_identity_init`` (features reach the decoder directly, as in EAGLE-3).
* ``slot0norm``: ``--slot_normalization slot0``.
* ``phases``: the reference's first phase and unlocking: the first half of the steps block 1 only and no rank
  loss, slots unlocked over an eighth of the steps each.
* ``cosine``: ``--lr_scheduler_type cosine`` with 10% warm-up.
* ``eagle3``: the EAGLE-3 drafter, same data (the reference point).
* ``combined``: identity + slot0norm + cosine.

Run: ``python examples/experiments/slot0_ablation.py --output_dir out/ablation`` (``--parallel 2`` runs two variants at once,
each on one thread); it writes ``results.json``, ``results.md`` and ``slot0_ablation.png`` there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from transformers_specblock.utils import import_pyplot

COMMON = [  # the shipped recipe, less the data size (set per run) and saving
    "--target_model", "smollm2-135m-instruct", "--dataset", "sharegpt", "--draft_vocab_size", "8192",
    "--max_length", "512", "--per_device_train_batch_size", "2", "--learning_rate", "7e-4",
    "--lr_scheduler_type", "constant_with_warmup", "--warmup_steps", "10", "--num_train_epochs", "1",
    "--eval_strategy", "no", "--save_strategy", "no", "--logging_steps", "4", "--save_dtype", "float32",
    "--features", "precomputed", "--seed", "0", "--report_to", "none", "--dataloader_num_workers", "0",
    "--use_cpu", "--disable_tqdm", "true",
]  # fmt: skip
SPECBLOCK = ["--block_size", "4", "--num_blocks", "2"]


def variants(steps: int) -> dict[str, list[str]]:
    """Command-line arguments of every variant for a run of ``steps`` optimizer steps."""
    cosine = ["--lr_scheduler_type", "cosine", "--warmup_steps", str(max(1, steps // 10))]
    return {
        "baseline": SPECBLOCK,
        "k1": ["--block_size", "1", "--num_blocks", "1"],
        "one_block": ["--block_size", "4", "--num_blocks", "1"],
        "slot0_loss": ["--block_size", "4", "--num_blocks", "1", "--slot_decay", "0"],
        "identity": SPECBLOCK + ["--fusion_identity_init"],
        "slot0norm": SPECBLOCK + ["--slot_normalization", "slot0"],
        "phases": SPECBLOCK
        + ["--single_block_steps", str(steps // 2), "--rank_start_step", str(steps // 2)]
        + ["--unlock_warmup_steps", str(max(1, steps // 8))],
        "cosine": SPECBLOCK + cosine,
        "eagle3": ["--drafter", "eagle3"],
        "combined": SPECBLOCK + ["--fusion_identity_init", "--slot_normalization", "slot0"] + cosine,
    }


def launch(name: str, extra: list[str], args: argparse.Namespace) -> subprocess.Popen:
    out = Path(args.output_dir) / name
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "transformers_specblock.train", *COMMON, *extra]
    command += ["--max_train_samples", str(args.conversations), "--features_dir", str(Path(args.output_dir) / "features")]
    command += ["--output_dir", str(out), "--eval_samples", str(args.eval_samples)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    log = open(out / "train.log", "w")
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_one(running: dict[int, tuple[str, subprocess.Popen, float]]) -> tuple[str, float, float, int]:
    """Wait for any running variant; its name, CPU minutes (user + system), wall minutes and exit status."""
    pid, status, usage = os.wait4(-1, 0)
    name, process, start = running.pop(pid)
    process.returncode = os.waitstatus_to_exitcode(status)
    return name, (usage.ru_utime + usage.ru_stime) / 60, (time.perf_counter() - start) / 60, process.returncode


def collect(name: str, cpu_minutes: float, wall_minutes: float, args: argparse.Namespace) -> dict:
    metrics = json.loads((Path(args.output_dir) / name / "all_results.json").read_text())
    return {
        "variant": name,
        "slot0_acc": metrics["eval_acc_slot0"],
        "slot1_acc": metrics.get("eval_acc_slot1"),
        "accept_length": metrics["eval_accept_length"],
        "train_tokens": metrics["train_tokens"],
        "cpu_minutes": cpu_minutes,  # training process: features read from the cache, final evaluation included
        "wall_minutes": wall_minutes,
        "train_minutes": metrics["train_runtime"] / 60,  # wall time of the training loop alone
    }


def write_report(rows: list[dict], args: argparse.Namespace) -> None:
    out = Path(args.output_dir)
    (out / "results.json").write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=2))
    lines = [
        "| variant | held-out slot-0 top-1 | slot-1 | est. greedy-chain length | train tokens | CPU min | train loop min (wall) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        slot1 = "-" if r["slot1_acc"] is None else f"{100 * r['slot1_acc']:.1f}%"
        lines.append(
            f"| {r['variant']} | {100 * r['slot0_acc']:.1f}% | {slot1} | {r['accept_length']:.3f} | "
            f"{r['train_tokens']:,} | {r['cpu_minutes']:.1f}{'*' if r.get('includes_feature_extraction') else ''} | "
            f"{r['train_minutes']:.1f} |"
        )
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        plt = import_pyplot()
    except ImportError as error:
        print(f"No figure: {error}")
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh([r["variant"] for r in rows], [100 * r["slot0_acc"] for r in rows], color="tab:blue")
    ax.set_xlabel("held-out slot-0 top-1 accuracy (%)")
    ax.set_title(f"Slot-0 ablation, {rows[0]['train_tokens']:,} ShareGPT tokens each")
    fig.tight_layout()
    fig.savefig(out / "slot0_ablation.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output_dir", default="out/ablation")
    parser.add_argument("--conversations", type=int, default=128, help="ShareGPT train conversations (1 epoch).")
    parser.add_argument("--eval_samples", type=int, default=64)
    parser.add_argument("--variants", default="baseline,k1,eagle3,identity,slot0norm,phases,cosine,combined")
    parser.add_argument("--parallel", type=int, default=1, help="Variants trained at once.")
    parser.add_argument("--threads", type=int, default=1, help="Intra-op threads per training process.")
    args = parser.parse_args()

    steps = args.conversations // 2  # batch 2, one epoch
    table = variants(steps)
    names = args.variants.split(",")
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"Unknown variants {unknown}; choose from {', '.join(table)}.")
    done_path = Path(args.output_dir) / "done.jsonl"  # resumable: finished variants are not trained again
    done = {}
    if done_path.exists():
        done = {r["variant"]: r for r in map(json.loads, done_path.read_text().splitlines())}
    todo = [n for n in names if n not in done]
    if todo and not (Path(args.output_dir) / "features").exists():  # build the shared cache alone, first
        first = launch(todo[0], table[todo[0]], args)
        name, cpu, wall, status = wait_one({first.pid: (todo[0], first, time.perf_counter())})
        todo.pop(0)
        if status != 0:
            raise SystemExit(f"{name} failed (exit {status}); see {args.output_dir}/{name}/train.log")
        done[name] = collect(name, cpu, wall, args) | {"includes_feature_extraction": True}
        with open(done_path, "a") as f:
            f.write(json.dumps(done[name]) + "\n")
    running: dict[int, tuple[str, subprocess.Popen, float]] = {}
    while todo or running:
        while todo and len(running) < args.parallel:
            name = todo.pop(0)
            process = launch(name, table[name], args)
            running[process.pid] = (name, process, time.perf_counter())
        name, cpu, wall, status = wait_one(running)
        if status != 0:
            print(f"{name} failed (exit {status}); see {args.output_dir}/{name}/train.log", file=sys.stderr)
            continue
        done[name] = collect(name, cpu, wall, args)
        print(f"{name}: {done[name]}", flush=True)
        with open(done_path, "a") as f:
            f.write(json.dumps(done[name]) + "\n")
    write_report([done[n] for n in names if n in done], args)


if __name__ == "__main__":
    main()
