"""Streams of requests served in order by one drafter object each: does a suffix cache of everything
served pay, against plain `generate`, transformers' prompt lookup, today's lookup tree and SuffixDecoding itself?

    python examples/suffix_streams.py --output_dir out/suffix-streams --num_prompts 6 --max_new_tokens 96
    bash examples/suffix_streams_setup.sh   # optional: builds SuffixDecoding's C++ core for --peer_path

Streams: code (HumanEval in order), chat (MT-Bench turn 1, then turn 2 with the turn-1 answer in the chat), agentic
(one fixed system prompt and instruction over HumanEval functions) and ShareGPT (held out, little repetition). Each
method gets a fresh drafter object per stream; the methods are interleaved prompt by prompt, so slower spells of
the machine hit all alike. Greedy, so every method's output must equal plain `generate` (checked). Per call:
tokens, seconds and target forwards (counted by a hook: tokens per target forward is exact, the speed is not on a
shared CPU). The peer: arctic-inference's `SuffixDecodingCache` (global cache of earlier responses, per-request
prompt tree), its `speculate(..., use_tree_spec=True)` drafts verified in this package's tree loop, capped at the
largest budget of the "auto" ladder (it verifies every draft it makes, sized by its match length). Writes `calls.jsonl`, `results.json`, `results.md` and `streams.png`.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import tracemalloc
import weakref
from pathlib import Path

import torch
from tqdm import tqdm

from transformers_specblock import Eagle3DraftModel, LookupTreeModel, SpecBlockDraftModel
from transformers_specblock.generation.candidate_generators import CANDIDATE_GENERATOR_MAPPING
from transformers_specblock.generation.candidate_generators.lookup_tree import LookupTreeCandidateGenerator
from transformers_specblock.generation.suffix_cache import SuffixStore, suffix_cache_for
from transformers_specblock.generation.suffix_index import SuffixAutomaton
from transformers_specblock.generation.tree import DraftTree
from transformers_specblock.hub.loading import load_model
from transformers_specblock.hub.prompts import _package_file, load_prompts, load_sharegpt_conversations
from transformers_specblock.hub.provenance import describe_hardware
from transformers_specblock.models.lookup_tree import LookupTreeConfig
from transformers_specblock.utils import import_pyplot

TODAY = dict(suffix_cache_num_tokens=0, suffix_local_num_tokens=0)  # the lookup tree's sources before the suffix cache
SUFFIX = dict(suffix_cache_num_tokens=32)  # the shipped default on top of prompt lookup and the n-gram cache
FREE = dict(prompt_lookup_num_tokens=10, ngram_cache_num_tokens=8, **SUFFIX)
SUFFIX_ONLY = dict(prompt_lookup_num_tokens=0, ngram_cache_num_tokens=0, suffix_cache_num_tokens=32,
                   suffix_local_num_tokens=32)  # the suffix cache with local matching in place of the lookups
METHODS = ("plain", "hf_prompt_lookup", "lookup_tree", "lookup_tree+suffix", "suffix_only", "suffix_decoding",
           "specblock+suffix", "eagle3+suffix")  # fmt: skip
AGENT_SYSTEM = (
    "You are a careful Python reviewer working through a queue of functions. For each function you receive, reply "
    "with the function's docstring rewritten in Google style (Args, Returns, Raises), then three pytest tests for "
    "it. Use the same layout for every function."
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--target_model", default="smollm2-135m-instruct")
    parser.add_argument("--streams", default="code,chat,agentic,sharegpt")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--num_prompts", type=int, default=6, help="requests per stream (chat: turns)")
    parser.add_argument("--max_new_tokens", type=int, default=96)
    parser.add_argument("--budget_candidates", default="0,2,4,8,16,24,32", help='the "auto" budget ladder')
    parser.add_argument("--peer_path", default="/work/venvs/arctic-src/arctic_inference-0.3.0",
                        help="a folder holding the built arctic_inference package (examples/suffix_streams_setup.sh)")  # fmt: skip
    parser.add_argument("--fixed_budget", type=int, default=0,
                        help="every tree method at this fixed budget instead of auto (a tau comparison)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="bfloat16 where the host has native bfloat16 (AVX512-BF16 / AMX)")
    parser.add_argument("--store_memory", type=int, default=0,
                        help="instead: fill stores bounded at 16384 and 65536 tokens with this many ShareGPT "
                             "conversations (600 tokens each at most) and measure their memory (tracemalloc)")  # fmt: skip
    return parser.parse_args()


# ------------------------------------------------------------------------------------------------- streams
def _chat(tokenizer, turns: list[dict]) -> str:
    return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)


def build_stream(name: str, tokenizer, count: int) -> list[dict]:
    """Requests in order: {"text"} or, for chat turn 2, {"turns"} whose assistant turn is the previous answer."""
    if name == "code":
        return [{"text": row["text"], "id": row["id"]} for row in load_prompts("humaneval", count, tokenizer)]
    if name == "sharegpt":
        return [{"text": row["text"], "id": row["id"]} for row in load_prompts("sharegpt", count, tokenizer)]
    if name == "agentic":
        rows = load_prompts("humaneval", count, tokenizer)
        return [
            {"id": row["id"], "text": _chat(tokenizer, [
                {"role": "system", "content": AGENT_SYSTEM},
                {"role": "user", "content": f"Next function:\n```python\n{row['prompt']}```"},
            ])}  # fmt: skip
            for row in rows
        ]
    if name == "chat":
        with _package_file("mt_bench").open(encoding="utf-8") as handle:
            questions = [json.loads(line) for line in handle if line.strip()][: (count + 1) // 2]
        out = []
        for q in questions:
            out.append({"id": f"{q['question_id']}/1", "turns": [{"role": "user", "content": q["turns"][0]}]})
            out.append({"id": f"{q['question_id']}/2", "turns": [{"role": "user", "content": q["turns"][0]}],
                        "second": q["turns"][1]})  # fmt: skip
        return out[:count]
    raise ValueError(f"unknown stream {name!r}")


# ------------------------------------------------------------------------------------------------- the peer
PEER_TYPE = "suffix_decoding_peer"  # the peer's generator is found by this model_type


class PeerModel(LookupTreeModel):
    """SuffixDecoding (arctic-inference) as a drafter of this package's tree loop: one cache per drafter object."""

    def __init__(self, config: LookupTreeConfig, cache) -> None:
        super().__init__(config)
        self.config.model_type = PEER_TYPE
        self.cache, self.next_request = cache, 0


