"""The tree loop's own overhead where nothing is drafted: budget 0 (the shipped EAGLE-3 drafter with
`tree_budget="auto"`, the single candidate 0 and the free candidates off: every step verifies the root alone, as a
plain step does) against plain batched `generate`, at several batch sizes, on the packaged SmolLM2-135M-Instruct.

    python examples/experiments/batch_overhead.py --batch_sizes 1,4,16 --repeats 9 --dtype bfloat16 --output docs/results/batch-overhead

With `--drafting_ladder` the drafter keeps a candidate that drafts but never chooses it: the cost of plain steps
in a loop that queues the drafter's target features (what a drafter pays while "auto" decodes plainly).

Each repeat runs both, in alternating order (plain first, then the loop first). Reported per batch size: the median
over repeats of (plain seconds / loop seconds) - 1.0 means no overhead, and one call on a shared machine moves by
several percent - and, steadier, what each call spent outside the target's forwards (generate's set-up, and all the
Python and bookkeeping around every step: the loop's own overhead is the difference) per decoding step, with the
outputs' equality; then, exactly, the aten ops and host syncs per step outside the target's forward (one more
call of each under `generation.op_counter.count_ops`). Writes results.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from transformers_specblock import Eagle3DraftModel, load_packaged_model, load_prompts
from transformers_specblock.generation.op_counter import count_ops
from transformers_specblock.hub.provenance import describe_device


class ForwardTimer:
    """Wall seconds of each call of `module` (hooks; the first call of a `generate` is its prefill)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.seconds: list[float] = []
        module.register_forward_pre_hook(lambda *_: self.seconds.append(-time.perf_counter()))
        module.register_forward_hook(lambda *_: self.seconds.__setitem__(-1, self.seconds[-1] + time.perf_counter()))


def timed_call(target, inputs, settings, timer: ForwardTimer, **kwargs) -> tuple[torch.Tensor, float, float, int]:
    """One `generate` call: (output, its seconds, its seconds outside the target's forwards, decoding forwards)."""
    timer.seconds.clear()
    start = time.perf_counter()
    out = target.generate(**inputs, **settings, **kwargs)
    seconds = time.perf_counter() - start
    return out, seconds, seconds - sum(timer.seconds), len(timer.seconds) - 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch_sizes", default="1,16")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--output", default="out/batch-overhead")
    parser.add_argument("--drafting_ladder", action="store_true",
                        help="keep a drafting candidate (8) that the chooser never picks (min gain 1000): every plain "
                        "step then also queues the target features the drafter would read")  # fmt: skip
    args = parser.parse_args()

    target, tokenizer = load_packaged_model("smollm2-135m-instruct")
    target = target.to(getattr(torch, args.dtype))
    timer = ForwardTimer(target.model)
    # candidates (0,) and no free candidates: the loop never drafts - every step verifies the root alone (with
    # --drafting_ladder the candidate 8 is tried once, in the untimed first pair, and never chosen again)
    ladder = {"auto_budget_candidates": [0]}
    if args.drafting_ladder:
        ladder = {"auto_budget_candidates": [0, 8], "auto_budget_min_gain": 1000.0, "auto_budget_warmup": 0,
                  "auto_budget_explore_interval": 10**9}  # fmt: skip
    drafter = Eagle3DraftModel.from_pretrained(
        "eagle3-smollm2-135m-instruct", tree_budget="auto", prompt_lookup_num_tokens=0, ngram_cache_num_tokens=0,
        suffix_cache_num_tokens=0, suffix_local_num_tokens=0, **ladder,
    ).to(target.dtype)
    prompts = load_prompts("mt_bench", num_prompts=max(int(b) for b in args.batch_sizes.split(",")), tokenizer=tokenizer)
    tokenizer.padding_side = "left"
    results = {"settings": vars(args) | {"hardware": describe_device(target.device)}, "batch_sizes": {}}
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        inputs = tokenizer(prompts["text"][:batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
        settings = dict(do_sample=False, max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id)
        calls = {"plain": {}, "loop": {"assistant_model": drafter}}
        runs: dict[str, list[tuple[float, float, int]]] = {name: [] for name in calls}
        outputs = {}
        for repeat in tqdm(range(args.repeats + 1), desc=f"batch {batch_size}"):
            for name in list(calls)[:: 1 if repeat % 2 else -1]:  # alternating order
                outputs[name], *run = timed_call(target, inputs, settings, timer, **calls[name])
                if repeat:  # the first pair warms up (and times the target once for "auto")
                    runs[name].append(tuple(run))
        ratios = [p[0] / loop[0] for p, loop in zip(runs["plain"], runs["loop"])]
        outside_ms = {  # per decoded step: the median over repeats
            name: statistics.median(1000 * outside / steps for _, outside, steps in run) for name, run in runs.items()
        }
        results["batch_sizes"][batch_size] = {
            "median_speed_vs_plain": statistics.median(ratios), "ratios": ratios,
            "median_seconds": {name: statistics.median(s for s, _, _ in run) for name, run in runs.items()},
            "outside_target_forwards_ms_per_step": outside_ms,
            "loop_overhead_ms_per_step": outside_ms["loop"] - outside_ms["plain"],
            "identical": outputs["loop"].tolist() == outputs["plain"].tolist(),
        }  # fmt: skip
        row = results["batch_sizes"][batch_size]
        for name, kwargs in calls.items():  # exact counts: one more call each, untimed
            with count_ops(target) as counts:
                target.generate(**inputs, **settings, **kwargs)
            per_step = counts.per_iteration()
            row[f"{name}_ops_per_step"], row[f"{name}_syncs_per_step"] = per_step["loop_ops"], per_step["loop_syncs"]
        print(f"batch {batch_size}: loop at budget 0 runs {row['median_speed_vs_plain']:.3f}x plain (median of "
              f"ratios); outside the target's forwards {outside_ms['plain']:.2f} ms/step plain, "
              f"{outside_ms['loop']:.2f} loop; aten ops per step outside it {row['plain_ops_per_step']:.1f} plain, "
              f"{row['loop_ops_per_step']:.1f} loop; identical={row['identical']}")  # fmt: skip
    Path(args.output).mkdir(parents=True, exist_ok=True)
    Path(args.output, "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
