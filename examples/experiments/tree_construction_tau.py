"""Tau of SpecBlock's two tree constructions: this package's (`tree_construction="package"`) against the reference
harness's (`"reference"`), on SmolLM2-135M-Instruct, greedy, fixed tree budgets, free candidates and adaptation off,
two block steps (`--max_blocks` adds arms with more or fewer). Every prompt runs every (drafter, construction, budget, context feeding) arm in turn (interleaved),
each output is checked against plain greedy, and the JSON is rewritten after every prompt (a rerun resumes after the
last one).

    python examples/experiments/tree_construction_tau.py \
        --drafter shipped=specblock-smollm2-135m-instruct --drafter reference_compatible=/tmp/sb-smollm2-ref \
        --output docs/results/specblock-reference-smollm2/tau.json

A drafter is a shipped name or a folder (this package's layout or the SpecBlock reference's).
"""

from __future__ import annotations

import argparse
import json
from itertools import product
from pathlib import Path

import torch
from tqdm import tqdm

from transformers_specblock import SpecBlockDraftModel, load_prompts
from transformers_specblock.hub.loading import load_model
from transformers_specblock.hub.provenance import describe_hardware
from transformers_specblock.hub.shipped import resolve_drafter_path
from transformers_specblock.utils import write_atomically

OFF = {"prompt_lookup_num_tokens": 0, "ngram_cache_num_tokens": 0, "suffix_cache_num_tokens": 0,
       "suffix_local_num_tokens": 0, "online_adaptation": "off"}  # fmt: skip


def summarise(rows: list[dict]) -> dict:
    """Per prompt set and arm: tau = committed tokens / verification steps over all its prompts."""
    out: dict = {}
    for row in rows:
        for arm, result in row["arms"].items():
            entry = out.setdefault(row["prompt_set"], {}).setdefault(arm, {"tokens": 0, "steps": 0, "prompts": 0,
                                                                            "all_equal_greedy": True})  # fmt: skip
            entry["tokens"] += result["tokens"]
            entry["steps"] += result["steps"]
            entry["prompts"] += 1
            entry["all_equal_greedy"] &= result["equals_greedy"]
    for arms in out.values():
        for entry in arms.values():
            entry["tau"] = round(entry["tokens"] / entry["steps"], 4)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", action="append", required=True, help="name=shipped drafter or folder")
    parser.add_argument("--output", required=True)
    parser.add_argument("--prompt_sets", nargs="+", default=["mt_bench", "humaneval", "sharegpt"])
    parser.add_argument("--num_prompts", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--tree_budgets", type=int, nargs="+", default=[90, 24])
    parser.add_argument("--constructions", nargs="+", default=["package", "reference"])
    parser.add_argument("--max_blocks", type=int, nargs="+", default=[2],
                        help="block rounds per iteration; arms other than 2 are named .../blocks=N")
    parser.add_argument("--context_feedings", nargs="+", default=["package"],
                        help='"reference" arms (named .../feeding=reference) feed the drafter as the harness does')
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    target, tokenizer = load_model("smollm2-135m-instruct", device="cpu", dtype="float32")
    drafters = {}
    for spec in args.drafter:
        name, path = spec.split("=", 1)
        drafters[name] = SpecBlockDraftModel.from_pretrained(resolve_drafter_path(path), target=target,
                                                             dtype=torch.float32).eval()  # fmt: skip
    output = Path(args.output)
    done = json.loads(output.read_text())["rows"] if output.exists() else []
    prompts = [(name, index, row["text"]) for name in args.prompt_sets
               for index, row in enumerate(load_prompts(name, num_prompts=args.num_prompts, tokenizer=tokenizer))]
    prompts.sort(key=lambda p: (p[1], args.prompt_sets.index(p[0])))  # sets interleaved: a cut run covers all three
    seen = {(row["prompt_set"], row["index"]) for row in done}
    for name, index, text in tqdm(prompts, desc="prompts"):
        if (name, index) in seen:
            continue
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        mask = torch.ones_like(ids)
        plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=args.max_new_tokens)
        arms = {}
        for budget in args.tree_budgets:
            for drafter_name, drafter in drafters.items():
                for construction, feeding, blocks in product(args.constructions, args.context_feedings, args.max_blocks):
                    with drafter.tree_settings(max_blocks=blocks):
                        out = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False,
                                              max_new_tokens=args.max_new_tokens, tree_budget=budget,
                                              tree_construction=construction, context_feeding=feeding,
                                              **OFF)  # fmt: skip
                    stats = drafter.last_stats
                    suffix = ("" if feeding == "package" else f"/feeding={feeding}") + (
                        "" if blocks == 2 else f"/blocks={blocks}"
                    )
                    arms[f"{drafter_name}/{construction}/{budget}{suffix}"] = {
                        "equals_greedy": bool(torch.equal(out, plain)), "tokens": out.shape[1] - ids.shape[1],
                        "steps": len(stats.accepted_per_iteration), "tau": round(stats.tau, 4),
                    }  # fmt: skip
        done.append({"prompt_set": name, "index": index, "prompt_tokens": ids.shape[1], "arms": arms})
        result = {"target": "smollm2-135m-instruct", "dtype": "float32", "max_new_tokens": args.max_new_tokens,
                  "max_blocks": args.max_blocks, "free_candidates": "off", "drafters": dict(d.split("=", 1) for d in args.drafter),
                  "hardware": describe_hardware(target.device, target.dtype, torch.float32),
                  "summary": summarise(done), "rows": done}  # fmt: skip
        output.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(output, json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