class PeerCandidateGenerator(LookupTreeCandidateGenerator):
    """Drafts with `SuffixDecodingCache.speculate(use_tree_spec=True)`; the request is stopped when the call ends."""

    def __init__(self, drafter: PeerModel, **overrides) -> None:
        super().__init__(drafter, **overrides)
        self.free_candidates = None
        self.request, self.fed = drafter.next_request, 0
        drafter.next_request += 1
        weakref.finalize(self, _stop_peer, drafter.cache, self.request)

    def draft_tree(self, sequence: torch.LongTensor, with_drafter: bool = True) -> DraftTree:
        cache, tokens = self.drafter.cache, sequence.tolist()
        if not self.fed:
            cache.start_request(self.request, tokens[:-1])
            self.fed = len(tokens) - 1
        cache.add_active_response(self.request, tokens[self.fed :])
        self.fed = len(tokens)
        start = time.perf_counter()
        draft = cache.speculate(self.request, tokens, max_spec_tokens=self.tree_budget, use_tree_spec=True)
        tree = DraftTree.root_only(tokens[-1])
        if draft.token_ids:
            parents = torch.tensor(draft.parents) + 1  # arctic's -1 = the root = node 0 here
            depths = torch.zeros(len(parents) + 1, dtype=torch.long)
            for i, p in enumerate(parents.tolist(), start=1):
                depths[i] = depths[p] + 1
            probs = torch.tensor(draft.probs).clamp(min=1e-6)
            tree.add_nodes(torch.tensor(draft.token_ids), parents, depths[1:], probs.log())
        self._account(start, forwards=0)
        return tree.prune(self.tree_budget)


def _stop_peer(cache, request: int) -> None:
    if request in cache.active_requests:
        cache.stop_request(request)


def load_peer(path: str):
    sys.path.insert(0, path)
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as error:
        print(f"SuffixDecoding peer skipped: arctic_inference is not built under {path} ({error}). "
              "Run `bash examples/suffix_streams_setup.sh` first.")  # fmt: skip
        return None
    CANDIDATE_GENERATOR_MAPPING[PEER_TYPE] = PeerCandidateGenerator
    return SuffixDecodingCache


