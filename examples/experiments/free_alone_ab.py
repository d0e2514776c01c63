"""Does scoring the free candidates' tree alone at every drafted step (`FreeShadow`, `AutoBudget.observe_free_alone`)
make the shipped SpecBlock drafter's `tree_budget="auto"` faster than the estimate it replaced?

Before, budget 0 (the free candidates alone, no drafter call) was estimated from the drafted trees' free parts: the
accepted path of the verified, pruned tree up to its first node no free source proposed, until budget 0 had run
`keep` times itself. That estimate is biased low where the drafter's nodes pruned the lookups' away, and capped at
what the drafted tree accepted. Now each drafted step scores the free candidates' own tree against the text the target
commits next: budget 0's tau, exact for greedy decoding, at every drafted step.

Per prompt: plain greedy, its A/A control, the drafter with the estimate as it was ("before", restored by patches
below), as it is now ("after") and the lookup tree (the free candidates alone, no drafter), in an order alternating
from prompt to prompt; each call timed with `time.process_time` (run it at one thread). "before" and "after" are two
copies of the shipped drafter (their own serving state, nothing cached across processes). A line per prompt goes to
OUTPUT_DIR/per_prompt.jsonl, the summary (median per-prompt speed-up, its total, the paired ratio after / before with
the prompts it won, the share of steps each arm spent at budget 0) to OUTPUT_DIR/summary.json.

    OMP_NUM_THREADS=1 python examples/experiments/free_alone_ab.py --dtype float32 --dataset humaneval \
        --output_dir docs/results/free-alone/float32-humaneval
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoModel

from transformers_specblock import LookupTreeModel, load_packaged_model, load_prompts
from transformers_specblock.generation import budget, decoding
from transformers_specblock.generation.tree import SOURCE_BITS
from transformers_specblock.hub.provenance import describe_device
from transformers_specblock.hub.shipped import resolve_drafter_path
from transformers_specblock.utils import RecentMean

CHOSEN: Counter = Counter()  # budgets chosen in the current call


def _counting(next_budget):
    @functools.wraps(next_budget)
    def wrapped(self, *args):
        chosen = next_budget(self, *args)
        CHOSEN[chosen] += 1
        return chosen

    return wrapped


AFTER = {
    "next_budget": _counting(budget.AutoBudget.next_budget),
    "observe_free_alone": budget.AutoBudget.observe_free_alone,
    "estimates": budget.AutoBudget.estimates,
    "seconds": budget.AutoBudget.seconds,
    "_learn": decoding._Loop._learn,
}


def _free_part(chooser: budget.AutoBudget) -> tuple[RecentMean, RecentMean]:
    """The earlier estimate's samples, kept on the chooser of the "before" arm."""
    if not hasattr(chooser, "free_part_tau"):
        chooser.free_part_tau = RecentMean(chooser.window, chooser.keep)
        chooser.free_part_size = RecentMean(chooser.window, chooser.keep)
    return chooser.free_part_tau, chooser.free_part_size


def _learn_before(self, row, tree, path, bonus, logits, budget_, drafting_seconds) -> None:
    """As before: every drafted tree's free part is a budget-0 sample (the accepted path up to its first node no free
    source proposed, and the nodes they proposed)."""
    AFTER["_learn"](self, row, tree, path, bonus, logits, budget_, drafting_seconds)
    chooser = self.auto_budget
    if chooser is not None and budget_ > 0 and chooser.free_at_zero and row.generator.grows_trees:
        tau, size = _free_part(chooser)
        free = [bits & ~SOURCE_BITS["drafter"] for bits in tree.host().sources]
        tau.add(chooser.clock, next((i for i, node in enumerate(path) if not free[node]), len(path)) + 1.0)
        size.add(chooser.clock, float(sum(1 for bits in free[1:] if bits)))


def _with_free_part(method):
    """As before: budget 0 is read from the free parts until it ran `keep` times itself."""

    @functools.wraps(method)
    def wrapped(self, *args):
        part_tau, part_size = _free_part(self)
        if self.free_tau.count >= self.keep or not part_tau.count:
            return method(self, *args)
        own = self.free_tau, self.free_size
        self.free_tau, self.free_size = part_tau, part_size
        try:
            return method(self, *args)
        finally:
            self.free_tau, self.free_size = own

    return wrapped


