"""Drafting milliseconds per iteration, eager against `compile_drafter=True`, on SmolLM2-135M-Instruct with a shipped
drafter (greedy, MT-Bench prompts; eager and compiled interleaved per prompt, best of two runs each), the compile
and warm-up time apart, and whether the outputs are identical.

    python examples/experiments/compiled_drafting.py --drafter eagle3 --dtype float32 --num_prompts 2 --output out/compile.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModel

from transformers_specblock import load_packaged_model
from transformers_specblock.hub.prompts import load_prompts
from transformers_specblock.hub.provenance import describe_device
from transformers_specblock.hub.shipped import resolve_drafter_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", choices=("specblock", "eagle3", "dflash"), default="eagle3")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--tree_budget", type=int, default=8)
    parser.add_argument("--num_prompts", type=int, default=2)
    parser.add_argument("--max_new_tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", default="out/compiled-drafting.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    target, tokenizer = load_packaged_model("smollm2-135m-instruct")
    target = target.to(dtype).eval()
    drafter = AutoModel.from_pretrained(resolve_drafter_path(f"{args.drafter}-smollm2-135m-instruct"), dtype=dtype)
    drafter.eval().bind_target(target)
    prompts = load_prompts("mt_bench", tokenizer=tokenizer)

    def encode(index: int):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompts[index]["prompt"]}], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
        return tokenizer(text, return_tensors="pt", add_special_tokens=False)

    def run(index: int, compiled: bool, new_tokens: int) -> tuple[float, list[int]]:
        with torch.no_grad(), drafter.tree_settings(compile_drafter=compiled, tree_budget=args.tree_budget):
            out = target.generate(**encode(index), max_new_tokens=new_tokens, do_sample=False, assistant_model=drafter)
        stats = drafter.last_stats
        return stats.drafter_time_s / stats.iterations * 1e3, out[0].tolist()

    start = time.perf_counter()
    run(0, True, 32)  # compiles (the prompt pass and the drafting shapes), then warms up
    run(1, True, 32)
    compile_s = time.perf_counter() - start
    rows = []
    for index in range(2, 2 + args.num_prompts):
        runs = {False: [], True: []}
        for compiled in (False, True, False, True):
            runs[compiled].append(run(index, compiled, args.max_new_tokens))
        eager, fast = min(ms for ms, _ in runs[False]), min(ms for ms, _ in runs[True])
        rows.append({"prompt": index, "eager_ms": eager, "compiled_ms": fast, "ratio": eager / fast,
                     "identical": runs[False][0][1] == runs[True][0][1]})  # fmt: skip
        print(rows[-1], flush=True)
    payload = {
        "settings": vars(args),
        "hardware": describe_device(target.device),
        "compile_and_warmup_s": compile_s,
        "median_ratio": statistics.median(r["ratio"] for r in rows),
        "rows": rows,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(payload, indent=2))
    print(json.dumps({k: payload[k] for k in ("compile_and_warmup_s", "median_ratio")}))


if __name__ == "__main__":
    main()
