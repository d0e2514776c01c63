"""The value checks of the drafting settings (`generation_config.TreeGenerationConfig.validate_settings`): each
raises a ValueError naming the setting, what it must be and what it got."""

from __future__ import annotations

from typing import Any, Callable

AUTO = "auto"


def is_count(value: Any, least: int) -> bool:
    """`value` is an int (not a bool) >= `least`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def check_tree_budget(value: int | str) -> None:
    """A tree budget is a positive int or "auto"."""
    if value != AUTO and not is_count(value, 1):
        raise ValueError(f'tree_budget must be a positive int or "auto", got {value!r}.')


def check_number(name: str, value: Any, valid: Callable[[float], bool], expected: str, kind: str = "a number") -> None:
    """Raise a ValueError unless `value` is an int or float (not a bool) that is `valid`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not valid(value):
        raise ValueError(f"{name} must be {kind} {expected}, got {value!r}.")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """Raise a ValueError unless `value` is one of `choices`."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}.")


def check_count(name: str, value: Any, least: int) -> None:
    """Raise a ValueError unless `value` is an int (not a bool) >= `least` (0 reads "off")."""
    if not is_count(value, least):
        off = " (0 = off)" if least == 0 else ""
        raise ValueError(f"{name} must be an int >= {least}{off}, got {value!r}.")
