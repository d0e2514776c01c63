"""Small helpers shared by the package's layers (no imports from the package itself)."""

from __future__ import annotations

import os
import statistics
from collections import deque
from typing import Any

import numpy
import torch
import transformers
from packaging.version import Version


# The transformers releases whose private GenerationMixin methods the `generate` router replaces (the table of their
# signatures per release is `generation.integration.ROUTED_SIGNATURES`, checked at import); CI runs the tree loop's
# exactness, sampling, batching and streamer tests under the oldest and the newest of them.
SUPPORTED_TRANSFORMERS = ">=5.23,<5.26"
# the name of the KV cache in a model's forward arguments and outputs (transformers renamed it in 5.24)
CACHE_ARGUMENT = "past_key_values" if Version(transformers.__version__).release < (5, 24) else "cache"
PATCH_FREE_ROUTE = "transformers_specblock.generate(model, **inputs, assistant_model=drafter)"


def to_device(host: numpy.ndarray | list, device: torch.device | str) -> torch.Tensor:
    """Host data (a numpy array or a list) on `device` without waiting for the device: on a GPU a blocking copy
    synchronises the stream (PyTorch waits for the copy and so for all queued work), while a non-blocking copy from
    pageable memory is staged by the driver before it returns (the host buffer may go at once) and waits for nothing.
    On a CPU it is the tensor itself."""
    tensor = torch.from_numpy(host) if isinstance(host, numpy.ndarray) else torch.tensor(host)
    return tensor.to(device, non_blocking=True)


def sync(device: torch.device) -> None:
    """Wait for queued device work so wall-clock timings are honest."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def additive_mask(visible: torch.BoolTensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool visibility -> additive float mask (0 where visible, dtype-min elsewhere), as eager attention adds it."""
    return torch.full(visible.shape, torch.finfo(dtype).min, dtype=dtype, device=visible.device).masked_fill_(visible, 0)


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


class RecentMean:
    """The mean of the samples of the last `window` steps, and at least of the last `keep` samples (so a quantity
    measured rarely keeps its latest measurements instead of none). `count` is the number of samples ever added."""

    def __init__(self, window: int, keep: int) -> None:
        self.window, self.keep = window, keep
        self.samples: deque[tuple[int, float]] = deque()  # (step, value), oldest first
        self.count = 0

    def add(self, step: int, value: float) -> None:
        self.samples.append((step, value))
        self.count += 1
        while len(self.samples) > self.keep and self.samples[0][0] <= step - self.window:
            self.samples.popleft()

    def latest_within_window(self, step: int) -> bool:
        """Whether the newest sample was added in the last `window` steps (before `step`)."""
        return bool(self.samples) and self.samples[-1][0] > step - self.window

    def mean(self, step: int) -> float:
        recent = self._recent(step)
        return sum(recent) / len(recent) if recent else 0.0

    def median(self, step: int) -> float:
        """The (low) median of the same samples: one-off spikes (a first call's new kernel shapes) do not move it."""
        recent = self._recent(step)
        return statistics.median_low(recent) if recent else 0.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able copy (`from_dict` restores it)."""
        return {"window": self.window, "keep": self.keep, "count": self.count, "samples": [list(s) for s in self.samples]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RecentMean":
        recent = cls(data["window"], data["keep"])
        recent.samples.extend((int(step), float(value)) for step, value in data["samples"])
        recent.count = data["count"]
        return recent

    @staticmethod
    def pairs_to_json(means: dict[tuple[int, int], "RecentMean"]) -> dict[str, dict[str, Any]]:
        """{(a, b): mean} as JSON, keys "a,b" (a bool b as 0 / 1); `pairs_from_json` reads it back."""
        return {",".join(str(int(part)) for part in key): mean.to_dict() for key, mean in means.items()}

    @classmethod
    def pairs_from_json(cls, data: dict[str, dict[str, Any]]) -> dict[tuple[int, int], "RecentMean"]:
        """The inverse of `pairs_to_json` (a key (1, 1) finds what (1, True) stored: they hash alike)."""
        return {tuple(int(part) for part in key.split(",")): cls.from_dict(mean) for key, mean in data.items()}

    def _recent(self, step: int) -> list[float]:
        return [v for i, (s, v) in enumerate(reversed(self.samples)) if i < self.keep or s > step - self.window]


def write_atomically(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a synced temporary file and a rename: readers see the old or the new file."""
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def check_same_machine(folder: str | os.PathLike, machine: str, rows: str = "per_prompt.jsonl") -> None:
    """Timed rows from two machines do not compare: ``folder/machine.txt`` names the machine that timed the rows in
    ``folder/rows`` (written before the first row), and resuming them on another machine is refused."""
    record = os.path.join(folder, "machine.txt")
    if os.path.exists(record):
        with open(record) as f:
            recorded = f.read().strip()
        if recorded != machine:
            raise ValueError(
                f"{folder} holds rows timed on {recorded}; this machine is {machine}. Rows timed on two machines do not "
                f"compare: pass another output folder, or delete {os.path.join(folder, rows)} to measure them again here."
            )
    elif not os.path.exists(os.path.join(folder, rows)):  # rows of an older folder name no machine: none is guessed
        os.makedirs(folder, exist_ok=True)
        write_atomically(record, machine + "\n")
