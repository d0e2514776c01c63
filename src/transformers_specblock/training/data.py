"""Training conversations: loading and normalising chats, rendering them with the target's chat template into
token ids and an assistant-token mask, and the batch collator."""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch
from transformers import PreTrainedTokenizerBase
from transformers.utils import logging

from ..hub.prompts import load_sharegpt_conversations

logger = logging.get_logger(__name__)


_ROLES = {
    "human": "user", "user": "user", "prompter": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
    "model": "assistant",
    "system": "system",
}  # fmt: skip
_END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "</s>", "<|endoftext|>")


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def normalize_conversation(record: dict) -> list[dict[str, str]]:
    """A ShareGPT (``conversations``: from/value) or OpenAI-style (``messages``: role/content) record -> messages.

    Roles map to system/user/assistant (human/gpt/chatgpt/... included); empty and unknown-role turns are dropped,
    consecutive turns of one role are merged, and trailing non-assistant turns are cut (nothing to learn there).
    """
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list):
        raise ValueError(f"Expected a 'conversations' or 'messages' list in every record, got keys {sorted(record)}.")
    messages: list[dict[str, str]] = []
    for turn in turns:
        if not isinstance(turn, dict):
            continue
        role = _ROLES.get(str(turn.get("from", turn.get("role", ""))).lower())
        content = _text(turn.get("value", turn.get("content")))
        if role is None or not content.strip():
            continue
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += "\n\n" + content
        else:
            messages.append({"role": role, "content": content})
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()
    return messages


