"""Command-line arguments of drafter training (`HfArgumentParser` dataclasses), the loss switches, and the dtype /
layer-id option parsing."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from transformers import HfArgumentParser, TrainingArguments

from ..hub.assets import PACKAGED_MODELS
from ..hub.loading import DTYPE_CHOICES, DTYPES
from .attention import SPARSE_SDPA

_DTYPES = DTYPES  # float32, bfloat16, float16
SLOT_NORMALIZATIONS = ("valid_prefix", "slot0")
RANK_LOSS_FORMS = ("package", "reference")
_TIMED_SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine", "warmup_stable_decay")
"""Learning-rate schedules a time budget (`--max_train_minutes`, `--max_train_cpu_hours`) can run by elapsed time."""


@dataclass
class ModelArguments:
    """Which target to train a drafter for, and the drafter's shape."""

    target_model: str = field(
        metadata={"help": f"Target: a packaged model name ({', '.join(PACKAGED_MODELS)}), a local model folder or a "
                  "Hugging Face Hub id."}
    )
    init_drafter: str | None = field(
        default=None, metadata={"help": "Start from this drafter checkpoint (must have been built for the target)."}
    )
    target_dtype: str = field(
        default="auto",
        metadata={
            "aliases": ["--dtype"],
            "choices": DTYPE_CHOICES,
            "help": "dtype of the frozen target (--dtype is the same option). auto = float32 on the CPU; on a GPU the "
            "checkpoint's own dtype if it is 16-bit, else bfloat16 (float32 on GPUs without bfloat16). The drafter "
            "keeps float32 weights whatever this says: --bf16 / --fp16 set its mixed precision, --save_dtype the "
            "saved weights.",
        },
    )
    target_device: str | None = field(
        default=None,
        metadata={
            "aliases": ["--device"],
            "help": "Where the frozen target runs (--device is the same option). Default: the Trainer's device (cuda, "
            "the process' own GPU under torchrun / accelerate launch, cpu with --use_cpu). cuda:N puts it on that "
            "GPU; auto spreads it over every visible GPU (device_map='auto') for a target larger than one GPU, one "
            "process only. The drafter always trains on the Trainer's device; features are moved there.",
        },
    )
    target_layer_ids: str | None = field(
        default=None,
        metadata={"help": "Comma-separated indices into the target's hidden_states tuple used as low/middle/high "
                  "features (default: EAGLE-3's 2, L//2, L-3)."},
    )
    block_size: int | None = field(default=None, metadata={"help": "K, slots per block (default 4)."})
    draft_vocab_size: int | None = field(
        default=None,
        metadata={"help": "Draft vocabulary size (default: the full vocabulary up to 16384 tokens; 16384 for "
                  "vocabularies up to 65536, e.g. SmolLM2's 49152; 32000 above)."},
    )
    drafter: str = field(
        default="specblock", metadata={"help": "Drafter to train: 'specblock', 'eagle3' or 'dflash'."}
    )
    mask_token_id: int | None = field(
        default=None,
        metadata={"help": "DFlash (required for a new drafter): id of a token the target never emits, whose embedding "
                  "marks the masked block positions (SmolLM2: 16, '<empty_output>')."},
    )
    num_anchors: int | None = field(
        default=None,
        metadata={"help": "DFlash: blocks (anchor positions) drawn per sequence each step (default 32; a continued "
                  "drafter: the one it was trained with)."},
    )
    loss_decay_gamma: float | None = field(
        default=None,
        metadata={"help": "DFlash: block offset k >= 1 weighs exp(-(k-1)/gamma) in the loss (default 7; 0 = no decay; "
                  "a continued drafter: the one it was trained with)."},
    )
    drafter_attn_implementation: str = field(
        default=SPARSE_SDPA,
        metadata={
            "choices": [SPARSE_SDPA, "sdpa", "eager"],
            "help": "Attention of the SpecBlock training pass. sparse_sdpa: SDPA per chunk of 256 slot queries over "
            "only the keys that chunk sees (exact; the block masks hide half to three quarters of the keys, which "
            "sdpa computes anyway). Not saved with the drafter; EAGLE-3's training-time test has its own attention.",
        },
    )
    ttt_steps: int | None = field(
        default=None,
        metadata={"help": "EAGLE-3 training-time-test unroll (default 7; a continued drafter: the one it was trained "
                  "with, from its training record). A training setting: recorded in training_record.json, not "
                  "config.json."},
    )
    ttt_decay: float | None = field(
        default=None,
        metadata={"help": "EAGLE-3: unroll step s weighs ttt_decay**s in the loss (default 0.8; a continued drafter: "
                  "the one it was trained with)."},
    )
    drafter_num_layers: int | None = field(default=None, metadata={"help": "Drafter decoder layers (default 2)."})
    init_head_from_target: bool = field(
        default=True,
        metadata={
            "help": "Start a new drafter's final norm and lm_head from the target's (rows d2t of its output "
            "embedding), so the drafter only has to learn the target's hidden-state space. Needs equal hidden sizes."
        },
    )
    init_decoder_from_target: bool = field(
        default=False,
        metadata={
            "help": "Start a new drafter's decoder layers from the target's top layers (drafter layer i of N from "
            "target layer L-N+i; weights whose shapes differ stay random, e.g. EAGLE-3's 2H-wide q/k/v)."
        },
    )
    fusion_identity_init: bool = field(
        default=False,
        metadata={
            "help": "SpecBlock: start a new drafter's fusion layer with identity on its condition part (the token "
            "and slot-query parts stay random), as the layer shifts already start, so the target features reach the "
            "decoder directly as in EAGLE-3. Off by default (the reference initialises the whole fusion at random)."
        },
    )
    save_dtype: str = field(
        default="float32", metadata={"help": "dtype of the final drafter weights: float32, bfloat16 or float16."}
    )
    license: str | None = field(
        default=None,
        metadata={"help": "License of the trained drafter for its model card (a Hub license id, e.g. apache-2.0 or "
                  "mit); without it the card names none."},
    )
    base_model_id: str | None = field(
        default=None,
        metadata={"help": "Hub id (owner/name) of the target, for the model card's base_model when --target_model is "
                  "a local folder that does not record one (packaged models and Hub ids are known already)."},
    )