# ------------------------------------------------------------------------------------------------- methods
def make_drafter(method: str, target, ladder: list[int], peer_cls, fixed_budget: int = 0):
    auto = dict(tree_budget=fixed_budget or "auto", auto_budget_candidates=ladder)
    if method == "lookup_tree":
        return LookupTreeModel.from_target(target, **auto, **TODAY)
    if method == "lookup_tree+suffix":
        return LookupTreeModel.from_target(target, **auto, **SUFFIX)
    if method == "suffix_only":
        return LookupTreeModel.from_target(target, **auto, **SUFFIX_ONLY)
    if method == "suffix_decoding":  # always verifies its draft (sized by the match), as SuffixDecoding does
        config = LookupTreeConfig.from_target_config(target.config, tree_budget=fixed_budget or max(ladder))
        return PeerModel(config, peer_cls(max_tree_depth=24, max_cached_requests=256))
    if method in ("specblock+suffix", "eagle3+suffix"):
        cls, name = (SpecBlockDraftModel, "specblock") if method.startswith("specblock") else (Eagle3DraftModel, "eagle3")
        drafter = cls.from_pretrained(f"{name}-smollm2-135m-instruct", dtype=target.dtype).eval()
        for key, value in {**auto, **FREE}.items():
            setattr(drafter.config, key, value)
        drafter.config.validate_settings()
        return drafter
    return None


class ForwardCounter:
    def __init__(self, model) -> None:
        self.count = 0
        model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:
        self.count += 1


def run_call(method: str, target, drafter, inputs: dict, max_new_tokens: int, counter: ForwardCounter) -> dict:
    kwargs = dict(do_sample=False, max_new_tokens=max_new_tokens)
    if method == "hf_prompt_lookup":
        kwargs["prompt_lookup_num_tokens"] = 10
    elif drafter is not None:
        kwargs["assistant_model"] = drafter
    before = counter.count
    start = time.perf_counter()
    out = target.generate(**inputs, **kwargs)
    seconds = time.perf_counter() - start
    new = out.shape[1] - inputs["input_ids"].shape[1]
    gc.collect()  # the call's generator is dropped: its request joins the drafter's store
    row = {"new_tokens": new, "seconds": seconds, "target_forwards": counter.count - before, "output": out[0].tolist()}
    if drafter is not None:
        stats = drafter.last_stats
        row["accepted_by_source"] = stats.accepted_by_source
        row["nodes_per_iteration"] = sum(stats.nodes_per_iteration) / max(1, stats.iterations)
        if "_suffix_store" in drafter.__dict__:
            store = suffix_cache_for(drafter)
            row["store_tokens"], row["store_requests"], row["store_states"] = store.tokens, len(store), len(store.index)
    return row


def run_stream(stream: str, methods: list[str], target, tokenizer, args, peer_cls, counter, log) -> list[dict]:
    ladder = [int(b) for b in args.budget_candidates.split(",")]
    drafters = {m: make_drafter(m, target, ladder, peer_cls, args.fixed_budget) for m in methods}
    rows, answers = [], {}
    for i, request in enumerate(tqdm(build_stream(stream, tokenizer, args.num_prompts), desc=stream)):
        for method in methods:
            if "turns" in request:  # chat: turn 2 quotes this method's own turn-1 answer (all equal: greedy)
                turns = list(request["turns"])
                if "second" in request:
                    turns += [{"role": "assistant", "content": answers[method]}, {"role": "user", "content": request["second"]}]
                text = _chat(tokenizer, turns)
            else:
                text = request["text"]
            inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
            row = run_call(method, target, drafters[method], inputs, args.max_new_tokens, counter)
            answers[method] = tokenizer.decode(row["output"][inputs["input_ids"].shape[1] :], skip_special_tokens=True)
            row.update(stream=stream, method=method, request=i, id=request["id"], prompt_tokens=inputs["input_ids"].shape[1])
            rows.append(row)
            log.write(json.dumps({k: v for k, v in row.items() if k != "output"}) + "\n")
            log.flush()
    return rows


