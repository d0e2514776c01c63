"""Time a candidate drafter against the shipped one, each in its own decoding settings, interleaved per prompt.

    OMP_NUM_THREADS=1 python examples/compare_drafters.py --candidate docs/results/campaign/specblock \\
        --candidate_settings tree_construction=reference max_blocks=1 --dataset humaneval --output_dir out/compare

What decides whether a newly trained drafter ships: in one process, every prompt runs plain `generate` (the
reference), plain once more (`plain_control`, the A/A noise floor of the timing), transformers' prompt lookup, the
shipped drafter, the candidate and a second copy of the shipped drafter (`shipped_control`: the drafters' A/A, whose
"auto" choosers go their own ways from prompt to prompt), each drafter with its own `generation_config` (the
shipped settings: ``tree_budget="auto"`` and the free candidates) plus ``--candidate_settings`` for the candidate.
A candidate is faster only where its ratio to the shipped drafter lies beyond `shipped_control`'s. Results, tables
and per-prompt rows as `specblock-bench` writes them (`commands.benchmark`); rerun with the same ``--output_dir`` to
resume.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

from transformers_specblock import load_prompts
from transformers_specblock.commands.benchmark import CONTROL, Method, run_benchmark
from transformers_specblock.commands.cli import load_bench_drafter, spread_over_categories
from transformers_specblock.commands.report import write_report
from transformers_specblock.hub.loading import load_model
from transformers_specblock.hub.provenance import describe_device


DRAFTER_CONTROL = "shipped_control"  # the shipped drafter timed again, loaded anew: the drafters' A/A


def parse_setting(text: str) -> tuple[str, object]:
    """``name=value`` with a Python literal value (``max_blocks=1``), else the value as a string."""
    name, _, value = text.partition("=")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name, value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target_model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kind", default="specblock", choices=["specblock", "eagle3", "dflash"])
    parser.add_argument("--shipped", help="a shipped name or a folder (default: the shipped drafter of this kind)")
    parser.add_argument("--candidate", required=True, help="a drafter folder")
    parser.add_argument("--candidate_settings", nargs="*", default=[], type=parse_setting, help="name=value ...")
    parser.add_argument("--dataset", default="mt_bench")
    parser.add_argument("--num_prompts", type=int, default=16)
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args(argv)
    target, tokenizer = load_model(args.target_model, device="cpu", dtype=args.dtype)
    prompts = spread_over_categories(load_prompts(args.dataset, tokenizer=tokenizer), args.num_prompts)
    shipped = load_bench_drafter(args.shipped, args.kind, args.target_model, target)
    candidate = load_bench_drafter(args.candidate, args.kind, args.target_model, target)
    shipped_again = load_bench_drafter(args.shipped, args.kind, args.target_model, target)  # its own serving state
    methods = [
        Method(CONTROL),
        Method("prompt_lookup", {"prompt_lookup_num_tokens": 10}),
        Method("shipped", {"assistant_model": shipped}),
        Method("candidate", {"assistant_model": candidate}, dict(args.candidate_settings)),
        Method(DRAFTER_CONTROL, {"assistant_model": shipped_again}),
    ]
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    results = run_benchmark(target, tokenizer, prompts, methods, max_new_tokens=args.max_new_tokens,
                            output_dir=args.output_dir)  # fmt: skip
    results.settings |= {"target_model": args.target_model, "dataset": args.dataset, "dtype": args.dtype,
                         "shipped": args.shipped or f"{args.kind}-{args.target_model}", "candidate": args.candidate,
                         "candidate_settings": dict(args.candidate_settings),
                         "hardware": describe_device(target.device)}  # fmt: skip
    write_report(results, args.output_dir)
    print((Path(args.output_dir) / "results.md").read_text())


if __name__ == "__main__":
    main()
