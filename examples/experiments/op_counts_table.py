"""Before -> after table of `examples/experiments/op_counts.py` results (markdown), for docs/benchmarks.md.

    python examples/experiments/op_counts_table.py --before docs/results/op-counts/batched-loop.json \
        docs/results/op-counts/lookup-host-text.json --after docs/results/op-counts/host-trees.json

A method found in several `--before` files takes its numbers from the last one that has it.
"""

from __future__ import annotations

import argparse
import json

ROWS = [  # (label, key or keys summed, decimals)
    ("aten ops in drafting", ("drafting_ops",), 0),
    ("aten ops in the rest of the loop", ("loop_ops",), 0),
    ("**outside the target forward**", ("drafting_ops", "loop_ops"), 0),
    ("host syncs in drafting", ("drafting_syncs",), 2),
    ("host syncs in the rest of the loop", ("loop_syncs",), 2),
    ("**host syncs outside**", ("drafting_syncs", "loop_syncs"), 2),
    ("drafter forwards", ("drafter_forwards_per_iter",), 1),
    ("iterations (both prompts)", ("iterations",), 0),
]


def load(paths: list[str]) -> dict[str, dict]:
    methods: dict[str, dict] = {}
    for path in paths:
        methods |= json.load(open(path))["per_iteration"]
    return methods


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", nargs="+", required=True)
    parser.add_argument("--after", nargs="+", required=True)
    args = parser.parse_args()
    before, after = load(args.before), load(args.after)
    methods = list(after)
    print("| per iteration | " + " | ".join(methods) + " |")
    print("|---" * (len(methods) + 1) + "|")
    for label, keys, decimals in ROWS:
        cells = []
        for method in methods:
            new = sum(after[method][key] for key in keys)
            old = sum(before[method][key] for key in keys) if method in before else None
            fmt = f"{{:,.{decimals}f}}"
            same = old is None or fmt.format(old) == fmt.format(new)
            cells.append(fmt.format(new) if same else f"{fmt.format(old)} -> **{fmt.format(new)}**")
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
