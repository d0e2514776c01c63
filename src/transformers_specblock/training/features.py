"""Target features: the frozen target's feature states, final-norm hidden state and argmax, its logits over the
draft vocabulary, and the precomputed-features path (safetensors shards written once, read lazily)."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import datasets
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import PreTrainedModel
from transformers.utils import logging

from .data import FEATURES_INFO, SpecBlockDataCollator

logger = logging.get_logger(__name__)

FEATURES_FORMAT = "specblock-features-v1"


def _target_head(target: PreTrainedModel) -> tuple[torch.Tensor, float | None]:
    """The target's output projection weight [V, H] and its final logit soft-cap (Gemma), if any."""
    text_config = target.config.get_text_config()
    return target.get_output_embeddings().weight, getattr(text_config, "final_logit_softcapping", None)


def _softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    return logits if not cap else torch.tanh(logits / cap) * cap


@torch.no_grad()
def target_features(
    target: PreTrainedModel, input_ids: torch.LongTensor, attention_mask: torch.Tensor, layer_ids: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One frozen target forward -> (features [B, T, 3H] = concat of hidden_states[layer_ids], final-norm hidden
    [B, T, H])."""
    decoder = target.get_decoder()
    out = decoder(
        input_ids=input_ids.to(target.device),
        attention_mask=attention_mask.to(target.device).long(),
        output_hidden_states=list(layer_ids),
        use_cache=False,
    )
    # a target spread over devices (device_map) returns each layer's state on that layer's device
    features = torch.cat([out.hidden_states[i].to(target.device) for i in layer_ids], dim=-1)
    return features, out.last_hidden_state


@torch.no_grad()
def target_argmax(final_hidden: torch.Tensor, weight: torch.Tensor, chunk: int = 1024) -> torch.LongTensor:
    """The target's greedy token (full vocabulary) per position, computed in chunks of positions."""
    flat = final_hidden.reshape(-1, final_hidden.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
    for start in range(0, flat.shape[0], chunk):
        piece = flat[start : start + chunk].to(device=weight.device, dtype=weight.dtype)
        out[start : start + chunk] = (piece @ weight.T).argmax(-1)  # the soft-cap is monotone: same argmax
    return out.view(final_hidden.shape[:-1])


def draft_target_logits(
    final_hidden: torch.Tensor, draft_weight: torch.Tensor, softcap: float | None = None
) -> torch.Tensor:
    """Target logits over the draft vocabulary [B, T, Vd] (float32) from its final-norm hidden and ``W[d2t]``."""
    return _softcap(final_hidden.float() @ draft_weight.float().T, softcap)


def _fingerprint(dataset: datasets.Dataset, extra: dict) -> str:
    digest = hashlib.sha256(json.dumps(extra, sort_keys=True).encode())
    for row in dataset:
        digest.update(torch.tensor(row["input_ids"], dtype=torch.int32).numpy().tobytes())
        digest.update(torch.tensor(row["loss_mask"], dtype=torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def features_bytes_per_token(hidden_size: int, dtype: torch.dtype) -> dict[str, int]:
    """Storage per token of the precomputed path, by field."""
    item = torch.empty((), dtype=dtype).element_size()
    return {
        "features": 3 * hidden_size * item,
        "final_hidden": hidden_size * item,
        "target_argmax": 4,
        "input_ids": 4,
        "loss_mask": 1,
    }


def write_shard(path: Path, buffer: dict[str, list[torch.Tensor]], lengths: list[int]) -> None:
    """One shard of sequences: each key's tensors concatenated, and `offsets` (each sequence's start, then the end),
    written to a temporary file and renamed into place (a reader sees the whole shard or none)."""
    tensors = {k: torch.cat(v).contiguous() for k, v in buffer.items()}
    tensors["offsets"] = torch.tensor([0, *lengths]).cumsum(0)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def precompute_features(
    target: PreTrainedModel,
    dataset: datasets.Dataset,
    features_dir: str | os.PathLike,
    layer_ids: Sequence[int],
    dtype: torch.dtype = torch.float16,
    batch_size: int = 8,
    shard_tokens: int = 131072,
    overwrite: bool = False,
    description: dict | None = None,
) -> dict:
    """Run the frozen target once over ``dataset`` and store, per token, the 3 feature states and the final-norm
    hidden state (``dtype``), the target's argmax, the token id and the assistant mask, in safetensors shards.

    ``features_info.json`` (written last: its presence marks a complete set) records the layout, the size per token
    and a fingerprint of target + data; a folder whose fingerprint matches is reused as is, one that does not raises
    unless ``overwrite``. Returns the info dict.
    """
    folder = Path(features_dir)
    text_config = target.config.get_text_config()
    if (folder / FEATURES_INFO).is_file() and "store_format" in json.loads((folder / FEATURES_INFO).read_text()):
        return _check_feature_store(folder, target, dataset, layer_ids, description or {})
    hidden = text_config.hidden_size
    identity = {
        "format": FEATURES_FORMAT,
        "target_vocab_size": text_config.vocab_size,
        "target_hidden_size": hidden,
        "target_num_hidden_layers": text_config.num_hidden_layers,
        "target_model_type": text_config.model_type,
        "target_layer_ids": list(layer_ids),
        "target_dtype": str(target.dtype).removeprefix("torch."),  # a bfloat16 target's features are others
        "dtype": str(dtype).removeprefix("torch."),
        **(description or {}),
    }
    fingerprint = _fingerprint(dataset, identity)
    info_path = folder / FEATURES_INFO
    if info_path.is_file():
        info = json.loads(info_path.read_text())
        if info.get("fingerprint") == fingerprint:
            logger.info(f"Reusing precomputed features in {folder} ({info['bytes_per_token']} bytes/token).")
            return info
        if not overwrite:
            raise ValueError(
                f"{folder} holds features for other data or another target (fingerprint {info.get('fingerprint')}, "
                f"expected {fingerprint}). Pass another --features_dir or --overwrite_features."
            )
        logger.warning(f"Overwriting the precomputed features in {folder}.")
    if folder.exists():
        for old in list(folder.glob("shard-*.safetensors")) + [info_path]:
            old.unlink(missing_ok=True)
    folder.mkdir(parents=True, exist_ok=True)

    breakdown = features_bytes_per_token(hidden, dtype)
    bytes_per_token = sum(breakdown.values())
    weight, _ = _target_head(target)
    collate = SpecBlockDataCollator(pad_token_id=0)
    shards: list[dict] = []
    fields = ("features", "final_hidden", "target_argmax", "input_ids", "loss_mask")
    buffer: dict[str, list[torch.Tensor]] = {k: [] for k in fields}
    lengths: list[int] = []
    start = time.perf_counter()

    def flush() -> None:
        if not lengths:
            return
        name = f"shard-{len(shards):05d}.safetensors"
        write_shard(folder / name, buffer, lengths)
        shards.append({"file": name, "num_sequences": len(lengths), "num_tokens": int(sum(lengths))})
        for v in buffer.values():
            v.clear()
        lengths.clear()

    for first in range(0, len(dataset), batch_size):
        rows = [dataset[i] for i in range(first, min(first + batch_size, len(dataset)))]
        batch = collate([{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]} for r in rows])
        features, final = target_features(target, batch["input_ids"], batch["attention_mask"], layer_ids)
        argmax = target_argmax(final, weight)
        for row, n in enumerate(len(r["input_ids"]) for r in rows):
            buffer["features"].append(features[row, :n].to("cpu", dtype))
            buffer["final_hidden"].append(final[row, :n].to("cpu", dtype))
            buffer["target_argmax"].append(argmax[row, :n].to("cpu", torch.int32))
            buffer["input_ids"].append(batch["input_ids"][row, :n].to(torch.int32))
            buffer["loss_mask"].append(batch["loss_mask"][row, :n].to(torch.uint8))
            lengths.append(n)
        if sum(lengths) >= shard_tokens:
            flush()
    flush()
    num_tokens = sum(s["num_tokens"] for s in shards)
    info = {
        **identity,
        "fingerprint": fingerprint,
        "num_sequences": len(dataset),
        "num_tokens": num_tokens,
        "bytes_per_token": bytes_per_token,
        "bytes_per_token_breakdown": breakdown,
        "total_bytes": bytes_per_token * num_tokens,
        "shards": shards,
        "seconds": round(time.perf_counter() - start, 3),
    }
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{FEATURES_INFO}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(info, f, indent=2)
    os.chmod(tmp, 0o644)
    os.replace(tmp, info_path)
    logger.warning(
        f"Precomputed target features: {num_tokens} tokens x {bytes_per_token} bytes/token "
        f"= {info['total_bytes'] / 2**20:.1f} MiB in {len(shards)} shard(s) under {folder} "
        f"({info['seconds']:.1f} s)."
    )
    return info


def _check_feature_store(
    folder: Path, target: PreTrainedModel, dataset: datasets.Dataset, layer_ids: Sequence[int], description: dict
) -> dict:
    """A feature store (`training.feature_store`) is used as it is, once it fits this run: the target's shape, the
    drafter's layers, ``max_length``, and the rendered training set (its first sequence, and no more sequences than
    the store holds: shards that a running extraction adds later are simply not trained on)."""
    info = json.loads((folder / FEATURES_INFO).read_text())
    text_config = target.config.get_text_config()
    expected = {
        "target_vocab_size": text_config.vocab_size,
        "target_hidden_size": text_config.hidden_size,
        "target_num_hidden_layers": text_config.num_hidden_layers,
        "target_model_type": text_config.model_type,
        "target_layer_ids": list(layer_ids),
        "max_length": description.get("max_length", info["max_length"]),
    }
    for key, value in expected.items():
        if info.get(key) != value:
            raise ValueError(
                f"The feature store {folder} holds {key}={info.get(key)!r}, but this run needs {value!r}"
                + (" (pass --max_length to match it)." if key == "max_length" else ".")
            )
    if str(target.dtype).removeprefix("torch.") != info["target_dtype"]:
        logger.warning(f"The feature store {folder} was computed by a {info['target_dtype']} target; this one is "
                       f"{target.dtype} (the draft vocabulary's soft labels come from the stored states).")  # fmt: skip
    if len(dataset) > info["num_sequences"]:
        raise ValueError(f"{len(dataset)} training sequences but the feature store {folder} holds {info['num_sequences']}.")
    if len(dataset) and info["shards"]:
        with safe_open(folder / info["shards"][0]["file"], framework="pt") as f:
            end = int(f.get_slice("offsets")[1:2].item())
            stored = f.get_slice("input_ids")[:end].tolist()
        if list(dataset[0]["input_ids"]) != stored:
            raise ValueError(f"The feature store {folder} holds other token ids than this tokenizer renders.")
    logger.warning(f"Training on the feature store {folder}: {info['num_sequences']} sequences, {info['num_tokens']} "
                   f"tokens ({info['bytes_per_token']} bytes/token).")  # fmt: skip
    return info


class PrecomputedFeatures(torch.utils.data.Dataset):
    """Sequences of a precomputed features folder, read lazily from the memory-mapped safetensors shards."""

    def __init__(self, features_dir: str | os.PathLike) -> None:
        self.folder = Path(features_dir)
        self.info = json.loads((self.folder / FEATURES_INFO).read_text())
        self.index: list[tuple[int, int, int]] = []  # (shard, start token, end token)
        for shard_idx, shard in enumerate(self.info["shards"]):
            with safe_open(self.folder / shard["file"], framework="pt") as f:
                offsets = f.get_tensor("offsets").tolist()
            self.index += [(shard_idx, offsets[i], offsets[i + 1]) for i in range(len(offsets) - 1)]
        self._handles: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        shard_idx, start, end = self.index[idx]
        handle = self._handles.get(shard_idx)
        if handle is None:
            handle = safe_open(self.folder / self.info["shards"][shard_idx]["file"], framework="pt")
            self._handles[shard_idx] = handle
        return {
            key: handle.get_slice(key)[start:end]
            for key in ("input_ids", "loss_mask", "features", "final_hidden", "target_argmax")
        }

    def __getstate__(self) -> dict:  # DataLoader workers reopen the shards
        return {**self.__dict__, "_handles": {}}