BEFORE = {
    "next_budget": AFTER["next_budget"],
    "observe_free_alone": lambda self, trees: None,
    "estimates": _with_free_part(AFTER["estimates"]),
    "seconds": _with_free_part(AFTER["seconds"]),
    "_learn": _learn_before,
}


def use_estimate(version: dict) -> None:
    for name, method in version.items():
        setattr(decoding._Loop if name == "_learn" else budget.AutoBudget, name, method)


def without_drafter(chosen: Counter) -> float:
    """The share of a call's steps that ran no drafter (budget 0: the free candidates alone; or a plain step)."""
    return (chosen[0] + chosen[budget.PLAIN]) / max(1, sum(chosen.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument("--num_prompts", type=int, default=16)
    parser.add_argument("--max_new_tokens", type=int, default=48)
    parser.add_argument("--output_dir", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    target, tokenizer = load_packaged_model("smollm2-135m-instruct", dtype=dtype)
    shipped = AutoModel.from_pretrained(resolve_drafter_path("specblock-smollm2-135m-instruct"), dtype=dtype).eval()
    shipped.set_drafting_settings(auto_budget_cost_cache=False)  # every arm learns in this process only
    drafters = {
        "before": copy.deepcopy(shipped),
        "after": copy.deepcopy(shipped),
        "lookup_tree": LookupTreeModel.from_target(target, auto_budget_cost_cache=False),
    }
    warm = tokenizer("Hello", return_tensors="pt").input_ids
    for name, drafter in drafters.items():  # binds them; the target's cost curve is measured before any timed call
        use_estimate(BEFORE if name == "before" else AFTER)
        drafter.bind_target(target)
        target.generate(warm, max_new_tokens=2, do_sample=False, assistant_model=drafter)
    arms = ["plain", "plain_control", *drafters]
    args.output_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    with (args.output_dir / "per_prompt.jsonl").open("w") as sink:
        for i, prompt in enumerate(load_prompts(args.dataset, num_prompts=args.num_prompts, tokenizer=tokenizer)):
            input_ids = tokenizer(prompt["text"], return_tensors="pt").input_ids
            seconds, outputs, at_zero = {}, {}, {}
            for arm in arms if i % 2 == 0 else arms[::-1]:
                use_estimate(BEFORE if arm == "before" else AFTER)
                assistant = {"assistant_model": drafters[arm]} if arm in drafters else {}
                CHOSEN.clear()
                start = time.process_time()
                outputs[arm] = target.generate(input_ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                                               **assistant)  # fmt: skip
                seconds[arm] = time.process_time() - start
                if arm in ("before", "after"):
                    at_zero[arm] = without_drafter(CHOSEN)
            identical = {arm: torch.equal(out, outputs["plain"]) for arm, out in outputs.items()}
            if dtype == torch.float32 and not all(identical.values()):
                raise AssertionError(f"prompt {prompt['id']}: float32 output differs from plain greedy: {identical}")
            rows.append({"prompt_id": prompt["id"], "seconds": seconds, "identical_to_plain": identical,
                         "share_without_drafter": at_zero})  # fmt: skip
            sink.write(json.dumps(rows[-1]) + "\n")
            sink.flush()
            print(prompt["id"], {arm: round(seconds["plain"] / s, 3) for arm, s in seconds.items()}, at_zero, flush=True)
    use_estimate(AFTER)
    speedups = {
        arm: {
            "median": statistics.median(r["seconds"]["plain"] / r["seconds"][arm] for r in rows),
            "total": sum(r["seconds"]["plain"] for r in rows) / sum(r["seconds"][arm] for r in rows),
        }
        for arm in arms[1:]
    }
    paired = [r["seconds"]["before"] / r["seconds"]["after"] for r in rows]
    summary = {
        "settings": {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                     "hardware": describe_device(target.device), "clock": "time.process_time, one thread"},
        "speedup_over_plain": speedups,
        "after_over_before": {"median": statistics.median(paired), "won": sum(p > 1 for p in paired), "of": len(paired)},
        "share_without_drafter": {arm: statistics.mean(r["share_without_drafter"][arm] for r in rows)
                                  for arm in ("before", "after")},
        "identical_to_plain": {arm: sum(r["identical_to_plain"][arm] for r in rows) for arm in arms},
    }  # fmt: skip
    (args.output_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary["speedup_over_plain"]), summary["after_over_before"], summary["share_without_drafter"])


if __name__ == "__main__":
    main()
