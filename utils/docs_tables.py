"""The commands' argument tables of docs/reference/commands.md, read from the argument dataclasses and parsers."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import sys
import textwrap

from transformers import TrainingArguments

from transformers_specblock.commands import card, convert
from transformers_specblock.commands.cli import BenchArguments
from transformers_specblock.commands.regenerate import RegenerateArguments
from transformers_specblock.training import DataArguments, ModelArguments, SpecBlockTrainingArguments

CARD = "python -m transformers_specblock.commands.card"
WIDTH = 100  # characters per line of a code block on the site (tests/test_docs.py's CODE_LINE)


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        return f"`{field.default!r}`"
    if field.default_factory is not dataclasses.MISSING:
        return f"`{field.default_factory()!r}`"
    return "required"


def _escape(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def argument_table(cls: type, skip: type | None = None) -> str:
    """One row per field of a dataclass of arguments (those it inherits from ``skip`` left out)."""
    inherited = {f.name for f in dataclasses.fields(skip)} if skip else set()
    rows = ["| argument | default | what it does |", "|---|---|---|"]
    for field in dataclasses.fields(cls):
        if field.name in inherited:
            continue
        flags = [field.name, *field.metadata.get("aliases", [])]
        if field.default is True:  # HfArgumentParser: --name turns it on (already on), --no_name off
            flags.append(f"no_{field.name}")
        names = ", ".join(f"`--{flag.lstrip('-')}`" for flag in flags)
        rows.append(f"| {names} | {_default(field)} | {_escape(field.metadata.get('help', ''))} |")
    return "\n".join(rows)


def fit_line(line: str, width: int = WIDTH) -> list[str]:
    """A help line folded at spaces to ``width``: an indented command goes on after a backslash, four spaces
    further in; a comment as a comment; prose at the same indent."""
    indent = re.match(r" *", line).group(0)
    comment = line.lstrip().startswith("#")
    command = bool(indent) and not comment
    lines = []
    while len(line) > width:
        cut = line.rfind(" ", len(indent) + 1, width - (2 if command else 0))
        if cut <= len(indent):
            break
        lines.append(line[:cut] + (" \\" if command else ""))
        line = indent + ("    " if command else "# " if comment else "") + line[cut + 1 :]
    return lines + [line]


def parser_help(name: str, main) -> str:
    """The ``--help`` text of an argparse command, as ``name``, formatted and folded to WIDTH characters."""
    previous, argv0 = os.environ.get("COLUMNS"), sys.argv[0]
    os.environ["COLUMNS"], sys.argv[0] = str(WIDTH), name
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main(["--help"])
    finally:
        sys.argv[0] = argv0
        if previous is None:
            os.environ.pop("COLUMNS")
        else:
            os.environ["COLUMNS"] = previous
    return "```text\n" + fit_text(out.getvalue().rstrip()) + "\n```"


def fit_text(text: str, width: int = WIDTH) -> str:
    """Help text folded to ``width``: a paragraph of unindented prose with a longer line is refilled, any other
    line folded on its own (``fit_line``)."""
    paragraphs = []
    for paragraph in text.split("\n\n"):
        lines = paragraph.splitlines()
        if any(len(line) > width for line in lines) and not any(line.startswith(" ") for line in lines):
            paragraphs.append(textwrap.fill(" ".join(lines), width, break_on_hyphens=False))
        else:
            paragraphs.append("\n".join(part for line in lines for part in fit_line(line, width)))
    return "\n\n".join(paragraphs)


def command_reference() -> str:
    return "\n\n".join([
        "## `specblock-train`",
        "Also `accelerate launch -m transformers_specblock.train ...` and `torchrun -m transformers_specblock.train "
        "...`. Every option of `transformers.TrainingArguments` is accepted as well (`--bf16`, `--save_steps`, "
        "`--resume_from_checkpoint`, ...).",
        "### The target and the drafter", argument_table(ModelArguments),
        "### The data", argument_table(DataArguments),
        "### Training (beyond `TrainingArguments`)", argument_table(SpecBlockTrainingArguments, skip=TrainingArguments),
        "## `specblock-bench`", argument_table(BenchArguments),
        "## `python -m transformers_specblock.commands.regenerate`",
        "The target's own answers to training prompts (self-distillation data), batched and resumable.",
        argument_table(RegenerateArguments),
        "## `specblock-convert`", parser_help("specblock-convert", convert.main),
        f"## `{CARD}`", parser_help(CARD, card.main),
    ])  # fmt: skip
