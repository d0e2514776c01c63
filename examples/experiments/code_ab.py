"""A/B of two versions of this package's code on the wall clock, each against plain `generate` in its own process.

One call measures one code version (`--src`, a `src` folder: e.g. a `git worktree` of the older commit's `src`):
per prompt, plain and every method interleaved, best of 2, giving speed-ups over plain. Alternate the versions over
several processes (old, new, old, new, ...) so the machine's bursts fall on both, then `--summarise` the outputs:
the median per prompt across a version's rounds, and the median of the paired per-prompt ratios new / old.

    python examples/experiments/code_ab.py --src /tmp/old/src --output out/ab/old-1.json --dtype bfloat16
    python examples/experiments/code_ab.py --src src --output out/ab/new-1.json --dtype bfloat16
    python examples/experiments/code_ab.py --summarise out/ab/old-*.json --against out/ab/new-*.json --output ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

METHODS = ("lookup_tree@16", "eagle3@8", "specblock@8", "dflash@8")
PROMPTS = (("mt_bench", range(4)), ("humaneval", range(4)))


def measure(src: str, dtype_name: str) -> dict[str, dict[str, float]]:
    sys.path.insert(0, str(Path(src).resolve()))  # this code version, ahead of the installed package
    import torch
    from transformers import AutoModel

    import transformers_specblock
    from transformers_specblock import LookupTreeModel, load_packaged_model
    from transformers_specblock.hub.prompts import load_prompts
    from transformers_specblock.hub.shipped import resolve_drafter_path

    if not Path(transformers_specblock.__file__).resolve().is_relative_to(Path(src).resolve()):
        raise RuntimeError(f"imported {transformers_specblock.__file__}, not the code under {src}")
    torch.set_num_threads(1)
    target, tok = load_packaged_model("smollm2-135m-instruct", dtype=getattr(torch, dtype_name))
    alone = {"prompt_lookup_num_tokens": 0, "ngram_cache_num_tokens": 0, "suffix_cache_num_tokens": 0}
    drafters = {"lookup_tree": LookupTreeModel.from_target(target)}
    for kind in ("specblock", "eagle3", "dflash"):
        drafters[kind] = AutoModel.from_pretrained(resolve_drafter_path(f"{kind}-smollm2-135m-instruct")).eval()
        drafters[kind].bind_target(target)
    runs = {
        "plain": (None, {}),
        "lookup_tree@16": ("lookup_tree", {"tree_budget": 16, "suffix_cache_num_tokens": 0}),
        "eagle3@8": ("eagle3", {"tree_budget": 8, **alone}),
        "specblock@8": ("specblock", {"tree_budget": 8, **alone}),
        "dflash@8": ("dflash", {"tree_budget": 8, **alone}),
    }
    speedups = {}
    for dataset, indices in PROMPTS:
        prompts = load_prompts(dataset, tokenizer=tok)
        for i in indices:
            text = tok.apply_chat_template([{"role": "user", "content": prompts[i]["prompt"]}], tokenize=False,
                                           add_generation_prompt=True)  # fmt: skip
            encoded = tok(text, return_tensors="pt", add_special_tokens=False)
            seconds = {}
            for _ in range(2):
                for name, (kind, settings) in runs.items():
                    drafter = drafters.get(kind)
                    extra = {"assistant_model": drafter} if drafter is not None else {}
                    with drafter.tree_settings(**settings) if drafter is not None else torch.no_grad(), torch.no_grad():
                        start = time.perf_counter()
                        target.generate(**encoded, max_new_tokens=48, do_sample=False, **extra)
                        seconds[name] = min(seconds.get(name, float("inf")), time.perf_counter() - start)
            speedups[f"{dataset}-{i}"] = {name: seconds["plain"] / seconds[name] for name in METHODS}
    return speedups


def summarise(old_paths: list[str], new_paths: list[str]) -> dict:
    def per_prompt(paths: list[str], method: str) -> dict[str, float]:
        rounds = [json.load(open(path)) for path in paths]
        return {p: statistics.median(r[p][method] for r in rounds) for p in rounds[0]}

    summary = {}
    for method in METHODS:
        old, new = per_prompt(old_paths, method), per_prompt(new_paths, method)
        paired = [new[p] / old[p] for p in old]
        summary[method] = {"old_median_speedup": statistics.median(old.values()),
                           "new_median_speedup": statistics.median(new.values()),
                           "median_new_over_old": statistics.median(paired), "min": min(paired), "max": max(paired)}  # fmt: skip
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", help="the code version to measure (a `src` folder)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--summarise", nargs="+", help="the older version's outputs")
    parser.add_argument("--against", nargs="+", help="the newer version's outputs")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    result = summarise(args.summarise, args.against) if args.summarise else measure(args.src, args.dtype)
    with open(args.output, "w") as out:
        json.dump(result, out, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
