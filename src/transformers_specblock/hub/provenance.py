"""What a model card may say about where a drafter came from, detected or recorded when it happens.

* `resolve_base_model_id`: the Hub id of a target model, or None; never a local path.
* `describe_hardware`: the machine and the torch dtypes a run actually used (CPU model and cores, or GPU name).
* the training record (``training_record.json`` next to a drafter's weights, `load_training_record` /
  `save_training_record`): where the weights came from (the chain of runs and their commands, data, tokens, time,
  hardware), the settings they were trained with and what they measured, each row naming its setting and results
  file. config.json holds the architecture only; the model card summarises the record.
* `scrub_paths`: a record never names a folder of the machine it was made on (``/home/me/runs/out`` becomes
  ``<local>:runs/out``).
"""

from __future__ import annotations

import json
import os
import platform
import re
from pathlib import Path

from typing import Any

import torch
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from .assets import PACKAGED_MODELS, default_cache_dir

__all__ = [
    "TRAINING_RECORD_NAME",
    "absolute_paths_in",
    "describe_device",
    "describe_hardware",
    "is_hub_id",
    "load_training_record",
    "resolve_base_model_id",
    "save_training_record",
    "scrub_paths",
]

TRAINING_RECORD_NAME = "training_record.json"
"""The file next to a drafter's weights that holds its training record."""

RECORD_ABOUT = (
    "How these drafter weights were trained and measured (transformers-specblock): 'training' is the run that wrote "
    "them, with the record of the drafter it started from nested under 'started_from'; 'training_settings' the "
    "training settings that are not architecture; 'evaluation' what the weights measured, each row naming its "
    "setting and its results file. config.json holds the architecture only; README.md summarises this record."
)

_ABSOLUTE_PATH = re.compile(r"(?<![\w.:/~-])(?:~|[A-Za-z]:)?/(?:[\w.@+~-]+/)*[\w.@+~-]+/?")
"""An absolute POSIX path (or ``~/...``, ``C:/...``) not inside a URL or an ``owner/name`` id."""


def _is_path(text: str) -> bool:
    return text.count("/") >= 2 or text.startswith("~")  # "/x" alone is too likely a ratio or a unit ("tokens/s")


def absolute_paths_in(value: Any) -> list[str]:
    """Every absolute path named anywhere in `value` (strings, and lists / dicts of them, keys included)."""
    if isinstance(value, str):
        return [m.group(0) for m in _ABSOLUTE_PATH.finditer(value) if _is_path(m.group(0))]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in absolute_paths_in(k) + absolute_paths_in(v)]
    if isinstance(value, (list, tuple)):
        return [p for v in value for p in absolute_paths_in(v)]
    return []


