"""What "auto" measures and learns, kept on disk like an autotuning cache (`auto_budget_cost_cache`).

Files live in the package's cache folder (`hub.assets.default_cache_dir`); each is JSON, written atomically, keyed by
what the measurement depends on: the hardware (`hardware_fingerprint`), the target's architecture
(`target_architecture_fingerprint`), its dtype and device, and for a chooser's learnt state the drafter's weights
(`weights_fingerprint`) and settings. A file that cannot be read is ignored (the measurement runs again); one that
cannot be written is skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from ..hub.provenance import cpu_capability, describe_device


def hardware_fingerprint(device: torch.device) -> str:
    """What a timing depends on besides the model: the device (GPU name, or CPU model, cores and its vector ISA),
    the intra-op threads and the torch version."""
    threads = torch.get_num_threads()
    return f"{describe_device(device)}; {cpu_capability()}; {threads} threads; torch {torch.__version__}"


def target_architecture_fingerprint(target: PreTrainedModel) -> str:
    """A short hash of what the target's cost depends on: its architecture (the config without names or paths)
    and attention implementation, not its weights."""
    config = {
        k: v for k, v in target.config.to_dict().items() if "name_or_path" not in k and k != "transformers_version"
    }
    return digest([config, target.config._attn_implementation])


def weights_fingerprint(module: nn.Module) -> str:
    """A short hash of a module's weights: names, shapes, dtypes and 64 evenly spaced values of each tensor."""
    parts = []
    for name, tensor in module.state_dict().items():
        flat = tensor.detach().flatten()
        sample = flat[:: max(1, flat.numel() // 64)][:64].float().cpu().tolist()
        parts.append([name, list(tensor.shape), str(tensor.dtype), sample])
    return digest(parts)


def digest(value: Any) -> str:
    """A 16-hex-digit hash of a JSON-able value."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or {} where there is none or it cannot be read."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write `data` to `path` atomically (a temporary file renamed over it); skipped where it cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as handle:
            json.dump(data, handle, indent=1, sort_keys=True)
        os.replace(handle.name, path)
    except OSError:
        return
