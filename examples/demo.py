"""Demo: SpecBlock tree speculative decoding on the packaged SmolLM2-135M-Instruct, inside `generate`.

Uses the drafter shipped inside the package, "specblock-smollm2-135m-instruct" (or --drafter FOLDER); with
--drafter none a fresh (untrained) drafter, which shows the mechanics and losslessness but no speed-up.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import TextStreamer

from transformers_specblock import SpecBlockDraftModel, load_packaged_model, load_prompts
from transformers_specblock.hub import resolve_drafter_path

SHIPPED = "specblock-smollm2-135m-instruct"  # a shipped drafter's name (see transformers_specblock.hub.shipped)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num_prompts", type=int, default=2)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--drafter", type=str, default=SHIPPED, help="drafter folder or shipped name, or none")
    args = parser.parse_args()

    torch.manual_seed(0)
    target, tokenizer = load_packaged_model("smollm2-135m-instruct")
    if Path(resolve_drafter_path(args.drafter), "config.json").exists():
        drafter = SpecBlockDraftModel.from_pretrained(args.drafter).eval()
        print(f"drafter: {args.drafter}")
    else:
        drafter = SpecBlockDraftModel.from_target(target, tree_policy="fixed", fixed_width=3, tree_budget=16)
        print(f"drafter: untrained (no drafter {args.drafter!r}) - expect tau near 1 and no speed-up")

    prompts = load_prompts("mt_bench", num_prompts=args.num_prompts, tokenizer=tokenizer)
    for row in prompts:
        inputs = tokenizer(row["text"], return_tensors="pt", add_special_tokens=False)
        print(f"\n=== [{row['category']}] {row['prompt'][:100]!r}")
        start = time.perf_counter()
        plain = target.generate(**inputs, do_sample=False, max_new_tokens=args.max_new_tokens)
        plain_s = time.perf_counter() - start
        start = time.perf_counter()
        tree = target.generate(
            **inputs, assistant_model=drafter, do_sample=False, max_new_tokens=args.max_new_tokens,
            streamer=TextStreamer(tokenizer, skip_prompt=True),
        )  # fmt: skip
        tree_s = time.perf_counter() - start
        stats = drafter.last_stats
        new = tree.shape[1] - inputs["input_ids"].shape[1]
        print(
            f"identical to plain greedy: {tree.tolist() == plain.tolist()} | tau {stats.tau:.2f} | "
            f"{new / tree_s:.1f} tok/s vs plain {new / plain_s:.1f} tok/s (speed-up {plain_s / tree_s:.2f}x) | "
            f"drafting share {stats.drafting_share:.0%} | nodes/iter "
            f"{sum(stats.nodes_per_iteration) / max(1, stats.iterations):.1f}"
        )


if __name__ == "__main__":
    main()