def _read_records(path: Path) -> list[dict]:
    # JSON lines end at "\n" only: str.splitlines would also split inside strings holding U+2028 or U+0085
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl" or not text.lstrip().startswith(("[", "{")):
        return [json.loads(line) for line in text.split("\n") if line.strip()]
    try:
        data = json.loads(text)
    except json.JSONDecodeError:  # a .json file holding JSON lines
        return [json.loads(line) for line in text.split("\n") if line.strip()]
    if isinstance(data, dict):
        data = data.get("data", data.get("conversations", [data]))
    return list(data)


CHATTERBOT_HELDOUT_BUCKETS = 50


def load_chatterbot_conversations(split: str = "train", language: str = "english") -> list[dict]:
    """The chatterbot-corpus dialogues of one language as ShareGPT-style records (``{"id", "conversations"}``), in
    file order, each opening question once (the corpus repeats questions with other answers; the first is kept).

    Fixed split by the opening question: ``"heldout"`` = ``zlib.crc32(question) % 50 == 0``, ``"train"`` = the rest.
    Needs the ``chatterbot-corpus`` package (the ``assets`` extra)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"Unknown split {split!r}: expected 'train' or 'heldout'")
    try:
        from importlib.resources import files

        import yaml

        root = files("chatterbot_corpus") / "data" / language
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            f"Chatterbot prompts need the chatterbot-corpus package and PyYAML ({error}): pip install "
            "'transformers-specblock[assets]' (or pip install --no-deps chatterbot-corpus pyyaml)."
        ) from None
    records, seen = [], set()
    for path in sorted((p for p in root.iterdir() if p.name.endswith(".yml")), key=lambda p: p.name):
        dialogues = yaml.safe_load(path.read_text(encoding="utf-8")).get("conversations") or []
        for i, dialogue in enumerate(dialogues):
            turns = [str(t) for t in dialogue if isinstance(t, (str, int, float)) and str(t).strip()]
            if len(turns) < 2 or turns[0] in seen:
                continue
            seen.add(turns[0])
            if (zlib.crc32(turns[0].encode()) % CHATTERBOT_HELDOUT_BUCKETS == 0) != (split == "heldout"):
                continue
            roles = ("human", "gpt")
            conversation = [{"from": roles[j % 2], "value": t} for j, t in enumerate(turns)]
            records.append({"id": f"chatterbot-{language}-{path.name[:-4]}-{i}", "conversations": conversation})
    return records


def load_conversations(source: str, limit: int | None = None) -> list[list[dict[str, str]]]:
    """Chats as lists of ``{"role", "content"}`` messages.

    ``source``: ``"sharegpt"`` (packaged ShareGPT, train split: the held-out split is never trained on),
    ``"sharegpt-heldout"`` (the held-out split, for evaluation), a local JSON/JSONL file, or a feature store folder
    (`training.feature_store`: the conversations it holds, in its order).
    """
    if os.path.isdir(source):
        from .feature_store import store_conversations  # feature_store imports this module

        return store_conversations(source, limit)
    if source in ("sharegpt", "sharegpt-train"):
        records = load_sharegpt_conversations("train")
    elif source == "sharegpt-heldout":
        records = load_sharegpt_conversations("heldout")
    elif os.path.isfile(source):
        records = _read_records(Path(source))
    else:
        raise ValueError(f"Unknown dataset {source!r}: expected 'sharegpt', 'sharegpt-heldout' or a JSON/JSONL file.")
    if limit is not None:
        records = records[:limit]
    return [normalize_conversation(r) for r in records]


FEATURES_INFO = "features_info.json"
"""The index of a folder of precomputed features or a feature store (`features`, `feature_store`)."""
REGENERATED_KEY = "regenerated"
"""Key of the record `commands.regenerate` writes into every conversation it produces (who answered, how)."""
SHAREGPT_HUB_ID = "anon8231489123/ShareGPT_Vicuna_unfiltered"


def regeneration_record(model: str, model_id: str | None, prompts: str, **settings: Any) -> dict[str, Any]:
    """What `commands.regenerate` stores under `REGENERATED_KEY` in each conversation: the answering model (as given
    and its Hub id), where the prompts came from, and the generation settings."""
    given = os.path.realpath(model) if os.path.isdir(model) else model
    return {"model": given, "model_id": model_id, "prompts": prompts, **settings}


def _same_model(record: dict[str, Any], target_model: str, target_id: str | None) -> bool:
    if record.get("model_id") and target_id:
        return record["model_id"] == target_id
    given = os.path.realpath(target_model) if os.path.isdir(target_model) else target_model
    return record.get("model") == given


def describe_training_data(
    source: str, limit: int | None, max_length: int, target_model: str, target_id: str | None
) -> dict[str, Any]:
    """The card's record of the training data, from the data itself: ``data`` (one sentence), ``datasets`` (Hub
    ids the conversations come from, or None) and ``self_distilled`` (True when every answer was regenerated by
    this target, per the `REGENERATED_KEY` records `commands.regenerate` writes; False otherwise)."""
    upto = f"the first {limit} conversations" if limit is not None else "all conversations"
    if source in ("sharegpt", "sharegpt-train"):
        return {
            "data": f"ShareGPT V3 (packaged; train split, the held-out split is never trained on), {upto}, truncated "
            f"to {max_length} tokens: the corpus' own assistant turns, written by other models, NOT responses "
            "regenerated by the target",
            "datasets": [SHAREGPT_HUB_ID],
            "self_distilled": False,
        }
    records, name = _source_records(Path(source))
    records = records[:limit]
    marks = [r.get(REGENERATED_KEY) for r in records]
    marked = [m for m in marks if isinstance(m, dict)]
    kinds = {}
    for record in records:  # records of a mixed file name their source (commands.build_data)
        if record.get("source"):
            kinds[record["source"]] = kinds.get(record["source"], 0) + 1
    mix = f", by source: {', '.join(f'{kind} {count}' for kind, count in kinds.items())}" if kinds else ""
    head = f"{len(records)} conversations of {name} ({upto}, truncated to {max_length} tokens{mix})"
    datasets_used = [SHAREGPT_HUB_ID] if any("sharegpt" in str(m.get("prompts", "")) for m in marked) else None
    if not marked:
        return {
            "data": f"{head}: the file's own assistant turns (it records no regeneration), not known to be "
            "responses of the target",
            "datasets": None,
            "self_distilled": False,
        }
    own = [m for m in marked if _same_model(m, target_model, target_id)]
    others = sorted({m.get("model_id") or "a local model" for m in marked if m not in own})
    settings = {k: v for k, v in own[0].items() if k not in ("model", "model_id")} if own else {}
    if len(own) == len(records):
        text = f"{head}: every answer regenerated by the target itself (self-distillation; {json.dumps(settings)})"
    else:
        parts = [f"{len(own)} answers regenerated by the target itself"] if own else []
        if len(marked) > len(own):
            parts.append(f"{len(marked) - len(own)} regenerated by another model ({', '.join(others)})")
        if len(records) > len(marked):
            parts.append(f"{len(records) - len(marked)} as written in the file")
        text = f"{head}: " + "; ".join(parts) + " - NOT all responses of the target"
    return {"data": text, "datasets": datasets_used, "self_distilled": len(own) == len(records) > 0}


def _source_records(source: Path) -> tuple[list[dict], str]:
    """The records a training source holds and how to name it: a local file's, or the stored ones of a feature store
    (its records file, the ids its complete shards hold)."""
    if (source / FEATURES_INFO).is_file():
        info = json.loads((source / FEATURES_INFO).read_text())
        wanted = {i for shard in info.get("shards", []) for i in shard.get("ids", [])}
        records_file = Path(info.get("records_file", ""))
        records = [r for r in _read_records(records_file) if r.get("id") in wanted] if records_file.is_file() else []
        return records, f"the feature store {source.name!r} over {records_file.name!r}, {info.get('num_tokens', 0):,} tokens"
    if source.is_file():
        return _read_records(source), f"the local file {source.name!r}"
    return [], repr(str(source))


def _apply(tokenizer: PreTrainedTokenizerBase, messages: list[dict], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _assistant_char_spans(
    messages: list[dict[str, str]], tokenizer: PreTrainedTokenizerBase, text: str
) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in the rendered ``text``.

    First choice: the text the template adds for turn i, i.e. render(messages[:i+1]) minus
    render(messages[:i], add_generation_prompt=True) (the assistant content plus its end-of-turn marker), when the
    renders are prefixes of each other. Otherwise: the turn's content found in ``text`` after the previous span,
    extended over an end-of-turn marker that directly follows it.
    """
    spans: list[tuple[int, int]] = []
    cursor = 0
    markers = tuple(m for m in (tokenizer.eos_token, *_END_MARKERS) if m)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        span = None
        if i > 0:
            try:
                before = _apply(tokenizer, messages[:i], generation_prompt=True)
                upto = _apply(tokenizer, messages[: i + 1])
            except Exception:  # noqa: BLE001 - templates that reject partial chats
                before = upto = None
            if upto is not None and text.startswith(upto) and upto.startswith(before) and len(before) >= cursor:
                if len(upto) > len(before):
                    span = (len(before), len(upto))
        if span is None:
            for content in (message["content"], message["content"].strip()):
                start = text.find(content, cursor) if content else -1
                if start >= 0:
                    end = start + len(content)
                    for marker in markers:
                        if text.startswith(marker, end):
                            end += len(marker)
                            break
                    span = (start, end)
                    break
        if span is not None:
            spans.append(span)
            cursor = span[1]
    return spans


def render_conversation(
    messages: list[dict[str, str]], tokenizer: PreTrainedTokenizerBase, max_length: int | None = None
) -> dict[str, list[int]] | None:
    """Chat-template a conversation -> ``{"input_ids", "loss_mask"}`` (1 on assistant tokens), or None if empty.

    Templates with ``{% generation %}`` blocks use transformers' ``return_assistant_tokens_mask``; others get their
    mask from the assistant turns' character spans (`_assistant_char_spans`) and the fast tokenizer's offsets.
    """
    if not messages:
        return None
    template = tokenizer.chat_template or ""
    if "generation %}" in template:
        enc = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = list(enc["input_ids"]), [int(m) for m in enc["assistant_masks"]]
    else:
        text = _apply(tokenizer, messages)
        spans = _assistant_char_spans(messages, tokenizer, text)
        if tokenizer.is_fast:
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids, mask, s = list(enc["input_ids"]), [], 0
            for start, end in enc["offset_mapping"]:
                while s < len(spans) and spans[s][1] <= start:
                    s += 1
                mask.append(int(end > start and s < len(spans) and spans[s][0] < end))
        else:  # slow tokenizer: tokenize the pieces between span boundaries separately
            ids, mask, pos = [], [], 0
            for start, end in spans:
                for piece, flag in ((text[pos:start], 0), (text[start:end], 1)):
                    piece_ids = tokenizer(piece, add_special_tokens=False)["input_ids"] if piece else []
                    ids += piece_ids
                    mask += [flag] * len(piece_ids)
                pos = end
            tail = tokenizer(text[pos:], add_special_tokens=False)["input_ids"] if text[pos:] else []
            ids, mask = ids + tail, mask + [0] * len(tail)
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    if len(ids) < 3 or not any(mask[2:]):  # slot 0 of position 0 predicts token 2
        return None
    return {"input_ids": ids, "loss_mask": mask}


def tokenize_conversations(
    conversations: Sequence[list[dict[str, str]]],
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    name: str = "dataset",
) -> datasets.Dataset:
    """Render every conversation; raise a ValueError if none has an assistant token left."""
    rows, failed, empty = [], 0, 0
    for messages in conversations:
        try:
            row = render_conversation(messages, tokenizer, max_length)
        except Exception as err:  # noqa: BLE001 - e.g. templates enforcing user/assistant alternation
            failed += 1
            if failed <= 3:
                logger.warning(f"{name}: skipping a conversation the chat template rejected: {err}")
            continue
        if row is None:
            empty += 1
        else:
            rows.append(row)
    if not rows:
        raise ValueError(
            f"{name}: none of its {len(conversations)} conversations has an assistant turn to train on "
            f"({empty} without assistant tokens, {failed} rejected by the chat template). A SpecBlock drafter "
            "learns only on assistant tokens: give turns with role 'assistant' (OpenAI 'messages') or from 'gpt' "
            "(ShareGPT 'conversations')."
        )
    num_tokens = sum(len(r["input_ids"]) for r in rows)
    num_assistant = sum(sum(r["loss_mask"]) for r in rows)
    logger.info(
        f"{name}: {len(rows)} sequences, {num_tokens} tokens ({num_assistant} assistant tokens); skipped "
        f"{empty} without assistant tokens and {failed} rejected by the chat template."
    )
    return datasets.Dataset.from_list(rows)


@dataclass
class SpecBlockDataCollator:
    """Right-pads ``input_ids`` (with ``pad_token_id``), ``loss_mask`` and, for precomputed features, the feature
    tensors; adds ``attention_mask`` (1 on real tokens)."""

    pad_token_id: int = 0
    pad_to_multiple_of: int | None = None

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        lengths = [len(e["input_ids"]) for e in examples]
        length = max(lengths)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch: dict[str, torch.Tensor] = {}
        for key in examples[0]:
            values = [torch.as_tensor(e[key]) for e in examples]
            fill = self.pad_token_id if key == "input_ids" else 0
            out = values[0].new_full((len(values), length, *values[0].shape[1:]), fill)
            for row, value in enumerate(values):
                out[row, : value.shape[0]] = value
            batch[key] = out
        batch["input_ids"] = batch["input_ids"].long()
        batch["loss_mask"] = batch["loss_mask"].bool()
        if "target_argmax" in batch:
            batch["target_argmax"] = batch["target_argmax"].long()
        batch["attention_mask"] = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
        return batch
