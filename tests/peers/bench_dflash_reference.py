"""Benchmark: z-lab's own DFlash chain loop (`dflash_generate`, dflash 0.1.0 in its venv) against our tree on the
SAME drafter (the shipped `dflash-smollm2-135m-instruct`, exported with `checkpoint_format="dflash"` and loaded by
their `DFlashDraftModel.from_pretrained`) and prompts.

    python tests/peers/bench_dflash_reference.py --dataset mt_bench --num_prompts 6 --max_new_tokens 64 \\
        --dtype float32 --out docs/results/bench/dflash-reference-chain-mt_bench

Each side runs plain greedy `generate` and its method interleaved per prompt in its own process on one thread (the
peer's in its venv: transformers 5.15.0; ours here); a speed-up is the method's tokens/s over that process's own
plain, and tree / chain is the per-prompt ratio of the two speed-ups (medians reported). `tokens/call` = new tokens per
target forward, prefill included (counted by a hook: exact). Every output is checked against plain greedy.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from transformers_specblock import DFlashDraftModel
from transformers_specblock.hub import load_packaged_model
from transformers_specblock.hub.assets import resolve_model_path
from transformers_specblock.hub.prompts import load_prompts

sys.path.insert(0, str(Path(__file__).parent))
import peer_envs  # noqa: E402

TARGET, DRAFTER = "smollm2-135m-instruct", "dflash-smollm2-135m-instruct"


def hardware() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())  # fmt: skip
    return {"cpu": model, "capability": torch.backends.cpu.get_cpu_capability(), "threads": 1,
            "torch": torch.__version__}  # fmt: skip


def timed(target, fn) -> tuple[torch.Tensor, float, int]:
    calls = []
    handle = target.register_forward_pre_hook(lambda module, inputs: calls.append(1))
    try:
        start = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - start, len(calls)
    finally:
        handle.remove()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="mt_bench")
    parser.add_argument("--num_prompts", type=int, default=6)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--budgets", default="8,auto", help="our tree budgets, comma-separated")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    reason = peer_envs.unavailable_reason(peer_envs.DEFAULT_ROOT, "dflash")
    if reason is not None:
        print(f"not run: {reason}")
        return 2
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    target, tokenizer = load_packaged_model(TARGET, dtype=dtype)
    target.eval()
    drafter = DFlashDraftModel.from_pretrained(DRAFTER, target=target)
    rows = load_prompts(args.dataset, args.num_prompts, tokenizer)
    prompts = [tokenizer(row["text"], add_special_tokens=False).input_ids for row in rows]
    stop = [target.generation_config.eos_token_id] if isinstance(target.generation_config.eos_token_id, int) else (
        list(target.generation_config.eos_token_id or []))  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        drafter.save_pretrained(Path(tmp) / "drafter", checkpoint_format="dflash")
        print(f"running z-lab's dflash_generate on {len(prompts)} prompts in its venv ...", flush=True)
        theirs = peer_envs.run_worker(
            peer_envs.DEFAULT_ROOT, "dflash", Path(__file__).parent / "workers" / "dflash_bench.py",
            {"target": resolve_model_path(TARGET), "drafter": str(Path(tmp) / "drafter"), "prompts": prompts,
             "max_new_tokens": args.max_new_tokens, "stop_token_ids": stop, "dtype": args.dtype},
        )  # fmt: skip
    budgets = [b if b == "auto" else int(b) for b in args.budgets.split(",")]
    results = []
    for prompt, peer in zip(tqdm(prompts, desc="our tree"), theirs["rows"]):
        ids = torch.tensor([prompt])
        row = {"peer": peer}
        methods = [("plain", None)] + [(f"tree@{b}", b) for b in budgets]
        for name, budget in methods:
            def run(budget=budget):
                with torch.inference_mode():
                    if budget is None:
                        return target.generate(ids, do_sample=False, max_new_tokens=args.max_new_tokens)
                    with drafter.tree_settings(tree_budget=budget):
                        return target.generate(ids, assistant_model=drafter, do_sample=False,
                                               max_new_tokens=args.max_new_tokens)  # fmt: skip
            out, seconds, calls = timed(target, run)
            row[name] = {"seconds": seconds, "target_calls": calls, "output": out[0, ids.shape[1]:].tolist()}
        results.append(row)

    def speed(entry) -> float:
        return len(entry["output"]) / entry["seconds"]

    summary = {}
    ours_plain = [r["plain"] for r in results]
    their_plain = [r["peer"]["plain"] for r in results]
    chain = [r["peer"]["reference_chain"] for r in results]
    columns = {"their plain": their_plain, "their chain (dflash_generate)": chain, "our plain": ours_plain}
    columns |= {f"our tree, budget {b}": [r[f"tree@{b}"] for r in results] for b in budgets}
    for name, entries in columns.items():
        plain = their_plain if name.startswith("their") else ours_plain
        summary[name] = {
            "tokens_per_s_median": statistics.median(speed(e) for e in entries),
            "speedup_median": statistics.median(speed(e) / speed(p) for e, p in zip(entries, plain)),
            "tokens_per_call": sum(len(e["output"]) for e in entries) / sum(e["target_calls"] for e in entries),
            "identical_to_plain": all(e["output"] == p["output"] for e, p in zip(entries, plain)),
        }
    for b in budgets:
        tree = columns[f"our tree, budget {b}"]
        quads = zip(tree, ours_plain, chain, their_plain)
        ratios = [(speed(t) / speed(op)) / (speed(c) / speed(tp)) for t, op, c, tp in quads]
        summary[f"our tree, budget {b}"]["over_their_chain_median"] = statistics.median(ratios)
    same_plain = all(a["output"] == b["output"] for a, b in zip(ours_plain, their_plain))
    report = {"dataset": args.dataset, "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "dtype": args.dtype, "target": TARGET, "drafter": DRAFTER, "block_size": theirs["block_size"],
              "peer": "dflash==0.1.0 (transformers 5.15.0, torch 2.13.0)", "hardware": hardware(),
              "plain_outputs_identical_across_venvs": same_plain, "summary": summary, "rows": results}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"{args.dataset}, {len(prompts)} prompts x {args.max_new_tokens} tokens, {args.dtype}, one thread, "
             f"{report['hardware']['cpu']}", "",
             "| method | tokens/s (median) | speed-up vs own plain | tokens/call | over their chain | = plain |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for name, s in summary.items():
        over = f"{s['over_their_chain_median']:.2f}x" if "over_their_chain_median" in s else "-"
        same = "yes" if s["identical_to_plain"] else "NO"
        lines.append(f"| {name} | {s['tokens_per_s_median']:.1f} | {s['speedup_median']:.2f} | "
                     f"{s['tokens_per_call']:.2f} | {over} | {same} |")  # fmt: skip
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
