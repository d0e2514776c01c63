"""Demo: tree speculative decoding on the packaged SmolLM2-135M-Instruct, inside `generate`, next to plain decoding.

Speculation is on by default, in the configuration measured fastest on this CPU (docs/benchmarks.md): the budget
"auto" (the tree size is chosen per step from the target's measured cost, no tree at all where none pays) with the
free candidates (prompt lookup, n-gram cache and the suffix cache of everything this drafter served). Two drafters
are shown: the weightless `LookupTreeModel` and the SpecBlock drafter shipped inside the package (its saved config
has the same settings; --drafter FOLDER for another, --drafter none for a fresh untrained one). Every output is
checked against plain greedy `generate`, and the speed-up printed is the measured one, slower or not.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import TextStreamer

from transformers_specblock import LookupTreeModel, SpecBlockDraftModel, load_packaged_model, load_prompts
from transformers_specblock.hub import resolve_drafter_path

SHIPPED = "specblock-smollm2-135m-instruct"  # a shipped drafter's name (see transformers_specblock.hub.shipped)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num_prompts", type=int, default=2)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--dataset", default="mt_bench", help="mt_bench, humaneval or sharegpt")
    parser.add_argument("--drafter", type=str, default=SHIPPED, help="drafter folder or shipped name, or none")
    args = parser.parse_args()

    torch.manual_seed(0)
    target, tokenizer = load_packaged_model("smollm2-135m-instruct")
    if Path(resolve_drafter_path(args.drafter), "config.json").exists():
        specblock = SpecBlockDraftModel.from_pretrained(args.drafter).eval()
        print(f"drafter: {args.drafter} (tree_budget={specblock.generation_config.tree_budget!r}, free candidates on)")
    else:
        specblock = SpecBlockDraftModel.from_target(target, tree_policy="fixed", fixed_width=3, tree_budget=16)
        print(f"drafter: untrained (no drafter {args.drafter!r}) - expect tau near 1 and no speed-up")
    drafters = {"lookup tree": LookupTreeModel.from_target(target), "specblock": specblock}  # one object per stream
    start = time.perf_counter()  # "auto" times the target once per model and device: do it before timing anything
    ladders = {tuple(d.generation_config.auto_budget_candidates) for d in drafters.values()}
    for ladder in ladders:  # one curve per ladder
        warm_up = LookupTreeModel.from_target(target, auto_budget_candidates=list(ladder))
        target.generate(**tokenizer("Hello", return_tensors="pt"), assistant_model=warm_up, max_new_tokens=2)
    print(f'timed the target once for tree_budget="auto": {time.perf_counter() - start:.1f} s')
    totals = dict.fromkeys(["plain", *drafters], 0.0)
    new_total = 0

    prompts = load_prompts(args.dataset, num_prompts=args.num_prompts, tokenizer=tokenizer)
    for row in prompts:
        inputs = tokenizer(row["text"], return_tensors="pt", add_special_tokens=False)
        print(f"\n=== [{row['category']}] {row['prompt'][:100]!r}")
        start = time.perf_counter()
        plain = target.generate(**inputs, do_sample=False, max_new_tokens=args.max_new_tokens)
        plain_s = time.perf_counter() - start
        totals["plain"] += plain_s
        new = plain.shape[1] - inputs["input_ids"].shape[1]
        new_total += new
        print(f"plain generate: {new / plain_s:.1f} tok/s")
        for name, drafter in drafters.items():
            streamer = TextStreamer(tokenizer, skip_prompt=True) if name == "specblock" else None
            start = time.perf_counter()
            out = target.generate(
                **inputs, assistant_model=drafter, do_sample=False, max_new_tokens=args.max_new_tokens,
                streamer=streamer,
            )  # fmt: skip
            seconds = time.perf_counter() - start
            totals[name] += seconds
            stats = drafter.last_stats
            print(
                f"{name}: identical to plain greedy: {out.tolist() == plain.tolist()} | tau {stats.tau:.2f} | "
                f"{new / seconds:.1f} tok/s vs plain {new / plain_s:.1f} tok/s (speed-up {plain_s / seconds:.2f}x) | "
                f"nodes/iter {sum(stats.nodes_per_iteration) / max(1, stats.iterations):.1f} | accepted by source "
                f"{ {k: v for k, v in stats.accepted_by_source.items() if v} }"
            )
    print(f"\nall prompts: plain {new_total / totals['plain']:.1f} tok/s; " + "; ".join(
        f"{name} {new_total / totals[name]:.1f} tok/s ({totals['plain'] / totals[name]:.2f}x plain)" for name in drafters
    ))  # fmt: skip


if __name__ == "__main__":
    main()
