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

Loss (every part has a switch in `SpecBlockTrainingArguments`), per block b (block 1 from the target features,
follow-up blocks from slot ``M-1`` of the previous block with ``M ~ U{1..K}`` drawn once per block per step) and
slot k, at drafter position i (features f_i, token x_{i+1+off_b}, slot k predicts x_{i+2+off_b+k}, whose target
distribution p is the target's softmax at position j = i+1+off_b+k restricted to the draft vocabulary and
renormalised):

* ``ce[b,i,k] = -sum_v p(v) log q(v)`` with q the drafter's softmax for that slot (hard CE on the target's argmax with
  ``--no_soft_labels``).
* ``correct[b,i,k] = d2t[argmax q] == argmax_target(j)``; ``prefix[b,i,k] = prod_{k'<k} correct[b,i,k']``.
* ``draft_mask = assistant(x_{j+1}) & in_draft_vocab(argmax_target(j)) & prefix`` (prefix only with
  ``valid_prefix_mask``).
* ``L_draft = (1/num_blocks) sum_b sum_k slot_decay^k * sum_i ce*draft_mask / sum_i draft_mask``.
* Rank head: see `rank_head_loss`; ``rank_mask = assistant(x_{j+1}) & prefix`` (the first wrong slot of a chain
  included), labels from the 1-based rank of the target's argmax in the slot's draft distribution.
* ``L = L_draft + rank_loss_weight * L_rank``.

