"""New drafter objects, as `make demo` makes them: "auto" with and without the free candidates' trees scored at plain
steps (and sized while warming up as after it), interleaved.

    OMP_NUM_THREADS=1 python examples/experiments/fresh_chooser_ab.py --output docs/results/auto-vs-fixed/fresh-chooser-ab.jsonl
    OMP_NUM_THREADS=1 python examples/experiments/fresh_chooser_ab.py --scenario demo --repeats 4 \
        --output docs/results/auto-vs-fixed/fresh-chooser-demo.jsonl

``--scenario prompts``: every prompt (HumanEval then MT-Bench, spread over the categories) is decoded by plain
`generate` and by each variant with a drafter loaded anew (a chooser that knows nothing, `auto_budget_cost_cache=False`).
``--scenario demo``: the demo's three prompts in its order (code, a chat question, a second turn quoting plain
greedy's answer to it), one new drafter per variant and repeat, its chooser going on from prompt to prompt. Each new
drafter first answers an unrelated 16-token warm-up untimed, as the demo does. Variants: ``current`` / ``current2`` the
package as it is (two copies: the A/A control); ``before`` plain steps score nothing and the shadows measured while
warming up are kept whole (the chooser before 2026-12-06). One JSON line per prompt: seconds per method, tau per
variant.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModel

import transformers_specblock.generation.decoding as decoding
from transformers_specblock import load_packaged_model, load_prompts
from transformers_specblock.commands.cli import spread_over_categories
from transformers_specblock.generation.budget import AutoBudget
from transformers_specblock.generation.candidate_generators.base import TreeCandidateGenerator
from transformers_specblock.hub.shipped import resolve_drafter_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from demo import build_prompts  # noqa: E402  (examples/demo.py)

PLAIN_STEP, FREE_ALONE_TREE = TreeCandidateGenerator.plain_step, AutoBudget.free_alone_tree


def plain_step(self: TreeCandidateGenerator, sequence: torch.LongTensor) -> None:
    if getattr(self.drafter, "variant", None) != "before":
        PLAIN_STEP(self, sequence)


def free_alone_tree(self: AutoBudget, tree):
    if getattr(self, "variant", None) == "before" and self.trees < self.warmup:
        return tree
    return FREE_ALONE_TREE(self, tree)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default="specblock-smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--variants", nargs="+", default=["current", "current2", "before"])
    parser.add_argument("--num_prompts", type=int, default=8, help="per prompt set")
    parser.add_argument("--max_new_tokens", type=int, default=96)
    parser.add_argument("--scenario", choices=("prompts", "demo"), default="prompts")
    parser.add_argument("--repeats", type=int, default=1, help="demo scenario: sequences of the three prompts")
    parser.add_argument("--output", required=True, help="JSONL, appended")
    args = parser.parse_args()
    torch.set_num_threads(1)
    TreeCandidateGenerator.plain_step, AutoBudget.free_alone_tree = plain_step, free_alone_tree
    auto_budget_for = decoding.auto_budget_for

    def tagged(drafter, target_model):
        chooser = auto_budget_for(drafter, target_model)
        chooser.variant = drafter.variant
        return chooser

    decoding.auto_budget_for = tagged
    target, tokenizer = load_packaged_model("smollm2-135m-instruct", dtype=getattr(torch, args.dtype))
    path = resolve_drafter_path(args.drafter)
    warm_up = tokenizer("Hello, how are you today?", return_tensors="pt").input_ids

    def new_drafter(name: str):
        drafter = AutoModel.from_pretrained(path).eval()  # its chooser starts from nothing
        drafter.variant = name.rstrip("2")
        target.generate(warm_up, assistant_model=drafter, max_new_tokens=16, do_sample=False,
                        auto_budget_cost_cache=False)  # fmt: skip
        return drafter

    def run(drafter, ids: torch.Tensor) -> tuple[float, float | None, torch.Tensor]:
        extra = {"assistant_model": drafter, "auto_budget_cost_cache": False} if drafter is not None else {}
        start = time.perf_counter()
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                              do_sample=False, **extra)  # fmt: skip
        return time.perf_counter() - start, drafter.last_stats.tau if drafter is not None else None, out

    if args.scenario == "prompts":
        prompts = [(row["id"], tokenizer(row["text"], return_tensors="pt").input_ids)
                   for name in ("humaneval", "mt_bench")
                   for row in spread_over_categories(load_prompts(name, tokenizer=tokenizer), args.num_prompts)]
    else:
        prompts = [(kind, ids) for kind, ids in build_prompts(tokenizer, lambda ids: tokenizer.decode(
            run(None, ids)[2][0, ids.shape[1]:], skip_special_tokens=True))]  # fmt: skip
    run(None, warm_up)  # warm-up: kernels, the target's cost curve
    run(new_drafter("current"), warm_up)
    methods = ["plain", *args.variants]
    rows = []
    for repeat in range(args.repeats):
        drafters = {name: new_drafter(name) for name in args.variants} if args.scenario == "demo" else {}
        for i, (prompt_id, ids) in enumerate(prompts):
            order = methods[(i + repeat) % len(methods):] + methods[: (i + repeat) % len(methods)]
            timed = {}
            for name in order:
                drafter = None if name == "plain" else drafters.get(name) or new_drafter(name)
                timed[name] = run(drafter, ids)[:2]
            row = {"id": prompt_id, "repeat": repeat, **{name: seconds for name, (seconds, _) in timed.items()},
                   "tau": {name: tau for name, (_, tau) in timed.items() if tau is not None}}  # fmt: skip
            rows.append(row)
            with open(args.output, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    for name in args.variants:
        speedups = [row["plain"] / row[name] for row in rows]
        print(f"{name}: median speed-up over plain per prompt {statistics.median(speedups):.3f}, "
              f"faster than plain on {sum(s > 1 for s in speedups)} of {len(speedups)}")  # fmt: skip
    for name in args.variants[1:]:
        ratios = [row[name] / row[args.variants[0]] for row in rows]  # > 1: the first variant is faster
        print(f"{args.variants[0]} over {name}: median speed ratio per prompt {statistics.median(ratios):.3f}, "
              f"faster on {sum(r > 1 for r in ratios)} of {len(ratios)}")  # fmt: skip


if __name__ == "__main__":
    main()
