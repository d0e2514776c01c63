"""Demo: tree speculative decoding on a packaged target, inside `generate`, next to plain decoding.

Runs on this host's fast dtype (bfloat16 where the CPU multiplies it natively - AVX512-BF16 or AMX - or on a GPU,
else float32; `--dtype` overrides), on three kinds of prompt: code to complete, a chat question, and a second turn
that quotes the first answer. Four ways to decode each: plain `generate`, the weightless lookup tree, the shipped
SpecBlock drafter and the shipped EAGLE-3 drafter of the target, both as shipped (`tree_budget="auto"` with the free
candidates); a target without shipped drafters runs plain and the lookup tree.
Prints tokens/s, speed-up over plain, tau (tokens committed per target forward) and whether the output is plain
greedy's, says where speculation does not pay on this host, and saves the table (JSON) and a figure.

    python examples/demo.py                       # SmolLM2-135M-Instruct, about 3 minutes on 2 CPU cores
    python examples/demo.py --target_model qwen2.5-coder-0.5b-instruct      # after `make qwen-models`
    python examples/demo.py --dtype float32 --max_new_tokens 64 --output_dir out/demo-fp32
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from transformers_specblock import Eagle3DraftModel, LookupTreeModel, SpecBlockDraftModel, load_model, load_prompts
from transformers_specblock.commands.cli import default_drafter_name
from transformers_specblock.commands.exactness import first_divergence, float32_copy, is_16bit
from transformers_specblock.hub.shipped import SHIPPED_DRAFTERS

TARGETS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct")
DRAFTERS = {"SpecBlock": (SpecBlockDraftModel, "specblock"), "EAGLE-3": (Eagle3DraftModel, "eagle3")}
METHODS = ("plain", "lookup tree", *DRAFTERS)


def cpu_flags() -> str:
    """The CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def fast_dtype(device: str, flags: str | None = None) -> tuple[str, str]:
    """The dtype this host decodes fastest in, and why (``flags``: the CPU's, read from /proc/cpuinfo by default)."""
    if device.startswith("cuda"):
        return "bfloat16", "a GPU"
    flags = cpu_flags() if flags is None else flags
    native = sorted(set(flags.split()) & {"avx512_bf16", "amx_bf16"})
    if native:
        return "bfloat16", f"this CPU multiplies bfloat16 natively: {', '.join(native)}"
    return "float32", "this CPU has no native bfloat16 matmul (no AVX512-BF16 or AMX)"


def build_prompts(tokenizer, plain_answer) -> list[tuple[str, torch.Tensor]]:
    """(kind, input_ids) for the three prompt kinds; the second turn quotes plain greedy's answer to the first."""
    code = load_prompts("humaneval", num_prompts=1)[0]["prompt"]  # a function to complete, as raw text
    question = next(row["prompt"] for row in load_prompts("mt_bench") if row["category"] == "stem")
    chat = [{"role": "user", "content": question}]

    def templated(messages: list[dict]) -> torch.Tensor:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)["input_ids"]  # fmt: skip

    first = templated(chat)
    answer = plain_answer(first)
    quote = answer.strip().split("\n")[0][:300]
    second = chat + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": f'You wrote: "{quote}" Rewrite your whole answer for a ten-year-old.'},
    ]
    return [
        ("code", tokenizer(code, return_tensors="pt")["input_ids"]),
        ("chat", first),
        ("second turn", templated(second)),
    ]


def timed_generate(target, input_ids: torch.Tensor, assistant, max_new_tokens: int) -> tuple[list[int], float]:
    """New tokens of one greedy call and its wall time (synchronised on a GPU)."""
    input_ids = input_ids.to(target.device)
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = target.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), assistant_model=assistant,
                          do_sample=False, max_new_tokens=max_new_tokens)  # fmt: skip
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    return out[0, input_ids.shape[1] :].tolist(), time.perf_counter() - start


def identical(float32_target, input_ids: torch.Tensor, reference: list[int], tokens: list[int]) -> str:
    """'yes', or where the output left plain greedy and whether that was a near-tie of the target's logits."""
    if tokens == reference:
        return "yes"
    if float32_target is None:
        return "NO"  # float32 must be identical: report it plainly
    divergence = first_divergence(float32_target, input_ids, reference, tokens)
    kind = "near-tie" if divergence.is_near_tie() else "NOT a near-tie"
    return f"no: {kind} at token {divergence.position} (float32 gap {divergence.fp32_gap:.2f})"


