"""Does weighing a chosen budget by what its steps took (`AutoBudget.step_time`) and trying the free candidates alone
from a drafting choice make the shipped SpecBlock drafter's `tree_budget="auto"` faster?

Per prompt: plain greedy, its A/A control, the drafter with the chooser as it was before ("before": the model alone,
no budget-0 tries from a drafting choice, budget 0 read from its first own step), as it is now ("after") and
optionally the lookup tree (`--lookup_tree`: the free candidates alone, no drafter), in an order alternating from
prompt to prompt; each call timed with `time.process_time` (run it at one thread). "before" and "after" are two copies
of the shipped drafter (their own serving state); "before" runs under patches that restore the earlier chooser.
A line per prompt goes to OUTPUT_DIR/per_prompt.jsonl, the summary (median per-prompt speed-up, its total, and the
paired ratio after / before with the prompts it won) to OUTPUT_DIR/summary.json.

    OMP_NUM_THREADS=1 python examples/experiments/chooser_step_time_ab.py --dtype float32 --dataset humaneval \
        --output_dir docs/results/chooser-step-time/float32-humaneval
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModel

from transformers_specblock import LookupTreeModel, load_packaged_model, load_prompts
from transformers_specblock.generation import budget
from transformers_specblock.hub.provenance import describe_device
from transformers_specblock.hub.shipped import resolve_drafter_path

AFTER = {"next_budget": budget.AutoBudget.next_budget, "_free_stats": budget.AutoBudget._free_stats}


def _free_stats_before(self):
    """Budget 0's statistics as before: its own steps' from the first one on."""
    if self.free_tau.count or not self.free_part_tau.count:
        return self.free_tau, self.free_size
    return self.free_part_tau, self.free_part_size


def _next_budget_before(self, explore_interval=32, explore_share=0.02, unread=0):
    """The choice as before: no budget-0 tries from a drafting choice, the model alone for every budget."""
    self.free_explored_at = self.steps + 1  # never due
    self.step_time.clear()
    return AFTER["next_budget"](self, explore_interval, explore_share, unread)


BEFORE = {"next_budget": _next_budget_before, "_free_stats": _free_stats_before}


def use_chooser(version: dict) -> None:
    for name, method in version.items():
        setattr(budget.AutoBudget, name, method)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument("--num_prompts", type=int, default=16)
    parser.add_argument("--max_new_tokens", type=int, default=48)
    parser.add_argument("--lookup_tree", action="store_true", help="add the lookup tree (free candidates alone)")
    parser.add_argument("--output_dir", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    target, tokenizer = load_packaged_model("smollm2-135m-instruct", dtype=dtype)
    shipped = AutoModel.from_pretrained(resolve_drafter_path("specblock-smollm2-135m-instruct"), dtype=dtype).eval()
    shipped.set_drafting_settings(auto_budget_cost_cache=False)  # every arm learns in this process only
    drafters = {"before": copy.deepcopy(shipped), "after": copy.deepcopy(shipped)}
    if args.lookup_tree:
        drafters["lookup_tree"] = LookupTreeModel.from_target(target, auto_budget_cost_cache=False)
    warm = tokenizer("Hello", return_tensors="pt").input_ids
    for name, drafter in drafters.items():  # binds them; the target's cost curve is measured before any timed call
        use_chooser(BEFORE if name == "before" else AFTER)
        drafter.bind_target(target)
        target.generate(warm, max_new_tokens=2, do_sample=False, assistant_model=drafter)
    arms = ["plain", "plain_control", *drafters]
    args.output_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    with (args.output_dir / "per_prompt.jsonl").open("w") as sink:
        for i, prompt in enumerate(load_prompts(args.dataset, num_prompts=args.num_prompts, tokenizer=tokenizer)):
            input_ids = tokenizer(prompt["text"], return_tensors="pt").input_ids
            seconds, outputs = {}, {}
            for arm in arms if i % 2 == 0 else arms[::-1]:
                use_chooser(BEFORE if arm == "before" else AFTER)
                assistant = {"assistant_model": drafters[arm]} if arm in drafters else {}
                start = time.process_time()
                outputs[arm] = target.generate(input_ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                                               **assistant)  # fmt: skip
                seconds[arm] = time.process_time() - start
            identical = {arm: torch.equal(out, outputs["plain"]) for arm, out in outputs.items()}
            if dtype == torch.float32 and not all(identical.values()):
                raise AssertionError(f"prompt {prompt['id']}: float32 output differs from plain greedy: {identical}")
            rows.append({"prompt_id": prompt["id"], "seconds": seconds, "identical_to_plain": identical})
            sink.write(json.dumps(rows[-1]) + "\n")
            sink.flush()
            print(prompt["id"], {arm: round(seconds["plain"] / s, 3) for arm, s in seconds.items()}, flush=True)
    use_chooser(AFTER)
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
        "identical_to_plain": {arm: sum(r["identical_to_plain"][arm] for r in rows) for arm in arms},
    }  # fmt: skip
    (args.output_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary["speedup_over_plain"]), summary["after_over_before"])


if __name__ == "__main__":
    main()
