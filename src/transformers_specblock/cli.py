"""Command-line entry points of transformers-specblock.

* ``specblock-train``: `train_main` (also ``accelerate launch -m transformers_specblock.train ...`` or
  ``torchrun -m transformers_specblock.train ...``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from transformers import HfArgumentParser

from .training import DataArguments, ModelArguments, SpecBlockTrainingArguments, run_training


def parse_train_args(
    argv: Sequence[str] | None = None,
) -> tuple[ModelArguments, DataArguments, SpecBlockTrainingArguments]:
    """Parse ``specblock-train`` arguments (or a single ``.json`` file holding them) into the three dataclasses."""
    parser = HfArgumentParser((ModelArguments, DataArguments, SpecBlockTrainingArguments))
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 1 and argv[0].endswith(".json"):
        return parser.parse_json_file(argv[0])
    return parser.parse_args_into_dataclasses(args=argv)


def train_main(argv: Sequence[str] | None = None) -> None:
    """``specblock-train``: train a SpecBlock drafter for a target with `transformers.Trainer`.

    Example::

        specblock-train --target_model smollm2-135m-instruct --dataset sharegpt --output_dir out/drafter \\
            --block_size 4 --num_blocks 3 --max_steps 2000 --per_device_train_batch_size 4 --learning_rate 3e-4

    Every `transformers.TrainingArguments` option works (``--eval_strategy steps --eval_steps 200``,
    ``--save_steps``, ``--resume_from_checkpoint``, ``--bf16``, ...); see ``specblock-train --help``.
    Metrics land in ``<output_dir>/all_results.json`` and ``trainer_state.json``; call
    `transformers_specblock.training.run_training` to get the trainer object instead.
    """
    model_args, data_args, training_args = parse_train_args(argv)
    run_training(model_args, data_args, training_args)


# ``bench_main`` (the ``specblock-bench`` entry point declared in pyproject.toml) is added here separately.