def copy_bound(requests: list[tuple[list[int], int]], node_cap: int) -> float:
    """Tokens per target forward that NO drafter copying what it has seen could beat with at most `node_cap` nodes:
    each step accepts the longest continuation (<= node_cap) that follows an earlier occurrence of the root token
    in the text seen so far (this request's prompt and committed answer, and every earlier request: prompt lookup,
    suffix trees local and global, SuffixDecoding), or whose every token completes a trigram seen so far (an
    order-2 n-gram walk), as if the drafter always chose that branch. requests: (prompt + answer ids, prompt length)
    in stream order, the answers plain `generate`'s. Counted as the benchmark counts: the prefill is a forward."""
    seen, seen_3, tokens, forwards = SuffixAutomaton(), set(), 0, 0
    for ids, prompt_length in requests:
        seen.start_sequence()
        for token in ids[: prompt_length + 1]:  # the prompt, and the first token (the prefill's forward)
            seen.append(token)
        seen_3.update(zip(ids[: prompt_length + 1], ids[1 : prompt_length + 1], ids[2 : prompt_length + 1]))
        forwards, i = forwards + 1, prompt_length + 1
        while i < len(ids):  # a step: ids[i - 1] is the root, committed
            state, copied = seen.next[0][ids[i - 1]], 0
            while copied < node_cap and i + copied < len(ids) and ids[i + copied] in seen.next[state]:
                state, copied = seen.next[state][ids[i + copied]], copied + 1
            walked = 0  # the n-gram walk: each token completes a trigram seen so far
            while walked < node_cap and i + walked < len(ids) and tuple(ids[i + walked - 2 : i + walked + 1]) in seen_3:
                walked += 1
            end = min(len(ids), i + max(copied, walked) + 1)  # the accepted tokens and the target's next one
            for token in ids[i:end]:
                seen.append(token)
            seen_3.update(zip(ids[i - 2 : end], ids[i - 1 : end], ids[i:end]))
            forwards, i = forwards + 1, end
        tokens += len(ids) - prompt_length
    return tokens / forwards


def summarise(rows: list[dict], node_cap: int) -> dict:
    """Per stream and method: tokens per target forward (exact), speed-up vs plain (median of per-call ratios),
    identical outputs, the store's size; for plain also the copy bound at `node_cap` nodes (`copy_bound`)."""
    out: dict[str, dict] = {}
    by_key = {(r["stream"], r["method"], r["request"]): r for r in rows}
    for stream in dict.fromkeys(r["stream"] for r in rows):
        out[stream] = {}
        for method in dict.fromkeys(r["method"] for r in rows if r["stream"] == stream):
            mine = [r for r in rows if r["stream"] == stream and r["method"] == method]
            plain = [by_key[(stream, "plain", r["request"])] for r in mine]
            tokens, forwards = sum(r["new_tokens"] for r in mine), sum(r["target_forwards"] for r in mine)
            ratios = [p["seconds"] / r["seconds"] * r["new_tokens"] / p["new_tokens"] for r, p in zip(mine, plain)]
            out[stream][method] = {
                "tokens_per_target_forward": round(tokens / forwards, 3),
                "speedup_vs_plain_median": round(statistics.median(ratios), 3),
                "speedup_vs_plain_min": round(min(ratios), 3),
                "tokens_per_s": round(tokens / sum(r["seconds"] for r in mine), 2),
                "identical_to_plain": all(r["output"] == p["output"] for r, p in zip(mine, plain)),
                "calls": len(mine),
                **({"store_tokens": mine[-1]["store_tokens"], "store_states": mine[-1]["store_states"]}
                   if "store_tokens" in mine[-1] else {}),  # fmt: skip
                **({"accepted_by_source": {k: sum(r["accepted_by_source"][k] for r in mine)
                                           for k in mine[0]["accepted_by_source"]}}
                   if "accepted_by_source" in mine[0] else {}),  # fmt: skip
            }
        plain = [r for r in rows if r["stream"] == stream and r["method"] == "plain"]
        if plain:
            requests = [(r["output"], r["prompt_tokens"]) for r in sorted(plain, key=lambda r: r["request"])]
            out[stream]["plain"]["copy_bound_tokens_per_target_forward"] = round(copy_bound(requests, node_cap), 3)
    return out


