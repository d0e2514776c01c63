"""A/B: a drafter's first `generate` call under `tree_budget="auto"`, its warm-up at the largest candidate (the code
before `auto_budget_warmup_cost`) against its warm-up at the largest tree that costs at most two plain steps (the
default), for the shipped drafters as shipped, on the packaged SmolLM2-135M-Instruct.

    python examples/experiments/first_call_ab.py --dtype float32 --num_prompts 6 --output out/first-call/float32.json

Every prompt gets fresh drafter objects for both arms (a first call: the chooser's warm-up trees are in it), timed
interleaved with plain `generate` in a rotating order; the target's cost curve is measured once before any timing
(as `make demo` does). Reports per arm the median of per-prompt speed-ups over plain and, exactly, the target's
work of the call in plain steps (each verified tree's cost-curve ratio, summed) per committed token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModel

from transformers_specblock import load_packaged_model, load_prompts
from transformers_specblock.hub.provenance import describe_device
from transformers_specblock.hub.shipped import resolve_drafter_path

ARMS = {"warm-up at the largest candidate": float("inf"), "warm-up at <= 2 plain steps": 2.0}


def load(kind: str, target, warmup_cost: float = 2.0):
    """A fresh object of the shipped `kind` drafter, in the target's dtype."""
    path = resolve_drafter_path(f"{kind}-smollm2-135m-instruct")
    return AutoModel.from_pretrained(path, auto_budget_warmup_cost=warmup_cost).to(target.dtype).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafters", default="specblock,eagle3,dflash")
    parser.add_argument("--dataset", default="mt_bench")
    parser.add_argument("--num_prompts", type=int, default=6)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--output", default="out/first-call/results.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, tokenizer = load_packaged_model("smollm2-135m-instruct", dtype=getattr(torch, args.dtype))
    prompts = load_prompts(args.dataset, num_prompts=args.num_prompts, tokenizer=tokenizer)
    drafters = args.drafters.split(",")
    for kind in drafters:  # the target's cost curve for each drafter's ladder is timed once, before any timing
        target.generate(**tokenizer("Hello", return_tensors="pt"), assistant_model=load(kind, target), max_new_tokens=2)
    seconds: dict[str, list[float]] = {"plain": []}
    work: dict[str, list[float]] = {}
    for index, row in enumerate(tqdm(prompts, desc="prompts")):
        inputs = tokenizer(row["text"], return_tensors="pt", add_special_tokens=False)
        calls = [("plain", None, None)] + [(f"{d}: {arm}", d, cost) for d in drafters for arm, cost in ARMS.items()]
        calls = calls[index % len(calls):] + calls[: index % len(calls)]  # rotate the order per prompt
        reference = None
        outputs = {}
        for name, kind, warmup_cost in calls:
            drafter = load(kind, target, warmup_cost) if kind is not None else None  # fresh: its first call
            start = time.perf_counter()
            out = target.generate(**inputs, assistant_model=drafter, do_sample=False,
                                  max_new_tokens=args.max_new_tokens)  # fmt: skip
            seconds.setdefault(name, []).append(time.perf_counter() - start)
            outputs[name] = out.tolist()
            if drafter is not None:
                stats, chooser = drafter.last_stats, drafter.serving_state().auto_budget
                steps = sum(chooser.cost(n) / chooser.cost(0) for n in stats.nodes_per_iteration)
                work.setdefault(name, []).append(steps / stats.new_tokens)
            else:
                reference = out.tolist()
        assert all(o == reference for o in outputs.values()) or args.dtype != "float32", "left plain greedy"
    summary = {
        name: {"median_speedup": statistics.median(p / s for p, s in zip(seconds["plain"], secs)),
               "speedups": [p / s for p, s in zip(seconds["plain"], secs)],
               "plain_steps_per_token": statistics.mean(work[name])}
        for name, secs in seconds.items() if name != "plain"
    }  # fmt: skip
    for name, row in summary.items():
        print(f"{name:48s} median {row['median_speedup']:.2f}x  target work {row['plain_steps_per_token']:.2f} "
              f"plain steps per token")  # fmt: skip
    payload = {"settings": vars(args), "hardware": describe_device(target.device), "results": summary,
               "seconds": seconds}  # fmt: skip
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
