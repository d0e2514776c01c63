"""aten ops (kernel launches) and host syncs per decoding iteration, per method, on SmolLM2-135M-Instruct with the
shipped drafters (greedy, MT-Bench prompts): exact counts, the same on any CPU (`generation.op_counter`).

    python examples/experiments/op_counts.py --num_prompts 2 --max_new_tokens 48 --output docs/results/op-counts/counts.json

Methods: plain, the shipped settings at budget 8 (lookup_tree at 16), and SpecBlock K = 4 x 2 blocks against
EAGLE-3 `tree_depth=8`, both at budget 32 (the paper's claim in launch terms: SpecBlock's drafting ops / EAGLE-3's).
`--specblock_variant PATH` counts (and times) a second SpecBlock drafter the same ways, e.g. one with one decoder
layer: its rows are "specblock_variant@8" and "specblock_variant K4x2@32".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModel

from transformers_specblock import LookupTreeModel, load_packaged_model
from transformers_specblock.generation.op_counter import OpCounts, count_ops
from transformers_specblock.hub.prompts import load_prompts
from transformers_specblock.hub.provenance import describe_device
from transformers_specblock.hub.shipped import resolve_drafter_path

# the drafters' trees alone, as they shipped before their configs turned the free candidates on (comparable with
# results/op-counts/before-f752bcf.json); the lookup tree with prompt lookup and the n-gram cache, no suffix cache
ALONE = {"prompt_lookup_num_tokens": 0, "ngram_cache_num_tokens": 0, "suffix_cache_num_tokens": 0}
RUNS = {
    "plain": (None, {}),
    "specblock@8": ("specblock", {"tree_budget": 8, **ALONE}),
    "eagle3@8": ("eagle3", {"tree_budget": 8, **ALONE}),
    "dflash@8": ("dflash", {"tree_budget": 8, **ALONE}),
    "lookup_tree@16": ("lookup_tree", {"tree_budget": 16, "suffix_cache_num_tokens": 0}),
    "specblock K4x2@32": ("specblock", {"tree_budget": 32, "max_blocks": 2, **ALONE}),
    "eagle3 depth8@32": ("eagle3", {"tree_budget": 32, "tree_depth": 8, **ALONE}),
}
VARIANT_RUNS = {
    "specblock_variant@8": ("specblock_variant", {"tree_budget": 8, **ALONE}),
    "specblock_variant K4x2@32": ("specblock_variant", {"tree_budget": 32, "max_blocks": 2, **ALONE}),
}
EQUAL_DEPTH = {"specblock K4x2@32": "eagle3 depth8@32", "specblock_variant K4x2@32": "eagle3 depth8@32"}


def time_drafting(target, tokenizer, prompts, drafters, pairs: dict[str, str], args) -> dict:
    """Drafting ms per iteration of each equal-depth pair (SpecBlock K4x2@32 and EAGLE-3 depth8@32), interleaved per
    prompt (best of two); per pair the median per-prompt ratio."""
    ratios, rows = {ours: [] for ours in pairs}, []
    names = list(dict.fromkeys([*pairs, *pairs.values()]))
    for row in prompts.select(range(args.num_prompts, args.num_prompts + args.time_prompts)):
        text = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
        encoded = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        ms = {}
        for name in names * 2:
            kind, settings = RUNS[name]
            with drafters[kind].tree_settings(**settings), torch.no_grad():
                target.generate(**encoded, max_new_tokens=args.max_new_tokens, do_sample=False,
                                assistant_model=drafters[kind])  # fmt: skip
            stats = drafters[kind].last_stats
            ms[name] = min(ms.get(name, float("inf")), stats.drafter_time_s / stats.iterations * 1e3)
        rows.append(ms)
        for ours, theirs in pairs.items():
            ratios[ours].append(ms[ours] / ms[theirs])
    medians = {f"{ours} over {pairs[ours]} drafting time": statistics.median(r) for ours, r in ratios.items()}
    return medians | {"drafting_ms_per_iter": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_prompts", type=int, default=2)
    parser.add_argument("--max_new_tokens", type=int, default=48)
    parser.add_argument("--methods", default=",".join(RUNS), help=f"comma list of {list(RUNS)}")
    parser.add_argument("--output", default="out/op-counts/counts.json")
    parser.add_argument("--specblock_variant", default=None, help="a second SpecBlock drafter's folder (see above)")
    parser.add_argument("--time_prompts", type=int, default=0,
                        help="also time the equal-depth pair's drafting on this many further prompts (interleaved, "
                             "uncounted): the median per-prompt ratio of drafting ms per iteration")  # fmt: skip
    args = parser.parse_args()
    if args.specblock_variant:
        RUNS.update(VARIANT_RUNS)
        args.methods += "," + ",".join(VARIANT_RUNS)
    torch.set_num_threads(1)
    target, tokenizer = load_packaged_model("smollm2-135m-instruct")
    prompts = load_prompts("mt_bench", tokenizer=tokenizer)
    inputs = []
    for row in prompts.select(range(args.num_prompts)):
        text = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
        inputs.append(tokenizer(text, return_tensors="pt", add_special_tokens=False))
    drafters = {"lookup_tree": LookupTreeModel.from_target(target)}
    for kind in ("specblock", "eagle3", "dflash"):
        drafters[kind] = AutoModel.from_pretrained(resolve_drafter_path(f"{kind}-smollm2-135m-instruct")).eval()
        drafters[kind].bind_target(target)
    if args.specblock_variant:
        drafters["specblock_variant"] = AutoModel.from_pretrained(args.specblock_variant).eval()
        drafters["specblock_variant"].bind_target(target)
    results = {}
    for name in tqdm(args.methods.split(","), desc="methods"):
        kind, settings = RUNS[name]
        drafter = drafters.get(kind)
        counts, forwards, iterations = OpCounts(), 0, 0
        for encoded in inputs:
            settings_context = drafter.tree_settings(**settings) if drafter is not None else contextlib.nullcontext()
            extra = {"assistant_model": drafter} if drafter is not None else {}
            with settings_context, torch.no_grad(), count_ops(target, counts):
                target.generate(**encoded, max_new_tokens=args.max_new_tokens, do_sample=False, **extra)
            if drafter is not None:
                forwards += drafter.last_stats.drafter_forwards
                iterations += drafter.last_stats.iterations
        results[name] = counts.per_iteration() | {
            "iterations": counts.iterations,
            "drafter_forwards_per_iter": forwards / max(1, iterations),
            "top_outside_per_iter": counts.top_outside(8),
        }
    pairs = {ours: theirs for ours, theirs in EQUAL_DEPTH.items() if {ours, theirs} <= results.keys()}
    claim = {f"{ours} over {theirs} drafting ops": results[ours]["drafting_ops"] / results[theirs]["drafting_ops"]
             for ours, theirs in pairs.items()}  # fmt: skip
    if args.time_prompts and pairs:
        claim |= time_drafting(target, tokenizer, prompts, drafters, pairs, args)
    payload = {
        "settings": vars(args) | {"target": "smollm2-135m-instruct", "dtype": str(target.dtype), "greedy": True},
        "hardware": describe_device(target.device),
        "per_iteration": results,
        "claim": claim,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(payload, indent=2))
    for name, row in results.items():
        print(f"{name:20s} target {row['target_ops']:7.0f}  drafting {row['drafting_ops']:6.0f} ops "
              f"{row['drafting_syncs']:5.1f} syncs  loop {row['loop_ops']:5.0f} ops {row['loop_syncs']:4.1f} syncs  "
              f"forwards {row['drafter_forwards_per_iter']:.1f}")  # fmt: skip
    print(claim)


if __name__ == "__main__":
    main()
