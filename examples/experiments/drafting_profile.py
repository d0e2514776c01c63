"""Where a drafter's drafting time goes on this machine, and how much compiling its forwards could save at most.

Profiles eager drafting (SmolLM2-135M-Instruct, a shipped drafter, greedy, MT-Bench prompts, `torch.profiler`): per
iteration the drafting time (`last_stats`), the time inside the drafter forwards (the methods `compile_drafter`
compiles) and, of that, the matrix products by shape. `torch.compile` (inductor on a CPU) fuses the small ops
around the matrix products but calls the same GEMM kernels for them, so if it removed every other op of the
forwards, drafting would take (drafting - forwards + matrix products): `compile_bound` is eager over that.

    python examples/experiments/drafting_profile.py --drafter eagle3 --dtype float32 --output out/drafting-profile-eagle3.json
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import AutoModel

from transformers_specblock import load_packaged_model
from transformers_specblock.hub.prompts import load_prompts
from transformers_specblock.hub.provenance import describe_device
from transformers_specblock.hub.shipped import resolve_drafter_path

FORWARD_METHOD = {"eagle3": "draft_step", "specblock": "draft_blocks", "dflash": "forward"}  # see compiled_method
MATRIX_PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", choices=tuple(FORWARD_METHOD), default="eagle3")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--tree_budget", type=int, default=8)
    parser.add_argument("--num_prompts", type=int, default=2)
    parser.add_argument("--max_new_tokens", type=int, default=48)
    parser.add_argument("--output", default="out/drafting-profile.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    target, tokenizer = load_packaged_model("smollm2-135m-instruct")
    target = target.to(dtype).eval()
    drafter = AutoModel.from_pretrained(resolve_drafter_path(f"{args.drafter}-smollm2-135m-instruct"), dtype=dtype)
    drafter.eval().bind_target(target)
    method = getattr(drafter, FORWARD_METHOD[args.drafter])

    def marked(*inputs, **kwargs):
        with record_function("drafter_forward"):
            return method(*inputs, **kwargs)

    setattr(drafter, FORWARD_METHOD[args.drafter], marked)  # eager: the generator calls the instance's attribute
    prompts = load_prompts("mt_bench", tokenizer=tokenizer)

    def generate(index: int, new_tokens: int) -> None:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompts[index]["prompt"]}], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
        inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        target.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, assistant_model=drafter)

    with torch.no_grad(), drafter.tree_settings(tree_budget=args.tree_budget):
        generate(0, 16)  # warm-up
        iterations, drafting_s = 0, 0.0
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for index in range(1, 1 + args.num_prompts):
                generate(index, args.max_new_tokens)
                iterations += drafter.last_stats.iterations
                drafting_s += drafter.last_stats.drafter_time_s
    events = prof.events()
    spans = [(e.time_range.start, e.time_range.end) for e in events if e.name == "drafter_forward"]
    forward_us = sum(end - start for start, end in spans)
    by_shape: collections.Counter[str] = collections.Counter()
    for e in events:
        if e.name in MATRIX_PRODUCTS and any(a <= e.time_range.start and e.time_range.end <= b for a, b in spans):
            by_shape[f"{e.name} {[tuple(s) for s in e.input_shapes if s]}"] += e.self_cpu_time_total
    drafting_ms, forward_ms = drafting_s * 1e3 / iterations, forward_us / 1e3 / iterations
    products_ms = sum(by_shape.values()) / 1e3 / iterations
    result = {
        "settings": vars(args), "hardware": describe_device("cpu"), "iterations": iterations,
        "drafter_forwards": len(spans), "drafting_ms_per_iteration": round(drafting_ms, 2),
        "forwards_ms_per_iteration": round(forward_ms, 2), "matrix_products_ms_per_iteration": round(products_ms, 2),
        "matrix_product_share_of_forwards": round(products_ms / forward_ms, 3),
        "compile_bound": round(drafting_ms / (drafting_ms - forward_ms + products_ms), 3),
        "matrix_products_by_shape_ms_per_iteration": {
            shape: round(us / 1e3 / iterations, 2) for shape, us in by_shape.most_common(8)
        },
    }  # fmt: skip
    print(json.dumps(result, indent=1))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
