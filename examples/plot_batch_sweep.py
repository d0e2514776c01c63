"""The figure and table of `examples/batch_sweep.sh`: speed-up over plain batched `generate` against batch size.

    python examples/plot_batch_sweep.py out/batch --dtype float32

Reads <root>/<dtype>-<dataset>-b<B>/results.json and per_prompt.jsonl; writes <root>/<dtype>-batch-speedup.png and
-batch-speedup.md. A cell: the speed-up of all the run's tokens (new tokens per second over plain's), the median of
the per-batch ratios (per batch and round with `--repeats`; one slow call cannot decide it) and tau.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from transformers_specblock.utils import import_pyplot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("root")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    root = Path(args.root)
    runs: dict[str, dict[int, dict]] = {}
    for path in sorted(root.glob(f"{args.dtype}-*-b*/results.json")):
        dataset, batch = re.fullmatch(rf"{args.dtype}-(.+)-b(\d+)", path.parent.name).groups()
        run = json.loads(path.read_text())
        run["median_ratio"] = _median_ratios(path.parent / "per_prompt.jsonl")
        runs.setdefault(dataset, {})[int(batch)] = run
    lines = []
    plt = import_pyplot()
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4.5), squeeze=False)
    for ax, (dataset, by_batch) in zip(axes[0], runs.items()):
        batches = sorted(by_batch)
        methods = list(dict.fromkeys(m for b in batches for m in by_batch[b]["methods"] if m != "plain"))
        lines += [f"### {dataset} ({args.dtype})", "", "| method | " + " | ".join(f"B={b}" for b in batches) + " |",
                  "|---" * (len(batches) + 1) + "|"]  # fmt: skip
        for method in methods:
            cells, xs, ys = [], [], []
            for b in batches:
                row = by_batch[b]["methods"].get(method)
                if row is None:
                    refused = by_batch[b]["settings"].get("refused", {})
                    cells.append("refused" if method in refused else "-")
                    continue
                median = f"median {by_batch[b]['median_ratio'][method]:.2f}x"
                cells.append(f"{row['speedup']:.2f}x ({median}, tau {row['tau']:.2f})" if row["tau"]
                             else f"{row['speedup']:.2f}x ({median})")  # fmt: skip
                xs.append(b)
                ys.append(row["speedup"])
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
            ax.plot(xs, ys, marker="o", label=method, linestyle="--" if "@auto" in method else "-")
        lines.append("")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch size")
        ax.set_ylabel("new tokens/s over plain batched generate")
        ax.set_title(f"{dataset}, {args.dtype}")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(root / f"{args.dtype}-batch-speedup.png", dpi=120)
    (root / f"{args.dtype}-batch-speedup.md").write_text("\n".join(lines))
    print("\n".join(lines))


def _median_ratios(log: Path) -> dict[str, float]:
    """Per method: the median over batches (and over rounds, with `--repeats`: round r's plain call against round
    r's call of the method) of plain's seconds / the method's seconds (same batch, same run)."""
    rows = [json.loads(line) for line in log.read_text().splitlines() if line]

    def rounds(row: dict) -> list[float]:
        return row.get("repeat_seconds") or [row["seconds"]]

    plain = {row["prompt_id"]: rounds(row) for row in rows if row["method"] == "plain"}
    ratios: dict[str, list[float]] = {}
    for row in rows:
        ratios.setdefault(row["method"], []).extend(p / s for p, s in zip(plain[row["prompt_id"]], rounds(row)))
    return {method: statistics.median(values) for method, values in ratios.items()}


if __name__ == "__main__":
    main()