def write_report(summary: dict, meta: dict, output_dir: Path) -> None:
    (output_dir / "results.json").write_text(json.dumps({"meta": meta, "results": summary}, indent=1))
    methods = list(dict.fromkeys(m for s in summary.values() for m in s))
    lines = [f"hardware: {meta['hardware']}; {meta['num_prompts']} requests per stream x {meta['max_new_tokens']} "
             "new tokens, greedy; tau = new tokens per target forward (exact); speed-up = median of per-call ratios "
             "to plain (a shared CPU: noisy)", "",
             "copy bound = tokens per target forward no drafter copying seen text can beat at the node cap "
             "(`copy_bound`)", "",
             "| stream | copy bound | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]  # fmt: skip
    for stream, per in summary.items():
        bound = per.get("plain", {}).get("copy_bound_tokens_per_target_forward")
        cells = [f"{bound:.2f}" if bound else "-"]
        cells += [f"{per[m]['tokens_per_target_forward']:.2f} / {per[m]['speedup_vs_plain_median']:.2f}x"
                 + ("" if per[m]["identical_to_plain"] else " (DIFFERS)") if m in per else "-" for m in methods]  # fmt: skip
        lines.append(f"| {stream} | " + " | ".join(cells) + " |")
    (output_dir / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plt = import_pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(methods)
    for j, method in enumerate(methods):
        xs = [i + j * width for i in range(len(summary))]
        for ax, key in zip(axes, ("tokens_per_target_forward", "speedup_vs_plain_median")):
            ax.bar(xs, [per.get(method, {}).get(key, 0) for per in summary.values()], width, label=method)
    for ax, title in zip(axes, ("tokens per target forward (exact)", "speed-up vs plain (median per call)")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(summary))], list(summary))
        ax.set_title(title)
    axes[1].axhline(1.0, color="k", lw=0.8)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(output_dir / "streams.png", dpi=120)


def measure_store_memory(tokenizer, conversations: int) -> list[dict]:
    """Bytes a store holds at its bound (tracemalloc: the store's own allocations), and the time to fill it."""
    records = load_sharegpt_conversations("train")[:conversations]
    requests = [tokenizer(" ".join(t["value"] for t in r["conversations"]))["input_ids"][:600] for r in records]
    out = []
    for max_tokens in (16384, 65536):
        start = time.perf_counter()
        tracemalloc.start()
        store, most = SuffixStore(max_tokens=max_tokens, max_requests=10**6), 0
        for request in tqdm(requests, desc=f"store of {max_tokens}"):
            store.add(request)
            most = max(most, store.tokens)
        current, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        out.append({"max_tokens": max_tokens, "tokens_added": sum(map(len, requests)), "kept_tokens": store.tokens,
                    "kept_requests": len(store), "most_tokens_ever": most, "states": len(store.index),
                    "bytes_now": current, "bytes_peak": peak, "bytes_per_kept_token": round(current / store.tokens),
                    "seconds_with_tracemalloc": round(time.perf_counter() - start, 1)})  # fmt: skip
        print(out[-1])
    return out


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    target, tokenizer = load_model(args.target_model, device="cpu", dtype=args.dtype)
    if args.store_memory:
        memory = measure_store_memory(tokenizer, args.store_memory)
        (output_dir / "store_memory.json").write_text(json.dumps(memory, indent=1))
        return
    methods = args.methods.split(",")
    peer_cls = load_peer(args.peer_path) if "suffix_decoding" in methods else None
    if peer_cls is None and "suffix_decoding" in methods:
        methods.remove("suffix_decoding")
    counter = ForwardCounter(target)
    ladder = [int(b) for b in args.budget_candidates.split(",")]  # time the target once, outside the streams
    warm = LookupTreeModel.from_target(target, tree_budget="auto", auto_budget_candidates=ladder)
    target.generate(**tokenizer("def f(x):\n    return x", return_tensors="pt"), assistant_model=warm, max_new_tokens=8)
    rows = []
    with (output_dir / "calls.jsonl").open("w") as log:
        for stream in args.streams.split(","):
            rows += run_stream(stream, methods, target, tokenizer, args, peer_cls, counter, log)
    meta = {
        "hardware": describe_hardware("cpu", args.dtype, args.dtype) + f", {torch.get_num_threads()} threads",
        "target": args.target_model, "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
        "budget_candidates": args.budget_candidates, "fixed_budget": args.fixed_budget, "free_candidates": FREE, "command": " ".join(sys.argv),
        "peer": "arctic-inference 0.3.0 SuffixDecodingCache(max_tree_depth=24, max_cached_requests=256), "
                "speculate(max_spec_tokens=<budget>, use_tree_spec=True)" if peer_cls else "not built",
    }  # fmt: skip
    write_report(summarise(rows, args.fixed_budget or max(ladder)), meta, output_dir)


if __name__ == "__main__":
    main()