def scrub_paths(value: Any) -> Any:
    """`value` with every absolute path replaced by ``<local>:`` and its last two components (a folder of the
    machine a run was made on says nothing to a reader and names its user); lists and dicts are scrubbed deeply."""
    if isinstance(value, str):

        def short(match: re.Match) -> str:
            path = match.group(0)
            if not _is_path(path):
                return path
            parts = [p for p in path.rstrip("/").split("/") if p and p not in ("~",) and not p.endswith(":")]
            return "<local>:" + "/".join(parts[-2:])

        return _ABSOLUTE_PATH.sub(short, value)
    if isinstance(value, dict):
        return {scrub_paths(k): scrub_paths(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub_paths(v) for v in value]
    return value


def load_training_record(
    name_or_path: str | os.PathLike, subfolder: str = "", **hub_kwargs: Any
) -> dict[str, Any] | None:
    """The training record saved next to a drafter (a local folder, or a Hub repository through the cache), or
    None where there is none."""
    folder = Path(name_or_path) / subfolder
    if folder.is_dir():
        path: str | Path | None = folder / TRAINING_RECORD_NAME
        if not Path(path).is_file():
            return None
    elif os.path.exists(name_or_path):  # a file, not a folder
        return None
    else:
        from transformers.utils import cached_file

        try:
            path = cached_file(
                str(name_or_path), TRAINING_RECORD_NAME, subfolder=subfolder,
                _raise_exceptions_for_missing_entries=False, _raise_exceptions_for_connection_errors=False,
                **hub_kwargs,
            )  # fmt: skip
        except (OSError, ValueError):
            return None
        if path is None:
            return None
    with open(path, encoding="utf-8") as handle:
        record = json.load(handle)
    record.pop("about", None)
    return record


def save_training_record(record: dict[str, Any] | None, folder: str | os.PathLike) -> Path | None:
    """Write `record` as ``training_record.json`` in `folder` (absolute paths scrubbed; nothing for an empty
    record, and a stale file of earlier weights is removed); returns the file written, or None."""
    path = Path(folder) / TRAINING_RECORD_NAME
    record = {k: v for k, v in (record or {}).items() if v}
    if not record:
        if path.is_file():
            path.unlink()
        return None
    path.write_text(json.dumps({"about": RECORD_ABOUT, **scrub_paths(record)}, indent=1) + "\n", encoding="utf-8")
    return path


def is_hub_id(text: str | None) -> bool:
    """True for a well-formed ``owner/name`` Hub repository id (syntax only: ``out/drafter`` is one too, so callers
    check for an existing local folder first)."""
    if not text or text.count("/") != 1:
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def _hub_cache_id(folder: Path) -> str | None:
    """``.../models--owner--name/snapshots/<sha>`` (a Hugging Face cache snapshot) -> ``owner/name``."""
    parts = folder.resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        candidate = parts[-3][len("models--") :].replace("--", "/", 1)
        return candidate if is_hub_id(candidate) else None
    return None


def resolve_base_model_id(name_or_path: str | os.PathLike | None, explicit: str | None = None) -> str | None:
    """The Hub id a target model was published under, or None when it is not known.

    ``explicit`` (``--base_model_id``) wins and must be an ``owner/name`` id. Otherwise: a packaged model name ->
    the Hub id `PACKAGED_MODELS` records (also for its converted copy in `default_cache_dir`); a local folder -> the
    Hub id its own ``config.json`` records as ``_name_or_path`` (or its Hugging Face cache location), else None; a
    string that is no local path and is an ``owner/name`` id -> itself (a model loaded from the Hub). A local path
    is never returned.
    """
    if explicit:
        if not is_hub_id(explicit):
            raise ValueError(f"--base_model_id must be a Hub id of the form owner/name, got {explicit!r}.")
        return explicit
    if name_or_path is None:
        return None
    name = str(name_or_path)
    if name in PACKAGED_MODELS:
        return PACKAGED_MODELS[name].hub_id
    if os.path.isdir(name):
        folder = Path(name).resolve()
        if folder.name in PACKAGED_MODELS and folder.parent == (default_cache_dir() / "models").resolve():
            return PACKAGED_MODELS[folder.name].hub_id  # the converted copy `load_packaged_model` loads
        recorded = None
        config_file = Path(name) / "config.json"
        if config_file.is_file():
            try:
                recorded = json.loads(config_file.read_text(encoding="utf-8")).get("_name_or_path")
            except (OSError, ValueError):
                recorded = None
        if isinstance(recorded, str) and is_hub_id(recorded) and not os.path.exists(recorded):
            return recorded
        return _hub_cache_id(Path(name))
    if os.path.exists(name):  # a file, not a model id
        return None
    return name if is_hub_id(name) else None


def _cpu_info() -> dict[str, str]:
    """The first processor's block of /proc/cpuinfo (empty where there is none)."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not line.strip():
                    break  # the first processor's block is enough
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return info


def _cpu_name(info: dict[str, str]) -> str:
    name = info.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    if not re.search(r"\d", name) and "cpu family" in info and "model" in info:  # e.g. a bare "AMD EPYC"
        name += f" (family {info['cpu family']} model {info['model']})"
    return name


def native_bfloat16_flags(info: dict[str, str] | None = None) -> list[str]:
    """The CPU flags that make bfloat16 matmuls native here (AVX512-BF16, AMX); empty where bfloat16 is emulated."""
    flags = set((info if info is not None else _cpu_info()).get("flags", "").split())
    return sorted(flags & {"avx512_bf16", "amx_bf16"})


def cpu_capability(info: dict[str, str] | None = None) -> str:
    """The vector ISA torch's CPU kernels use here, and whether the CPU multiplies bfloat16 natively: without
    AVX512-BF16 or AMX, a bfloat16 matmul of several rows (a tree verification, training) is far slower than float32."""
    native = native_bfloat16_flags(info)
    return f"torch {torch.backends.cpu.get_cpu_capability()}, " + (
        f"native bfloat16 ({', '.join(native)})" if native else "no native bfloat16 matmul"
    )


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def describe_device(device: torch.device | str | None = None, num_processes: int = 1) -> str:
    """The hardware behind ``device``: GPU name (times the processes), or CPU model and usable cores."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
        return f"{num_processes} x {name}" if num_processes > 1 else name
    if device.type != "cpu":
        return f"{device.type} device" + (f" x {num_processes}" if num_processes > 1 else "")
    info = _cpu_info()
    text = f"{_cpu_name(info)}, {_usable_cores()} cores, {cpu_capability(info)}"
    return text + (f" ({num_processes} processes)" if num_processes > 1 else "")


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def describe_hardware(
    device: torch.device | str | None,
    target_dtype: torch.dtype | str,
    drafter_dtype: torch.dtype | str,
    num_processes: int = 1,
    mixed_precision: str | None = None,
    target_device: torch.device | str | None = None,
) -> str:
    """One line for a card: ``"<device>; target <dtype>, drafter <dtype>[ (<mixed> mixed precision)]"``; when the
    target runs on another kind of device than the drafter (``target_device``), both are named."""
    text = describe_device(device, num_processes)
    if target_device is not None and torch.device(target_device).type != torch.device(device or "cpu").type:
        text = f"drafter on {text}, target on {describe_device(target_device)}"
    text += f"; target {_dtype_name(target_dtype)}, drafter {_dtype_name(drafter_dtype)}"
    return text + (f" ({mixed_precision} mixed precision)" if mixed_precision else "")
