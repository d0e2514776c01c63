"""The benchmark's report: results.json, markdown tables and figures of a `BenchmarkResults`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers.utils import logging

from ..utils import import_pyplot
from .benchmark import REFERENCE, BenchmarkResults

logger = logging.get_logger(__name__)


def write_report(results: BenchmarkResults, output_dir: str | Path) -> None:
    """results.json, results.md (tables) and figures (speed-up / tau per category; time split per iteration; skipped
    with a warning when matplotlib, the ``plot`` extra, is not installed)."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    payload = results.payload()
    (output_dir / "results.json").write_text(json.dumps(payload, indent=2))
    (output_dir / "results.md").write_text(markdown_tables(payload))
    try:
        plot_results(payload, output_dir)
    except ImportError as error:
        logger.warning(f"No figures in {output_dir} (results.json and results.md are written): {error}")


def markdown_tables(payload: dict[str, Any]) -> str:
    columns = ["tokens_per_s", "speedup", "tau", "tokens_per_target_call", "drafting_share",
               "drafter_forwards_per_iter", "nodes_per_iter", "peak_memory_mb", "identical_to_reference", "left_greedy",
               "max_fp32_gap"]  # fmt: skip
    lines = []
    if payload["settings"].get("near_tie_gap") is not None:
        lines += [f"left_greedy: greedy outputs that differ from plain `generate`; max_fp32_gap: the largest float32 "
                  "logit gap between the two tokens where they first differ (a near-tie, round-off in 16-bit, up to "
                  f"{payload['settings']['near_tie_gap']}).", ""]  # fmt: skip
    for method, error in payload["settings"].get("refused", {}).items():
        lines += [f"{method}: refused at batch size {payload['settings']['batch_size']} ({error})", ""]
    counted = {m: row["ops_per_iter"] for m, row in payload["methods"].items() if row.get("ops_per_iter")}
    if counted:
        keys = ["target_ops", "drafting_ops", "loop_ops", "outside_ops",
                "drafting_syncs", "loop_syncs", "outside_syncs"]  # fmt: skip
        lines += ["### aten ops and host syncs per iteration (count_ops)", "",
                  "| method | " + " | ".join(keys) + " | drafter_forwards_per_iter |", "|---" * (len(keys) + 2) + "|"]
        for method, row in counted.items():
            forwards = payload["methods"][method]["drafter_forwards_per_iter"]
            lines.append(f"| {method} | " + " | ".join(_fmt(row[k]) for k in keys) + f" | {_fmt(forwards)} |")
        lines.append("")
    for title, block in [("all prompts", payload["methods"])] + list(payload["per_category"].items()):
        lines += [f"### {title}", "", "| method | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
        for method, row in block.items():
            cells = [_fmt(row[c]) for c in columns]
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    return str(value)


def plot_results(payload: dict[str, Any], output_dir: Path) -> None:
    plt = import_pyplot()
    categories = list(payload["per_category"])
    methods = [m for m in payload["methods"] if m != REFERENCE]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / max(1, len(methods))
    for ax, key in zip(axes, ("speedup", "tau")):
        for i, method in enumerate(methods):
            values = [payload["per_category"][c].get(method, {}).get(key) or 0.0 for c in categories]
            ax.bar([x + i * width for x in range(len(categories))], values, width, label=method)
        ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(categories))], categories, rotation=30)
        ax.set_title(key)
        ax.axhline(1.0, color="grey", lw=0.8)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(output_dir / "speedup_tau.png", dpi=120)
    plt.close(fig)

    split = {m: payload["methods"][m]["time_per_iter_ms"] for m in methods if payload["methods"][m]["time_per_iter_ms"]}
    if split:
        fig, ax = plt.subplots(figsize=(max(7.0, 1.5 * len(split)), 4.5))
        bottom = [0.0] * len(split)
        for part in ("drafting", "verification", "overhead"):
            values = [split[m][part] for m in split]
            ax.bar(list(split), values, bottom=bottom, label=part)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_ylabel("ms per iteration")
        ax.tick_params(axis="x", labelrotation=25)
        ax.legend()
        fig.tight_layout()
        fig.savefig(output_dir / "time_per_iteration.png", dpi=120)
        plt.close(fig)
