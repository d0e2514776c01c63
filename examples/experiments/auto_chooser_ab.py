"""Variants of the `tree_budget="auto"` chooser side by side, interleaved per prompt (bfloat16, as shipped).

    OMP_NUM_THREADS=1 python examples/experiments/auto_chooser_ab.py --variants A A2 S \
        --output docs/results/auto-vs-fixed/chooser-ab-3.jsonl

Each variant serves the same prompts (HumanEval then MT-Bench, 16 each spread over the categories, 128 new tokens)
with its own drafter object, so each keeps its own chooser from prompt to prompt as a server would; the order of the
variants rotates per prompt. Variants: ``A`` / ``A2`` the chooser as shipped (two copies: the A/A control),
``S`` a budget's measured whole-step time used however old it is (the chooser before 2026-12-06; the rows of
``chooser-ab-1/2.jsonl`` name the rule since then, taking it only while it has a sample in the chooser's window,
``F1``), ``G`` a drafted budget's tau estimated as the free candidates' current tau plus the drafter's measured gain
over them at drafted steps, ``fixedN`` a fixed budget of N nodes. S and G patch `AutoBudget` for their own
choosers only. One JSON line per prompt: seconds per variant.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoModel

import transformers_specblock.generation.decoding as decoding
from transformers_specblock import load_packaged_model, load_prompts
from transformers_specblock.commands.cli import spread_over_categories
from transformers_specblock.generation import budget as B
from transformers_specblock.hub.shipped import resolve_drafter_path
from transformers_specblock.utils import RecentMean

ORIGINAL = {name: getattr(B.AutoBudget, name) for name in ("seconds", "observe", "observe_free_alone", "estimates")}


def variant(chooser: B.AutoBudget) -> str:
    return getattr(chooser, "variant", "A")


def seconds(self: B.AutoBudget, budget: int) -> float:
    taken = self.step_time.get((B.batch_bucket(self.batch_size), budget))
    if variant(self) == "S" and taken is not None and taken.count >= self.keep:  # however old its samples are
        return taken.mean(self.clock)
    return ORIGINAL["seconds"](self, budget)


def observe(self: B.AutoBudget, tree, path, drafting_seconds, budget=None) -> None:
    before = {b: m.samples[-1] if m.samples else None for b, m in self.tau.items()}
    ORIGINAL["observe"](self, tree, path, drafting_seconds, budget)
    if variant(self) == "G":
        self.pending = {b: m.samples[-1][1] for b, m in self.tau.items() if m.samples and m.samples[-1] is not before[b]}


def observe_free_alone(self: B.AutoBudget, trees) -> None:
    ORIGINAL["observe_free_alone"](self, trees)
    pending = getattr(self, "pending", None)
    if variant(self) == "G" and pending and trees:
        gains = self.__dict__.setdefault("gain", {b: RecentMean(self.window, self.keep) for b in self.tau})
        free = sum(tree.tau for tree in trees) / len(trees)
        for b, sample in pending.items():
            gains[b].add(self.clock, sample - free)
        self.pending = None


def estimates(self: B.AutoBudget) -> dict[int, float]:
    est = ORIGINAL["estimates"](self)
    if variant(self) == "G" and self.free_tau.count:
        free = self.free_tau.mean(self.clock)
        for b, gain in getattr(self, "gain", {}).items():
            if gain.count >= self.keep and b in est:
                est[b] = free + max(0.0, gain.mean(self.clock))
    return est


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default="specblock-smollm2-135m-instruct")
    parser.add_argument("--variants", nargs="+", default=["A", "A2", "S", "fixed16"])
    parser.add_argument("--num_prompts", type=int, default=16, help="per prompt set")
    parser.add_argument("--output", required=True, help="JSONL, appended")
    args = parser.parse_args()
    torch.set_num_threads(1)
    B.AutoBudget.seconds, B.AutoBudget.observe = seconds, observe
    B.AutoBudget.observe_free_alone, B.AutoBudget.estimates = observe_free_alone, estimates
    target, tokenizer = load_packaged_model("smollm2-135m-instruct", dtype=torch.bfloat16)
    path = resolve_drafter_path(args.drafter)
    drafters = {name: AutoModel.from_pretrained(path).eval() for name in args.variants}
    auto_budget_for = decoding.auto_budget_for

    def tagged(drafter, target_model):
        chooser = auto_budget_for(drafter, target_model)
        chooser.variant = next(name for name, d in drafters.items() if d is drafter).rstrip("2")
        return chooser

    decoding.auto_budget_for = tagged

    def run(name: str, ids: torch.Tensor, tokens: int) -> float:
        drafter = drafters[name]
        if drafter.serving_states.suffix_store is not None:  # every call a first request (as the benchmarks)
            drafter.serving_states.suffix_store.reset()
        budget = {"tree_budget": int(name[5:])} if name.startswith("fixed") else {}
        start = time.perf_counter()
        target.generate(ids, assistant_model=drafter, max_new_tokens=tokens, do_sample=False,
                        auto_budget_cost_cache=False, **budget)  # fmt: skip
        return time.perf_counter() - start

    prompts = [row for name in ("humaneval", "mt_bench")
               for row in spread_over_categories(load_prompts(name, tokenizer=tokenizer), args.num_prompts)]  # fmt: skip
    first = tokenizer(prompts[0]["text"], return_tensors="pt").input_ids
    for name in args.variants:  # warm-up: kernels
        run(name, first, 16)
    rows = []
    for i, prompt in enumerate(prompts):
        ids = tokenizer(prompt["text"], return_tensors="pt").input_ids
        order = args.variants[i % len(args.variants):] + args.variants[: i % len(args.variants)]
        row = {"id": prompt["id"], **{name: run(name, ids, 128) for name in order}}
        rows.append(row)
        with open(args.output, "a") as f:
            f.write(json.dumps(row) + "\n")
    reference = args.variants[0]
    for name in args.variants[1:]:
        ratios = [row[name] / row[reference] for row in rows]
        print(f"{name} / {reference}: median time ratio {statistics.median(ratios):.3f}, "
              f"faster on {sum(r < 1 for r in ratios)} of {len(ratios)}")  # fmt: skip


if __name__ == "__main__":
    main()
