"""How every command reports a user error: one clean paragraph on stderr and exit status 2, no traceback.

A user error is a `ValueError` or an `OSError` (a model or file that cannot be found or read, a bad argument value,
a drafter built for another target): the package's messages already say what is wrong and what to do. Any other
exception is a bug and keeps its traceback. ``--traceback`` on any command shows the traceback of a user error too
(``--debug`` is taken: it is a `TrainingArguments` option of ``specblock-train``). The command functions themselves
(`bench_main`, `train_main`, `regenerate.main`) raise, for programs that call them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError)
TRACEBACK_FLAG = "--traceback"


def run_command(name: str, main: Callable[[list[str]], Any], argv: Sequence[str] | None = None) -> int:
    """Run `main(argv)` (default: ``sys.argv[1:]``); a user error becomes one paragraph on stderr and status 2,
    unless `argv` holds ``--traceback`` (taken out before `main` sees it). Returns `main`'s int status, else 0."""
    argv = list(sys.argv[1:] if argv is None else argv)
    show_traceback = TRACEBACK_FLAG in argv
    argv = [arg for arg in argv if arg != TRACEBACK_FLAG]
    try:
        status = main(argv)
    except USER_ERRORS as error:
        if show_traceback:
            raise
        print(f"{name}: error: {paragraph(error)} (Run with {TRACEBACK_FLAG} for the traceback.)", file=sys.stderr)
        return 2
    return status if isinstance(status, int) else 0


def paragraph(error: BaseException) -> str:
    """The error's message as one paragraph (its lines joined; the class name when it has no message)."""
    return " ".join(str(error).split()) or type(error).__name__


def command(name: str, main: Callable[[list[str]], Any]) -> Callable[[], None]:
    """A console-script entry (``project.scripts``): `run_command(name, main)`, its status as the exit code."""

    def entry() -> None:
        sys.exit(run_command(name, main))

    entry.__name__ = entry.__qualname__ = f"{main.__name__}_command"
    entry.__doc__ = f"``{name}``: `{main.__name__}` with user errors as one paragraph (`commands.errors`)."
    return entry
