"""Training a SpecBlock drafter with `transformers.Trainer`.

Pipeline (see `run_training`):

1. Conversations (packaged ShareGPT train split, or a local JSON/JSONL file with ShareGPT ``conversations`` or
   OpenAI-style ``messages``) are rendered with the target's chat template; an assistant-token mask marks the tokens
   the drafter is trained to predict. Sequences are truncated to ``max_length``.
2. The draft vocabulary (``d2t`` / ``t2d``) is the ``draft_vocab_size`` most frequent assistant tokens of the training
   data, stored sorted by target id.
3. Target features come either online (the frozen target runs under ``no_grad`` inside every training step) or from
   safetensors shards precomputed once (per token: the three feature states, the target's final-norm hidden state
   and the target's argmax; the soft labels over the draft vocabulary are recomputed at train time from the target's
   ``lm_head`` rows ``W[d2t]``).
4. `SpecBlockTrainer` (a `Trainer` subclass: the target runs inside `compute_loss`) optimises
   `SpecBlockDraftModelForTraining`, whose ``forward`` is the multi-block training pass and returns the loss.

Modules (imports flow one way: ``attention`` <- ``arguments``, ``data``, ``features``, ``vocab``, ``losses`` <-
``modeling`` <- ``trainer`` <- ``run``):

* `attention`: ``sparse_sdpa``, exact SDPA that skips the keys the block masks hide (the training pass' default).
* `arguments`: the command-line dataclasses, `parse_train_args` and `SpecBlockLossConfig`.
* `data`: conversations, chat-template rendering with assistant masks, `SpecBlockDataCollator`.
* `features`: the frozen target's features, online or precomputed (`precompute_features`, `PrecomputedFeatures`).
* `vocab`: the draft vocabulary (``d2t`` / ``t2d``) and the head initialised from the target.
* `losses`: the loss parts, the follow-up block mask and the logged metrics.
* `modeling`: `SpecBlockDraftModelForTraining`, the multi-block training pass; its docstring states the loss.
* `trainer`: `SpecBlockTrainer`.
* `records`: what a card says about training: a run's record, a checkpoint's, the drafter a run started from.
* `run`: `run_training`, the drafter it builds, its learning curve and saved weights.
"""

from .attention import SPARSE_SDPA, sparse_sdpa_attention_forward
from .arguments import (
    DataArguments,
    ModelArguments,
    SpecBlockLossConfig,
    SpecBlockTrainingArguments,
    parse_train_args,
)
from .data import (
    SpecBlockDataCollator,
    load_conversations,
    normalize_conversation,
    render_conversation,
    tokenize_conversations,
)
from .features import (
    FEATURES_FORMAT,
    FEATURES_INFO,
    PrecomputedFeatures,
    draft_target_logits,
    features_bytes_per_token,
    precompute_features,
    target_argmax,
    target_features,
)
from .losses import (
    BlockTerms,
    block_terms,
    followup_training_mask,
    ordinal_targets,
    rank_head_loss,
    rank_labels,
    reference_rank_loss,
    slot_windows,
    soft_cross_entropy,
    stats_to_metrics,
    target_ranks,
)
from .modeling import SpecBlockDraftModelForTraining, SpecBlockTrainingOutput
from .records import checkpoint_training_info, parse_train_command, record_training_info, training_info
from .run import (
    DRAFTERS,
    check_drafter_for_target,
    check_layer_ids,
    plot_learning_curve,
    run_training,
    save_drafter,
)
from .trainer import SpecBlockTrainer
from .vocab import (
    build_draft_vocab,
    default_draft_vocab_size,
    init_decoder_from_target,
    init_head_from_target,
    set_draft_vocab,
)

__all__ = [
    "DRAFTERS",
    "FEATURES_FORMAT",
    "FEATURES_INFO",
    "SPARSE_SDPA",
    "BlockTerms",
    "DataArguments",
    "ModelArguments",
    "PrecomputedFeatures",
    "SpecBlockDataCollator",
    "SpecBlockDraftModelForTraining",
    "SpecBlockLossConfig",
    "SpecBlockTrainer",
    "SpecBlockTrainingArguments",
    "SpecBlockTrainingOutput",
    "block_terms",
    "build_draft_vocab",
    "check_drafter_for_target",
    "checkpoint_training_info",
    "check_layer_ids",
    "default_draft_vocab_size",
    "draft_target_logits",
    "features_bytes_per_token",
    "followup_training_mask",
    "init_decoder_from_target",
    "init_head_from_target",
    "load_conversations",
    "normalize_conversation",
    "ordinal_targets",
    "parse_train_args",
    "parse_train_command",
    "plot_learning_curve",
    "precompute_features",
    "rank_head_loss",
    "rank_labels",
    "reference_rank_loss",
    "record_training_info",
    "render_conversation",
    "run_training",
    "save_drafter",
    "set_draft_vocab",
    "slot_windows",
    "soft_cross_entropy",
    "sparse_sdpa_attention_forward",
    "stats_to_metrics",
    "target_argmax",
    "target_features",
    "target_ranks",
    "tokenize_conversations",
    "training_info",
]
