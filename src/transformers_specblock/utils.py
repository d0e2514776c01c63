"""Small helpers every layer of the package uses (no imports from the package itself)."""

from __future__ import annotations

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
