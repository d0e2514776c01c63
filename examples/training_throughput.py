"""Training throughput of the shipped recipe against this checkout's, for both drafters, in one run.

Every configuration trains a few steps with ``python -m transformers_specblock.train`` (the real Trainer, data
loader and optimizer) on the same first ``--conversations`` ShareGPT conversations, starting from the shipped
drafter (so the valid-prefix survival that the sparse heads exploit is a trained drafter's, not a random one's).
Training tokens/s = non-padding tokens between the first and the last logged step / the training seconds between
them. Configurations:

* ``shipped``: the code of ``--baseline_ref`` (the commit before this work; its ``src`` extracted with ``git
  archive`` and put first on PYTHONPATH) running the command recorded in the shipped model cards (online float32
  target features inside every step, float32 drafter, batch 2, ``max_length`` 512).
* ``online``: this checkout, the same command (what the code changes alone buy; SpecBlock only, EAGLE-3's training
  code did not change).
* ``precomputed``: this checkout, ``--features precomputed``: the target runs once over the conversations (timed
  separately as feature-extraction tokens/s, in float32 as ``--dtype auto`` picks on a CPU); the steps read the
  cache. Over E epochs a token costs 1/train + 1/(E x extraction) seconds.
* ``precomputed + bf16`` (only where a bfloat16 matmul beats float32 on this CPU, or with ``--bf16 yes``): target
  in bfloat16 for the extraction, features stored in bfloat16, ``--bf16`` autocast for the drafter.

Rounds alternate the order of the configurations, so a change of machine load hits all of them; the table shows
medians over rounds. The training processes run ``--threads`` intra-op threads (default 1: tokens per CPU-second,
and on a shared machine far steadier than two threads that spin-wait on each other's cores). Run:
``python examples/training_throughput.py`` (about 25 minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
BASELINE_REF = "c6de8bb"  # the last commit before the training-throughput work (issue 11, section 2)
SHIPPED_COMMAND = [  # the shipped model cards' command, less output, steps, saving and the 4000-conversation pool
    "--target_model", "smollm2-135m-instruct", "--dataset", "sharegpt", "--draft_vocab_size", "8192",
    "--max_length", "512", "--per_device_train_batch_size", "2", "--learning_rate", "7e-4",
    "--lr_scheduler_type", "constant_with_warmup", "--warmup_steps", "10", "--eval_strategy", "no",
    "--save_dtype", "bfloat16", "--features", "online", "--seed", "0", "--report_to", "none",
    "--dataloader_num_workers", "0",
]  # fmt: skip
DRAFTER_ARGS = {"specblock": ["--block_size", "4", "--num_blocks", "2"], "eagle3": ["--drafter", "eagle3"]}


def bf16_matmul_speedup() -> float:
    """float32 time / bfloat16 time of a draft-lm_head-shaped matmul (1024 x 576 x 8192) on this CPU."""
    times = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, w = torch.randn(1024, 576, dtype=dtype), torch.randn(8192, 576, dtype=dtype)
        a @ w.T
        start = time.perf_counter()
        for _ in range(3):
            a @ w.T
        times[dtype] = time.perf_counter() - start
    return times[torch.float32] / times[torch.bfloat16]


def training_tokens_per_second(output_dir: Path) -> float:
    """Non-padding tokens / training seconds between the first and the last logged step."""
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    logs = [entry for entry in history if "loss" in entry]
    first, last = logs[0], logs[-1]
    return (last["num_input_tokens_seen"] - first["num_input_tokens_seen"]) / (
        last["train_seconds"] - first["train_seconds"]
    )


def run_training(args: list[str], pythonpath: Path, log: Path) -> None:
    """``python -m transformers_specblock.train ARGS`` with ``pythonpath`` first and this process' thread count;
    its output goes to ``log``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pythonpath), os.environ.get("PYTHONPATH", "")])}
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    with log.open("w") as out:
        code = subprocess.call(
            [sys.executable, "-m", "transformers_specblock.train", *args], env=env, stdout=out, stderr=out
        )
    if code:
        raise RuntimeError(f"training exited with {code}; its output: {log}\n{log.read_text()[-3000:]}")


