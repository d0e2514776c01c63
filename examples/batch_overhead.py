"""The tree loop's own overhead where nothing is drafted: budget 0 (the shipped EAGLE-3 drafter with
`tree_budget="auto"`, the single candidate 0 and the free candidates off: every step verifies the root alone, as a
plain step does) against plain batched `generate`, at several batch sizes, interleaved repeats, on the packaged
SmolLM2-135M-Instruct.

    python examples/batch_overhead.py --batch_sizes 1,16 --repeats 5 --dtype bfloat16 --output docs/results/batch-overhead

Reports per batch size the median over repeats of (plain seconds / loop seconds) - 1.0 means no overhead - and
the outputs' equality; writes results.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from transformers_specblock import Eagle3DraftModel, load_packaged_model, load_prompts
from transformers_specblock.hub.provenance import describe_device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch_sizes", default="1,16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--output", default="out/batch-overhead")
    args = parser.parse_args()

    target, tokenizer = load_packaged_model("smollm2-135m-instruct")
    target = target.to(getattr(torch, args.dtype))
    # candidates (0,) and no free candidates: the loop never drafts - every step verifies the root alone
    drafter = Eagle3DraftModel.from_pretrained(
        "eagle3-smollm2-135m-instruct", tree_budget="auto", auto_budget_candidates=[0], prompt_lookup_num_tokens=0,
        ngram_cache_num_tokens=0, suffix_cache_num_tokens=0, suffix_local_num_tokens=0,
    ).to(target.dtype)
    prompts = load_prompts("mt_bench", num_prompts=max(int(b) for b in args.batch_sizes.split(",")), tokenizer=tokenizer)
    tokenizer.padding_side = "left"
    results = {"settings": vars(args) | {"hardware": describe_device(target.device)}, "batch_sizes": {}}
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        inputs = tokenizer(prompts["text"][:batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
        settings = dict(do_sample=False, max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id)
        ratios, identical = [], True
        for repeat in tqdm(range(args.repeats + 1), desc=f"batch {batch_size}"):
            start = time.perf_counter()
            plain = target.generate(**inputs, **settings)
            plain_s = time.perf_counter() - start
            start = time.perf_counter()
            loop = target.generate(**inputs, assistant_model=drafter, **settings)
            loop_s = time.perf_counter() - start
            identical &= loop.tolist() == plain.tolist()
            if repeat:  # the first pair warms up (and times the target once for "auto")
                ratios.append(plain_s / loop_s)
        results["batch_sizes"][batch_size] = {
            "median_speed_vs_plain": statistics.median(ratios), "ratios": ratios, "identical": identical,
        }  # fmt: skip
        print(f"batch {batch_size}: loop at budget 0 runs {statistics.median(ratios):.3f}x plain, identical={identical}")
    Path(args.output).mkdir(parents=True, exist_ok=True)
    Path(args.output, "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
