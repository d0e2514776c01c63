"""Two SpecBlock drafters in one benchmark run, interleaved per prompt against plain `generate`: e.g. the shipped
two-layer drafter and one with a single decoder layer trained with the same recipe, data and steps.

    python examples/experiments/specblock_layers_ab.py --other out/specblock-1l --dtype bfloat16 --dataset mt_bench \
        --output_dir out/specblock-layers-ab/mt_bench

Each drafter runs twice: its trees alone at budget 8, and as the shipped drafter runs ("auto" with prompt lookup,
the n-gram cache and the suffix cache). The other drafter takes every tree setting of the shipped one (branch
widths, free candidates, the auto ladder): the two differ in their weights and architecture only.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
from transformers import AutoModel

from transformers_specblock import load_packaged_model, load_prompts
from transformers_specblock.commands.benchmark import Method, run_benchmark
from transformers_specblock.commands.report import write_report
from transformers_specblock.hub.provenance import describe_device
from transformers_specblock.hub.shipped import resolve_drafter_path

ALONE = {"tree_budget": 8, "prompt_lookup_num_tokens": 0, "ngram_cache_num_tokens": 0, "suffix_cache_num_tokens": 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other", required=True, help="the second SpecBlock drafter's folder")
    parser.add_argument("--shipped", default="specblock-smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--dataset", default="mt_bench")
    parser.add_argument("--num_prompts", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--output_dir", default="out/specblock-layers-ab")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, tokenizer = load_packaged_model("smollm2-135m-instruct", dtype=getattr(torch, args.dtype))
    drafters = {}
    for name, path in (("shipped", args.shipped), ("other", args.other)):
        drafters[name] = AutoModel.from_pretrained(resolve_drafter_path(path), dtype=target.dtype).eval()
        drafters[name].bind_target(target)
    # the same trees and free candidates: only weights and architecture differ
    drafters["other"].generation_config = copy.deepcopy(drafters["shipped"].generation_config)
    methods = []
    for name, drafter in drafters.items():
        layers = drafter.config.num_hidden_layers
        methods += [Method(f"specblock {layers}L@8", {"assistant_model": drafter}, ALONE),
                    Method(f"specblock {layers}L", {"assistant_model": drafter})]  # fmt: skip
    prompts = load_prompts(args.dataset, num_prompts=args.num_prompts, tokenizer=tokenizer)
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    results = run_benchmark(target, tokenizer, prompts, methods, max_new_tokens=args.max_new_tokens,
                            output_dir=args.output_dir)  # fmt: skip
    results.settings |= {"hardware": describe_device(target.device), "dtype": args.dtype, "other": args.other}
    write_report(results, args.output_dir)
    for method, row in results.summary().items():
        print(f"{method:16s} speed-up {row['speedup']:.3f}  tau {row['tau'] or 1:.2f}  "
              f"drafting share {row['drafting_share'] or 0:.3f}  identical {row['identical_to_reference']}")  # fmt: skip


if __name__ == "__main__":
    main()