@dataclass
class DataArguments:
    """Training conversations and how target features are obtained."""

    dataset: str = field(
        default="sharegpt",
        metadata={"help": "'sharegpt' (packaged ShareGPT V3, train split) or a local JSON/JSONL file of chats "
                  "(ShareGPT 'conversations' or OpenAI-style 'messages')."},
    )
    eval_dataset: str | None = field(
        default=None,
        metadata={"help": "'sharegpt-heldout', a local JSON/JSONL file or 'none' (default: sharegpt-heldout when "
                  "training on sharegpt, none otherwise)."},
    )
    eval_samples: int = field(default=64, metadata={"help": "Conversations of the eval set used (its first N)."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only the first N conversations."})
    max_length: int = field(default=1024, metadata={"help": "Truncate rendered conversations to this many tokens."})
    features: str = field(
        default="online",
        metadata={"help": "'online': run the frozen target inside each training step; 'precomputed': run it once "
                  "over the training set and store features in --features_dir."},
    )
    features_dir: str | None = field(
        default=None, metadata={"help": "Where precomputed features live (default: <output_dir>/features)."}
    )
    features_dtype: str = field(
        default="float16", metadata={"help": "Storage dtype of precomputed hidden states (float16/bfloat16/float32)."}
    )
    features_shard_tokens: int = field(default=131072, metadata={"help": "Tokens per precomputed shard (about)."})
    precompute_batch_size: int = field(default=8, metadata={"help": "Sequences per target forward when precomputing."})
    overwrite_features: bool = field(
        default=False, metadata={"help": "Recompute features even if --features_dir holds features for other data."}
    )
    feature_store: str | None = field(
        default=None,
        metadata={"help": "Train on a feature store (`training.feature_store`, e.g. built by `python -m "
                  "transformers_specblock.commands.build_data`): its sequences and stored target features, so no "
                  "step runs the target. Sets --dataset and --features_dir to it and --features precomputed."},
    )

    def __post_init__(self) -> None:
        if self.feature_store is not None:
            self.dataset = self.features_dir = self.feature_store
            self.features = "precomputed"


@dataclass
class SpecBlockTrainingArguments(TrainingArguments):
    """`TrainingArguments` plus the SpecBlock loss switches.

    Changed defaults: ``do_train=True`` (``--do_train false`` evaluates a saved drafter without training it),
    ``remove_unused_columns=False`` (the collator builds what the trainer needs),
    ``adam_beta2=0.95`` and ``max_grad_norm=0.5`` (the reference recipe), ``output_dir="out/drafter"``,
    ``include_num_input_tokens_seen="non_padding"`` (the model card's token count, kept across a resume).
    """

    output_dir: str | None = field(default="out/drafter", metadata={"help": "Checkpoints and the final drafter."})
    do_train: bool = field(
        default=True,
        metadata={"help": "Train (default). --do_train false only evaluates the --init_drafter on the eval set."},
    )
    include_num_input_tokens_seen: str = field(
        default="non_padding", metadata={"help": "Count trained tokens: 'non_padding' (default), 'all' or 'no'."}
    )
    remove_unused_columns: bool = field(default=False, metadata={"help": "Keep all dataset columns (needed)."})
    adam_beta2: float = field(default=0.95, metadata={"help": "AdamW beta2."})
    max_grad_norm: float = field(default=0.5, metadata={"help": "Gradient clipping norm."})
    num_blocks: int = field(default=3, metadata={"help": "Blocks per training step (1 = block 1 only)."})
    slot_decay: float = field(default=0.8, metadata={"help": "Slot k's draft loss weight is slot_decay**k."})
    soft_labels: bool = field(
        default=True, metadata={"help": "Soft CE to the target distribution (else hard CE on the target argmax)."}
    )
    valid_prefix_mask: bool = field(
        default=True, metadata={"help": "Count slot k's draft loss only where slots 0..k-1 were top-1 correct."}
    )
    rank_loss_weight: float = field(default=1.0, metadata={"help": "Weight of the rank-head loss (0 disables it)."})
    rank_chain_mask: bool = field(
        default=True, metadata={"help": "Count rank loss only up to and including the first wrong slot."}
    )
    rank_class_weight_power: float = field(
        default=0.5, metadata={"help": "Class re-weighting (N / (C n_c))**power; 0 disables, 1 = inverse frequency."}
    )
    rank_label_smoothing: float = field(default=0.1, metadata={"help": "Ordinal label smoothing mass epsilon."})
    rank_distance_weight: float = field(default=1.0, metadata={"help": "Weight of the expected ordinal distance."})
    rank_under_penalty: float = field(
        default=2.0,
        metadata={"help": "How much harder under-estimating a rank class is punished than over-estimating."},
    )
    rank_loss_form: str = field(
        default="package",
        metadata={
            "choices": list(RANK_LOSS_FORMS),
            "help": "package: the rank loss of `rank_head_loss` with the rank_class_weight_power, "
            "rank_label_smoothing, rank_distance_weight and rank_under_penalty switches, pooled over blocks. "
            "reference: the SpecBlock reference's (chain cut after the first wrong class prediction, per-slot "
            "weights min(1, rank_budget_per_class / count), kernel smoothing, distance to the predicted class), "
            "averaged over blocks; those four switches are then unused.",
        },
    )
    rank_budget_per_class: int = field(
        default=10, metadata={"help": "rank_loss_form reference: per-slot class weight min(1, budget / count)."}
    )
    slot_normalization: str = field(
        default="valid_prefix",
        metadata={
            "choices": list(SLOT_NORMALIZATIONS),
            "help": "Denominator of each slot's masked draft-loss sum. valid_prefix (the reference formula): that "
            "slot's own count of valid-prefix tokens. slot0: the block's slot-0 count for every slot, so a later "
            "slot gains weight only as the slots before it become right (a departure from the reference formula).",
        },
    )
    unlock_warmup_steps: int = field(
        default=0,
        metadata={"help": "Progressive slot unlocking: slot k >= 1's draft-loss weight ramps linearly from 0 to "
                  "slot_decay**k over the first unlock_warmup_steps * (k+1) steps; slot 0 always has full weight. "
                  "0 = off."},
    )
    rank_start_step: int = field(
        default=0,
        metadata={"help": "The rank loss weighs 0 during the first rank_start_step steps, rank_loss_weight after "
                  "(the reference's first phase; 0 = from the start). Evaluation always counts it."},
    )
    single_block_steps: int = field(
        default=0,
        metadata={"help": "Train with block 1 only (no follow-up blocks) during the first single_block_steps steps, "
                  "with num_blocks after (the reference's first phase; 0 = off). Evaluation always runs num_blocks."},
    )
    max_train_minutes: float | None = field(
        default=None,
        metadata={"help": "Stop after this many minutes of training (all sessions of a resumed run, evaluations "
                  "included) and schedule the learning rate by time: after the warm-up steps, a linear or cosine "
                  "decay (or warmup_stable_decay's, see --decay_share) follows elapsed time / budget instead of step / max_steps, so it ends at the budget "
                  "whatever the hardware's speed. max_steps (or the epochs) still bound the run. Default: no budget."},
    )
    max_train_cpu_hours: float | None = field(
        default=None,
        metadata={"help": "Stop after this many CPU-hours of training (the training process's CPU time, all sessions "
                  "of a resumed run, evaluations included) and schedule the learning rate by CPU progress = CPU time / "
                  "budget, as --max_train_minutes does by wall time: the compute a run spends, which wall time does not "
                  "measure on a shared machine. Give two drafters the same budget to compare them at equal CPU. Not "
                  "with --max_train_minutes. Default: no budget."},
    )
    decay_share: float = field(
        default=0.2,
        metadata={"help": "--lr_scheduler_type warmup_stable_decay with a time budget: the share of the budget, at its "
                  "end, over which the learning rate decays linearly from its peak to 0 (reached exactly at the "
                  "budget); before it, after the warm-up steps, the rate stays at its peak. In (0, 1]."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_train_minutes is not None and self.max_train_cpu_hours is not None:
            raise ValueError(
                "--max_train_minutes (a wall-clock budget) and --max_train_cpu_hours (a CPU-time budget) exclude each "
                "other: give one."
            )
        if self.max_train_minutes is not None and not self.max_train_minutes > 0:
            raise ValueError(f"--max_train_minutes must be > 0, got {self.max_train_minutes}.")
        if self.max_train_cpu_hours is not None and not (0 < self.max_train_cpu_hours < float("inf")):
            raise ValueError(f"--max_train_cpu_hours must be a finite number > 0, got {self.max_train_cpu_hours}.")
        if not 0 < self.decay_share <= 1:
            raise ValueError(f"--decay_share must be in (0, 1], got {self.decay_share}.")
        schedule = getattr(self.lr_scheduler_type, "value", self.lr_scheduler_type)
        budget = self.time_budget_option
        if budget is not None and schedule not in _TIMED_SCHEDULES:
            raise ValueError(
                f"{budget} schedules the learning rate by time, which supports --lr_scheduler_type "
                f"{', '.join(_TIMED_SCHEDULES)}; got {schedule!r}."
            )
        if budget is None and schedule == "warmup_stable_decay" and not self.lr_scheduler_kwargs:
            raise ValueError(
                "--lr_scheduler_type warmup_stable_decay decays to a time budget: give --max_train_cpu_hours H (or "
                "--max_train_minutes N), with --decay_share; without a budget it is transformers' step schedule, "
                "which needs --lr_scheduler_kwargs (num_decay_steps, ...)."
            )

    @property
    def time_budget_option(self) -> str | None:
        """The time-budget option this run gives (``--max_train_cpu_hours`` or ``--max_train_minutes``), or None."""
        if self.max_train_cpu_hours is not None:
            return "--max_train_cpu_hours"
        return "--max_train_minutes" if self.max_train_minutes is not None else None


@dataclass
class SpecBlockLossConfig:
    """The loss switches `SpecBlockDraftModelForTraining.forward` reads (see the `modeling` module docstring)."""

    slot_decay: float = 0.8
    soft_labels: bool = True
    valid_prefix_mask: bool = True
    rank_loss_weight: float = 1.0
    rank_chain_mask: bool = True
    rank_class_weight_power: float = 0.5
    rank_label_smoothing: float = 0.1
    rank_distance_weight: float = 1.0
    rank_under_penalty: float = 2.0
    rank_loss_form: str = "package"
    rank_budget_per_class: int = 10
    slot_normalization: str = "valid_prefix"
    unlock_warmup_steps: int = 0
    rank_start_step: int = 0
    sync_normalizers: bool = True  # sum normalisers over processes under torch.distributed

    def __post_init__(self) -> None:
        if self.slot_normalization not in SLOT_NORMALIZATIONS:
            raise ValueError(
                f"slot_normalization must be one of {SLOT_NORMALIZATIONS}, got {self.slot_normalization!r}."
            )
        if self.rank_loss_form not in RANK_LOSS_FORMS:
            raise ValueError(f"rank_loss_form must be one of {RANK_LOSS_FORMS}, got {self.rank_loss_form!r}.")
        if self.unlock_warmup_steps < 0 or self.rank_start_step < 0:
            raise ValueError("unlock_warmup_steps and rank_start_step must be >= 0.")

    def slot_weights(self, block_size: int, step: int | None = None) -> list[float]:
        """Draft-loss weight of each slot at optimizer step ``step`` (None: evaluation, every slot unlocked):
        ``slot_decay**k``, times ``min(1, step / (unlock_warmup_steps * (k+1)))`` for k >= 1 while unlocking."""
        weights = [self.slot_decay**k for k in range(block_size)]
        if step is None or not self.unlock_warmup_steps:
            return weights
        return [w * min(1.0, step / (self.unlock_warmup_steps * (k + 1))) if k else w for k, w in enumerate(weights)]

    def rank_weight(self, step: int | None = None) -> float:
        """Rank-loss weight at optimizer step ``step`` (None: evaluation): 0 before ``rank_start_step``."""
        return 0.0 if step is not None and step < self.rank_start_step else self.rank_loss_weight

    @classmethod
    def from_args(cls, args: SpecBlockTrainingArguments) -> "SpecBlockLossConfig":
        names = [f for f in cls.__dataclass_fields__ if f != "sync_normalizers"]
        return cls(**{name: getattr(args, name) for name in names})


def _parse_layer_ids(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"--target_layer_ids must be comma-separated integers, got {text!r}.") from None



def parse_train_args(
    argv: Sequence[str] | None = None,
) -> tuple[ModelArguments, DataArguments, SpecBlockTrainingArguments]:
    """Parse ``specblock-train`` arguments (or a single ``.json`` file holding them) into the three dataclasses."""
    parser = HfArgumentParser((ModelArguments, DataArguments, SpecBlockTrainingArguments))
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 1 and argv[0].endswith(".json"):
        return parser.parse_json_file(argv[0])
    return parser.parse_args_into_dataclasses(args=argv)
