"""Self-distillation data: answer training prompts with the target itself (the method's data recipe).

    python -m transformers_specblock.commands.regenerate --target_model smollm2-135m-instruct \
        --num_conversations 4096 --max_new_tokens 256 --sampled_fraction 0.5 --output data/smollm2-regen.jsonl

Any target works (a Hub id such as ``meta-llama/Llama-3.1-8B-Instruct``, or a local folder) with ``--device``
(default: cuda if visible, else cpu; ``auto`` spreads it over all GPUs) and ``--dtype`` (default ``auto``: float32
on a CPU; bfloat16 is faster there only on a CPU that multiplies it natively, AVX512-BF16 or AMX - see
`hub.provenance.cpu_capability`). The dtype is recorded with every answer.

Prompts are first human turns of the ShareGPT TRAIN split and / or opening questions of the chatterbot-corpus
TRAIN split (``--prompts``; the held-out splits stay unseen). A stable
``--sampled_fraction`` of them (by a hash of the conversation id) is answered by sampling at ``--temperature``, the
rest greedily, so the drafter sees both serving modes. Prompts are batched by mode and similar length (little
padding). Writes one JSON line per conversation, `{"id", "conversations": [{"from": "human", ...}, {"from": "gpt",
...}], "sampled": bool, "finished": bool, "regenerated": {"model", "model_id", "prompts", generation settings}}`
(training reads the last part to tell the model card whether the answers are the target's own; ``finished`` is
False where the answer hit ``--max_new_tokens``). Every batch is appended and flushed to disk at once; a rerun
skips the ids already written and drops a last line an interrupted write left incomplete, so a run resumes where
it stopped.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import HfArgumentParser, PreTrainedTokenizerBase

from ..hub.loading import DEVICE_HELP, DTYPE_CHOICES, DTYPE_HELP, load_model
from ..hub.prompts import load_sharegpt_conversations
from ..hub.provenance import resolve_base_model_id
from ..training.data import REGENERATED_KEY, load_chatterbot_conversations, regeneration_record
from .errors import command


PROMPT_SOURCES = {
    "sharegpt": "sharegpt-train (first human turns)",
    "chatterbot": "chatterbot-corpus english train split (opening questions)",
}


@dataclass
class RegenerateArguments:
    target_model: str = field(
        metadata={"help": "Target: a packaged model name, a local model folder or a Hugging Face Hub id."}
    )
    output: str = field(metadata={"help": "JSONL file to write (appended to; existing ids are skipped)."})
    prompts: str = field(
        default="sharegpt",
        metadata={"help": "Where the prompts come from, comma-separated, taken in this order: 'sharegpt' (first human "
                  "turns of the ShareGPT train split) and/or 'chatterbot' (opening questions of the English "
                  "chatterbot-corpus train split). Held-out splits are never answered."},
    )
    num_conversations: int = field(default=512, metadata={"help": "Training prompts to answer (in total)."})
    max_prompt_tokens: int = field(default=256, metadata={"help": "Skip prompts longer than this (tokens)."})
    max_new_tokens: int = field(default=256)
    batch_size: int = field(default=16)
    sampled_fraction: float = field(
        default=0.5,
        metadata={"help": "Share of prompts answered by sampling (the rest greedily), chosen by a hash of the id: 0 "
                  "= all greedy (what T=0 decoding sees), 1 = all sampled."},
    )
    temperature: float = field(default=0.7, metadata={"help": "Sampling temperature of the sampled answers."})
    seed: int = field(default=0)
    device: str | None = field(default=None, metadata={"help": DEVICE_HELP})
    dtype: str = field(default="auto", metadata={"help": DTYPE_HELP, "choices": DTYPE_CHOICES})

    @property
    def prompt_sources(self) -> list[str]:
        return [name.strip() for name in self.prompts.split(",") if name.strip()]

    def __post_init__(self):
        if not 0.0 <= self.sampled_fraction <= 1.0:
            raise ValueError(f"--sampled_fraction must lie in [0, 1], got {self.sampled_fraction}.")
        if self.sampled_fraction > 0 and self.temperature <= 0:
            raise ValueError(f"--temperature must be > 0 for sampled answers, got {self.temperature}.")
        unknown = set(self.prompt_sources) - set(PROMPT_SOURCES)
        if unknown or not self.prompt_sources:
            raise ValueError(f"--prompts takes {' / '.join(PROMPT_SOURCES)} (comma-separated), got {self.prompts!r}.")
        if self.batch_size < 1 or self.num_conversations < 1 or self.max_new_tokens < 1:
            raise ValueError("--batch_size, --num_conversations and --max_new_tokens must be at least 1.")


@dataclass
class Prompt:
    id: str
    question: str
    num_tokens: int
    sampled: bool


def is_sampled(conversation_id: str, sampled_fraction: float) -> bool:
    """Whether this conversation is answered by sampling: a stable hash of its id, so a resumed run agrees."""
    return zlib.crc32(conversation_id.encode()) % 10_000 < sampled_fraction * 10_000


def first_turn_prompts(tokenizer: PreTrainedTokenizerBase, args: RegenerateArguments) -> list[Prompt]:
    """First human messages of the TRAIN conversations of ``--prompts`` that fit the prompt limit, source by source
    in file order, each id and text once (ShareGPT repeats some)."""
    chosen, seen = [], set()
    loaders = {"sharegpt": load_sharegpt_conversations, "chatterbot": load_chatterbot_conversations}
    records = [record for source in args.prompt_sources for record in loaders[source]("train")]
    for record in records:
        turns = record["conversations"]
        if not turns or turns[0]["from"] != "human" or not turns[0]["value"].strip():
            continue
        if record["id"] in seen or turns[0]["value"] in seen:
            continue
        seen |= {record["id"], turns[0]["value"]}
        num_tokens = len(tokenizer(turns[0]["value"], add_special_tokens=False)["input_ids"])
        if num_tokens > args.max_prompt_tokens:
            continue
        chosen.append(Prompt(record["id"], turns[0]["value"], num_tokens, is_sampled(record["id"], args.sampled_fraction)))
        if len(chosen) == args.num_conversations:
            break
    return chosen


def finished_ids(output: Path) -> set[str]:
    """Ids already answered in `output`; a last line an interrupted write left incomplete is cut off the file."""
    if not output.exists():
        return set()
    data = output.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]  # everything up to the last newline was written whole
    if len(complete) < len(data):
        with output.open("r+b") as f:
            f.truncate(len(complete))
    return {json.loads(line)["id"] for line in complete.decode().split("\n") if line.strip()}


def batches(todo: list[Prompt], batch_size: int) -> list[list[Prompt]]:
    """Batches of one decoding mode and similar prompt length (so left padding stays small), greedy and sampled
    batches alternating, so a run stopped early has answered both modes in their share."""
    modes = []
    for sampled in (False, True):
        group = sorted((p for p in todo if p.sampled == sampled), key=lambda p: p.num_tokens)
        modes.append([group[i : i + batch_size] for i in range(0, len(group), batch_size)])
    greedy, sampled = modes
    out = [batch for pair in zip(greedy, sampled) for batch in pair]
    shorter = min(len(greedy), len(sampled))
    return out + greedy[shorter:] + sampled[shorter:]


def answer_end(answer: list[int], stop_ids: set[int]) -> tuple[int, bool]:
    """(tokens generated, whether an end token was among them) of one answer row of a batched `generate`."""
    for i, token in enumerate(answer):
        if token in stop_ids:
            return i + 1, True
    return len(answer), False


def regenerate(args: RegenerateArguments) -> Path:
    target, tokenizer = load_model(args.target_model, device=args.device, dtype=args.dtype)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    done = finished_ids(output)
    record = regeneration_record(  # written into every conversation: training reads it for the model card
        args.target_model, resolve_base_model_id(args.target_model),
        " + ".join(PROMPT_SOURCES[source] for source in args.prompt_sources),
        max_new_tokens=args.max_new_tokens, sampled_fraction=args.sampled_fraction,
        temperature=args.temperature if args.sampled_fraction > 0 else None, seed=args.seed,
        dtype=str(target.dtype).removeprefix("torch."),
    )  # fmt: skip
    stop_ids = target.generation_config.eos_token_id
    stop_ids = set(stop_ids if isinstance(stop_ids, list) else [stop_ids if stop_ids is not None else tokenizer.eos_token_id])
    todo = [p for p in first_turn_prompts(tokenizer, args) if p.id not in done]
    with output.open("a") as sink, tqdm(total=len(todo), desc="regenerating answers", unit="answer") as bar:
        new_tokens = 0
        for batch in batches(todo, args.batch_size):
            torch.manual_seed(args.seed + zlib.crc32(batch[0].id.encode()))  # reproducible whatever was done before
            texts = [
                tokenizer.apply_chat_template([{"role": "user", "content": p.question}], tokenize=False,
                                              add_generation_prompt=True)
                for p in batch
            ]  # fmt: skip
            inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(target.device)
            sampling = {"do_sample": True, "temperature": args.temperature} if batch[0].sampled else {"do_sample": False}
            with torch.inference_mode():
                out = target.generate(
                    **inputs, max_new_tokens=args.max_new_tokens, top_p=None, top_k=None,
                    pad_token_id=tokenizer.pad_token_id, **sampling,
                )  # fmt: skip
            answer_ids = out[:, inputs["input_ids"].shape[1] :]  # (batch, new), padded after an end token
            ends = [answer_end(row, stop_ids) for row in answer_ids.tolist()]
            new_tokens += sum(length for length, _ in ends)
            lines = []
            answers = tokenizer.batch_decode(answer_ids, skip_special_tokens=True)
            for prompt, answer, (_, finished) in zip(batch, answers, ends):
                turns = [{"from": "human", "value": prompt.question}, {"from": "gpt", "value": answer.strip()}]
                line = {"id": prompt.id, "conversations": turns, "sampled": prompt.sampled, "finished": finished}
                lines.append(json.dumps(line | {REGENERATED_KEY: record}) + "\n")
            sink.write("".join(lines))  # one write per batch, then to disk
            sink.flush()
            os.fsync(sink.fileno())
            bar.update(len(batch))
            bar.set_postfix(new_tokens=new_tokens, tok_per_s=f"{new_tokens / bar.format_dict['elapsed']:.0f}")
    return output


def main(argv: list[str] | None = None) -> None:
    (args,) = HfArgumentParser(RegenerateArguments).parse_args_into_dataclasses(args=argv)
    print(f"wrote {regenerate(args)}")


if __name__ == "__main__":
    command("python -m transformers_specblock.commands.regenerate", main)()
