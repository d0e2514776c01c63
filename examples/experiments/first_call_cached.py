"""First calls of fresh drafter objects in a process whose "auto" cache is filled, against plain `generate`.

    python examples/experiments/first_call_cached.py --drafters specblock,eagle3 --dtype float32 \
        --num_prompts 12 --output out/first-call/cached.json

The packaged SmolLM2-135M-Instruct and the shipped drafters (cast to the target's dtype when loaded). First the cache
is filled: `--fill_prompts` calls of one drafter object per kind on other MT-Bench prompts (what an earlier process
would have left). Then every measured prompt gets a fresh drafter object per kind (its first call, restoring the
cached chooser), timed interleaved with plain `generate` in a rotating order. CPU time of this process is the
headline (one thread: what the call computed, untouched by other processes' load); wall time is kept beside it.
Exact counts per call: the drafter's forwards and the target's work in plain steps per committed token.
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


def load(kind: str, dtype: torch.dtype):
    """A fresh object of the shipped `kind` drafter in `dtype`."""
    return AutoModel.from_pretrained(resolve_drafter_path(f"{kind}-smollm2-135m-instruct"), dtype=dtype).eval()


def timed(target, inputs, drafter, max_new_tokens: int) -> tuple[float, float, list[int]]:
    """(CPU seconds, wall seconds, output ids) of one greedy `generate` call."""
    cpu, wall = time.process_time(), time.perf_counter()
    out = target.generate(**inputs, assistant_model=drafter, do_sample=False, max_new_tokens=max_new_tokens)
    return time.process_time() - cpu, time.perf_counter() - wall, out[0].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafters", default="specblock,eagle3")
    parser.add_argument("--num_prompts", type=int, default=12)
    parser.add_argument("--fill_prompts", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--output", default="out/first-call/cached.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    target, tokenizer = load_packaged_model("smollm2-135m-instruct", dtype=dtype)
    prompts = load_prompts("mt_bench", num_prompts=args.num_prompts + args.fill_prompts, tokenizer=tokenizer)
    prompts = [prompts[i] for i in range(len(prompts))]
    encode = lambda row: tokenizer(row["text"], return_tensors="pt", add_special_tokens=False)  # noqa: E731
    kinds = args.drafters.split(",")
    for kind in kinds:  # what an earlier process leaves in the cache: cost curves and the chooser's learnt state
        drafter = load(kind, dtype)
        for row in tqdm(prompts[args.num_prompts :], desc=f"filling the cache ({kind})"):
            target.generate(**encode(row), assistant_model=drafter, do_sample=False, max_new_tokens=args.max_new_tokens)
    calls: dict[str, dict[str, list[float]]] = {name: {} for name in ["plain", *kinds]}
    for index, row in enumerate(tqdm(prompts[: args.num_prompts], desc="first calls")):
        inputs = encode(row)
        order = ["plain", *kinds]
        order = order[index % len(order) :] + order[: index % len(order)]  # rotate the order per prompt
        outputs = {}
        for name in order:
            drafter = load(name, dtype) if name != "plain" else None  # fresh: its first call
            cpu, wall, outputs[name] = timed(target, inputs, drafter, args.max_new_tokens)
            record = calls[name]
            record.setdefault("cpu_s", []).append(cpu)
            record.setdefault("wall_s", []).append(wall)
            if drafter is not None:
                stats, chooser = drafter.last_stats, drafter.serving_state().auto_budget
                steps = sum(chooser.cost(n) / chooser.cost(0) for n in stats.nodes_per_iteration)
                record.setdefault("drafter_forwards", []).append(stats.drafter_forwards)
                record.setdefault("plain_steps_per_token", []).append(steps / stats.new_tokens)
                record.setdefault("tau", []).append(stats.tau)
        if args.dtype == "float32":
            assert all(out == outputs["plain"] for out in outputs.values()), "left plain greedy"
    plain = calls["plain"]
    summary = {}
    for kind in kinds:
        record = calls[kind]
        summary[kind] = {
            f"{clock}_{stat}": fn([p / s for p, s in zip(plain[f"{clock}_s"], record[f"{clock}_s"])])
            for clock in ("cpu", "wall") for stat, fn in (("median", statistics.median), ("min", min))
        }  # fmt: skip
        summary[kind]["cpu_aggregate"] = sum(plain["cpu_s"]) / sum(record["cpu_s"])
        summary[kind]["drafter_forwards_mean"] = statistics.mean(record["drafter_forwards"])
        summary[kind]["plain_steps_per_token"] = statistics.mean(record["plain_steps_per_token"])
        print(kind, {k: round(v, 3) for k, v in summary[kind].items()})
    payload = {"settings": vars(args), "hardware": describe_device(target.device), "summary": summary, "calls": calls}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
