"""Device and dtype of the models the entry points load (``--device`` / ``--dtype``), and `load_model`.

One rule for ``specblock-bench``, ``python -m transformers_specblock.commands.regenerate``,
``examples/evaluate_drafter.py`` and the target of ``specblock-train``:

* ``--device``: unset -> ``cuda`` when a GPU is visible, else ``cpu``. ``auto`` -> ``device_map="auto"``: the model
  spread over every visible GPU (then CPU memory), for a model larger than one GPU (``balanced``,
  ``balanced_low_0`` and ``sequential`` are passed on too). Any torch device (``cpu``, ``cuda``, ``cuda:1``,
  ``mps``) -> the whole model on it (``device_map=<device>``).
* ``--dtype``: ``float32``, ``bfloat16``, ``float16``, or ``auto``: on a CUDA GPU the checkpoint's own dtype when it
  is 16-bit, else bfloat16 (float32 where the GPU has no bfloat16); anywhere else float32.
* Drafters are loaded in the target's dtype, and `TreeDraftModel.bind_target` (which every ``generate`` call runs)
  puts a drafter on the device of the target's input embedding in the target's dtype.
"""

from __future__ import annotations

import os
import torch
from transformers import AutoConfig, PreTrainedModel, PreTrainedTokenizerBase

from .assets import explain_hub_errors, load_packaged_model, resolve_model_path

__all__ = ["DEVICE_HELP", "DTYPES", "DTYPE_CHOICES", "DTYPE_HELP", "load_model", "resolve_device", "resolve_dtype"]

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES: tuple[str, ...] = ("auto", *DTYPES)
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")  # spread over devices by accelerate

DEVICE_HELP = (
    "Where the model runs: cpu, cuda, cuda:N (one device), or auto (device_map='auto': spread over every visible "
    "GPU, then CPU memory, for a model larger than one GPU). Default: cuda if a GPU is visible, else cpu."
)
DTYPE_HELP = (
    "Weights dtype: auto, bfloat16, float16 or float32. auto = float32 on the CPU; on a GPU the checkpoint's own "
    "dtype if it is 16-bit, else bfloat16 (float32 on GPUs without bfloat16)."
)


def resolve_device(device: str | None) -> str:
    """``--device`` -> the ``device_map`` for ``from_pretrained``: ``"auto"`` (or another accelerate strategy), or
    one device (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...). A ValueError names a malformed or unavailable device."""
    if device is None or device == "":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device in DEVICE_MAPS:
        return device
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"--device {device!r} is not a device: expected auto, cpu, cuda, cuda:N (or another torch device "
            "such as mps)."
        ) from None
    if parsed.type == "meta":
        raise ValueError("--device meta holds no weights: pass a real device (cpu, cuda, cuda:N) or auto.")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: no CUDA GPU is visible here. Pass --device cpu (or leave it unset).")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(
                f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) are visible (cuda:0 .. "
                f"cuda:{torch.cuda.device_count() - 1})."
            )
    return str(parsed)


def _on_gpu(device: str) -> bool:
    """Whether a resolved ``--device`` puts (the start of) the model on a CUDA GPU."""
    if device in DEVICE_MAPS:
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda"


def resolve_dtype(dtype: str | torch.dtype, device: str, checkpoint_dtype: torch.dtype | None = None) -> torch.dtype:
    """``--dtype`` -> a torch dtype for a model on the resolved ``device`` (see the module docstring for
    ``auto``; ``checkpoint_dtype`` is the dtype the checkpoint was saved in, if known)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if not _on_gpu(device):
            return torch.float32
        if checkpoint_dtype in (torch.bfloat16, torch.float16):
            return checkpoint_dtype
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {', '.join(DTYPE_CHOICES)}.")
    return DTYPES[dtype]


def checkpoint_dtype(path: str | os.PathLike) -> torch.dtype | None:
    """The dtype a checkpoint's ``config.json`` records (``dtype`` / ``torch_dtype``), or None."""
    value = getattr(AutoConfig.from_pretrained(path), "dtype", None)
    if isinstance(value, str):
        value = DTYPES.get(value)
    return value if isinstance(value, torch.dtype) else None


def load_model(
    name: str,
    device: str | None = None,
    dtype: str | torch.dtype = "auto",
    cache_dir: str | os.PathLike | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer (a packaged name, a local folder or a Hub id, passed to ``from_pretrained``
    unchanged) on ``device`` in ``dtype``, both command-line strings resolved as in the module docstring.

    ``load_model("meta-llama/Llama-3.1-8B-Instruct", device="auto")`` is
    ``from_pretrained(id, device_map="auto", dtype=torch.bfloat16)`` on a GPU machine.
    """
    device_map = resolve_device(device)
    saved = None
    if dtype == "auto" and _on_gpu(device_map):
        with explain_hub_errors(name):
            saved = checkpoint_dtype(resolve_model_path(name, cache_dir))
    torch_dtype = resolve_dtype(dtype, device_map, saved)
    return load_packaged_model(name, dtype=torch_dtype, cache_dir=cache_dir, device_map=device_map)
