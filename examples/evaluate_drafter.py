"""Measure a trained drafter on MT-Bench, HumanEval and held-out ShareGPT (greedy, batch 1), record the numbers in
its config and save it (weights + generated model card) to a Hub-style folder.

    python examples/evaluate_drafter.py --drafter out/specblock-smollm2 \
        --output src/transformers_specblock/hub/shipped/specblock-smollm2-135m-instruct \
        --num_prompts 6 --max_new_tokens 64 --report_dir docs/results/shipped-drafter-eval

`--tree_budget 8 16 32` measures several fixed budgets (one row per prompt set and budget, interleaved per prompt
against one plain reference); `--drafter_only` turns the free candidates off (prompt lookup, n-gram and suffix
cache), so the rows measure the drafter alone; `--tree_construction reference` grows SpecBlock's trees as the
reference implementation does, `--block_expansion best_first` lays out its last round's blocks best first. Each prompt
set resumes from `REPORT_DIR/SET/per_prompt.jsonl`.

Any target (packaged name, local folder or Hub id) with --device / --dtype as in specblock-bench; the drafter (shipped
name, local folder or Hub id) runs in the target's dtype on its device.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModel

from transformers_specblock import load_prompts
from transformers_specblock.commands.benchmark import Method, run_benchmark
from transformers_specblock.commands.report import write_report
from transformers_specblock.commands.errors import command
from transformers_specblock.hub.assets import explain_hub_errors
from transformers_specblock.hub.loading import DEVICE_HELP, DTYPE_CHOICES, DTYPE_HELP, load_model
from transformers_specblock.hub.shipped import resolve_drafter_path
from transformers_specblock.hub.provenance import describe_hardware

PROMPT_SETS = ("mt_bench", "humaneval", "sharegpt")
FREE_CANDIDATES_OFF = {"prompt_lookup_num_tokens": 0, "ngram_cache_num_tokens": 0, "suffix_cache_num_tokens": 0,
                       "suffix_local_num_tokens": 0}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True, help="drafter: a shipped drafter name, a local folder or a Hub id")
    parser.add_argument("--output", required=True, help="folder to save the drafter with its model card")
    parser.add_argument(
        "--target_model", default="smollm2-135m-instruct", help="a packaged model name, a local folder or a Hub id"
    )
    parser.add_argument("--device", default=None, help=DEVICE_HELP)
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    parser.add_argument("--num_prompts", type=int, default=6)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--report_dir", default="docs/results/shipped-drafter-eval")
    parser.add_argument(
        "--tree_budget", type=int, nargs="+", default=None,
        help="nodes verified per iteration, one or more (default: the drafter's own; 'auto' may choose not to draft)",
    )  # fmt: skip
    parser.add_argument(
        "--drafter_only", action="store_true", help="free candidates off (prompt lookup, n-gram, suffix cache)"
    )
    parser.add_argument(
        "--tree_construction", choices=("package", "reference"), default=None,
        help="SpecBlock's tree construction (default: the drafter's own setting)",
    )  # fmt: skip
    parser.add_argument(
        "--block_expansion", choices=("chain", "best_first"), default=None,
        help="how SpecBlock lays out its last round's blocks (default: the drafter's own setting)",
    )  # fmt: skip
    args = parser.parse_args(argv)

    target, tokenizer = load_model(args.target_model, device=args.device, dtype=args.dtype)
    with explain_hub_errors(args.drafter, kind="drafter", names="a shipped drafter"):
        drafter = AutoModel.from_pretrained(resolve_drafter_path(args.drafter), dtype=target.dtype).eval()
    drafter.bind_target(target)  # on the target's device, in its dtype
    hardware = describe_hardware(target.device, target.dtype, drafter.dtype)  # detected now, not typed in
    shape = {name: getattr(args, name) for name in ("tree_construction", "block_expansion") if getattr(args, name)}
    settings = {**(FREE_CANDIDATES_OFF if args.drafter_only else {}), **shape}
    budgets = args.tree_budget or [drafter.generation_config.tree_budget]
    methods = [Method(f"drafter@{budget}", {"assistant_model": drafter}, {"tree_budget": budget, **settings})
               for budget in budgets]  # fmt: skip
    rows = []
    for name in PROMPT_SETS:
        prompts = load_prompts(name, num_prompts=args.num_prompts, tokenizer=tokenizer)
        report_dir = Path(args.report_dir) / name
        report_dir.mkdir(parents=True, exist_ok=True)
        results = run_benchmark(
            target, tokenizer, prompts, methods, max_new_tokens=args.max_new_tokens, output_dir=report_dir
        )
        write_report(results, report_dir)
        summaries = results.summary()
        for budget, method in zip(budgets, methods):
            summary = summaries[method.name]
            rows.append(
                {
                    "dataset": name,
                    "prompts": len(prompts),
                    "max_new_tokens": args.max_new_tokens,
                    "tree_budget": budget,
                    **({"free_candidates": "off"} if args.drafter_only else {}),
                    **shape,
                    "tau": round(summary["tau"], 3),
                    "speedup_vs_plain": round(summary["speedup"], 3),
                    "tokens_per_s": round(summary["tokens_per_s"], 2),
                    "drafting_share": round(summary["drafting_share"], 3),
                    "identical_to_plain_greedy": summary["identical_to_reference"],
                    "hardware": hardware,
                }
            )
            print(json.dumps(rows[-1]))
    (Path(args.report_dir) / "eval_results.json").write_text(json.dumps(rows, indent=2) + "\n")
    drafter.config.eval_results = rows
    drafter.to(torch.bfloat16).save_pretrained(args.output)
    print(f"saved {args.output} (weights + README.md model card)")


if __name__ == "__main__":
    command("examples/evaluate_drafter.py", main)()  # a user error: one paragraph, exit 2 (--traceback: all of it)
