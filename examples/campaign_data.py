"""The training conversations of the drafter campaign, built reproducibly by one command.

    python examples/campaign_data.py --output_dir /work/campaign/data --regenerate_conversations 512

Writes ``OUTPUT_DIR/train.jsonl`` (ShareGPT-style records, what ``specblock-train --dataset`` reads) and
``OUTPUT_DIR/stats.json`` (conversations and tokens per source, rendered with the target's chat template and cut to
``--max_length`` as training does). The sources, in this order:

* ``sharegpt``: the packaged ShareGPT V3 train split with the corpus' own answers (16,776 conversations that render,
  8.0M tokens of which 5.7M assistant tokens at ``--max_length`` 512);
* ``regenerated (GPU)``: the 3,456 greedy answers SmolLM2-135M-Instruct wrote to ShareGPT train prompts on a lent
  H200 (kept compressed in ``docs/results/gpu-h200-2026-11-30/``; ``--gpu_answers ''`` leaves them out);
* ``regenerated (CPU)``: ``--regenerate_conversations N`` more answers of the target itself, written by
  ``python -m transformers_specblock.commands.regenerate`` (chatterbot prompts first, then ShareGPT train prompts;
  half of them sampled at temperature 0.7 by a hash of the id, the rest greedy; seed 0; batched; a progress bar;
  resumable: a rerun answers only what is missing), into ``OUTPUT_DIR/regenerated-cpu.jsonl``.

Nothing comes from MT-Bench or HumanEval, and no held-out conversation is used: the ShareGPT held-out split (by
conversation id) and the chatterbot held-out split (by opening question) stay out of every source. A regenerated
answer and ShareGPT's own answer to the same prompt are both kept (two texts). ``train.jsonl`` is rewritten
atomically, so a rerun with more regenerated answers grows the mix in place.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import sys
from functools import cache
from pathlib import Path

from tqdm import tqdm

from transformers_specblock.commands.regenerate import main as regenerate_main
from transformers_specblock.hub.loading import load_model
from transformers_specblock.hub.prompts import load_sharegpt_conversations
from transformers_specblock.training.data import normalize_conversation, render_conversation

REPO = Path(__file__).resolve().parents[1]
GPU_ANSWERS = REPO / "docs/results/gpu-h200-2026-11-30/smollm2-regen-h200.jsonl.xz"


@cache
def heldout_ids() -> frozenset[str]:
    """Ids of the ShareGPT held-out split (no source may train on them)."""
    return frozenset(r["id"] for r in load_sharegpt_conversations("heldout"))


def read_jsonl(path: Path) -> list[dict]:
    opener = lzma.open if path.suffix == ".xz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def count_tokens(records: list[dict], tokenizer, max_length: int, name: str) -> dict[str, int]:
    """Conversations that render, their tokens and assistant tokens at ``max_length`` (as training counts them)."""
    rows = tokens = assistant = 0
    for record in tqdm(records, desc=f"counting {name}", unit="conversation"):
        try:
            row = render_conversation(normalize_conversation(record), tokenizer, max_length)
        except Exception:  # noqa: BLE001 - what training skips too
            continue
        if row is not None:
            rows, tokens, assistant = rows + 1, tokens + len(row["input_ids"]), assistant + sum(row["loss_mask"])
    return {"conversations": rows, "tokens": tokens, "assistant_tokens": assistant}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--target_model", default="smollm2-135m-instruct")
    parser.add_argument("--max_length", type=int, default=512)
    parser.add_argument("--gpu_answers", default=str(GPU_ANSWERS), help="Regenerated answers to include ('': none).")
    parser.add_argument("--regenerate_conversations", type=int, default=0, help="Target answers to write on this CPU.")
    parser.add_argument("--regenerate_batch_size", type=int, default=16)
    parser.add_argument("--no_sharegpt_answers", action="store_true", help="Only the regenerated answers.")
    options = parser.parse_args()
    out = Path(options.output_dir)
    out.mkdir(parents=True, exist_ok=True)

    sources: dict[str, list[dict]] = {}
    if not options.no_sharegpt_answers:
        sources["sharegpt"] = load_sharegpt_conversations("train")
    if options.gpu_answers:
        sources["regenerated (GPU)"] = read_jsonl(Path(options.gpu_answers))
    if options.regenerate_conversations > 0:
        cpu_file = out / "regenerated-cpu.jsonl"
        regenerate_main([
            "--target_model", options.target_model, "--prompts", "chatterbot,sharegpt",
            "--num_conversations", str(options.regenerate_conversations), "--max_new_tokens", "256",
            "--batch_size", str(options.regenerate_batch_size), "--sampled_fraction", "0.5", "--temperature", "0.7",
            "--seed", "0", "--output", str(cpu_file),
        ])  # fmt: skip
        sources["regenerated (CPU)"] = read_jsonl(cpu_file)[: options.regenerate_conversations]
    leaked = [r["id"] for records in sources.values() for r in records if r["id"] in heldout_ids()]
    if leaked:
        raise ValueError(f"{len(leaked)} held-out ShareGPT conversations in the sources, e.g. {leaked[:3]}")

    _, tokenizer = load_model(options.target_model, device="cpu", dtype="float32")
    stats = {name: count_tokens(records, tokenizer, options.max_length, name) for name, records in sources.items()}
    keys = ("conversations", "tokens", "assistant_tokens")
    stats["total"] = {key: sum(s[key] for s in stats.values()) for key in keys}
    stats["max_length"] = options.max_length
    tmp = out / "train.jsonl.tmp"
    with tmp.open("w", encoding="utf-8") as f:
        for records in sources.values():
            for record in records:
                f.write(json.dumps(record) + "\n")  # ASCII: str.splitlines also splits at U+2028
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out / "train.jsonl")
    (out / "stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    json.dump(stats, sys.stdout, indent=1)
    print(f"\nwrote {out / 'train.jsonl'}")


if __name__ == "__main__":
    main()
