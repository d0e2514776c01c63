"""Are a drafter's node scores calibrated: is a node's exp(path score) its chance of being accepted?

    OMP_NUM_THREADS=1 python examples/experiments/score_calibration.py --drafter specblock-smollm2-135m-instruct

"auto" sizes each tree (`AutoBudget.worth_verifying`) reading exp(path score) as a node's chance of acceptance.
This decodes float32 greedy at a fixed budget with the free candidates off, and for every verified drafter node
compares that reading with whether the target accepted it: per probability bin and per depth. Writes JSON to
--output when given.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy
import torch
from tqdm import tqdm
from transformers import AutoModel

import transformers_specblock.generation.decoding as decoding
from transformers_specblock import load_packaged_model, load_prompts
from transformers_specblock.hub.shipped import resolve_drafter_path
from transformers_specblock.utils import write_atomically

FREE_OFF = {"prompt_lookup_num_tokens": 0, "ngram_cache_num_tokens": 0, "suffix_cache_num_tokens": 0,
            "suffix_local_num_tokens": 0}  # fmt: skip
BINS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.4, 0.7, 1.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default="specblock-smollm2-135m-instruct", help="a shipped name or a folder")
    parser.add_argument("--tree_budget", type=int, default=16)
    parser.add_argument("--num_prompts", type=int, default=6, help="per prompt set (MT-Bench and HumanEval)")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, tokenizer = load_packaged_model("smollm2-135m-instruct", dtype=torch.float32)
    drafter = AutoModel.from_pretrained(resolve_drafter_path(args.drafter)).eval()
    nodes = []  # (exp(path score), accepted, depth) per verified node
    accept = decoding.greedy_accept_rows

    def recording_accept(trees, processed):
        kept, bonus, host_bonus = accept(trees, processed)
        for row, tree in enumerate(trees.trees):
            host, accepted = tree.host(), set(kept[row])
            scores = host.path_scores()
            nodes.extend((math.exp(scores[n]), n in accepted, host.depths[n]) for n in range(1, len(host)))
        return kept, bonus, host_bonus

    decoding.greedy_accept_rows = recording_accept
    prompts = [row for name in ("mt_bench", "humaneval") for row in load_prompts(name, args.num_prompts, tokenizer)]
    for row in tqdm(prompts, desc="prompts"):
        ids = tokenizer(row["text"], return_tensors="pt").input_ids
        target.generate(ids, assistant_model=drafter, max_new_tokens=args.max_new_tokens, do_sample=False,
                        tree_budget=args.tree_budget, **FREE_OFF)  # fmt: skip
    decoding.greedy_accept_rows = accept
    table = numpy.array(nodes, dtype=float)
    predicted, accepted, depth = table.T

    def cell(mask: numpy.ndarray) -> dict:
        return {"nodes": int(mask.sum()), "predicted": round(float(predicted[mask].mean()), 4),
                "accepted": round(float(accepted[mask].mean()), 4)}  # fmt: skip

    result = {
        "drafter": args.drafter, "tree_budget": args.tree_budget, "nodes": len(table),
        "expected_accepted": round(float(predicted.sum()), 1), "accepted": int(accepted.sum()),
        "by_probability": {f"{lo}-{hi}": cell((predicted >= lo) & (predicted < hi))
                           for lo, hi in zip(BINS, BINS[1:]) if ((predicted >= lo) & (predicted < hi)).any()},
        "by_depth": {int(d): cell(depth == d) for d in sorted(set(depth.astype(int)))},
    }  # fmt: skip
    print(json.dumps(result, indent=1))
    if args.output:
        write_atomically(args.output, json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
