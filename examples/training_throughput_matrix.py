"""Training tokens/s of both drafters on this host: float32 / bfloat16, online / precomputed features, 1 / 2 threads.

    python examples/training_throughput_matrix.py --output docs/results/training-throughput-amd

Every configuration trains ``--steps`` steps with ``python -m transformers_specblock.train`` (the real Trainer) on the
first ``--conversations`` ShareGPT train conversations, from the shipped drafter, batch 2 x ``max_length`` 512, the
campaign recipe (SpecBlock: K 4, 2 blocks, slot-0 normalisation; EAGLE-3: 7 unrolled steps). Training tokens/s =
non-padding tokens between the first and the last logged step / the seconds between them (the first step, with its
warm-up, is not timed). ``bfloat16`` = ``--dtype bfloat16 --bf16`` (target and its features in bfloat16, the
drafter under bfloat16 autocast with float32 master weights); ``precomputed`` = the features cache built once per
dtype (its extraction tokens/s is reported too: over E epochs a token costs 1/train + 1/(E x extraction)).

Rounds run the configurations in alternating order, so load from other processes hits all of them alike: on a
shared machine read the RATIOS between configurations of one run, not the absolute figures. Writes
``OUTPUT/results.json`` (every round's raw figure, the host, the load) and ``OUTPUT/table.md``.
"""

from __future__ import annotations

import argparse
import itertools
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from training_throughput import SHIPPED_COMMAND, bf16_matmul_speedup, training_tokens_per_second  # noqa: E402

from transformers_specblock.hub.provenance import describe_device  # noqa: E402

RECIPE = {
    "specblock": ["--block_size", "4", "--num_blocks", "2", "--slot_normalization", "slot0"],
    "eagle3": ["--drafter", "eagle3"],
}


def run(args: list[str], threads: int, log: Path) -> float:
    """Train with ``args`` at ``threads`` intra-op threads; returns the wall seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    with log.open("w") as out:
        command = [sys.executable, "-m", "transformers_specblock.train", *args]
        code = subprocess.call(command, env=env, stdout=out, stderr=out)
    if code:
        raise RuntimeError(f"training exited with {code}; its output: {log}\n{log.read_text()[-3000:]}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="Results folder.")
    parser.add_argument("--drafters", nargs="+", default=["specblock", "eagle3"], choices=sorted(RECIPE))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--features", nargs="+", default=["online", "precomputed"], choices=["online", "precomputed"])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument(
        "--more_threads_features", nargs="+", default=["online"], choices=["online", "precomputed"],
        help="Feature modes also run at the --threads above 1 (the rest at the first thread count only).",
    )
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    options = parser.parse_args()
    torch.set_num_threads(1)
    configs = [
        (drafter, dtype, features, threads)
        for drafter, dtype, features, threads in itertools.product(
            options.drafters, options.dtypes, options.features, options.threads
        )
        if threads == options.threads[0] or features in options.more_threads_features
    ]
    load_before = os.getloadavg()
    speedup = bf16_matmul_speedup()
    raw: dict[str, list[float]] = {}
    extraction: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="throughput-matrix-") as tmp_name:
        tmp = Path(tmp_name)
        progress = tqdm(total=options.rounds * len(configs), desc="training runs", unit="run")
        for round_ in range(options.rounds):
            for drafter, dtype, features, threads in configs if round_ % 2 == 0 else configs[::-1]:
                name = f"{drafter} / {dtype} / {features} / {threads} thread{'s' if threads > 1 else ''}"
                progress.set_postfix_str(f"round {round_ + 1}: {name}")
                out = tmp / f"{drafter}-{dtype}-{features}-{threads}-{round_}"
                args = [*SHIPPED_COMMAND, *RECIPE[drafter], "--output_dir", str(out), "--use_cpu"]
                args += ["--max_train_samples", str(options.conversations), "--max_steps", str(options.steps)]
                args += ["--logging_steps", "1", "--save_strategy", "no", "--eval_dataset", "none"]
                args += ["--init_drafter", f"{drafter}-smollm2-135m-instruct", "--disable_tqdm", "true"]
                if dtype == "bfloat16":
                    args += ["--dtype", "bfloat16", "--features_dtype", "bfloat16", "--bf16"]
                cache = tmp / f"features-{dtype}"
                built = (cache / "features_info.json").is_file()
                if features == "precomputed":
                    args[args.index("--features") + 1] = "precomputed"
                    args += ["--features_dir", str(cache)]
                run(args, threads, tmp / f"{out.name}.log")
                raw.setdefault(name, []).append(training_tokens_per_second(out))
                if features == "precomputed" and not built:
                    info = json.loads((cache / "features_info.json").read_text())
                    rate = info["num_tokens"] / info["seconds"]
                    extraction.setdefault(f"{dtype} / {threads} thread(s)", []).append(rate)
                progress.update()
                write_results(options, configs, raw, extraction, speedup, load_before)
        progress.close()


def write_results(options, configs, raw, extraction, speedup, load_before) -> None:
    """Write ``results.json`` and ``table.md`` from the runs so far (after every run: a stopped run keeps them)."""
    hardware = describe_device("cpu")
    median = {name: statistics.median(values) for name, values in raw.items()}
    lines = [
        "| drafter | dtype | features | threads | training tok/s | vs float32 online 1 thread |",
        "|---|---|---|---|---|---|",
    ]
    for drafter, dtype, features, threads in configs:
        name = f"{drafter} / {dtype} / {features} / {threads} thread{'s' if threads > 1 else ''}"
        if name not in median:
            continue
        base = median.get(f"{drafter} / float32 / online / 1 thread")
        ratio = f"{median[name] / base:.2f}x" if base else "-"
        lines.append(f"| {drafter} | {dtype} | {features} | {threads} | {median[name]:.0f} | {ratio} |")
    table = "\n".join(lines) + "\n"
    results = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "hardware": hardware,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "bf16_matmul_speedup": round(speedup, 2),
        "load_average_before": load_before,
        "load_average_now": os.getloadavg(),
        "conversations": options.conversations,
        "steps": options.steps,
        "rounds": options.rounds,
        "training_tokens_per_second": {name: [round(v, 1) for v in values] for name, values in raw.items()},
        "extraction_tokens_per_second": {name: [round(v, 1) for v in values] for name, values in extraction.items()},
    }
    output = Path(options.output)
    output.mkdir(parents=True, exist_ok=True)
    (output / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (output / "table.md").write_text(table)


if __name__ == "__main__":
    main()