def configurations(drafters: list[str], bf16: bool) -> list[tuple[str, str]]:
    """(drafter, configuration) pairs to run."""
    names = ["shipped", "online", "precomputed"] + (["precomputed + bf16"] if bf16 else [])
    return [(d, n) for d in drafters for n in names if not (d == "eagle3" and n == "online")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafters", nargs="+", default=["specblock", "eagle3"], choices=sorted(DRAFTER_ARGS))
    parser.add_argument("--conversations", type=int, default=24, help="First N ShareGPT train conversations.")
    parser.add_argument("--steps", type=int, default=5, help="Steps per run (the first one is not timed).")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--baseline_ref", default=BASELINE_REF)
    parser.add_argument("--bf16", choices=["auto", "yes", "no"], default="auto")
    parser.add_argument("--threads", type=int, default=1, help="Intra-op threads of every training process.")
    options = parser.parse_args()
    torch.set_num_threads(options.threads)

    speedup = bf16_matmul_speedup()
    bf16 = options.bf16 == "yes" or (options.bf16 == "auto" and speedup > 1.0)
    print(
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, load average "
        f"{os.getloadavg()[0]:.1f}; bfloat16 matmul {speedup:.2f}x float32 -> bf16 configurations "
        f"{'run' if bf16 else 'skipped'}"
    )
    runs = configurations(options.drafters, bf16)
    train_tps: dict[tuple[str, str], list[float]] = {}
    extraction_tps: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="throughput-") as tmp_name:
        tmp = Path(tmp_name)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", options.baseline_ref, "src"], capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive.stdout, check=True)
        sources = {"shipped": tmp / "src", "new": REPO / "src"}
        progress = tqdm(total=options.rounds * len(runs), desc="training runs", unit="run")
        for round_ in range(options.rounds):
            order = runs if round_ % 2 == 0 else runs[::-1]
            for drafter, name in order:
                progress.set_postfix_str(f"round {round_ + 1}: {drafter}, {name}")
                out = tmp / f"{drafter}-{name.replace(' ', '')}-{round_}"
                args = [*SHIPPED_COMMAND, *DRAFTER_ARGS[drafter], "--output_dir", str(out)]
                args += ["--max_train_samples", str(options.conversations), "--max_steps", str(options.steps)]
                args += ["--logging_steps", "1", "--save_strategy", "no", "--eval_dataset", "none"]
                args += ["--init_drafter", f"{drafter}-smollm2-135m-instruct", "--disable_tqdm", "true"]
                cache = None
                if name.startswith("precomputed"):
                    cache = tmp / f"features-{name.replace(' ', '')}-{round_}"  # built by the round's first user
                    args[args.index("--features") + 1] = "precomputed"
                    args += ["--features_dir", str(cache)]
                if name == "precomputed + bf16":
                    args += ["--dtype", "bfloat16", "--features_dtype", "bfloat16", "--bf16"]
                built = cache is not None and (cache / "features_info.json").is_file()
                run_training(args, sources["shipped" if name == "shipped" else "new"], tmp / f"{out.name}.log")
                train_tps.setdefault((drafter, name), []).append(training_tokens_per_second(out))
                if cache is not None and not built:
                    info = json.loads((cache / "features_info.json").read_text())
                    extraction_tps.setdefault(name, []).append(info["num_tokens"] / info["seconds"])
                progress.update()
        progress.close()

    print(f"\nload average after: {os.getloadavg()[0]:.1f}")
    print("raw tokens/s per round:", {f"{d} / {n}": [round(v, 1) for v in r] for (d, n), r in train_tps.items()})
    print("feature extraction tokens/s per round:", {n: [round(v, 1) for v in r] for n, r in extraction_tps.items()})
    print("\n| drafter | configuration | training tok/s | extraction tok/s | tok/s, 1 epoch | tok/s, 3 epochs "
          "| vs shipped, 1 / 3 epochs |")
    print("|---|---|---|---|---|---|---|")
    for drafter in options.drafters:
        shipped = statistics.median(train_tps[(drafter, "shipped")])
        for d, name in runs:
            if d != drafter:
                continue
            train = statistics.median(train_tps[(drafter, name)])
            extraction = statistics.median(extraction_tps[name]) if name in extraction_tps else None
            per_epochs = [1 / (1 / train + 1 / (e * extraction)) if extraction else train for e in (1, 3)]
            print(
                f"| {drafter} | {name} | {train:.0f} | {f'{extraction:.0f}' if extraction else 'in the step'} "
                f"| {per_epochs[0]:.0f} | {per_epochs[1]:.0f} "
                f"| {per_epochs[0] / shipped:.2f}x / {per_epochs[1] / shipped:.2f}x |"
            )


if __name__ == "__main__":
    main()
