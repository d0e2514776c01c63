"""CPU time of SpecBlock's two tree constructions: this package's (`tree_construction="package"`, the default)
against the reference harness's (`"reference"`), on SmolLM2-135M-Instruct with a SpecBlock drafter, float32 greedy,
fixed tree budgets, two block steps, free candidates off and on. Every prompt runs plain greedy and every (budget,
free candidates, construction) arm in turn, the two constructions in alternating order from prompt to prompt; each
call is timed with `time.process_time` (CPU time of this process: run it at one thread) and its output checked
against plain greedy. The JSON is rewritten after every prompt (a rerun resumes after the last one).

    OMP_NUM_THREADS=1 nice -n 10 python examples/experiments/tree_construction_throughput.py \
        --output docs/results/specblock-tree-construction-throughput/throughput.json

"Free candidates on" is the shipped drafter's prompt lookup (10 tokens) and n-gram cache (8 tokens); its suffix cache
stays off, since it would remember the answers earlier arms gave to the same prompt.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from transformers_specblock import SpecBlockDraftModel, load_prompts
from transformers_specblock.hub.loading import load_model
from transformers_specblock.hub.provenance import describe_hardware
from transformers_specblock.hub.shipped import resolve_drafter_path
from transformers_specblock.utils import write_atomically

FREE = {
    "off": {"prompt_lookup_num_tokens": 0, "ngram_cache_num_tokens": 0},
    "on": {"prompt_lookup_num_tokens": 10, "ngram_cache_num_tokens": 8},
}
COMMON = {"suffix_cache_num_tokens": 0, "suffix_local_num_tokens": 0, "online_adaptation": "off"}


def timed(fn) -> tuple[torch.Tensor, float]:
    """fn()'s result and the CPU seconds it took."""
    start = time.process_time()
    out = fn()
    return out, time.process_time() - start


def summarise(rows: list[dict]) -> dict:
    """Per arm: CPU seconds, tokens and steps summed over the prompts; tau; the reference / package CPU time ratio
    per (budget, free candidates); each arm's CPU time relative to plain greedy."""
    arms: dict = {}
    plain = sum(row["plain_cpu_s"] for row in rows)
    for row in rows:
        for name, result in row["arms"].items():
            entry = arms.setdefault(name, {"cpu_s": 0.0, "tokens": 0, "steps": 0, "all_equal_greedy": True})
            entry["cpu_s"] += result["cpu_s"]
            entry["tokens"] += result["tokens"]
            entry["steps"] += result["steps"]
            entry["all_equal_greedy"] &= result["equals_greedy"]
    for entry in arms.values():
        entry["tau"] = round(entry["tokens"] / entry["steps"], 4)
        entry["speedup_vs_plain"] = round(plain / entry["cpu_s"], 4)
        entry["cpu_s"] = round(entry["cpu_s"], 3)
    ratios = {}
    for name, entry in arms.items():
        construction, budget, free = name.split("/")
        if construction == "reference" and f"package/{budget}/{free}" in arms:
            ratios[f"{budget}/{free}"] = round(entry["cpu_s"] / arms[f"package/{budget}/{free}"]["cpu_s"], 4)
    return {"prompts": len(rows), "plain_cpu_s": round(plain, 3), "arms": arms,
            "reference_over_package_cpu_time": ratios}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default="specblock-smollm2-135m-instruct", help="a shipped name or a folder")
    parser.add_argument("--output", required=True)
    parser.add_argument("--prompt_sets", nargs="+", default=["mt_bench", "humaneval"])
    parser.add_argument("--num_prompts", type=int, default=3)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--tree_budgets", type=int, nargs="+", default=[16, 32, 90])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    target, tokenizer = load_model("smollm2-135m-instruct", device="cpu", dtype="float32")
    drafter = SpecBlockDraftModel.from_pretrained(resolve_drafter_path(args.drafter), target=target,
                                                  dtype=torch.float32).eval()  # fmt: skip
    output = Path(args.output)
    done = json.loads(output.read_text())["rows"] if output.exists() else []
    prompts = [(name, index, row["text"]) for name in args.prompt_sets
               for index, row in enumerate(load_prompts(name, num_prompts=args.num_prompts, tokenizer=tokenizer))]
    prompts.sort(key=lambda p: (p[1], args.prompt_sets.index(p[0])))  # sets interleaved: a cut run covers both
    seen = {(row["prompt_set"], row["index"]) for row in done}
    warm = tokenizer("Hello", return_tensors="pt").input_ids
    for construction in ("package", "reference"):  # first-call costs (allocations, lazy imports) before timing
        with drafter.tree_settings(max_blocks=2):
            target.generate(warm, attention_mask=torch.ones_like(warm), assistant_model=drafter, do_sample=False,
                            max_new_tokens=8, tree_budget=16, tree_construction=construction, **COMMON)  # fmt: skip
    for name, index, text in tqdm(prompts, desc="prompts"):
        if (name, index) in seen:
            continue
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        mask = torch.ones_like(ids)
        plain, plain_s = timed(lambda: target.generate(ids, attention_mask=mask, do_sample=False,
                                                       max_new_tokens=args.max_new_tokens))  # fmt: skip
        order = ("package", "reference") if len(done) % 2 == 0 else ("reference", "package")
        arms = {}
        for budget in args.tree_budgets:
            for free, settings in FREE.items():
                for construction in order:
                    with drafter.tree_settings(max_blocks=2):
                        out, seconds = timed(lambda: target.generate(
                            ids, attention_mask=mask, assistant_model=drafter, do_sample=False,
                            max_new_tokens=args.max_new_tokens, tree_budget=budget, tree_construction=construction,
                            **settings, **COMMON))  # fmt: skip
                    stats = drafter.last_stats
                    arms[f"{construction}/{budget}/{free}"] = {
                        "equals_greedy": bool(torch.equal(out, plain)), "tokens": out.shape[1] - ids.shape[1],
                        "steps": len(stats.accepted_per_iteration), "cpu_s": round(seconds, 4),
                        "mean_nodes": round(sum(stats.nodes_per_iteration) / max(1, stats.iterations), 2),
                        "drafter_forwards": stats.drafter_forwards, "drafting_share": round(stats.drafting_share, 4),
                    }  # fmt: skip
        done.append({"prompt_set": name, "index": index, "prompt_tokens": ids.shape[1], "order": list(order),
                     "plain_cpu_s": round(plain_s, 4), "arms": arms})  # fmt: skip
        result = {"target": "smollm2-135m-instruct", "drafter": args.drafter, "dtype": "float32",
                  "max_new_tokens": args.max_new_tokens, "max_blocks": 2, "clock": "time.process_time",
                  "threads": torch.get_num_threads(), "free_candidates_on": FREE["on"], "common": COMMON,
                  "hardware": describe_hardware(target.device, target.dtype, torch.float32),
                  "summary": summarise(done), "rows": done}  # fmt: skip
        output.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(output, json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
