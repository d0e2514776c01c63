"""A feature store: the frozen target's features over a records file, computed once, sharded, resumable, shared by
every drafter that reads the same target layers (SpecBlock and EAGLE-3 both read ``target_layer_ids`` = the inputs
of layers 2, L//2 and L-3).

Layout of a store folder (the layout `features.PrecomputedFeatures` reads, so training reads a store as it reads
precomputed features):

* ``shard-00000.safetensors``, ...: per token ``features`` [T, 3H] (the concatenated hidden states of
  ``target_layer_ids``, what every drafter fuses), ``final_hidden`` [T, H] (the final-norm hidden state: the soft
  labels over any draft vocabulary are ``final_hidden @ W[d2t]``), ``target_argmax`` (int32), ``input_ids`` (int32),
  ``loss_mask`` (uint8), and ``offsets`` (sequence starts); written to a temporary file and renamed into place.
* ``features_info.json`` (`features.FEATURES_INFO`): the target's identity, the layer ids, dtypes, ``max_length``,
  the records file, and the complete shards with the record ids each holds; rewritten atomically after every shard,
  so it always describes complete shards only.

`extract_features` renders every record of the records file (chat template, assistant mask, cut to ``max_length``,
as training does), skips the ids already stored, runs the target over one sequence at a time (no padding: a
sequence's features do not depend on what it is batched with) and writes a shard every ``shard_tokens`` tokens. An
interrupted run loses at most the shard in progress; a rerun continues after the last complete shard and writes the
same shards an uninterrupted run would have. Records appended to the records file later are extracted by the next
run (a store grows with its data).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging

from .data import _read_records, normalize_conversation, render_conversation
from .features import FEATURES_INFO, _target_head, features_bytes_per_token, target_argmax, target_features, write_shard

logger = logging.get_logger(__name__)

__all__ = ["STORE_FORMAT", "extract_features", "is_feature_store", "read_store_info", "store_conversations"]

STORE_FORMAT = "specblock-feature-store-v1"


def is_feature_store(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds a feature store (an index of format `STORE_FORMAT`)."""
    path = Path(folder) / FEATURES_INFO
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()).get("store_format") == STORE_FORMAT
    except (OSError, json.JSONDecodeError):
        return False


def read_store_info(folder: str | os.PathLike) -> dict[str, Any]:
    """The index of a feature store (complete shards only)."""
    info = json.loads((Path(folder) / FEATURES_INFO).read_text())
    if info.get("store_format") != STORE_FORMAT:
        raise ValueError(f"{folder} is not a feature store (no {STORE_FORMAT} index).")
    return info


def store_conversations(folder: str | os.PathLike, limit: int | None = None) -> list[list[dict[str, str]]]:
    """The conversations a store holds, in its order (normalised messages, read from its records file): what
    training renders to build the draft vocabulary of a run that reads the store."""
    info = read_store_info(folder)
    ids = [i for shard in info["shards"] for i in shard["ids"]][:limit]
    wanted = set(ids)
    records = {r["id"]: r for r in _read_records(Path(info["records_file"])) if r.get("id") in wanted}
    missing = [i for i in ids if i not in records]
    if missing:
        raise ValueError(f"{len(missing)} stored ids are not in {info['records_file']} (e.g. {missing[:3]}).")
    return [normalize_conversation(records[i]) for i in ids]


def _identity(target: PreTrainedModel, layer_ids: Sequence[int], dtype: torch.dtype, max_length: int) -> dict:
    text_config = target.config.get_text_config()
    return {
        "store_format": STORE_FORMAT,
        "target_vocab_size": text_config.vocab_size,
        "target_hidden_size": text_config.hidden_size,
        "target_num_hidden_layers": text_config.num_hidden_layers,
        "target_model_type": text_config.model_type,
        "target_layer_ids": list(layer_ids),
        "target_dtype": str(target.dtype).removeprefix("torch."),
        "dtype": str(dtype).removeprefix("torch."),
        "max_length": max_length,
    }


