"""Online adaptation on a stream of prompts (`online_adaptation`): the shipped chat-trained drafters serve
code, then chat, a shuffled mix of both, and held-out ShareGPT (in domain), under each policy.

    OMP_NUM_THREADS=1 python examples/adaptation_stream.py --output_dir out/adaptation \
        --num_code 12 --num_chat 6 --num_sharegpt 8 --max_new_tokens 48

Another target takes its own drafters: `--target_model qwen2.5-coder-0.5b-instruct --dtype bfloat16
--specblock_model specblock-qwen2.5-coder-0.5b-instruct --eagle3_model eagle3-qwen2.5-coder-0.5b-instruct`.

A run is stream/drafter/policy, optionally with a label (`shift/specblock/off/repeat`: a second "off" run, the
A/A control of the timings): a freshly loaded drafter serves the stream's prompts one `generate` call each
(greedy, a fixed tree budget); the runs of one stream are interleaved prompt by prompt, so that the machine's slower
spells hit every policy alike. Every call is timed from the call to the return, so the update time (run inside the
call) is included. Per call: tau, tokens, seconds, the adaptation action, its time and signal, rollbacks, the
held-out check's verdicts (loaded head back, candidate head served), and whether the output equals plain `generate`
(one plain reference per prompt, also the throughput baseline). Writes `calls.jsonl` (resumable: finished runs are
skipped), `results.json`, `results.md` and `tau_along_stream.png`.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from transformers_specblock import DFlashDraftModel, Eagle3DraftModel, SpecBlockDraftModel
from transformers_specblock.commands.cli import parse_tree_budget
from transformers_specblock.hub.loading import load_model
from transformers_specblock.hub.prompts import load_prompts
from transformers_specblock.utils import import_pyplot

DRAFTERS = {
    "specblock": (SpecBlockDraftModel, "specblock-smollm2-135m-instruct"),
    "eagle3": (Eagle3DraftModel, "eagle3-smollm2-135m-instruct"),
    "dflash": (DFlashDraftModel, "dflash-smollm2-135m-instruct"),  # (refuses "head_only"; not in the default runs)
}
POLICIES = ("off", "always", "head_only", "full", "bandit")
DEFAULT_RUNS = (
    [f"shift/{drafter}/{policy}" for drafter in ("specblock", "eagle3") for policy in POLICIES]
    + ["mixed/specblock/off", "mixed/specblock/bandit"]
    + [f"sharegpt/{drafter}/{policy}" for drafter in ("specblock", "eagle3") for policy in ("off", "bandit")]
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--target_model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the target's and drafters'")
    for name, (_, shipped) in DRAFTERS.items():
        parser.add_argument(f"--{name}_model", default=shipped, help=f"the {name} drafter: a shipped name or a folder")
    parser.add_argument("--runs", default=",".join(DEFAULT_RUNS), help="comma-separated stream/drafter/policy")
    parser.add_argument("--num_code", type=int, default=12, help="HumanEval prompts opening the shift stream")
    parser.add_argument("--num_chat", type=int, default=6, help="MT-Bench prompts after them (round-robin categories)")
    parser.add_argument("--num_sharegpt", type=int, default=8, help="held-out ShareGPT prompts (in domain)")
    parser.add_argument("--max_new_tokens", type=int, default=48)
    parser.add_argument(
        "--tree_budget", type=parse_tree_budget, default=8, help='a fixed budget, or "auto" (the shipped setting)'
    )
    parser.add_argument("--seed", type=int, default=0, help="shuffles the mixed stream")
    return parser.parse_args()


def build_streams(tokenizer, args: argparse.Namespace) -> dict[str, list[dict]]:
    """shift: code then chat; mixed: the same prompts shuffled; sharegpt: held-out conversations."""
    code = [dict(row, domain="code") for row in load_prompts("humaneval", args.num_code, tokenizer)]
    by_category: dict[str, list[dict]] = {}
    for row in load_prompts("mt_bench", None, tokenizer):
        by_category.setdefault(row["category"], []).append(dict(row, domain="chat"))
    chat = [rows[i] for i in range(10) for rows in by_category.values() if i < len(rows)][: args.num_chat]
    mixed = code + chat
    random.Random(args.seed).shuffle(mixed)
    sharegpt = [dict(row, domain="sharegpt") for row in load_prompts("sharegpt", args.num_sharegpt, tokenizer)]
    return {"shift": code + chat, "mixed": mixed, "sharegpt": sharegpt}


def encode(tokenizer, row: dict):
    return tokenizer(row["text"], return_tensors="pt", add_special_tokens=False)


def plain_references(target, tokenizer, streams, max_new_tokens: int) -> dict[str, dict]:
    """One plain greedy output and timing per distinct prompt."""
    references = {}
    for row in (row for rows in streams.values() for row in rows):
        if row["id"] in references:
            continue
        inputs = encode(tokenizer, row)
        start = time.perf_counter()
        out = target.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
        seconds = time.perf_counter() - start
        new = out[0, inputs["input_ids"].shape[1] :]
        references[row["id"]] = {"tokens": new.tolist(), "seconds": seconds}
    return references


def load_drafter(drafter_name: str, policy: str, tokenizer, target, args):
    """A freshly loaded drafter under `policy`, warmed up untimed (the warm-up leaves its weights as loaded)."""
    cls, _ = DRAFTERS[drafter_name]
    path = getattr(args, f"{drafter_name}_model")
    drafter = cls.from_pretrained(path, online_adaptation=policy, tree_budget=args.tree_budget)
    with drafter.tree_settings(online_adaptation="off"):
        target.generate(**encode(tokenizer, {"text": "Hello"}), assistant_model=drafter, max_new_tokens=8)
    return drafter


def serve(target, tokenizer, stream: list[dict], runs: list[str], args, references) -> dict[str, list[dict]]:
    """The runs of one stream, interleaved: each prompt is served by every run's own drafter in turn, so a slower
    spell of the machine hits all policies alike. One row per run and call."""
    drafters = {run: load_drafter(*run.split("/")[1:3], tokenizer, target, args) for run in runs}
    rows: dict[str, list[dict]] = {run: [] for run in runs}
    for index, row in enumerate(stream):
        inputs = encode(tokenizer, row)
        for run, drafter in drafters.items():
            start, cpu_start = time.perf_counter(), time.process_time()
            out = target.generate(
                **inputs, assistant_model=drafter, do_sample=False, max_new_tokens=args.max_new_tokens
            )
            seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
            stats = drafter.last_stats
            new = out[0, inputs["input_ids"].shape[1] :].tolist()
            rows[run].append({
                "call": index, "prompt_id": row["id"], "domain": row["domain"], "new_tokens": len(new),
                "seconds": seconds, "cpu_seconds": cpu_seconds, "plain_seconds": references[row["id"]]["seconds"],
                "tau": stats.tau,
                "action": stats.adaptation.action, "update_s": stats.adaptation.update_time_s,
                "signal": stats.adaptation.signal, "signal_wrong": stats.adaptation.signal_wrong,
                "rolled_back": stats.adaptation.rolled_back, "restored_loaded": stats.adaptation.restored_loaded,
                "held_out_gain": stats.adaptation.held_out_gain, "candidate_gain": stats.adaptation.candidate_gain,
                "promoted": stats.adaptation.promoted,
                "identical": new == references[row["id"]]["tokens"],
            })  # fmt: skip
            print(f"  call {index:2d} {row['domain']:8s} {run:24s} tau {stats.tau:.2f} {len(new) / seconds:5.1f} "
                  f"tok/s {stats.adaptation.action:9s} update {stats.adaptation.update_time_s:.2f}s"
                  f"{' rolled back' if stats.adaptation.rolled_back else ''}"
                  f"{' loaded back' if stats.adaptation.restored_loaded else ''}"
                  f"{' candidate served' if stats.adaptation.promoted else ''}", flush=True)  # fmt: skip
    return rows


def summarise(rows: list[dict]) -> dict:
    """tau (all, first and last third of the stream), throughput with update time, update share, actions."""
    third = max(1, len(rows) // 3)
    tokens, seconds = sum(r["new_tokens"] for r in rows), sum(r["seconds"] for r in rows)
    plain = sum(r["plain_seconds"] for r in rows)
    actions: dict[str, int] = {}
    for r in rows:
        actions[r["action"]] = actions.get(r["action"], 0) + 1
    mean = lambda rs: sum(r["tau"] for r in rs) / len(rs) if rs else float("nan")  # noqa: E731
    code = [r for r in rows if r["domain"] == "code"]
    return {
        "calls": len(rows), "tau": mean(rows), "tau_first_third": mean(rows[:third]),
        "tau_last_third": mean(rows[-third:]), "tau_code_last_third": mean(code[-max(1, len(code) // 3) :] if code else []),
        "tau_chat": mean([r for r in rows if r["domain"] == "chat"]), "tokens_per_s": tokens / seconds,
        "tokens_per_cpu_s": tokens / sum(r["cpu_seconds"] for r in rows),
        "plain_tokens_per_s": tokens / plain, "update_share": sum(r["update_s"] for r in rows) / seconds,
        "actions": actions, "rollbacks": sum(r["rolled_back"] for r in rows),
        "restored_loaded": sum(r.get("restored_loaded", False) for r in rows),
        "promoted": sum(r.get("promoted", False) for r in rows),
        "identical": all(r["identical"] for r in rows),
    }  # fmt: skip


def paired_speedup(calls: list[dict], off_calls: list[dict]) -> float:
    """Throughput vs "off" without the wall clock's noise (one call's time varies by up to +-30% here, same tau):
    each of off's measured call times scaled by the verifications the run needed instead (off's tau over the
    run's: same tokens), plus the run's measured update time. The signal capture inside decoding is not in it."""
    estimated = sum(o["seconds"] * o["tau"] / r["tau"] + r["update_s"] for r, o in zip(calls, off_calls))
    return sum(o["seconds"] for o in off_calls) / estimated


def median_cpu_ratio(calls: list[dict], off_calls: list[dict]) -> float:
    """Median over calls of off's CPU time over the run's (the same tokens per call): one slow call cannot decide it."""
    ratios = sorted(o["cpu_seconds"] / r["cpu_seconds"] for r, o in zip(calls, off_calls))
    middle = len(ratios) // 2
    return ratios[middle] if len(ratios) % 2 else (ratios[middle - 1] + ratios[middle]) / 2


def write_report(out_dir: Path, results: dict[str, dict], settings: dict) -> None:
    (out_dir / "results.json").write_text(json.dumps({"settings": settings, "runs": results}, indent=1))
    lines = [
        "| stream | drafter | policy | tau | tau first third | tau last third | tau code, last third | tau chat | "
        "tokens/s (incl. updates) | vs off | vs off, CPU time | vs off, median per-call CPU time | vs off, paired estimate | "
        "update share | actions | candidate heads served | rollbacks / loaded head back | identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, run in results.items():
        stream, drafter, *policy = key.split("/")
        policy = "/".join(policy)
        s = run["summary"]
        off = results.get(f"{stream}/{drafter}/off", {}).get("summary")
        versus = f"{s['tokens_per_s'] / off['tokens_per_s']:.3f}" if off else "-"
        versus_cpu = f"{s['tokens_per_cpu_s'] / off['tokens_per_cpu_s']:.3f}" if off else "-"
        off_calls = results.get(f"{stream}/{drafter}/off", {}).get("calls")
        paired = f"{paired_speedup(run['calls'], off_calls):.3f}" if off_calls else "-"
        median = f"{median_cpu_ratio(run['calls'], off_calls):.3f}" if off_calls else "-"
        actions = ", ".join(f"{a} {n}" for a, n in sorted(s["actions"].items()))
        lines.append(
            f"| {stream} | {drafter} | {policy} | {s['tau']:.3f} | {s['tau_first_third']:.3f} | "
            f"{s['tau_last_third']:.3f} | {s['tau_code_last_third']:.3f} | {s['tau_chat']:.3f} | "
            f"{s['tokens_per_s']:.2f} | {versus} | {versus_cpu} | {median} | {paired} | {100 * s['update_share']:.1f}% | "
            f"{actions} | {s.get('promoted', 0)} | {s['rollbacks']} / {s['restored_loaded']} | "
            f"{'yes' if s['identical'] else 'NO'} |"
        )
    (out_dir / "results.md").write_text("\n".join(lines) + "\n")
    plot(out_dir / "tau_along_stream.png", results)


def plot(path: Path, results: dict[str, dict], window: int = 3) -> None:
    """tau per call along each stream (running mean over `window` calls), one line per drafter and policy."""
    plt = import_pyplot()
    streams = sorted({key.split("/")[0] for key in results}, key=["shift", "mixed", "sharegpt"].index)
    fig, axes = plt.subplots(1, len(streams), figsize=(5.5 * len(streams), 4), squeeze=False)
    for ax, stream in zip(axes[0], streams):
        for key, run in results.items():
            if not key.startswith(stream + "/"):
                continue
            taus = [r["tau"] for r in run["calls"]]
            smooth = [sum(taus[max(0, i - window + 1) : i + 1]) / len(taus[max(0, i - window + 1) : i + 1])
                      for i in range(len(taus))]  # fmt: skip
            style = "--" if key.split("/")[1] == "eagle3" else "-"
            ax.plot(range(len(taus)), smooth, style, label="/".join(key.split("/")[1:]))
        if stream == "shift":
            switch = next((r["call"] for r in results[next(k for k in results if k.startswith("shift/"))]["calls"]
                           if r["domain"] == "chat"), None)  # fmt: skip
            if switch is not None:
                ax.axvline(switch - 0.5, color="grey", lw=0.8)
                ax.text(switch - 0.3, ax.get_ylim()[1], "code -> chat", va="top", fontsize=8, color="grey")
        ax.set_title(f"{stream} stream")
        ax.set_xlabel("call")
        ax.set_ylabel(f"tau (running mean of {window} calls)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    target, tokenizer = load_model(args.target_model, device="cpu", dtype=args.dtype)
    streams = build_streams(tokenizer, args)
    references = plain_references(target, tokenizer, streams, args.max_new_tokens)
    log = out_dir / "calls.jsonl"
    done = {}
    if log.exists():  # resume: runs already written are kept
        for line in log.read_text().splitlines():
            record = json.loads(line)
            done[record["run"]] = record["calls"]
    runs = args.runs.split(",")
    for stream in dict.fromkeys(run.split("/")[0] for run in runs):
        todo = [run for run in runs if run.startswith(stream + "/") and run not in done]
        if todo:
            print(f"{stream}: {len(streams[stream])} calls x {len(todo)} runs, interleaved", flush=True)
            served = serve(target, tokenizer, streams[stream], todo, args, references)
            with log.open("a") as f:
                for run, calls in served.items():
                    f.write(json.dumps({"run": run, "calls": calls}) + "\n")
            done.update(served)
    results = {run: {"summary": summarise(done[run]), "calls": done[run]} for run in runs}
    settings = {k: v for k, v in vars(args).items() if k != "output_dir"} | {"torch_threads": torch.get_num_threads()}
    write_report(out_dir, results, settings)
    print((out_dir / "results.md").read_text())


if __name__ == "__main__":
    main()
