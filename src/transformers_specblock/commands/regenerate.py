"""Self-distillation data: answer training prompts with the target itself (the method's data recipe).

    python -m transformers_specblock.commands.regenerate --target_model smollm2-135m-instruct \
        --num_conversations 512 --max_new_tokens 256 --output data/smollm2-sharegpt-regen.jsonl

Any target works (a Hub id such as ``meta-llama/Llama-3.1-8B-Instruct``, or a local folder) with ``--device``
(default: cuda if visible, else cpu; ``auto`` spreads it over all GPUs) and ``--dtype`` (default ``auto``).

Writes one JSON line per conversation, `{"id", "conversations": [{"from": "human", ...}, {"from": "gpt", ...}],
"regenerated": {"model", "model_id", "prompts", generation settings}}` (training reads the last part to tell the
model card whether the answers are the target's own), appending and skipping ids already present, so an
interrupted run resumes where it stopped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import HfArgumentParser

from ..hub.prompts import load_sharegpt_conversations
from ..hub.loading import DEVICE_HELP, DTYPE_CHOICES, DTYPE_HELP, load_model
from ..hub.provenance import resolve_base_model_id
from ..training.data import REGENERATED_KEY, regeneration_record


@dataclass
class RegenerateArguments:
    target_model: str = field(
        metadata={"help": "Target: a packaged model name, a local model folder or a Hugging Face Hub id."}
    )
    output: str = field(metadata={"help": "JSONL file to write (appended to; existing ids are skipped)."})
    num_conversations: int = field(default=512, metadata={"help": "Training conversations to answer."})
    max_prompt_tokens: int = field(default=256, metadata={"help": "Skip prompts longer than this (tokens)."})
    max_new_tokens: int = field(default=256)
    batch_size: int = field(default=16)
    do_sample: bool = field(default=False, metadata={"help": "Greedy answers by default (what T=0 decoding sees)."})
    temperature: float = field(default=0.7)
    seed: int = field(default=0)
    device: str | None = field(default=None, metadata={"help": DEVICE_HELP})
    dtype: str = field(default="auto", metadata={"help": DTYPE_HELP, "choices": DTYPE_CHOICES})


def first_turn_prompts(tokenizer, num: int, max_prompt_tokens: int) -> list[tuple[str, str]]:
    """(id, first human message) of ShareGPT TRAIN conversations that fit the prompt limit, in file order."""
    chosen = []
    for record in load_sharegpt_conversations("train"):
        turns = record["conversations"]
        if not turns or turns[0]["from"] != "human" or not turns[0]["value"].strip():
            continue
        if len(tokenizer(turns[0]["value"], add_special_tokens=False)["input_ids"]) > max_prompt_tokens:
            continue
        chosen.append((record["id"], turns[0]["value"]))
        if len(chosen) == num:
            break
    return chosen


def regenerate(args: RegenerateArguments) -> Path:
    torch.manual_seed(args.seed)
    target, tokenizer = load_model(args.target_model, device=args.device, dtype=args.dtype)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if output.exists():
        done = {json.loads(line)["id"] for line in output.read_text().splitlines() if line.strip()}
    record = regeneration_record(  # written into every conversation: training reads it for the model card
        args.target_model, resolve_base_model_id(args.target_model), "sharegpt-train (first human turns)",
        max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
        temperature=args.temperature if args.do_sample else None, seed=args.seed,
    )  # fmt: skip
    todo = [p for p in first_turn_prompts(tokenizer, args.num_conversations, args.max_prompt_tokens) if p[0] not in done]
    with output.open("a") as sink, tqdm(total=len(todo), desc="regenerating answers") as bar:
        for start in range(0, len(todo), args.batch_size):
            batch = todo[start : start + args.batch_size]
            texts = [
                tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
                for _, q in batch
            ]
            inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(target.device)
            out = target.generate(
                **inputs, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                temperature=args.temperature if args.do_sample else None, top_p=None, top_k=None,
                pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
            answers = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
            for (conv_id, question), answer in zip(batch, answers):
                turns = [{"from": "human", "value": question}, {"from": "gpt", "value": answer.strip()}]
                sink.write(json.dumps({"id": conv_id, "conversations": turns, REGENERATED_KEY: record}) + "\n")
            sink.flush()
            bar.update(len(batch))
    return output


def main(argv: list[str] | None = None) -> None:
    (args,) = HfArgumentParser(RegenerateArguments).parse_args_into_dataclasses(args=argv)
    print(f"wrote {regenerate(args)}")


if __name__ == "__main__":
    main()
