"""The commands' argument tables of docs/reference/commands.md, read from the argument dataclasses and parsers."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import sys

from transformers import TrainingArguments

from transformers_specblock.commands import card, convert
from transformers_specblock.commands.cli import BenchArguments
from transformers_specblock.commands.regenerate import RegenerateArguments
from transformers_specblock.training import DataArguments, ModelArguments, SpecBlockTrainingArguments

CARD = "python -m transformers_specblock.commands.card"


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


def parser_help(name: str, main) -> str:
    """The ``--help`` text of an argparse command, as ``name`` and at a fixed width."""
    previous, argv0 = os.environ.get("COLUMNS"), sys.argv[0]
    os.environ["COLUMNS"], sys.argv[0] = "110", name
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
    return "```text\n" + out.getvalue().rstrip() + "\n```"


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
