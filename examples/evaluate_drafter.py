"""Measure a trained drafter on MT-Bench, HumanEval and held-out ShareGPT (greedy, batch 1), record the numbers in
its config and save it (weights + generated model card) to a Hub-style folder.

    python examples/evaluate_drafter.py --drafter out/specblock-smollm2 \
        --output src/transformers_specblock/hub/shipped/specblock-smollm2-135m-instruct \
        --num_prompts 6 --max_new_tokens 64 --report_dir docs/results/shipped-drafter-eval
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModel

from transformers_specblock import load_packaged_model, load_prompts
from transformers_specblock.commands.benchmark import Method, run_benchmark, write_report
from transformers_specblock.hub.provenance import describe_hardware

PROMPT_SETS = ("mt_bench", "humaneval", "sharegpt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--output", required=True, help="folder to save the drafter with its model card")
    parser.add_argument("--target_model", default="smollm2-135m-instruct")
    parser.add_argument("--num_prompts", type=int, default=6)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--report_dir", default="docs/results/shipped-drafter-eval")
    args = parser.parse_args()

    target, tokenizer = load_packaged_model(args.target_model)
    drafter = AutoModel.from_pretrained(args.drafter, dtype=torch.float32).eval()
    drafter.bind_target(target)
    hardware = describe_hardware(target.device, target.dtype, drafter.dtype)  # detected now, not typed in
    rows = []
    for name in PROMPT_SETS:
        prompts = load_prompts(name, num_prompts=args.num_prompts, tokenizer=tokenizer)
        results = run_benchmark(
            target, tokenizer, prompts, [Method("drafter", {"assistant_model": drafter})],
            max_new_tokens=args.max_new_tokens, output_dir=None,
        )  # fmt: skip
        write_report(results, Path(args.report_dir) / name)
        summary = results.summary()["drafter"]
        rows.append(
            {
                "dataset": name,
                "prompts": len(prompts),
                "max_new_tokens": args.max_new_tokens,
                "tau": round(summary["tau"], 3),
                "speedup_vs_plain": round(summary["speedup"], 3),
                "tokens_per_s": round(summary["tokens_per_s"], 2),
                "drafting_share": round(summary["drafting_share"], 3),
                "identical_to_plain_greedy": summary["identical_to_reference"],
                "hardware": hardware,
            }
        )
        print(json.dumps(rows[-1]))
    drafter.config.eval_results = rows
    drafter.to(torch.bfloat16).save_pretrained(args.output)
    print(f"saved {args.output} (weights + README.md model card)")


if __name__ == "__main__":
    main()
