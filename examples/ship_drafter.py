"""Ship a trained drafter inside the package: its weights in bfloat16, the decoding settings it ships with, and the
results it measured as its training record's evaluation rows (the model card is generated from them).

    python examples/ship_drafter.py --drafter qwen-runs/specblock-1.0h \
        --name specblock-qwen2.5-coder-0.5b-instruct --settings_from specblock-smollm2-135m-instruct --set max_blocks=1 \
        --as_shipped docs/results/qwen-glance-2026-12-07/bfloat16-humaneval/results.json:specblock_one_block \
        --drafter_alone docs/results/qwen-ship-2026-12-07/specblock-one-block

`--as_shipped FILE:METHOD` (repeatable) reads a `specblock-bench` run; `--drafter_alone DIR` the `eval_results.json`
that `examples/evaluate_drafter.py --drafter_only --tree_budget ... --report_dir DIR` writes.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch
from transformers import AutoModel

from transformers_specblock.commands.card import card_for_folder
from transformers_specblock.commands.errors import command
from transformers_specblock.hub.modelcard import row_from_benchmark
from transformers_specblock.hub.shipped import SHIPPED_DRAFTERS_DIR, resolve_drafter_path

ROOT = Path(__file__).resolve().parents[1]


def parse_value(text: str):
    """A --set value: JSON where it parses (numbers, lists, true), else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def drafter_alone_rows(folder: Path) -> list[dict]:
    """Rows of kind "drafter_alone" from an `evaluate_drafter.py --drafter_only` report folder."""
    rows = []
    for row in json.loads((folder / "eval_results.json").read_text()):
        results = (folder / "eval_results.json").resolve().relative_to(ROOT)
        dtype = re.search(r"target (\w+)", row["hardware"]).group(1)  # describe_hardware's "; target DTYPE, ..."
        setting = f"drafter alone: {dtype}, free candidates off, fixed tree_budget {row['tree_budget']}, " \
                  f"{row['prompts']} prompts x {row['max_new_tokens']} new tokens"  # fmt: skip
        rows.append({**row, "kind": "drafter_alone", "setting": setting, "results": results.as_posix()})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True, help="the trained drafter: a local folder")
    parser.add_argument("--name", required=True, help="the shipped name, e.g. specblock-qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--settings_from", help="a shipped drafter whose decoding settings this one ships with")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="decoding settings to override")
    parser.add_argument("--as_shipped", nargs="*", default=[], metavar="RESULTS_JSON:METHOD")
    parser.add_argument("--drafter_alone", nargs="*", default=[], metavar="REPORT_DIR")
    args = parser.parse_args(argv)

    drafter = AutoModel.from_pretrained(resolve_drafter_path(args.drafter), dtype=torch.bfloat16).eval()
    config = drafter.generation_config
    if args.settings_from:
        config = type(config).from_pretrained(resolve_drafter_path(args.settings_from))
    config.update(**dict((key, parse_value(value)) for key, value in (item.split("=", 1) for item in args.set)))
    drafter.generation_config = config
    rows = []
    for spec in args.as_shipped:
        results, method = spec.rsplit(":", 1)
        path = Path(results).resolve().relative_to(ROOT)
        run = json.loads((ROOT / path).read_text())["settings"]
        setting = f"as shipped: {run['dtype']}, the shipped generation_config (tree_budget \"auto\", free candidates " \
                  f"on; specblock-bench method {method}), {run['num_prompts']} prompts x {run['max_new_tokens']} new " \
                  "tokens"  # fmt: skip
        rows.append(row_from_benchmark(path, method, setting, root=ROOT))
    for folder in args.drafter_alone:
        rows += drafter_alone_rows(Path(folder))
    drafter.config.eval_results = rows
    output = SHIPPED_DRAFTERS_DIR / args.name
    drafter.save_pretrained(output)
    card_for_folder(output).save(output / "README.md")  # the card names the drafter by its shipped name
    print(f"shipped {output} ({sum(p.numel() for p in drafter.parameters()) / 1e6:.1f}M parameters, bfloat16)")


if __name__ == "__main__":
    command("examples/ship_drafter.py", main)()
