"""Small helpers shared by the package's layers (no imports from the package itself)."""

from __future__ import annotations

from typing import Any

import torch


def sync(device: torch.device) -> None:
    """Wait for queued device work so wall-clock timings are honest."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def additive_mask(visible: torch.BoolTensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool visibility -> additive float mask (0 where visible, dtype-min elsewhere), as eager attention adds it."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
        ~visible, torch.finfo(dtype).min
    )


def import_pyplot() -> Any:
    """`matplotlib.pyplot` on the non-interactive Agg backend, for the benchmark and learning-curve figures.

    matplotlib is the optional ``plot`` extra: without it this raises an ImportError saying how to install it.
    """
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError(
            "The figures need matplotlib, an optional dependency: pip install 'transformers-specblock[plot]'"
        ) from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
