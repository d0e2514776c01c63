"""Are the branches a best-first block grows off the greedy chain overrated by their draft scores?

    OMP_NUM_THREADS=1 python examples/experiments/off_chain_calibration.py \
        --output docs/results/best-first-calibration/sharegpt-budget32.json

Decodes float32 greedy with the free candidates off and `block_expansion="best_first"` at a fixed budget, and for
every verified drafter node whose parent the target accepted compares its own draft probability
exp(score - parent's score) with whether the target accepted it, per depth, split by whether the node hangs below a
runner-up candidate (off the chain of best candidates) or not. A block's later slots are trained under the greedy
prefix, so a calibrated drafter shows the same ratio on and off the chain.
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
from transformers_specblock.generation.tree import HostTree
from transformers_specblock.hub.shipped import resolve_drafter_path
from transformers_specblock.utils import write_atomically

FREE_OFF = {"prompt_lookup_num_tokens": 0, "ngram_cache_num_tokens": 0, "suffix_cache_num_tokens": 0,
            "suffix_local_num_tokens": 0}  # fmt: skip


def conditional_rows(host: HostTree, accepted: set[int]) -> list[tuple[float, bool, int, bool]]:
    """(own probability, accepted, depth, below a runner-up) of every node whose parent was accepted (root: 0)."""
    best_child: dict[int, int] = {}
    for node in range(1, len(host)):
        parent = host.parents[node]
        if parent not in best_child or host.scores[node] > host.scores[best_child[parent]]:
            best_child[parent] = node
    off_chain, rows = {0: False}, []
    for node in range(1, len(host)):
        parent = host.parents[node]
        off_chain[node] = off_chain[parent] or best_child[parent] != node
        if parent in accepted:
            own = math.exp(host.scores[node] - (host.scores[parent] if parent else 0.0))
            rows.append((own, node in accepted, host.depths[node], off_chain[parent]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default="specblock-smollm2-135m-instruct", help="a shipped name or a folder")
    parser.add_argument("--dataset", default="sharegpt", help="held-out ShareGPT: no benchmark set is tuned on")
    parser.add_argument("--num_prompts", type=int, default=12)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--tree_budget", type=int, default=32)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, tokenizer = load_packaged_model("smollm2-135m-instruct", dtype=torch.float32)
    drafter = AutoModel.from_pretrained(resolve_drafter_path(args.drafter)).eval()
    rows = []
    accept = decoding.greedy_accept_rows

    def recording_accept(trees, processed):
        kept, bonus, host_bonus = accept(trees, processed)
        for row, tree in enumerate(trees.trees):
            rows.extend(conditional_rows(tree.host(), set(kept[row]) | {0}))
        return kept, bonus, host_bonus

    decoding.greedy_accept_rows = recording_accept
    try:
        for prompt in tqdm(load_prompts(args.dataset, args.num_prompts, tokenizer), desc="prompts"):
            ids = tokenizer(prompt["text"], return_tensors="pt").input_ids
            target.generate(ids, assistant_model=drafter, max_new_tokens=args.max_new_tokens, do_sample=False,
                            tree_budget=args.tree_budget, block_expansion="best_first", **FREE_OFF)  # fmt: skip
    finally:
        decoding.greedy_accept_rows = accept
    own, accepted, depth, below = numpy.array(rows, dtype=float).T
    cells = {}
    for d in sorted(set(depth.astype(int))):
        for off in (False, True):
            mask = (depth == d) & (below == off)
            if mask.any():
                predicted, observed = float(own[mask].mean()), float(accepted[mask].mean())
                cells[f"depth {d}, {'below a runner-up' if off else 'not below one'}"] = {
                    "nodes": int(mask.sum()), "predicted": round(predicted, 4), "accepted": round(observed, 4),
                    "log_ratio": round(math.log(max(observed, 1e-3) / predicted), 3),
                }  # fmt: skip
    result = {"settings": vars(args), "cells": cells}
    print(json.dumps(result, indent=1))
    if args.output:
        write_atomically(args.output, json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