def run(args: argparse.Namespace) -> dict:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype, reason = fast_dtype(device)
    if args.dtype:
        dtype, reason = args.dtype, "--dtype"
    print(f"dtype: {dtype} ({reason}); device: {device}; --dtype float32 or bfloat16 to override")
    torch.manual_seed(0)
    target, tokenizer = load_model(args.target_model, device=device, dtype=dtype)
    assistants = {"plain": None, "lookup tree": LookupTreeModel.from_target(target)}
    for name, (cls, kind) in DRAFTERS.items():  # one object per method: its suffix cache and "auto" state are its own
        shipped = default_drafter_name(kind, args.target_model)
        if shipped not in SHIPPED_DRAFTERS:
            print(f"{name}: no drafter is shipped for {args.target_model} ({shipped}); skipped")
            continue
        assistants[name] = cls.from_pretrained(shipped).eval()
    reference = float32_copy(target) if is_16bit(target) else None

    def plain_answer(input_ids: torch.Tensor) -> str:
        return tokenizer.decode(timed_generate(target, input_ids, None, args.max_new_tokens)[0],
                                skip_special_tokens=True)  # fmt: skip

    prompts = build_prompts(tokenizer, plain_answer)
    start = time.perf_counter()  # "auto" times the target once per model and device; keep that out of the table
    warm_up = tokenizer("Hello, how are you today?", return_tensors="pt")["input_ids"]  # not one of the prompts
    for assistant in assistants.values():
        timed_generate(target, warm_up, assistant, 16)
    seconds = time.perf_counter() - start
    print(f'warm-up (times the target\'s cost per tree size for tree_budget="auto"): {seconds:.0f} s')
    rows = []
    for kind, input_ids in prompts:
        plain_tokens = None
        for method, assistant in assistants.items():
            # one timed call per drafter: a repeat would find this very answer in its suffix cache and copy it
            tokens, seconds = timed_generate(target, input_ids, assistant, args.max_new_tokens)
            plain_tokens = tokens if method == "plain" else plain_tokens
            rows.append({
                "prompt": kind, "method": method, "new_tokens": len(tokens), "seconds": seconds,
                "tau": None if assistant is None else assistant.last_stats.tau,
                "identical": identical(reference, input_ids, plain_tokens, tokens),
            })  # fmt: skip
        plain_row = next(row for row in rows if row["prompt"] == kind and row["method"] == "plain")
        again = timed_generate(target, input_ids, None, args.max_new_tokens)[1]
        plain_row["seconds"] = min(plain_row["seconds"], again)
        print(f"  {kind}: done (plain timed before and after the others, the faster counts)")
    for row in rows:
        row["tokens_per_s"] = row["new_tokens"] / row["seconds"]
    plain = {row["prompt"]: row["tokens_per_s"] for row in rows if row["method"] == "plain"}
    for row in rows:  # tokens per second: a 16-bit output that left plain greedy may stop at another length
        row["speedup"] = row["tokens_per_s"] / plain[row["prompt"]]
    return {"target_model": args.target_model, "dtype": dtype, "device": device, "max_new_tokens": args.max_new_tokens,
            "rows": rows}


def print_table(result: dict) -> None:
    print(f"\n| prompt | method | tokens/s | speed-up | tau | identical to plain |\n|---|---|---|---|---|---|")
    for row in result["rows"]:
        tau = "-" if row["tau"] is None else f"{row['tau']:.2f}"
        print(f"| {row['prompt']} | {row['method']} | {row['tokens_per_s']:.1f} | {row['speedup']:.2f}x | {tau} | "
              f"{row['identical']} |")  # fmt: skip
    losses = [r for r in result["rows"] if r["method"] != "plain" and r["speedup"] < 1.0]
    if not losses:
        print(f"\nOn this host in {result['dtype']} every method ran faster than plain decoding on every prompt.")
        return
    print(f"\nWhere speculation does not pay on this host ({result['dtype']}):")
    for row in losses:
        print(f"  {row['method']} on the {row['prompt']} prompt: {row['speedup']:.2f}x plain (tau {row['tau']:.2f})")
    print("  A verified tree costs the target more than a plain step, so it pays only where enough of it is accepted;"
          " \"auto\" drafts less where it measures a loss, and a cost under about 5% is the loop's own overhead.")


def plot(result: dict, path: Path) -> Path | None:
    """Speed-up over plain per prompt kind and method, as a bar chart (None without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'transformers-specblock[plot]'): no figure")
        return None
    kinds = list(dict.fromkeys(row["prompt"] for row in result["rows"]))
    methods = [m for m in METHODS if m != "plain" and any(row["method"] == m for row in result["rows"])]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        speedup = {r["prompt"]: r["speedup"] for r in result["rows"] if r["method"] == method}
        values = [speedup[k] for k in kinds]
        ax.bar([k + i * width for k in range(len(kinds))], values, width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([k + width * (len(methods) - 1) / 2 for k in range(len(kinds))], kinds)
    ax.set_ylabel("speed-up over plain generate")
    ax.set_title(f"{result['target_model']}, {result['dtype']} on {result['device']}, greedy")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target_model", choices=TARGETS, default=TARGETS[0], help="a packaged target")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="default: this host's fast dtype")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when a GPU is visible)")
    parser.add_argument("--max_new_tokens", type=int, default=96)
    parser.add_argument("--output_dir", default="out/demo")
    args = parser.parse_args()
    result = run(args)
    print_table(result)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tmp = output_dir / "demo.json.tmp"
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(output_dir / "demo.json")
    figure = plot(result, output_dir / "demo.png")
    print(f"\ntable: {output_dir / 'demo.json'}" + (f"\nfigure: {figure}" if figure else ""))


if __name__ == "__main__":
    main()