def _write_json_atomically(path: Path, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def extract_features(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    records_file: str | os.PathLike,
    store_dir: str | os.PathLike,
    layer_ids: Sequence[int],
    max_length: int = 1024,
    dtype: torch.dtype = torch.bfloat16,
    shard_tokens: int = 65536,
    max_tokens: int | None = None,
    max_shards: int | None = None,
    description: dict | None = None,
) -> dict[str, Any]:
    """Extend the store at ``store_dir`` with the features of the records of ``records_file`` not stored yet (see
    the module docstring); stop once the store holds ``max_tokens`` tokens or after ``max_shards`` new shards.
    Returns the index. A store made for another target, other layers, dtype or ``max_length`` is refused."""
    folder = Path(store_dir)
    folder.mkdir(parents=True, exist_ok=True)
    identity = {**_identity(target, layer_ids, dtype, max_length), **(description or {})}
    info_path = folder / FEATURES_INFO
    if info_path.is_file():
        info = read_store_info(folder)
        for key, value in identity.items():
            if info.get(key) != value:
                raise ValueError(f"{folder} was made with {key}={info.get(key)!r}, not {value!r}: use another folder.")
    else:
        breakdown = features_bytes_per_token(identity["target_hidden_size"], dtype)
        info = {**identity, "bytes_per_token": sum(breakdown.values()), "bytes_per_token_breakdown": breakdown,
                "records_file": str(Path(records_file).resolve()), "shards": [], "num_sequences": 0,
                "num_tokens": 0, "total_bytes": 0, "cpu_seconds": 0.0, "seconds": 0.0}  # fmt: skip
    for stale in folder.glob(".shard-*.tmp"):  # a shard an interrupted run was writing
        stale.unlink(missing_ok=True)
    done = {i for shard in info["shards"] for i in shard["ids"]}
    if max_tokens is not None and info["num_tokens"] >= max_tokens:
        return info

    weight, _ = _target_head(target)
    pending = [r for r in _read_records(Path(records_file)) if r["id"] not in done]
    fields = ("features", "final_hidden", "target_argmax", "input_ids", "loss_mask")
    buffer: dict[str, list[torch.Tensor]] = {k: [] for k in fields}
    ids: list[str] = []
    lengths: list[int] = []
    new_shards = 0
    clock, cpu_clock = time.perf_counter(), time.process_time()

    def flush() -> None:
        nonlocal clock, cpu_clock, new_shards
        name = f"shard-{len(info['shards']):05d}.safetensors"
        write_shard(folder / name, buffer, lengths)
        tokens = int(sum(lengths))
        now, cpu_now = time.perf_counter(), time.process_time()
        info["shards"].append({"file": name, "num_sequences": len(lengths), "num_tokens": tokens,
                               "bytes": (folder / name).stat().st_size, "seconds": round(now - clock, 2),
                               "cpu_seconds": round(cpu_now - cpu_clock, 2), "ids": list(ids)})  # fmt: skip
        info["num_sequences"] += len(lengths)
        info["num_tokens"] += tokens
        info["total_bytes"] = sum(s["bytes"] for s in info["shards"])
        info["seconds"] = round(info["seconds"] + now - clock, 2)
        info["cpu_seconds"] = round(info["cpu_seconds"] + cpu_now - cpu_clock, 2)
        clock, cpu_clock = now, cpu_now
        _write_json_atomically(info_path, info)
        new_shards += 1
        for v in buffer.values():
            v.clear()
        ids.clear()
        lengths.clear()

    total = max_tokens if max_tokens is not None else None
    with tqdm(total=total, initial=info["num_tokens"], desc=f"features {folder.name}", unit="tok",
              mininterval=30, smoothing=0.05) as bar:  # fmt: skip
        for record in pending:
            try:
                row = render_conversation(normalize_conversation(record), tokenizer, max_length)
            except Exception:  # noqa: BLE001 - what training skips too
                row = None
            if row is None:
                continue
            input_ids = torch.tensor([row["input_ids"]])
            features, final = target_features(target, input_ids, torch.ones_like(input_ids), layer_ids)
            argmax = target_argmax(final, weight)
            buffer["features"].append(features[0].to("cpu", dtype))
            buffer["final_hidden"].append(final[0].to("cpu", dtype))
            buffer["target_argmax"].append(argmax[0].to("cpu", torch.int32))
            buffer["input_ids"].append(input_ids[0].to(torch.int32))
            buffer["loss_mask"].append(torch.tensor(row["loss_mask"], dtype=torch.uint8))
            ids.append(record["id"])
            lengths.append(input_ids.shape[1])
            bar.update(input_ids.shape[1])
            if sum(lengths) >= shard_tokens:
                flush()
                bar.set_postfix(shards=len(info["shards"]), GB=f"{info['total_bytes'] / 1e9:.2f}")
                if (max_tokens is not None and info["num_tokens"] >= max_tokens) or (
                    max_shards is not None and new_shards >= max_shards
                ):
                    return info
        if lengths:  # the records file is used up: its tail is a (shorter) shard
            flush()
    return info
