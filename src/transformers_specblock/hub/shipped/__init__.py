"""Drafters shipped inside the package (package data): one folder per drafter, each a `save_pretrained` folder
(``config.json``, ``model.safetensors``, ``README.md`` model card).

A shipped drafter is named by its folder name, e.g. ``"specblock-smollm2-135m-instruct"``:
``SpecBlockDraftModel.from_pretrained(name)`` (any `TreeDraftModel` subclass) and ``specblock-bench
--specblock_model name`` resolve it with `resolve_drafter_path`; for `AutoModel` pass the folder,
``AutoModel.from_pretrained(shipped_drafter_path(name))`` (`AutoConfig` resolves names before any drafter code runs).
"""

from __future__ import annotations

import os
from pathlib import Path

SHIPPED_DRAFTERS_DIR = Path(__file__).resolve().parent
"""The folder holding the shipped drafters (inside the installed package)."""

SHIPPED_DRAFTERS: tuple[str, ...] = tuple(
    sorted(entry.name for entry in SHIPPED_DRAFTERS_DIR.iterdir() if (entry / "config.json").is_file())
)
"""Names of the shipped drafters (their folder names)."""


def shipped_drafter_path(name: str) -> Path:
    """The folder of the shipped drafter `name` (one of `SHIPPED_DRAFTERS`); a ValueError for any other name."""
    if name not in SHIPPED_DRAFTERS:
        raise ValueError(f"No shipped drafter named {name!r}: the shipped drafters are {', '.join(SHIPPED_DRAFTERS)}.")
    return SHIPPED_DRAFTERS_DIR / name


def resolve_drafter_path(name_or_path: str | os.PathLike | None) -> str | os.PathLike | None:
    """What `from_pretrained` should load for `name_or_path`.

    * an existing local folder wins, even if a shipped drafter has the same name: returned unchanged;
    * otherwise a shipped drafter's name (one of `SHIPPED_DRAFTERS`) -> `shipped_drafter_path(name)`;
    * anything else (a Hub id such as ``"user/repo"``, a missing path, None) is returned unchanged, so
      `from_pretrained` treats it as it always does.
    """
    if isinstance(name_or_path, str) and name_or_path in SHIPPED_DRAFTERS and not os.path.isdir(name_or_path):
        return shipped_drafter_path(name_or_path)
    return name_or_path
