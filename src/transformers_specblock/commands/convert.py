"""``specblock-convert``: drafter checkpoints between this package's layout and the published ones, folder to folder.

    # a published EAGLE-3 (EAGLE / SpecForge / vLLM speculators), SpecBlock reference or DFlash checkpoint -> ours
    specblock-convert --to native --target meta-llama/Llama-3.1-8B-Instruct yuhuili/EAGLE3-LLaMA3.1-Instruct-8B out/
    # a drafter trained here -> SGLang / vLLM (EAGLE-3; the export carries the target's embedding) or the reference
    specblock-convert --to eagle3 --target meta-llama/Llama-3.1-8B-Instruct out/eagle3-drafter out/eagle3-for-sglang
    specblock-convert --to speculators --target meta-llama/Llama-3.1-8B-Instruct out/eagle3-drafter out/for-vllm
    specblock-convert --to specblock_reference out/specblock-drafter out/specblock-reference

The layout of the input is detected from its `config.json`. A published checkpoint does not describe its target, so
``--to native`` needs ``--target`` (a packaged name, a local folder or a Hub id; only its config is read); so does an
EAGLE-3 export (``--to eagle3`` / ``speculators``), which writes the target's token embedding. Loading is
strict and export refuses a drafter the other tool would compute differently: both say what is wrong.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from transformers import AutoConfig, AutoModelForCausalLM

from ..hub.assets import resolve_model_path
from ..hub.shipped import resolve_drafter_path
from ..models.dflash.modeling_dflash import DFlashDraftModel
from ..models.eagle3.modeling_eagle3 import Eagle3DraftModel
from ..models.specblock.modeling_specblock import SpecBlockDraftModel
from ..models.tree_drafter.checkpoint_io import read_config_dict
from ..models.tree_drafter.modeling_tree_drafter import TreeDraftModel
from .errors import run_command

DRAFTER_CLASSES: tuple[type[TreeDraftModel], ...] = (Eagle3DraftModel, SpecBlockDraftModel, DFlashDraftModel)
NATIVE = "native"
FORMATS = (NATIVE, *sorted({name for cls in DRAFTER_CLASSES for name in cls.checkpoint_writers}))
WITH_TARGET_EMBEDDING = ("eagle3", "speculators")  # exports that carry the target's token embedding


def drafter_class_for(config: dict) -> type[TreeDraftModel] | None:
    """The drafter class whose published layouts include this `config.json` (None: none of them)."""
    return next((cls for cls in DRAFTER_CLASSES if cls.detect_published_layout(config)), None)


def convert(source: str, output: str, to: str, target: str | None = None) -> TreeDraftModel:
    """Convert the checkpoint `source` (folder, Hub id or shipped drafter name) into `output` in layout `to`."""
    if to not in FORMATS:
        raise ValueError(f"--to must be one of {FORMATS}, got {to!r}.")
    path = resolve_drafter_path(source)
    config = read_config_dict(path, {})
    if config is None:
        raise ValueError(f"{source} has no config.json: give a checkpoint folder or Hub id.")
    published = drafter_class_for(config)
    if to == NATIVE:
        if published is None:
            raise ValueError(f"{source} is not a published EAGLE-3, SpecBlock reference or DFlash checkpoint.")
        if target is None:
            raise ValueError("--to native needs --target: the target model the drafter was trained for.")
        drafter = published.from_pretrained(path, target_config=AutoConfig.from_pretrained(resolve_model_path(target)))
        drafter.save_pretrained(output)
        return drafter
    cls = next((c for c in DRAFTER_CLASSES if c.config_class.model_type == config.get("model_type")), None)
    if cls is None:
        raise ValueError(
            f"{source} is not a drafter saved by this package (model_type {config.get('model_type')!r}); "
            "convert it with --to native first."
        )
    if to not in cls.checkpoint_writers:
        raise ValueError(f"A {cls.__name__} exports to {sorted(cls.checkpoint_writers)}, not {to!r}.")
    drafter = cls.from_pretrained(path)
    target_model = None  # kept alive while the export reads its embedding (a drafter binds its target weakly)
    if to in WITH_TARGET_EMBEDDING:
        if target is None:
            raise ValueError(f"--to {to} needs --target: the export carries the target model's token embedding.")
        target_model = AutoModelForCausalLM.from_pretrained(resolve_model_path(target), dtype="auto")
        drafter.bind_target(target_model, place=False)
    drafter.save_pretrained(output, checkpoint_format=to)
    return drafter


def main(argv: Sequence[str] | None = None) -> int:
    """``specblock-convert``: 0 on success, 2 with one paragraph on stderr for a user error (`commands.errors`)."""
    return run_command("specblock-convert", _convert_command, argv)


def _convert_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="checkpoint folder, Hub id or shipped drafter name")
    parser.add_argument("output", help="folder to write")
    parser.add_argument("--to", required=True, choices=FORMATS, help="layout to write")
    parser.add_argument("--target", default=None, help="target model (needed with --to native, eagle3, speculators)")
    parser.add_argument("--traceback", action="store_true", help="show the traceback of a user error")
    args = parser.parse_args(argv)
    convert(args.source, args.output, args.to, args.target)
    print(f"wrote {args.output} ({args.to})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
