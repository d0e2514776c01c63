"""What verifying a tree costs the target on this machine: one forward over each row's root plus n drafted nodes, as
a multiple of a plain step (n = 0), per dtype and batch size (`generation.target_cost.measure_target_cost`, the curve
`tree_budget="auto"` weighs trees by).

    python examples/target_cost_curve.py --output docs/results/target-cost/amd-epyc.json
    (--max_relative_cost inf times every size; the default stops once a size costs 4 plain steps, as "auto" does)

Where a row's extra nodes are nearly free (a GPU, or a CPU whose matrix units idle at one token per row) trees pay
at every batch size; where each extra verified token costs compute (a CPU once the matmuls are compute-bound), the
batch's rows share that bill and a tree must commit more tokens per row to pay.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from transformers_specblock import load_packaged_model
from transformers_specblock.generation.target_cost import BATCH_CONTEXT, MAX_RELATIVE_COST, measure_target_cost
from transformers_specblock.hub.provenance import describe_device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target_model", default="smollm2-135m-instruct")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--batch_sizes", default="1,4,16")
    parser.add_argument("--sizes", default="0,1,2,3,4,6,8,16,32", help="drafted nodes per row (0 = a plain step)")
    parser.add_argument("--repeats", type=int, default=5, help="timed forwards per size (the fastest is kept)")
    parser.add_argument("--max_relative_cost", type=float, default=MAX_RELATIVE_COST,
                        help="larger trees are not timed once one costs this many plain steps (inf: time every size)")
    parser.add_argument("--output", default="out/target-cost/curve.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = [int(s) for s in args.sizes.split(",")]
    curves = {}
    for dtype in args.dtypes.split(","):
        target, _ = load_packaged_model(args.target_model, dtype=getattr(torch, dtype))
        for batch_size in (int(b) for b in args.batch_sizes.split(",")):
            started = time.perf_counter()
            cost = measure_target_cost(target, sizes, BATCH_CONTEXT, repeats=args.repeats, batch_size=batch_size,
                                       max_relative_cost=args.max_relative_cost)  # fmt: skip
            seconds, step = time.perf_counter() - started, cost.seconds[0]
            curves[f"{dtype} B={batch_size}"] = {"plain_step_ms": step * 1e3, "timing_seconds": seconds,
                                                 "timed_sizes": cost.sizes,  # the rest extrapolated
                                                 "relative": {n: cost(n) / step for n in sizes}}  # fmt: skip
            print(f"{dtype:9s} B={batch_size:<3d} step {step * 1e3:6.1f} ms  "
                  + "  ".join(f"{n}:{s / step:.2f}" for n, s in zip(cost.sizes, cost.seconds)), flush=True)  # fmt: skip
        hardware = describe_device(target.device)
    payload = {"settings": vars(args) | {"context_per_row": BATCH_CONTEXT, "threads": 1}, "hardware": hardware,
               "curves": curves}  # fmt: skip
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
