"""Rewrite the model card (``README.md``) of saved drafters from their config and training record.

    python -m transformers_specblock.commands.card FOLDER [FOLDER ...]          # rewrite README.md
    python -m transformers_specblock.commands.card --check FOLDER [FOLDER ...]  # exit 1 if a card differs

The card is exactly what `TreeDraftModel.save_pretrained` writes (`hub.modelcard.build_model_card`), so a generated
card is never edited by hand: change the training record (``training_record.json``: ``training``, ``evaluation``,
``training_settings``) or ``base_model_id`` in ``config.json`` and run this. A README.md this package did not
generate is kept unless ``--force`` is given. A shipped drafter's folder is named by its shipped name in the card.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from huggingface_hub import ModelCard
from transformers import AutoModel

from ..hub.modelcard import build_model_card, is_generated_card
from ..hub.provenance import load_training_record
from ..hub.shipped import SHIPPED_DRAFTERS, SHIPPED_DRAFTERS_DIR
from ..models.tree_drafter.modeling_tree_drafter import TreeDraftModel
from .errors import run_command


def card_for_folder(folder: str | Path, repo_id: str | None = None) -> ModelCard:
    """The generated card of the drafter saved in `folder` (what ``save_pretrained`` would write now; a shipped
    drafter's folder is named by its shipped name)."""
    drafter = AutoModel.from_pretrained(str(folder))
    if not isinstance(drafter, TreeDraftModel):
        raise ValueError(f"{folder} holds a {type(drafter).__name__}, not a transformers-specblock drafter.")
    record = load_training_record(folder)  # AutoConfig builds the config without the drafter's own loader
    if record is not None:
        drafter.config.attach_training_record(record)
    folder = Path(folder).resolve()
    if repo_id is None and folder.parent == SHIPPED_DRAFTERS_DIR and folder.name in SHIPPED_DRAFTERS:
        repo_id = folder.name
    return build_model_card(drafter, repo_id=repo_id)


def main(argv: Sequence[str] | None = None) -> int:
    """0, or 1 when ``--check`` found a stale card; 2 with one paragraph on stderr for a user error."""
    return run_command("python -m transformers_specblock.commands.card", _card_command, argv)


def _card_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", help="saved drafter folders (config.json + model.safetensors)")
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if a README.md differs")
    parser.add_argument("--repo_id", default=None, help="Hub repository id to name in the card (one folder)")
    parser.add_argument("--force", action="store_true", help="replace a README.md this package did not generate")
    parser.add_argument("--traceback", action="store_true", help="show the traceback of a user error")
    args = parser.parse_args(argv)
    stale = []
    for folder in map(Path, args.folders):
        card, path = card_for_folder(folder, args.repo_id), folder / "README.md"
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != str(card):
                stale.append(path)
        elif path.is_file() and not args.force and not is_generated_card(path.read_text(encoding="utf-8")):
            print(f"kept {path}: not a generated card (--force replaces it)", file=sys.stderr)
        else:
            card.save(path)
            print(f"wrote {path}")
    for path in stale:
        print(f"{path} differs from the card generated from its config.json", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
