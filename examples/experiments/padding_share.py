"""How much of a batch's verified forward is padding: every row's tree is padded to the longest row's (dummy nodes
that see only themselves), so a forward verifies B x (1 + longest) tokens where the rows' own trees hold
sum(1 + nodes). Counted exactly for the lookup tree at fixed budgets on the packaged SmolLM2-135M-Instruct.

    python examples/experiments/padding_share.py --dataset humaneval --num_prompts 16 --batch_size 4 --budgets 4,8,16

A share near 1 means unpadded (ragged) verification could save little; the rest of a tree step's cost is the
rows' own nodes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

from transformers_specblock import LookupTreeModel, load_packaged_model, load_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument("--num_prompts", type=int, default=16)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--budgets", default="4,8,16")
    parser.add_argument("--max_new_tokens", type=int, default=48)
    parser.add_argument("--output", default="out/padding-share/results.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, tokenizer = load_packaged_model("smollm2-135m-instruct", dtype=torch.bfloat16)
    tokenizer.padding_side = "left"
    texts = load_prompts(args.dataset, num_prompts=args.num_prompts, tokenizer=tokenizer)["text"]
    shapes: list[tuple[int, int]] = []  # [rows, nodes per row] of every target forward
    target.model.register_forward_pre_hook(lambda _, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
                                           with_kwargs=True)  # fmt: skip
    results = {}
    for budget in [int(b) for b in args.budgets.split(",")]:
        drafter = LookupTreeModel.from_target(target, tree_budget=budget)
        own = padded = 0
        for start in tqdm(range(0, len(texts), args.batch_size), desc=f"budget {budget}"):
            batch = tokenizer(texts[start : start + args.batch_size], return_tensors="pt", padding=True,
                              add_special_tokens=False)  # fmt: skip
            shapes.clear()
            target.generate(**batch, assistant_model=drafter, do_sample=False, max_new_tokens=args.max_new_tokens,
                            pad_token_id=tokenizer.eos_token_id)  # fmt: skip
            stats = drafter.last_stats  # every live row's tree of every step: a root and its drafted nodes
            own += stats.iterations + sum(stats.nodes_per_iteration)
            padded += sum(rows * width for rows, width in shapes[1:])  # the forwards after the prefill
        results[budget] = {"own_tokens": own, "padded_tokens": padded, "share": own / padded}
        print(f"budget {budget}: the rows' own trees fill {own / padded:.0%} of the padded forwards")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"settings": vars(args), "budgets": results}, indent=2))


if __name__ == "__main__":
    main()