The sums over i run over the whole batch. Under DDP the normalisers (counted slots per block and slot, rank class
counts) are summed over all processes, so the averaged gradient and the logged loss equal those of one process on the
same global batch. With the valid-prefix mask the total loss is not monotone early in training: slots 1..K-1 enter
it only as the slots before them become right. The logged ``ce_slot{k}`` (block 1 draft CE per slot),
``acc_slot{k}`` (block-1 top-1 accuracy against the target's argmax), ``accept_length`` (expected accepted length of
block 1's greedy chain, ``1 + sum_k P(slots 0..k all right)``) and ``rank_acc`` are the progress measures.

Memory: a step holds ``num_blocks`` x [B, T, K, draft_vocab] drafter logits and attention masks of
[P*K, num_blocks*P*K] for the last block, so ``max_length`` and the batch size bound it.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase, Trainer, TrainingArguments
from transformers.trainer_utils import EvalLoopOutput
from transformers.utils import ModelOutput, logging

from .assets import PACKAGED_MODELS, load_packaged_model, load_sharegpt_conversations
from .configuration_specblock import SpecBlockConfig
from .configuration_eagle3 import Eagle3Config
from .modeling_eagle3 import Eagle3DraftModel
from .modeling_specblock import SpecBlockDraftModel
from .modeling_tree_drafter import training_stat_names
from .tree import block_causal_mask

logger = logging.get_logger(__name__)

__all__ = [
    "DataArguments",
    "ModelArguments",
    "PrecomputedFeatures",
    "SpecBlockDataCollator",
    "SpecBlockDraftModelForTraining",
    "SpecBlockLossConfig",
    "SpecBlockTrainer",
    "SpecBlockTrainingArguments",
    "block_terms",
    "build_draft_vocab",
    "default_draft_vocab_size",
    "load_conversations",
    "precompute_features",
    "rank_head_loss",
    "rank_labels",
    "render_conversation",
    "run_training",
    "soft_cross_entropy",
    "target_ranks",
    "tokenize_conversations",
    "valid_prefix",
]

FEATURES_INFO = "features_info.json"
FEATURES_FORMAT = "specblock-features-v1"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# ================================================================================================== arguments
@dataclass
class ModelArguments:
    """Which target to train a drafter for, and the drafter's shape."""

    target_model: str = field(
        metadata={"help": f"Packaged model name ({', '.join(PACKAGED_MODELS)}) or a local Hugging Face model folder."}
    )
    init_drafter: str | None = field(
        default=None, metadata={"help": "Start from this drafter checkpoint (must have been built for the target)."}
    )
    target_dtype: str = field(
        default="auto",
        metadata={"help": "dtype of the frozen target: auto (bfloat16 on a bf16-capable GPU, else float32), "
                  "float32, bfloat16 or float16."},
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
    drafter: str = field(default="specblock", metadata={"help": "Drafter to train: 'specblock' or 'eagle3'."})
    ttt_steps: int | None = field(default=None, metadata={"help": "EAGLE-3 training-time-test unroll (default 7)."})
    drafter_num_layers: int | None = field(default=None, metadata={"help": "Drafter decoder layers (default 2)."})
    init_head_from_target: bool = field(
        default=True,
        metadata={
            "help": "Start a new drafter's final norm and lm_head from the target's (rows d2t of its output "
            "embedding), so the drafter only has to learn the target's hidden-state space. Needs equal hidden sizes."
        },
    )
    save_dtype: str = field(
        default="float32", metadata={"help": "dtype of the final drafter weights: float32, bfloat16 or float16."}
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


@dataclass
class SpecBlockTrainingArguments(TrainingArguments):
    """`TrainingArguments` plus the SpecBlock loss switches.

    Changed defaults: ``remove_unused_columns=False`` (the collator builds what the trainer needs),
    ``adam_beta2=0.95`` and ``max_grad_norm=0.5`` (the reference recipe), ``output_dir="out/drafter"``,
    ``include_num_input_tokens_seen="non_padding"`` (the model card's token count, kept across a resume).
    """

    output_dir: str | None = field(default="out/drafter", metadata={"help": "Checkpoints and the final drafter."})
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


@dataclass
class SpecBlockLossConfig:
    """The loss switches `SpecBlockDraftModelForTraining.forward` reads (see the module docstring)."""

    slot_decay: float = 0.8
    soft_labels: bool = True
    valid_prefix_mask: bool = True
    rank_loss_weight: float = 1.0
    rank_chain_mask: bool = True
    rank_class_weight_power: float = 0.5
    rank_label_smoothing: float = 0.1
    rank_distance_weight: float = 1.0
    rank_under_penalty: float = 2.0
    sync_normalizers: bool = True  # sum normalisers over processes under torch.distributed

    @classmethod
    def from_args(cls, args: SpecBlockTrainingArguments) -> "SpecBlockLossConfig":
        names = [f for f in cls.__dataclass_fields__ if f != "sync_normalizers"]
        return cls(**{name: getattr(args, name) for name in names})


# ============================================================================================ conversations
_ROLES = {
    "human": "user", "user": "user", "prompter": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
    "model": "assistant",
    "system": "system",
}  # fmt: skip
_END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "</s>", "<|endoftext|>")


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def normalize_conversation(record: dict) -> list[dict[str, str]]:
    """A ShareGPT (``conversations``: from/value) or OpenAI-style (``messages``: role/content) record -> messages.

    Roles map to system/user/assistant (human/gpt/chatgpt/... included); empty and unknown-role turns are dropped,
    consecutive turns of one role are merged, and trailing non-assistant turns are cut (nothing to learn there).
    """
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list):
        raise ValueError(f"Expected a 'conversations' or 'messages' list in every record, got keys {sorted(record)}.")
    messages: list[dict[str, str]] = []
    for turn in turns:
        if not isinstance(turn, dict):
            continue
        role = _ROLES.get(str(turn.get("from", turn.get("role", ""))).lower())
        content = _text(turn.get("value", turn.get("content")))
        if role is None or not content.strip():
            continue
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += "\n\n" + content
        else:
            messages.append({"role": role, "content": content})
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()
    return messages


def _read_records(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl" or not text.lstrip().startswith(("[", "{")):
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    try:
        data = json.loads(text)
    except json.JSONDecodeError:  # a .json file holding JSON lines
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    if isinstance(data, dict):
        data = data.get("data", data.get("conversations", [data]))
    return list(data)


def load_conversations(source: str, limit: int | None = None) -> list[list[dict[str, str]]]:
    """Chats as lists of ``{"role", "content"}`` messages.

    ``source``: ``"sharegpt"`` (packaged ShareGPT, train split: the held-out split is never trained on),
    ``"sharegpt-heldout"`` (the held-out split, for evaluation) or a local JSON/JSONL file.
    """
    if source in ("sharegpt", "sharegpt-train"):
        records = load_sharegpt_conversations("train")
    elif source == "sharegpt-heldout":
        records = load_sharegpt_conversations("heldout")
    elif os.path.isfile(source):
        records = _read_records(Path(source))
    else:
        raise ValueError(f"Unknown dataset {source!r}: expected 'sharegpt', 'sharegpt-heldout' or a JSON/JSONL file.")
    if limit is not None:
        records = records[:limit]
    return [normalize_conversation(r) for r in records]


def _apply(tokenizer: PreTrainedTokenizerBase, messages: list[dict], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _assistant_char_spans(
    messages: list[dict[str, str]], tokenizer: PreTrainedTokenizerBase, text: str
) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in the rendered ``text``.

    First choice: the text the template adds for turn i, i.e. render(messages[:i+1]) minus
    render(messages[:i], add_generation_prompt=True) (the assistant content plus its end-of-turn marker), when the
    renders are prefixes of each other. Otherwise: the turn's content found in ``text`` after the previous span,
    extended over an end-of-turn marker that directly follows it.
    """
    spans: list[tuple[int, int]] = []
    cursor = 0
    markers = tuple(m for m in (tokenizer.eos_token, *_END_MARKERS) if m)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        span = None
        if i > 0:
            try:
                before = _apply(tokenizer, messages[:i], generation_prompt=True)
                upto = _apply(tokenizer, messages[: i + 1])
            except Exception:  # noqa: BLE001 - templates that reject partial chats
                before = upto = None
            if upto is not None and text.startswith(upto) and upto.startswith(before) and len(before) >= cursor:
                if len(upto) > len(before):
                    span = (len(before), len(upto))
        if span is None:
            for content in (message["content"], message["content"].strip()):
                start = text.find(content, cursor) if content else -1
                if start >= 0:
                    end = start + len(content)
                    for marker in markers:
                        if text.startswith(marker, end):
                            end += len(marker)
                            break
                    span = (start, end)
                    break
        if span is not None:
            spans.append(span)
            cursor = span[1]
    return spans


def render_conversation(
    messages: list[dict[str, str]], tokenizer: PreTrainedTokenizerBase, max_length: int | None = None
) -> dict[str, list[int]] | None:
    """Chat-template a conversation -> ``{"input_ids", "loss_mask"}`` (1 on assistant tokens), or None if empty.

    Templates with ``{% generation %}`` blocks use transformers' ``return_assistant_tokens_mask``; others get their
    mask from the assistant turns' character spans (`_assistant_char_spans`) and the fast tokenizer's offsets.
    """
    if not messages:
        return None
    template = tokenizer.chat_template or ""
    if "generation %}" in template:
        enc = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = list(enc["input_ids"]), [int(m) for m in enc["assistant_masks"]]
    else:
        text = _apply(tokenizer, messages)
        spans = _assistant_char_spans(messages, tokenizer, text)
        if tokenizer.is_fast:
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids, mask, s = list(enc["input_ids"]), [], 0
            for start, end in enc["offset_mapping"]:
                while s < len(spans) and spans[s][1] <= start:
                    s += 1
                mask.append(int(end > start and s < len(spans) and spans[s][0] < end))
        else:  # slow tokenizer: tokenize the pieces between span boundaries separately
            ids, mask, pos = [], [], 0
            for start, end in spans:
                for piece, flag in ((text[pos:start], 0), (text[start:end], 1)):
                    piece_ids = tokenizer(piece, add_special_tokens=False)["input_ids"] if piece else []
                    ids += piece_ids
                    mask += [flag] * len(piece_ids)
                pos = end
            tail = tokenizer(text[pos:], add_special_tokens=False)["input_ids"] if text[pos:] else []
            ids, mask = ids + tail, mask + [0] * len(tail)
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    if len(ids) < 3 or not any(mask[2:]):  # slot 0 of position 0 predicts token 2
        return None
    return {"input_ids": ids, "loss_mask": mask}


def tokenize_conversations(
    conversations: Sequence[list[dict[str, str]]],
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    name: str = "dataset",
) -> datasets.Dataset:
    """Render every conversation; raise a ValueError if none has an assistant token left."""
    rows, failed, empty = [], 0, 0
    for messages in conversations:
        try:
            row = render_conversation(messages, tokenizer, max_length)
        except Exception as err:  # noqa: BLE001 - e.g. templates enforcing user/assistant alternation
            failed += 1
            if failed <= 3:
                logger.warning(f"{name}: skipping a conversation the chat template rejected: {err}")
            continue
        if row is None:
            empty += 1
        else:
            rows.append(row)
    if not rows:
        raise ValueError(
            f"{name}: none of its {len(conversations)} conversations has an assistant turn to train on "
            f"({empty} without assistant tokens, {failed} rejected by the chat template). A SpecBlock drafter "
            "learns only on assistant tokens: give turns with role 'assistant' (OpenAI 'messages') or from 'gpt' "
            "(ShareGPT 'conversations')."
        )
    num_tokens = sum(len(r["input_ids"]) for r in rows)
    num_assistant = sum(sum(r["loss_mask"]) for r in rows)
    logger.info(
        f"{name}: {len(rows)} sequences, {num_tokens} tokens ({num_assistant} assistant tokens); skipped "
        f"{empty} without assistant tokens and {failed} rejected by the chat template."
    )
    return datasets.Dataset.from_list(rows)


@dataclass
class SpecBlockDataCollator:
    """Right-pads ``input_ids`` (with ``pad_token_id``), ``loss_mask`` and, for precomputed features, the feature
    tensors; adds ``attention_mask`` (1 on real tokens)."""

    pad_token_id: int = 0
    pad_to_multiple_of: int | None = None

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        lengths = [len(e["input_ids"]) for e in examples]
        length = max(lengths)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch: dict[str, torch.Tensor] = {}
        for key in examples[0]:
            values = [torch.as_tensor(e[key]) for e in examples]
            fill = self.pad_token_id if key == "input_ids" else 0
            out = values[0].new_full((len(values), length, *values[0].shape[1:]), fill)
            for row, value in enumerate(values):
                out[row, : value.shape[0]] = value
            batch[key] = out
        batch["input_ids"] = batch["input_ids"].long()
        batch["loss_mask"] = batch["loss_mask"].bool()
        if "target_argmax" in batch:
            batch["target_argmax"] = batch["target_argmax"].long()
        batch["attention_mask"] = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
        return batch


# ============================================================================================ draft vocabulary
def default_draft_vocab_size(vocab_size: int) -> int:
    """The full vocabulary up to 16384 tokens; 16384 up to 65536 (SmolLM2: 49152 -> 16384); 32000 above
    (Llama 3 / Qwen2.5: the reference EAGLE-3 size)."""
    if vocab_size <= 16384:
        return vocab_size
    return 16384 if vocab_size <= 65536 else 32000


def build_draft_vocab(
    token_lists: Iterable[Sequence[int]], mask_lists: Iterable[Sequence[int]], vocab_size: int, draft_vocab_size: int
) -> tuple[torch.LongTensor, float]:
    """``d2t``: the ``draft_vocab_size`` most frequent assistant tokens (ties: lower id first; ids never seen fill
    up from the lowest id), sorted by target id; and the fraction of assistant tokens it covers."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in zip(token_lists, mask_lists):
        ids_t = torch.as_tensor(ids, dtype=torch.long)
        counts += torch.bincount(ids_t[torch.as_tensor(mask, dtype=torch.bool)], minlength=vocab_size)[:vocab_size]
    order = torch.sort(-counts, stable=True).indices  # most frequent first, ties by id
    d2t = torch.sort(order[:draft_vocab_size]).values
    coverage = float(counts[d2t].sum()) / max(1, int(counts.sum()))
    return d2t, coverage


def set_draft_vocab(drafter: SpecBlockDraftModel, d2t: torch.LongTensor) -> None:
    """Store a sorted draft->target id map into the drafter's ``d2t`` / ``t2d`` buffers."""
    if d2t.numel() != drafter.config.draft_vocab_size:
        raise ValueError(
            f"d2t has {d2t.numel()} ids, the drafter's draft_vocab_size is {drafter.config.draft_vocab_size}."
        )
    with torch.no_grad():
        drafter.d2t.copy_(d2t.to(drafter.d2t.device))
        drafter.t2d.zero_()
        drafter.t2d[drafter.d2t] = True


def init_head_from_target(drafter: SpecBlockDraftModel, target: PreTrainedModel) -> None:
    """Copy the target's final norm and its output-embedding rows `d2t` into the drafter's `norm` / `lm_head`."""
    weight, _ = _target_head(target)
    if weight.shape[1] != drafter.config.hidden_size:
        raise ValueError(
            f"--init_head_from_target needs the drafter hidden size ({drafter.config.hidden_size}) to equal the "
            f"target's ({weight.shape[1]}); pass --no_init_head_from_target."
        )
    final_norm = target.get_decoder().norm
    with torch.no_grad():
        drafter.lm_head.weight.copy_(weight[drafter.d2t.to(weight.device)].to(drafter.lm_head.weight))
        drafter.norm.weight.copy_(final_norm.weight.to(drafter.norm.weight))


# ============================================================================================ target features
def _target_head(target: PreTrainedModel) -> tuple[torch.Tensor, float | None]:
    """The target's output projection weight [V, H] and its final logit soft-cap (Gemma), if any."""
    text_config = target.config.get_text_config()
    return target.get_output_embeddings().weight, getattr(text_config, "final_logit_softcapping", None)


def _softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    return logits if not cap else torch.tanh(logits / cap) * cap


@torch.no_grad()
def target_features(
    target: PreTrainedModel, input_ids: torch.LongTensor, attention_mask: torch.Tensor, layer_ids: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One frozen target forward -> (features [B, T, 3H] = concat of hidden_states[layer_ids], final-norm hidden
    [B, T, H])."""
    decoder = target.get_decoder()
    out = decoder(
        input_ids=input_ids.to(target.device),
        attention_mask=attention_mask.to(target.device).long(),
        output_hidden_states=list(layer_ids),
        use_cache=False,
    )
    features = torch.cat([out.hidden_states[i] for i in layer_ids], dim=-1)
    return features, out.last_hidden_state


@torch.no_grad()
def target_argmax(final_hidden: torch.Tensor, weight: torch.Tensor, chunk: int = 1024) -> torch.LongTensor:
    """The target's greedy token (full vocabulary) per position, computed in chunks of positions."""
    flat = final_hidden.reshape(-1, final_hidden.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
    for start in range(0, flat.shape[0], chunk):
        piece = flat[start : start + chunk].to(weight.dtype)
        out[start : start + chunk] = (piece @ weight.T).argmax(-1)  # the soft-cap is monotone: same argmax
    return out.view(final_hidden.shape[:-1])


def draft_target_logits(
    final_hidden: torch.Tensor, draft_weight: torch.Tensor, softcap: float | None = None
) -> torch.Tensor:
    """Target logits over the draft vocabulary [B, T, Vd] (float32) from its final-norm hidden and ``W[d2t]``."""
    return _softcap(final_hidden.float() @ draft_weight.float().T, softcap)


def _fingerprint(dataset: datasets.Dataset, extra: dict) -> str:
    digest = hashlib.sha256(json.dumps(extra, sort_keys=True).encode())
    for row in dataset:
        digest.update(torch.tensor(row["input_ids"], dtype=torch.int32).numpy().tobytes())
        digest.update(torch.tensor(row["loss_mask"], dtype=torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def features_bytes_per_token(hidden_size: int, dtype: torch.dtype) -> dict[str, int]:
    """Storage per token of the precomputed path, by field."""
    item = torch.empty((), dtype=dtype).element_size()
    return {
        "features": 3 * hidden_size * item,
        "final_hidden": hidden_size * item,
        "target_argmax": 4,
        "input_ids": 4,
        "loss_mask": 1,
    }


def precompute_features(
    target: PreTrainedModel,
    dataset: datasets.Dataset,
    features_dir: str | os.PathLike,
    layer_ids: Sequence[int],
    dtype: torch.dtype = torch.float16,
    batch_size: int = 8,
    shard_tokens: int = 131072,
    overwrite: bool = False,
    description: dict | None = None,
) -> dict:
    """Run the frozen target once over ``dataset`` and store, per token, the 3 feature states and the final-norm
    hidden state (``dtype``), the target's argmax, the token id and the assistant mask, in safetensors shards.

    ``features_info.json`` (written last: its presence marks a complete set) records the layout, the size per token
    and a fingerprint of target + data; a folder whose fingerprint matches is reused as is, one that does not raises
    unless ``overwrite``. Returns the info dict.
    """
    folder = Path(features_dir)
    text_config = target.config.get_text_config()
    hidden = text_config.hidden_size
    identity = {
        "format": FEATURES_FORMAT,
        "target_vocab_size": text_config.vocab_size,
        "target_hidden_size": hidden,
        "target_num_hidden_layers": text_config.num_hidden_layers,
        "target_model_type": text_config.model_type,
        "target_layer_ids": list(layer_ids),
        "dtype": str(dtype).removeprefix("torch."),
        **(description or {}),
    }
    fingerprint = _fingerprint(dataset, identity)
    info_path = folder / FEATURES_INFO
    if info_path.is_file():
        info = json.loads(info_path.read_text())
        if info.get("fingerprint") == fingerprint:
            logger.info(f"Reusing precomputed features in {folder} ({info['bytes_per_token']} bytes/token).")
            return info
        if not overwrite:
            raise ValueError(
                f"{folder} holds features for other data or another target (fingerprint {info.get('fingerprint')}, "
                f"expected {fingerprint}). Pass another --features_dir or --overwrite_features."
            )
        logger.warning(f"Overwriting the precomputed features in {folder}.")
    if folder.exists():
        for old in list(folder.glob("shard-*.safetensors")) + [info_path]:
            old.unlink(missing_ok=True)
    folder.mkdir(parents=True, exist_ok=True)

    breakdown = features_bytes_per_token(hidden, dtype)
    bytes_per_token = sum(breakdown.values())
    weight, _ = _target_head(target)
    collate = SpecBlockDataCollator(pad_token_id=0)
    shards: list[dict] = []
    fields = ("features", "final_hidden", "target_argmax", "input_ids", "loss_mask")
    buffer: dict[str, list[torch.Tensor]] = {k: [] for k in fields}
    lengths: list[int] = []
    start = time.perf_counter()

    def flush() -> None:
        if not lengths:
            return
        name = f"shard-{len(shards):05d}.safetensors"
        tensors = {k: torch.cat(v).contiguous() for k, v in buffer.items()}
        tensors["offsets"] = torch.tensor([0, *lengths]).cumsum(0)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
        os.close(fd)
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.chmod(tmp, 0o644)
        os.replace(tmp, folder / name)
        shards.append({"file": name, "num_sequences": len(lengths), "num_tokens": int(sum(lengths))})
        for v in buffer.values():
            v.clear()
        lengths.clear()

    for first in range(0, len(dataset), batch_size):
        rows = [dataset[i] for i in range(first, min(first + batch_size, len(dataset)))]
        batch = collate([{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]} for r in rows])
        features, final = target_features(target, batch["input_ids"], batch["attention_mask"], layer_ids)
        argmax = target_argmax(final, weight)
        for row, n in enumerate(len(r["input_ids"]) for r in rows):
            buffer["features"].append(features[row, :n].to("cpu", dtype))
            buffer["final_hidden"].append(final[row, :n].to("cpu", dtype))
            buffer["target_argmax"].append(argmax[row, :n].to("cpu", torch.int32))
            buffer["input_ids"].append(batch["input_ids"][row, :n].to(torch.int32))
            buffer["loss_mask"].append(batch["loss_mask"][row, :n].to(torch.uint8))
            lengths.append(n)
        if sum(lengths) >= shard_tokens:
            flush()
    flush()
    num_tokens = sum(s["num_tokens"] for s in shards)
    info = {
        **identity,
        "fingerprint": fingerprint,
        "num_sequences": len(dataset),
        "num_tokens": num_tokens,
        "bytes_per_token": bytes_per_token,
        "bytes_per_token_breakdown": breakdown,
        "total_bytes": bytes_per_token * num_tokens,
        "shards": shards,
        "seconds": round(time.perf_counter() - start, 3),
    }
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{FEATURES_INFO}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(info, f, indent=2)
    os.chmod(tmp, 0o644)
    os.replace(tmp, info_path)
    logger.warning(
        f"Precomputed target features: {num_tokens} tokens x {bytes_per_token} bytes/token "
        f"= {info['total_bytes'] / 2**20:.1f} MiB in {len(shards)} shard(s) under {folder} "
        f"({info['seconds']:.1f} s)."
    )
    return info


class PrecomputedFeatures(torch.utils.data.Dataset):
    """Sequences of a precomputed features folder, read lazily from the memory-mapped safetensors shards."""

    def __init__(self, features_dir: str | os.PathLike) -> None:
        self.folder = Path(features_dir)
        self.info = json.loads((self.folder / FEATURES_INFO).read_text())
        self.index: list[tuple[int, int, int]] = []  # (shard, start token, end token)
        for shard_idx, shard in enumerate(self.info["shards"]):
            with safe_open(self.folder / shard["file"], framework="pt") as f:
                offsets = f.get_tensor("offsets").tolist()
            self.index += [(shard_idx, offsets[i], offsets[i + 1]) for i in range(len(offsets) - 1)]
        self._handles: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        shard_idx, start, end = self.index[idx]
        handle = self._handles.get(shard_idx)
        if handle is None:
            handle = safe_open(self.folder / self.info["shards"][shard_idx]["file"], framework="pt")
            self._handles[shard_idx] = handle
        return {
            key: handle.get_slice(key)[start:end]
            for key in ("input_ids", "loss_mask", "features", "final_hidden", "target_argmax")
        }

    def __getstate__(self) -> dict:  # DataLoader workers reopen the shards
        return {**self.__dict__, "_handles": {}}


# ==================================================================================================== losses
def soft_cross_entropy(draft_logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """``-sum_v p(v) log softmax(draft_logits)(v)`` over the last dim (p: the target's draft-vocab distribution)."""
    return -(target_probs * draft_logits.float().log_softmax(-1)).sum(-1)


def valid_prefix(correct: torch.BoolTensor) -> torch.BoolTensor:
    """[..., K] -> [..., K]: slot k is True iff slots 0..k-1 were all correct (slot 0 always True)."""
    ones = torch.ones_like(correct[..., :1])
    return torch.cat([ones, correct[..., :-1]], dim=-1).long().cumprod(-1).bool()


def target_ranks(draft_logits: torch.Tensor, target_index: torch.LongTensor) -> torch.LongTensor:
    """1-based rank of the target's token (a draft-vocab index, -1 = not in the draft vocabulary) in each draft
    distribution: 1 + the number of draft logits strictly above its logit; ``Vd + 1`` when not in the vocabulary."""
    logits = draft_logits.detach().float()
    own = logits.gather(-1, target_index.clamp(min=0)[..., None])
    ranks = (logits > own).sum(-1) + 1
    return torch.where(target_index >= 0, ranks, logits.shape[-1] + 1)


def rank_labels(ranks: torch.LongTensor, upper_bounds: Sequence[int], in_vocab: torch.BoolTensor) -> torch.LongTensor:
    """Rank-head class per slot: class c holds ranks in (bounds[c-1], bounds[c]] (bounds (1, 4, 10): rank 1 -> 0,
    2-4 -> 1, 5-10 -> 2, >10 -> 3); a target token outside the draft vocabulary is always the last class."""
    bounds = torch.tensor(list(upper_bounds), device=ranks.device)
    labels = torch.bucketize(ranks, bounds, right=False)
    return torch.where(in_vocab, labels, len(bounds))


def ordinal_targets(labels: torch.LongTensor, num_classes: int, smoothing: float, under_penalty: float) -> torch.Tensor:
    """Asymmetric ordinal label smoothing: ``1 - eps`` on the label, ``eps * u/(u+1)`` on the next higher class and
    ``eps * 1/(u+1)`` on the next lower one (u = ``under_penalty``; at an edge the whole eps goes to the one
    neighbour; with a single class no smoothing)."""
    target = F.one_hot(labels, num_classes).float()
    if smoothing <= 0 or num_classes < 2:
        return target
    up_share = under_penalty / (under_penalty + 1.0)
    up = torch.where(labels == 0, 1.0, torch.where(labels == num_classes - 1, 0.0, up_share))
    target = target * (1 - smoothing)
    higher = (labels + 1).clamp(max=num_classes - 1)
    lower = (labels - 1).clamp(min=0)
    up_mass = smoothing * up * (labels < num_classes - 1)
    down_mass = smoothing * (1 - up) * (labels > 0)
    target = target.scatter_add(-1, higher[..., None], up_mass[..., None])
    target = target.scatter_add(-1, lower[..., None], down_mass[..., None])
    return target


def rank_head_loss(
    rank_logits: torch.Tensor,
    labels: torch.LongTensor,
    mask: torch.BoolTensor,
    class_counts: torch.Tensor | None = None,
    class_weight_power: float = 0.5,
    label_smoothing: float = 0.1,
    distance_weight: float = 1.0,
    under_penalty: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-head loss: returns (weighted loss sum, weight sum); the loss is their ratio.

    Per counted slot with label y and predicted class distribution p over C classes::

        l = -sum_c q_c log p_c  +  distance_weight * sum_c p_c * D(c, y) / (C - 1)
        D(c, y) = under_penalty * (y - c)  if c < y  (under-estimating the rank: a branch that would have been
                  (c - y)                  if c >= y  accepted is not drafted)

    q: `ordinal_targets` (asymmetric ordinal smoothing). Each slot is weighted by its class weight
    ``w_y = (N / (C * max(n_y, 1))) ** class_weight_power``, where n_c are the counted slots of class c in
    ``class_counts`` (default: counted in ``mask``; under DDP: summed over processes) and N = sum n_c.
    """
    num_classes = rank_logits.shape[-1]
    labels = labels.clamp(max=num_classes - 1)
    mask_f = mask.float()
    if class_counts is None:
        class_counts = torch.bincount(labels[mask], minlength=num_classes).float()
    total = class_counts.sum()
    class_weights = (total / (num_classes * class_counts.clamp(min=1))).pow(class_weight_power)
    log_p = rank_logits.float().log_softmax(-1)
    q = ordinal_targets(labels, num_classes, label_smoothing, under_penalty)
    loss = -(q * log_p).sum(-1)
    if distance_weight and num_classes > 1:
        c = torch.arange(num_classes, device=labels.device)
        diff = labels[..., None] - c  # > 0: class c under-estimates the label
        dist_ = torch.where(diff > 0, under_penalty * diff, -diff).float() / (num_classes - 1)
        loss = loss + distance_weight * (log_p.exp() * dist_).sum(-1)
    weights = class_weights[labels] * mask_f
    return (loss * weights).sum(), (class_counts * class_weights).sum()


@dataclass
class BlockTerms:
    """Per (batch, position, slot) terms of one block; see `block_terms`."""

    ce: torch.Tensor  # float, with grad
    correct: torch.BoolTensor  # draft argmax == target argmax
    in_vocab: torch.BoolTensor  # target argmax inside the draft vocabulary
    counted: torch.BoolTensor  # predicted token exists and is an assistant token
    exists: torch.BoolTensor  # predicted token exists (not padding, inside the sequence)
    labels: torch.LongTensor  # rank-head class
    prefix: torch.BoolTensor  # slots 0..k-1 all correct


def block_terms(
    logits: torch.Tensor,
    target_probs: torch.Tensor,
    target_index: torch.LongTensor,
    loss_tokens: torch.BoolTensor,
    real_tokens: torch.BoolTensor,
    offset: int,
    rank_bounds: Sequence[int],
    soft_labels: bool = True,
) -> BlockTerms:
    """Align one block's slots with the target and compute its per-slot terms.

    logits [B, P, K, Vd] drafter logits for positions i = 0..P-1 (P = T-1); target_probs [B, T, Vd] the target's
    draft-vocab distribution per sequence position; target_index [B, T] its argmax as a draft index (-1: outside the
    draft vocabulary); loss_tokens / real_tokens [B, T] assistant / non-padding tokens. With the block's cumulative
    ``offset`` (0 for block 1), slot k of position i is compared with target position j = i + 1 + offset + k and
    predicts token j + 1.
    """
    batch, num_pos, k_slots, _ = logits.shape
    length = target_probs.shape[1]
    cols: dict[str, list[torch.Tensor]] = {k: [] for k in ("ce", "correct", "in_vocab", "counted", "exists", "labels")}
    for k in range(k_slots):
        s = 1 + offset + k
        n = max(0, min(num_pos, length - 1 - s))
        pad = num_pos - n
        dl = logits[:, :n, k].float()
        tid = target_index[:, s : s + n]
        if soft_labels:
            ce = soft_cross_entropy(dl, target_probs[:, s : s + n])
        else:
            ce = -dl.log_softmax(-1).gather(-1, tid.clamp(min=0)[..., None])[..., 0]
        ranks = target_ranks(dl, tid)
        in_vocab = tid >= 0
        values = {
            "ce": ce,
            "correct": (dl.detach().argmax(-1) == tid) & in_vocab,
            "in_vocab": in_vocab,
            "counted": loss_tokens[:, s + 1 : s + 1 + n] & real_tokens[:, s + 1 : s + 1 + n],
            "exists": real_tokens[:, s + 1 : s + 1 + n].clone(),
            "labels": rank_labels(ranks, rank_bounds, in_vocab),
        }
        for key, value in values.items():
            cols[key].append(F.pad(value, (0, pad)) if pad else value)
    stacked = {key: torch.stack(v, dim=2) for key, v in cols.items()}
    return BlockTerms(**stacked, prefix=valid_prefix(stacked["correct"]))


def followup_training_mask(
    num_positions: int, block_size: int, increments: Sequence[int], device: torch.device | str
) -> torch.BoolTensor:
    """[P*K, (b+1)*P*K] visibility for follow-up block b (after b earlier blocks, all in one cache).

    ``increments[c]`` = M of the block started from block c (it inherits slot M-1). Slot k of position i sees
    block 1's slots of positions < i, slots 0..M-1 of every earlier block at position i (the chain it extends), and
    its own slots 0..k, as `tree.followup_block_mask` does at inference.
    """
    pos = torch.arange(num_positions, device=device).repeat_interleave(block_size)
    slot = torch.arange(block_size, device=device).repeat(num_positions)
    same_pos = pos[None, :] == pos[:, None]
    parts = []
    for c, m in enumerate(increments):
        visible = same_pos & (slot[None, :] < m)
        if c == 0:
            visible = visible | (pos[None, :] < pos[:, None])
        parts.append(visible)
    parts.append(same_pos & (slot[None, :] <= slot[:, None]))
    return torch.cat(parts, dim=1)


def _all_reduce(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        tensor = tensor.clone()
        dist.all_reduce(tensor)
        return tensor, dist.get_world_size()
    return tensor, 1


@dataclass
class SpecBlockTrainingOutput(ModelOutput):
    """loss = loss_draft + rank_loss_weight * loss_rank; ``stats``: detached metric sums (`STAT_NAMES` layout)."""

    loss: torch.Tensor | None = None
    loss_draft: torch.Tensor | None = None
    loss_rank: torch.Tensor | None = None
    stats: torch.Tensor | None = None


def stats_to_metrics(stats: torch.Tensor, block_size: int) -> dict[str, float]:
    """Summed stats -> per-slot top-1 accuracy and draft CE (block 1), acceptance estimate, rank-head accuracy and
    the loss parts."""
    s = dict(zip(training_stat_names(block_size), stats.double().tolist()))
    batches = max(s["batches"], 1.0)
    metrics = {"loss_draft": s["loss_draft"] / batches, "loss_rank": s["loss_rank"] / batches}
    for k in range(block_size):
        metrics[f"acc_slot{k}"] = s[f"correct_slot{k}"] / max(s[f"counted_slot{k}"], 1.0)
    for k in range(block_size):
        metrics[f"ce_slot{k}"] = s[f"ce_sum_slot{k}"] / max(s[f"ce_count_slot{k}"], 1.0)
    metrics["accept_length"] = s["accept_sum"] / max(s["accept_count"], 1.0)
    metrics["rank_acc"] = s["rank_correct"] / max(s["rank_count"], 1.0)
    return metrics


class SpecBlockDraftModelForTraining(SpecBlockDraftModel):
    """The drafter with the multi-block training pass as ``forward`` (so DDP / Trainer see one call per step).

    Same parameters, buffers and config as `SpecBlockDraftModel`: a checkpoint of one loads into the other.
    ``loss_config`` (a `SpecBlockLossConfig`) holds the loss switches.
    """

    def __init__(self, config: SpecBlockConfig) -> None:
        super().__init__(config)
        self.loss_config = SpecBlockLossConfig()

    def _target_draft_index(self, target_argmax: torch.LongTensor) -> torch.LongTensor:
        lookup = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=self.d2t.device)
        lookup[self.d2t] = torch.arange(self.d2t.numel(), device=self.d2t.device)
        return lookup[target_argmax.to(self.d2t.device)]

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor,
        loss_mask: torch.Tensor,
        features: torch.Tensor,
        target_logits: torch.Tensor,
        target_argmax: torch.LongTensor,
        followup_offsets: Sequence[int] = (),
    ) -> SpecBlockTrainingOutput:
        """Multi-block training pass.

        input_ids / attention_mask / loss_mask [B, T]; features [B, T, 3*H_target] target features per position;
        target_logits [B, T, Vd] the target's logits over the draft vocabulary; target_argmax [B, T] its greedy
        token (target ids); followup_offsets: M (1..K) of each follow-up block (``num_blocks - 1`` values).
        """
        cfg = self.loss_config
        k_slots = self.config.block_size
        batch, length = input_ids.shape
        num_pos = length - 1
        device = input_ids.device
        if num_pos < 1:
            raise ValueError("Training sequences need at least 2 tokens.")
        real = attention_mask.bool()
        counted_tokens = loss_mask.bool() & real
        target_index = self._target_draft_index(target_argmax)
        target_probs = target_logits.float().softmax(-1)
        positions = torch.arange(1, num_pos + 1, device=device).expand(batch, -1)
        bounds = self.config.rank_bucket_upper_bounds

        cache = DynamicCache()
        out = self.draft_blocks(
            self.project_condition(features[:, :num_pos]),
            input_ids[:, 1:],
            positions,
            block_causal_mask(num_pos, k_slots, 0, device)[None],
            cache,
        )
        outputs = [out]
        terms = [block_terms(out.logits, target_probs, target_index, counted_tokens, real, 0, bounds, cfg.soft_labels)]
        offset = 0
        for b, m in enumerate(followup_offsets, start=1):
            if not 1 <= m <= k_slots:
                raise ValueError(f"Follow-up offsets must lie in 1..{k_slots}, got {m}.")
            offset += m
            # (a block past the end of short sequences still runs: every process must run the same blocks)
            token_idx = (torch.arange(num_pos, device=device) + 1 + offset).clamp(max=length - 1)
            out = self.draft_blocks(
                out.hidden_states[:, :, m - 1],
                input_ids[:, token_idx],
                positions + offset,
                followup_training_mask(num_pos, k_slots, list(followup_offsets[:b]), device)[None],
                cache,
            )
            outputs.append(out)
            terms.append(
                block_terms(
                    out.logits, target_probs, target_index, counted_tokens, real, offset, bounds, cfg.soft_labels
                )
            )

        # ---- normalisers, summed over processes
        draft_masks = [
            t.counted & t.in_vocab & (t.prefix if cfg.valid_prefix_mask else torch.ones_like(t.prefix)) for t in terms
        ]
        rank_masks = [t.counted & (t.prefix if cfg.rank_chain_mask else torch.ones_like(t.prefix)) for t in terms]
        num_classes = self.config.num_rank_classes
        draft_den = torch.stack([m.sum((0, 1)) for m in draft_masks]).float()  # [blocks, K]
        class_counts = sum(torch.bincount(t.labels[m], minlength=num_classes) for t, m in zip(terms, rank_masks))
        norms = torch.cat([draft_den.flatten(), class_counts.float()])
        if cfg.sync_normalizers:
            norms, world = _all_reduce(norms.detach())
        else:
            world = 1
        num_blocks_run = len(terms)
        draft_den = norms[: num_blocks_run * k_slots].view(num_blocks_run, k_slots)
        class_counts = norms[num_blocks_run * k_slots :]

        # ---- draft loss
        slot_weights = torch.tensor([cfg.slot_decay**k for k in range(k_slots)], device=device)
        loss_draft = torch.zeros((), dtype=torch.float32, device=device)
        for b, (t, m) in enumerate(zip(terms, draft_masks)):
            per_slot = (t.ce * m).sum((0, 1)) / draft_den[b].clamp(min=1)
            loss_draft = loss_draft + (slot_weights * per_slot).sum()
        loss_draft = loss_draft * world / num_blocks_run

        # ---- rank loss (its input is detached inside the model: it trains the rank head only)
        rank_logits = torch.cat([o.rank_logits for o in outputs], dim=1)
        labels = torch.cat([t.labels for t in terms], dim=1)
        rank_mask = torch.cat(rank_masks, dim=1)
        rank_sum, rank_weight = rank_head_loss(
            rank_logits, labels, rank_mask, class_counts,
            cfg.rank_class_weight_power, cfg.rank_label_smoothing, cfg.rank_distance_weight, cfg.rank_under_penalty,
        )  # fmt: skip
        loss_rank = rank_sum * world / rank_weight.clamp(min=1e-12)
        loss = loss_draft
        if cfg.rank_loss_weight:
            loss = loss + cfg.rank_loss_weight * loss_rank
        else:  # keep the rank head in the graph (DDP expects every parameter to get a gradient)
            loss = loss + rank_logits.sum() * 0.0

        # ---- metrics (block 1 for accuracy and acceptance; all blocks for the rank head)
        with torch.no_grad():
            first = terms[0]
            chain = first.correct.long().cumprod(-1)
            accept_rows = first.counted[..., 0] & first.exists[..., -1]
            rank_hits = (rank_logits.argmax(-1) == labels.clamp(max=num_classes - 1)) & rank_mask
            stats = torch.cat(
                [
                    torch.stack([loss_draft.detach() / world, loss_rank.detach() / world]).double(),
                    torch.tensor([1.0 / world, float(real.sum())], dtype=torch.double, device=device),
                    (first.correct & first.counted).sum((0, 1)).double(),
                    first.counted.sum((0, 1)).double(),
                    (first.ce.detach() * draft_masks[0]).sum((0, 1)).double(),
                    draft_masks[0].sum((0, 1)).double(),
                    torch.stack(
                        [
                            ((1 + chain.sum(-1)) * accept_rows).sum(),
                            accept_rows.sum(),
                            rank_hits.sum(),
                            rank_mask.sum(),
                        ]
                    ).double(),
                ]
            )
        return SpecBlockTrainingOutput(loss=loss, loss_draft=loss_draft, loss_rank=loss_rank, stats=stats)


# ==================================================================================================== trainer
class SpecBlockTrainer(Trainer):
    """`Trainer` whose step runs the frozen target (online features) or turns precomputed features into soft labels,
    draws the follow-up offsets, and logs the SpecBlock metrics (``acc_slot{k}``, ``accept_length``, ``rank_acc``,
    ``loss_draft``, ``loss_rank``) with the training loss and in every evaluation."""

    def __init__(self, *args: Any, target: PreTrainedModel, num_blocks: int = 3, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.target = target.to(self.args.device).eval().requires_grad_(False)
        self.num_blocks = num_blocks
        self.loss_is_scaled_for_ga = False  # per-micro-batch means: the Trainer divides by the accumulation steps
        drafter = self.accelerator.unwrap_model(self.model)
        self.block_size = getattr(drafter.config, "block_size", None) or drafter.config.ttt_steps  # eagle3: steps
        self.layer_ids = list(drafter.config.target_layer_ids)
        self._stats: dict[str, torch.Tensor | None] = {"train": None, "eval": None}
        self.train_micro_batches = 0  # in this session, this process
        self._session_start = time.perf_counter()
        self._earlier_seconds: float | None = None  # training time of the sessions before a resume

    def followup_offsets(self, training: bool) -> list[int]:
        """M ~ U{1..K} per follow-up block, from a generator seeded by (seed, global step): the same on every
        process and across a resume; evaluation uses a fixed draw."""
        step = self.state.global_step if training else -1
        generator = torch.Generator().manual_seed(self.args.seed * 1_000_003 + step + 17)
        draws = torch.randint(1, self.block_size + 1, (max(0, self.num_blocks - 1),), generator=generator)
        return draws.tolist()

    def target_batch(self, drafter: SpecBlockDraftModel, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The drafter's training inputs: target features, draft-vocab target logits and the target argmax."""
        weight, softcap = _target_head(self.target)
        with torch.no_grad():
            draft_weight = weight.index_select(0, drafter.d2t.to(weight.device))
            if "features" in inputs:  # precomputed
                features, final, argmax = inputs["features"], inputs["final_hidden"], inputs["target_argmax"]
            else:
                features, final = target_features(
                    self.target, inputs["input_ids"], inputs["attention_mask"], self.layer_ids
                )
                argmax = target_argmax(final, weight)
            target_logits = draft_target_logits(final.to(draft_weight.device), draft_weight, softcap)
        device = drafter.device
        return {
            "input_ids": inputs["input_ids"],
            "attention_mask": inputs["attention_mask"],
            "loss_mask": inputs["loss_mask"],
            "features": features.to(device),
            "target_logits": target_logits.to(device),
            "target_argmax": argmax.to(device),
        }

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: D102
        drafter = self.accelerator.unwrap_model(model)
        batch = self.target_batch(drafter, inputs)
        outputs = model(**batch, followup_offsets=self.followup_offsets(model.training))
        key = "train" if model.training else "eval"
        stats = outputs.stats.detach()
        self._stats[key] = stats if self._stats[key] is None else self._stats[key] + stats
        if model.training:
            self.train_micro_batches += 1
        return (outputs.loss, outputs) if return_outputs else outputs.loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):  # noqa: D102
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def _reduced_metrics(self, key: str) -> dict[str, float]:
        stats = self._stats[key]
        self._stats[key] = None
        if stats is None:
            return {}
        stats, _ = _all_reduce(stats.to(self.args.device))
        return stats_to_metrics(stats, self.block_size)

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> EvalLoopOutput:  # noqa: D102
        self._stats["eval"] = None
        output = super().evaluation_loop(*args, **kwargs)
        prefix = kwargs.get("metric_key_prefix", args[4] if len(args) > 4 else "eval")
        for name, value in self._reduced_metrics("eval").items():
            output.metrics[f"{prefix}_{name}"] = value
        return output

    def train(self, *args: Any, **kwargs: Any):  # noqa: D102
        self._session_start, self._earlier_seconds = time.perf_counter(), None
        return super().train(*args, **kwargs)

    def training_seconds(self) -> float:
        """Wall-clock training time so far, across resumes: earlier sessions' time comes from the restored log
        history (up to their last log before the checkpoint)."""
        if self._earlier_seconds is None:
            logged = (h["train_seconds"] for h in reversed(self.state.log_history) if "train_seconds" in h)
            self._earlier_seconds = next(logged, 0.0)
        return self._earlier_seconds + time.perf_counter() - self._session_start

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:  # noqa: D102
        if "loss" in logs:  # a training-progress log: every process calls it
            logs.update(self._reduced_metrics("train"))
            logs["train_seconds"] = round(self.training_seconds(), 1)
        super().log(logs, start_time)


# =================================================================================================== entry point
def _resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"Unknown dtype {name!r}: expected one of auto, {', '.join(_DTYPES)}.")
    return _DTYPES[name]


def _parse_layer_ids(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"--target_layer_ids must be comma-separated integers, got {text!r}.") from None


def check_layer_ids(layer_ids: Sequence[int], target: PreTrainedModel, target_name: str) -> None:
    """Raise a ValueError if the target has no hidden state for one of ``layer_ids``."""
    num_layers = target.config.get_text_config().num_hidden_layers
    if len(layer_ids) != 3:
        raise ValueError(f"--target_layer_ids needs 3 ids (low, middle, high), got {list(layer_ids)}.")
    bad = [i for i in layer_ids if not 0 <= i <= num_layers]
    if bad:
        raise ValueError(
            f"--target_layer_ids {list(layer_ids)}: the target {target_name!r} has {num_layers} layers, so its hidden "
            f"states are numbered 0..{num_layers}; {bad} do not exist."
        )


def check_drafter_for_target(
    config: SpecBlockConfig, target: PreTrainedModel, drafter_path: str, target_name: str
) -> None:
    """Raise a ValueError naming both values if the drafter at ``drafter_path`` was built for another target."""
    text_config = target.config.get_text_config()
    checks = [
        ("vocab_size", config.vocab_size, target.get_input_embeddings().num_embeddings),
        ("hidden_size", config.target_hidden_size, text_config.hidden_size),
        ("num_hidden_layers", config.target_num_hidden_layers, text_config.num_hidden_layers),
    ]
    if config.target_model_type is not None:
        checks.append(("model_type", config.target_model_type, text_config.model_type))
    for name, expected, actual in checks:
        if expected != actual:
            raise ValueError(
                f"--init_drafter {drafter_path} was built for a target with {name}={expected}, but --target_model "
                f"{target_name} has {name}={actual}. Train from scratch (drop --init_drafter) or pass a drafter "
                "trained for this target."
            )


DRAFTERS = {  # --drafter -> (config class, trainable model class whose forward returns the loss)
    "specblock": (SpecBlockConfig, SpecBlockDraftModelForTraining),
    "eagle3": (Eagle3Config, Eagle3DraftModel),
}


def _build_drafter(
    model_args: ModelArguments, target: PreTrainedModel, train_set: datasets.Dataset
) -> SpecBlockDraftModelForTraining | Eagle3DraftModel:
    layer_ids = _parse_layer_ids(model_args.target_layer_ids)
    if layer_ids is not None:
        check_layer_ids(layer_ids, target, model_args.target_model)
    vocab_size = target.config.get_text_config().vocab_size
    if model_args.drafter not in DRAFTERS:
        raise ValueError(f"--drafter must be one of {sorted(DRAFTERS)}, got {model_args.drafter!r}.")
    config_class, model_class = DRAFTERS[model_args.drafter]
    if model_args.drafter == "eagle3" and (model_args.block_size or model_args.drafter_num_layers):
        raise ValueError("--block_size / --drafter_num_layers are SpecBlock settings; EAGLE-3 has one layer.")
    if model_args.init_drafter:
        config = config_class.from_pretrained(model_args.init_drafter)
        check_drafter_for_target(config, target, model_args.init_drafter, model_args.target_model)
        for name, requested in (
            ("block_size", model_args.block_size),
            ("target_layer_ids", layer_ids),
            ("draft_vocab_size", model_args.draft_vocab_size),
            ("num_hidden_layers", model_args.drafter_num_layers),
        ):
            if requested is not None and requested != getattr(config, name, requested):
                raise ValueError(
                    f"--init_drafter {model_args.init_drafter} has {name}={getattr(config, name)}, but "
                    f"{requested} was requested. Drop the option or train a new drafter."
                )
        check_layer_ids(config.target_layer_ids, target, model_args.target_model)
        drafter = model_class.from_pretrained(model_args.init_drafter, dtype=torch.float32)
        logger.info(f"Starting from the drafter in {model_args.init_drafter} (its draft vocabulary is kept).")
    else:
        overrides: dict[str, Any] = {
            "draft_vocab_size": model_args.draft_vocab_size or default_draft_vocab_size(vocab_size)
        }
        if model_args.drafter == "eagle3":
            overrides["ttt_steps"] = model_args.ttt_steps or 7
        else:
            overrides["block_size"] = model_args.block_size or 4
        if layer_ids is not None:
            overrides["target_layer_ids"] = layer_ids
        if model_args.drafter_num_layers is not None:
            overrides["num_hidden_layers"] = model_args.drafter_num_layers
        config = config_class.from_target_config(target.config, **overrides)
        check_layer_ids(config.target_layer_ids, target, model_args.target_model)
        drafter = model_class(config)
        d2t, coverage = build_draft_vocab(
            train_set["input_ids"], train_set["loss_mask"], vocab_size, config.draft_vocab_size
        )
        set_draft_vocab(drafter, d2t)
        if model_args.init_head_from_target:
            init_head_from_target(drafter, target)
        logger.warning(
            f"Draft vocabulary: {config.draft_vocab_size} of {vocab_size} target tokens, covering "
            f"{100 * coverage:.2f}% of the training assistant tokens."
        )
    drafter.bind_target(target)
    return drafter.float()


def training_info(
    model_args: ModelArguments, data_args: DataArguments, metrics: dict[str, Any], command: str
) -> dict[str, Any]:
    """What the model card reports about a training run (stored as ``config.training_info``)."""
    packaged = model_args.target_model in PACKAGED_MODELS
    device = "GPU: " + torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    return {
        "command": command,
        "datasets": ["anon8231489123/ShareGPT_Vicuna_unfiltered"] if data_args.dataset == "sharegpt" else None,
        "data": (
            f"{data_args.dataset} conversations (max_train_samples={data_args.max_train_samples}, max_length="
            f"{data_args.max_length}); the corpus' own assistant turns with the target's soft labels, NOT responses "
            "regenerated by the target; held-out ShareGPT split never used for training"
        ),
        "target": PACKAGED_MODELS[model_args.target_model].hub_id if packaged else model_args.target_model,
        "compute": device,
        "train_tokens": metrics.get("train_tokens"),
        "train_steps": metrics.get("train_steps"),
        "train_time_minutes": round(metrics.get("train_seconds", 0.0) / 60, 1),
        "license": "apache-2.0",
    }


def record_training_info(drafter: SpecBlockDraftModel, info: dict[str, Any]) -> None:
    """Attach a run's record to the drafter config (the generated model card reads it)."""
    drafter.config.training_info = {k: v for k, v in info.items() if k not in ("target",)}
    drafter.config.target_name_or_path = info["target"]


def plot_learning_curve(log_history: list[dict[str, Any]], path: str | os.PathLike) -> None:
    """Training loss, per-slot top-1 accuracy and the chain acceptance estimate against the step (a PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logs = [e for e in log_history if "loss" in e and "step" in e]
    if not logs:
        return
    steps = [e["step"] for e in logs]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    axes[0].plot(steps, [e["loss"] for e in logs])
    axes[0].set_title("training loss")
    for key in sorted(k for k in logs[0] if k.startswith("acc_slot")):
        axes[1].plot(steps, [e.get(key, float("nan")) for e in logs], label=key)
    axes[1].set_title("top-1 accuracy per slot (training batches)")
    axes[1].legend(fontsize=7)
    axes[2].plot(steps, [e.get("accept_length", float("nan")) for e in logs])
    axes[2].set_title("estimated accepted length (greedy chain)")
    for ax in axes:
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save_drafter(drafter: SpecBlockDraftModel, output_dir: str | os.PathLike, dtype: torch.dtype) -> None:
    """``save_pretrained`` a plain `SpecBlockDraftModel` copy (safetensors, no target embedding) in ``dtype``."""
    final = (SpecBlockDraftModel if isinstance(drafter, SpecBlockDraftModel) else type(drafter))(drafter.config)
    final.load_state_dict(drafter.state_dict())
    final.to(dtype).save_pretrained(output_dir)


def run_training(
    model_args: ModelArguments,
    data_args: DataArguments,
    training_args: SpecBlockTrainingArguments,
    command: str | None = None,
) -> SpecBlockTrainer:
    """Train a drafter end to end (what ``specblock-train`` runs); returns the trainer after saving."""
    if data_args.features not in ("online", "precomputed"):
        raise ValueError(f"--features must be 'online' or 'precomputed', got {data_args.features!r}.")
    if training_args.num_blocks < 1:
        raise ValueError(f"--num_blocks must be >= 1, got {training_args.num_blocks}.")
    save_dtype = _DTYPES.get(model_args.save_dtype)
    if save_dtype is None:
        raise ValueError(f"--save_dtype must be one of {', '.join(_DTYPES)}, got {model_args.save_dtype!r}.")
    features_dtype = _DTYPES.get(data_args.features_dtype)
    if features_dtype is None:
        raise ValueError(f"--features_dtype must be one of {', '.join(_DTYPES)}, got {data_args.features_dtype!r}.")

    target_dtype = _resolve_dtype(model_args.target_dtype, training_args.device)
    target, tokenizer = load_packaged_model(model_args.target_model, dtype=target_dtype)
    target.requires_grad_(False)
    if not tokenizer.chat_template:
        raise ValueError(f"The tokenizer of {model_args.target_model!r} has no chat template to render conversations.")

    conversations = load_conversations(data_args.dataset, data_args.max_train_samples)
    train_set = tokenize_conversations(conversations, tokenizer, data_args.max_length, name=data_args.dataset)
    eval_source = data_args.eval_dataset
    if eval_source is None:
        eval_source = "sharegpt-heldout" if data_args.dataset in ("sharegpt", "sharegpt-train") else "none"
    eval_set = None
    if eval_source != "none":
        eval_conversations = load_conversations(eval_source, data_args.eval_samples)
        eval_set = tokenize_conversations(eval_conversations, tokenizer, data_args.max_length, name=eval_source)

    torch.manual_seed(training_args.seed)
    drafter = _build_drafter(model_args, target, train_set)
    drafter.loss_config = SpecBlockLossConfig.from_args(training_args)

    if data_args.features == "precomputed":
        features_dir = data_args.features_dir or os.path.join(training_args.output_dir, "features")
        with training_args.main_process_first(desc="precomputing target features"):
            precompute_features(
                target.to(training_args.device),
                train_set,
                features_dir,
                drafter.config.target_layer_ids,
                dtype=features_dtype,
                batch_size=data_args.precompute_batch_size,
                shard_tokens=data_args.features_shard_tokens,
                overwrite=data_args.overwrite_features and training_args.process_index == 0,
                description={"target_model": model_args.target_model, "max_length": data_args.max_length},
            )
        train_dataset: torch.utils.data.Dataset = PrecomputedFeatures(features_dir)
        logger.warning(f"Precomputed features: {train_dataset.info['bytes_per_token']} bytes per token.")
    else:
        train_dataset = train_set

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    trainer = SpecBlockTrainer(
        model=drafter,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_set,
        data_collator=SpecBlockDataCollator(pad_token_id=pad_id),
        processing_class=tokenizer,
        target=target,
        num_blocks=1 if model_args.drafter == "eagle3" else training_args.num_blocks,
    )
    start = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    seconds = time.perf_counter() - start
    metrics = dict(result.metrics)
    steps = trainer.train_micro_batches / training_args.gradient_accumulation_steps
    metrics["train_seconds_per_step"] = seconds / max(1.0, steps)
    metrics["train_tokens"] = trainer.state.num_input_tokens_seen  # all sessions, all processes
    metrics["train_seconds"] = trainer.training_seconds()  # all sessions
    if eval_set is not None:
        metrics.update(trainer.evaluate())
    metrics["train_steps"] = trainer.state.global_step
    info = training_info(model_args, data_args, metrics, command or "run_training(...)")
    record_training_info(trainer.accelerator.unwrap_model(trainer.model), info)
    if training_args.should_save:
        trainer.save_metrics("train", metrics)
        trainer.save_state()
        save_drafter(trainer.accelerator.unwrap_model(trainer.model), training_args.output_dir, save_dtype)
        plot_learning_curve(trainer.state.log_history, os.path.join(training_args.output_dir, "learning_curve.png"))
        logger.warning(f"Saved the drafter ({model_args.save_dtype}) to {training_args.output_dir}.")
    trainer.final_metrics = metrics
    return trainer
