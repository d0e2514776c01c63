"""Training data and target features for a new target, built by one resumable command.

    python -m transformers_specblock.commands.build_data --target_model qwen2.5-coder-0.5b-instruct \\
        --output_dir /work/qwen-data/qwen2.5-coder-0.5b-instruct

Stages (``--stages``, in this order; each resumes from what is on disk, so the same command continues an interrupted
or finished run and extends it):

1. ``sources``: ``sources/sharegpt.jsonl`` (packaged ShareGPT V3 outside its held-out split) and
   ``sources/code.jsonl`` (Python sources of the standard library and of permissively licensed installed packages,
   split by file, see `training.corpus`), each without the records that hold a benchmark prompt or solution
   (``sources/dropped.jsonl`` says which item each dropped record held). Written once (atomically); kept after.
2. ``regenerate``: the target's own answers to opening prompts of the ShareGPT source (programming prompts and the
   others alternating), decoded with this package's lookup tree (``LookupTreeModel.from_target(target)`` as the
   ``assistant_model`` of ``generate``: greedy output, the fastest decoder here), appended and fsynced answer by answer
   to ``sources/regenerated.jsonl``; a rerun skips the answered ids. At most ``--regenerate_minutes`` per run, so the
   stage grows a little every session.
3. ``splits``: every source through the benchmark filter again, into ``splits/{train,select,report}.jsonl`` by
   ``sha256(split key)`` (`training.corpus.split_records`; a regenerated answer goes where its conversation goes), the
   sources interleaved; rewritten atomically; ``splits/stats.json`` counts them.
4. ``features``: the target's features (`training.feature_store.extract_features`) over ``--feature_splits`` into
   ``features/<split>/``, select first (up to ``--select_feature_tokens``), then train (up to
   ``--max_feature_tokens``): one shard every ``--shard_tokens`` tokens, a rerun continues after the last complete
   shard, and records added to a split later are extracted by the next run.

Train a drafter on it with ``specblock-train --feature_store OUTPUT_DIR/features/train --eval_dataset
OUTPUT_DIR/splits/select.jsonl ...``. The report split is read by no decision (no checkpoint choice, no tuning).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..hub.assets import resolve_model_path
from ..hub.loading import load_model
from ..hub.provenance import resolve_base_model_id
from ..training.corpus import (
    SPLITS,
    BenchmarkFilter,
    benchmark_items,
    code_records,
    interleave,
    prompt_key,
    python_source_files,
    sharegpt_records,
    split_records,
)
from ..training.data import REGENERATED_KEY, regeneration_record

STAGES = ("sources", "regenerate", "splits", "features")
_CODE_WORDS = re.compile(
    r"```|\b(python|code|function|def|class|script|program|sql|javascript|typescript|java|c\+\+|rust|golang|bash|"
    r"regex|api|json|html|css|algorithm|bug|error|compile|implement|react|django|pandas|numpy)\b",
    re.I,
)


def log(message: str) -> None:
    print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {message}", flush=True)


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]  # a last line an interrupted write left incomplete is ignored
    return [json.loads(line) for line in complete.decode("utf-8").split("\n") if line.strip()]


def write_jsonl_atomically(path: Path, records: list[dict]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")  # ASCII: str.splitlines would also split at U+2028
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# -------------------------------------------------------------------------------------------------------- stages
def build_sources(out: Path, options: argparse.Namespace, bench: BenchmarkFilter) -> None:
    folder = out / "sources"
    folder.mkdir(parents=True, exist_ok=True)
    dropped: list[dict] = read_jsonl(folder / "dropped.jsonl")
    for name in ("sharegpt", "code"):
        path = folder / f"{name}.jsonl"
        if path.is_file():
            log(f"sources: {path} exists, kept")
            continue
        start = time.process_time()
        if name == "sharegpt":
            records = sharegpt_records()
        else:
            files = python_source_files()
            log(f"sources: {len(files)} Python files of the standard library and permissive packages")
            records = list(code_records(files, max_bytes=options.code_max_file_bytes,
                                        chunk_chars=options.code_chunk_chars,
                                        max_total_chars=options.code_max_chars,
                                        max_package_chars=options.code_max_package_chars))  # fmt: skip
        clean, bad = bench.filter(tqdm(records, desc=f"decontaminating {name}", mininterval=30))
        dropped += [{**d, "source": name} for d in bad]
        write_jsonl_atomically(path, clean)
        write_jsonl_atomically(folder / "dropped.jsonl", dropped)
        log(f"sources: {name}: {len(clean)} records kept, {len(bad)} dropped as benchmark matches "
            f"({time.process_time() - start:.0f} CPU s)")  # fmt: skip


def regeneration_prompts(sharegpt: list[dict], max_chars: int) -> list[dict]:
    """Opening human turns of the ShareGPT source's first parts, each prompt once, programming prompts and the others
    alternating (each group in `order_key` order)."""
    code, other, seen = [], [], set()
    for record in interleave([sharegpt]):
        turns = record["conversations"]
        if not record["id"].endswith("_0") or not turns or turns[0]["from"] != "human":
            continue
        question = turns[0]["value"].strip()
        key = prompt_key(record)
        if not question or len(question) > max_chars or key in seen:
            continue
        seen.add(key)
        (code if _CODE_WORDS.search(question) else other).append({**record, "question": question})
    prompts = []
    for i in range(max(len(code), len(other))):
        prompts += [group[i] for group in (code, other) if i < len(group)]
    return prompts


def regenerate(out: Path, options: argparse.Namespace, target, tokenizer) -> None:
    from ..models.lookup_tree import LookupTreeModel

    path = out / "sources" / "regenerated.jsonl"
    done = {r["id"] for r in read_jsonl(path)}
    if path.is_file():  # drop a last line an interrupted write left incomplete
        data = path.read_bytes()
        if not data.endswith(b"\n") and data:
            with path.open("r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)
    prompts = [p for p in regeneration_prompts(read_jsonl(out / "sources" / "sharegpt.jsonl"), options.max_prompt_chars)
               if f"regenerated:{p['id']}" not in done]  # fmt: skip
    record = regeneration_record(
        options.target_model, resolve_base_model_id(options.target_model),
        "sharegpt (first human turns, outside the held-out split)", max_new_tokens=options.max_new_tokens,
        decoding="greedy, lookup tree (LookupTreeModel) as assistant_model", dtype=str(target.dtype).removeprefix("torch."),
    )  # fmt: skip
    lookup = LookupTreeModel.from_target(target)
    stop = time.perf_counter() + options.regenerate_minutes * 60
    new_tokens, seconds, cpu_seconds = 0, 0.0, 0.0
    log(f"regenerate: {len(done)} answers on disk, {len(prompts)} prompts left, {options.regenerate_minutes} min")
    with path.open("a", encoding="utf-8") as sink, tqdm(desc="regenerating", unit="answer", mininterval=30) as bar:
        for prompt in prompts:
            if time.perf_counter() >= stop:
                break
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt["question"]}], tokenize=False,
                                                 add_generation_prompt=True)  # fmt: skip
            inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
            start, cpu_start = time.perf_counter(), time.process_time()
            with torch.inference_mode():
                output = target.generate(**inputs, assistant_model=lookup, max_new_tokens=options.max_new_tokens,
                                         do_sample=False, top_p=None, top_k=None, temperature=None)  # fmt: skip
            answer = output[0, inputs["input_ids"].shape[1] :]
            seconds += time.perf_counter() - start
            cpu_seconds += time.process_time() - cpu_start
            new_tokens += len(answer)
            eos = target.generation_config.eos_token_id
            eos = set(eos if isinstance(eos, list) else [eos])
            turns = [{"from": "human", "value": prompt["question"]},
                     {"from": "gpt", "value": tokenizer.decode(answer, skip_special_tokens=True).strip()}]  # fmt: skip
            line = {"id": f"regenerated:{prompt['id']}", "source": "regenerated", "split_key": prompt["split_key"],
                    "conversations": turns, "finished": any(int(t) in eos for t in answer.tolist()),
                    "new_tokens": len(answer), "tau": getattr(getattr(lookup, "last_stats", None), "tau", None),
                    REGENERATED_KEY: record}  # fmt: skip
            sink.write(json.dumps(line) + "\n")
            sink.flush()
            os.fsync(sink.fileno())
            bar.update(1)
            bar.set_postfix(tok_per_s=f"{new_tokens / max(seconds, 1e-9):.1f}")
    log(f"regenerate: {new_tokens} new tokens in {seconds:.0f} s ({cpu_seconds:.0f} CPU s, "
        f"{new_tokens / max(seconds, 1e-9):.2f} tok/s)")  # fmt: skip
    stats_path = out / "sources" / "regenerate_stats.json"
    stats = json.loads(stats_path.read_text()) if stats_path.is_file() else {"runs": []}
    stats["runs"].append({"date": time.strftime("%Y-%m-%d %H:%M"), "new_tokens": new_tokens, "seconds": round(seconds, 1),
                          "cpu_seconds": round(cpu_seconds, 1), "threads": torch.get_num_threads()})  # fmt: skip
    stats_path.write_text(json.dumps(stats, indent=1) + "\n")


def build_splits(out: Path, bench: BenchmarkFilter) -> dict:
    sources = {name: read_jsonl(out / "sources" / f"{name}.jsonl") for name in ("sharegpt", "code", "regenerated")}
    dropped = 0
    for name, records in sources.items():  # again: the regenerated answers are new text
        sources[name], bad = bench.filter(records)
        dropped += len(bad)
    parts = {name: split_records(records) for name, records in sources.items()}
    folder = out / "splits"
    folder.mkdir(parents=True, exist_ok=True)
    stats: dict = {"benchmark_matches_dropped_at_split_time": dropped}
    for split in SPLITS:
        records = interleave([parts[name][split] for name in sources])
        write_jsonl_atomically(folder / f"{split}.jsonl", records)
        stats[split] = {name: {"records": len(parts[name][split]),
                               "characters": sum(len(t.get("value", "")) for r in parts[name][split]
                                                 for t in r["conversations"])}
                        for name in sources}  # fmt: skip
    (folder / "stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    log(f"splits: {json.dumps({s: {n: v['records'] for n, v in stats[s].items()} for s in SPLITS})}")
    return stats


def build_features(out: Path, options: argparse.Namespace, target, tokenizer) -> None:
    from ..models.tree_drafter.configuration_tree_drafter import default_target_layer_ids
    from ..training.feature_store import extract_features

    layer_ids = default_target_layer_ids(target.config.get_text_config().num_hidden_layers)
    for split in options.feature_splits.split(","):
        cap = options.select_feature_tokens if split != "train" else options.max_feature_tokens
        log(f"features: {split} (layers {layer_ids}, up to {cap} tokens)")
        info = extract_features(
            target, tokenizer, out / "splits" / f"{split}.jsonl", out / "features" / split, layer_ids,
            max_length=options.max_length, dtype=torch.bfloat16, shard_tokens=options.shard_tokens, max_tokens=cap,
            description={"target_model": options.target_model},
        )  # fmt: skip
        rate = info["num_tokens"] / max(info["cpu_seconds"], 1e-9)
        log(f"features: {split}: {info['num_tokens']} tokens in {len(info['shards'])} shards, "
            f"{info['total_bytes'] / 1e9:.2f} GB, {info['cpu_seconds']:.0f} CPU s ({rate:.1f} tok per CPU s)")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target_model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--output_dir", required=True, help="Where everything goes (outside the git checkout).")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"Comma-separated, of {', '.join(STAGES)}.")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads.")
    parser.add_argument("--dtype", default="bfloat16", help="The target's dtype (bfloat16 on a native-bf16 CPU).")
    parser.add_argument("--max_length", type=int, default=1024, help="Tokens per rendered conversation.")
    parser.add_argument("--code_max_file_bytes", type=int, default=200_000)
    parser.add_argument("--code_chunk_chars", type=int, default=3000, help="About 1000 tokens: one --max_length.")
    parser.add_argument("--code_max_chars", type=int, default=60_000_000, help="Characters of code kept at most.")
    parser.add_argument("--code_max_package_chars", type=int, default=3_000_000, help="... per top-level package.")
    parser.add_argument("--regenerate_minutes", type=float, default=20.0, help="Wall minutes of regeneration per run.")
    parser.add_argument("--max_new_tokens", type=int, default=512)
    parser.add_argument("--max_prompt_chars", type=int, default=2000)
    parser.add_argument("--feature_splits", default="select,train")
    parser.add_argument("--select_feature_tokens", type=int, default=131072, help="Tokens of select/report features.")
    parser.add_argument("--max_feature_tokens", type=int, default=4_000_000, help="Tokens of train features.")
    parser.add_argument("--shard_tokens", type=int, default=65536)
    parser.add_argument("--extra_benchmark", action="append", default=[], help="JSONL of more benchmark prompts.")
    options = parser.parse_args(argv)
    stages = [s.strip() for s in options.stages.split(",") if s.strip()]
    if set(stages) - set(STAGES):
        parser.error(f"--stages takes {', '.join(STAGES)}, got {options.stages!r}")
    torch.set_num_threads(options.threads)
    out = Path(options.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    lock = (out / ".build_data.lock").open("w")
    try:  # one run per folder: a second one would rewrite the splits under the first one's extraction
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        sys.exit(f"Another build_data run holds {out / '.build_data.lock'}; let it finish (or end it) first.")
    log(f"build_data {' '.join(sys.argv[1:] if argv is None else argv)}")
    bench = None
    if "sources" in stages or "splits" in stages:
        bench = BenchmarkFilter(benchmark_items(extra_files=options.extra_benchmark))
        log(f"benchmark filter: {len(bench.items)} prompts and solutions")
    if "sources" in stages:
        build_sources(out, options, bench)
    target = tokenizer = None
    if "regenerate" in stages or "features" in stages:
        resolve_model_path(options.target_model)
        target, tokenizer = load_model(options.target_model, device="cpu", dtype=options.dtype)
        target.requires_grad_(False)
    if "regenerate" in stages and options.regenerate_minutes > 0:
        regenerate(out, options, target, tokenizer)
    if "splits" in stages:
        build_splits(out, bench)
    if "features" in stages:
        build_features(out, options, target, tokenizer)
    log("build_data: done")


if __name__ == "__main__":
    main()
