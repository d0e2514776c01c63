"""`run_training`, what ``specblock-train`` runs: load the target and the data, build (or load) the drafter, train
it with `SpecBlockTrainer`, then record the run, plot the learning curve and save the weights."""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Sequence
from typing import Any

import datasets
import torch
from transformers import PreTrainedModel
from transformers.utils import logging

from ..hub.assets import explain_hub_errors
from ..hub.loading import load_model
from ..hub.provenance import describe_hardware
from ..models.dflash.configuration_dflash import DFlashConfig
from ..models.dflash.modeling_dflash import DFlashDraftModel
from ..models.eagle3.configuration_eagle3 import Eagle3Config
from ..models.eagle3.modeling_eagle3 import Eagle3DraftModel
from ..models.specblock.configuration_specblock import SpecBlockConfig
from ..models.specblock.modeling_specblock import SpecBlockDraftModel
from ..utils import import_pyplot
from .arguments import (
    _DTYPES,
    DataArguments,
    ModelArguments,
    SpecBlockLossConfig,
    SpecBlockTrainingArguments,
    _parse_layer_ids,
)
from .data import SpecBlockDataCollator, load_conversations, tokenize_conversations
from .dflash import DFlashDraftModelForTraining, DFlashTrainer, build_dflash_drafter
from .features import PrecomputedFeatures, precompute_features
from .modeling import SpecBlockDraftModelForTraining
from .records import record_training_info, training_info
from .trainer import SpecBlockTrainer, last_complete_checkpoint, session_records
from .vocab import (
    build_draft_vocab,
    default_draft_vocab_size,
    init_decoder_from_target,
    init_head_from_target,
    set_draft_vocab,
)

logger = logging.get_logger(__name__)


def target_device(requested: str | None, training_args: SpecBlockTrainingArguments) -> str:
    """The frozen target's ``--device``: by default the Trainer's device (the process' own GPU, cpu with
    ``--use_cpu``); an explicit one only in a single process (each process of a distributed run holds its own
    target copy on its own device)."""
    if requested is None:
        return str(training_args.device)
    if training_args.world_size > 1:
        raise ValueError(
            f"--device {requested}: in a distributed run (torchrun / accelerate launch) every process puts the target "
            "on its own device, the Trainer's; drop --device."
        )
    return requested


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
    "dflash": (DFlashConfig, DFlashDraftModelForTraining),
}


def apply_training_settings(config: Any, model_args: ModelArguments) -> None:
    """The training settings given on the command line (``--ttt_steps``, ``--ttt_decay``, ...) over those of a
    continued drafter (its training record's, else the defaults): training settings are no architecture, so a run
    may change them. A setting of another drafter family is refused."""
    given = {name: getattr(model_args, name, None) for name in ("ttt_steps", "ttt_decay")}
    for name, value in given.items():
        if value is None:
            continue
        if name not in config.training_settings:
            raise ValueError(f"--{name} is an EAGLE-3 training setting; this drafter is a {config.drafter_name} one.")
        setattr(config, name, value)
    config.validate_settings()


def _build_drafter(
    model_args: ModelArguments, target: PreTrainedModel, train_set: datasets.Dataset | None
) -> SpecBlockDraftModelForTraining | Eagle3DraftModel:
    if model_args.drafter == "dflash":  # full vocabulary, DFlash's own layer ids (training/dflash.py)
        drafter = build_dflash_drafter(model_args, target)
        drafter.set_attn_implementation(model_args.drafter_attn_implementation)
        return drafter.float()
    layer_ids = _parse_layer_ids(model_args.target_layer_ids)
    if layer_ids is not None:
        check_layer_ids(layer_ids, target, model_args.target_model)
    vocab_size = target.config.get_text_config().vocab_size
    if model_args.drafter not in DRAFTERS:
        raise ValueError(f"--drafter must be one of {sorted(DRAFTERS)}, got {model_args.drafter!r}.")
    config_class, model_class = DRAFTERS[model_args.drafter]
    if model_args.drafter == "eagle3" and (
        model_args.block_size or model_args.drafter_num_layers or model_args.fusion_identity_init
    ):
        raise ValueError(
            "--block_size / --drafter_num_layers / --fusion_identity_init are SpecBlock settings; EAGLE-3 has one "
            "layer and no fusion."
        )
    if model_args.init_drafter and model_args.init_decoder_from_target:
        raise ValueError("--init_decoder_from_target starts a new drafter; it cannot be combined with --init_drafter.")
    if model_args.init_drafter:
        with explain_hub_errors(model_args.init_drafter, kind="drafter", names="a shipped drafter"):
            config = config_class.from_pretrained(model_args.init_drafter)
        check_drafter_for_target(config, target, model_args.init_drafter, model_args.target_model)
        for name, requested in (
            ("block_size", model_args.block_size),
            ("target_layer_ids", layer_ids),
            ("draft_vocab_size", model_args.draft_vocab_size),
            ("num_hidden_layers", model_args.drafter_num_layers),
            ("fusion_identity_init", model_args.fusion_identity_init or None),
        ):
            if requested is not None and requested != getattr(config, name, requested):
                raise ValueError(
                    f"--init_drafter {model_args.init_drafter} has {name}={getattr(config, name)}, but "
                    f"{requested} was requested. Drop the option or train a new drafter."
                )
        check_layer_ids(config.target_layer_ids, target, model_args.target_model)
        drafter = model_class.from_pretrained(model_args.init_drafter, dtype=torch.float32)
        apply_training_settings(drafter.config, model_args)
        logger.info(f"Starting from the drafter in {model_args.init_drafter} (its draft vocabulary is kept).")
    else:
        overrides: dict[str, Any] = {
            "draft_vocab_size": model_args.draft_vocab_size or default_draft_vocab_size(vocab_size)
        }
        if model_args.drafter == "eagle3":
            overrides["ttt_steps"] = model_args.ttt_steps or 7
            if model_args.ttt_decay is not None:
                overrides["ttt_decay"] = model_args.ttt_decay
        else:
            overrides["block_size"] = model_args.block_size or 4
        if layer_ids is not None:
            overrides["target_layer_ids"] = layer_ids
        if model_args.drafter_num_layers is not None:
            overrides["num_hidden_layers"] = model_args.drafter_num_layers
        if model_args.fusion_identity_init:
            overrides["fusion_identity_init"] = True
        config = config_class.from_target_config(target.config, **overrides)
        check_layer_ids(config.target_layer_ids, target, model_args.target_model)
        drafter = model_class(config)
        d2t, coverage = build_draft_vocab(
            train_set["input_ids"], train_set["loss_mask"], vocab_size, config.draft_vocab_size
        )
        set_draft_vocab(drafter, d2t)
        if model_args.init_head_from_target:
            init_head_from_target(drafter, target)
        if model_args.init_decoder_from_target:
            init_decoder_from_target(drafter, target)
        logger.warning(
            f"Draft vocabulary: {config.draft_vocab_size} of {vocab_size} target tokens, covering "
            f"{100 * coverage:.2f}% of the training assistant tokens."
        )
    drafter.bind_target(target, place=False)  # the Trainer places the drafter; its weights stay float32
    drafter.set_attn_implementation(model_args.drafter_attn_implementation)
    return drafter.float()


def plot_learning_curve(log_history: list[dict[str, Any]], path: str | os.PathLike) -> None:
    """Training loss, per-slot top-1 accuracy and the chain acceptance estimate against the step (a PNG)."""
    plt = import_pyplot()  # matplotlib is the optional `plot` extra
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


def evaluation_at(log_history: list[dict[str, Any]], step: int) -> dict[str, Any] | None:
    """The evaluation metrics the Trainer logged at `step`, or None where it did not evaluate there."""
    for entry in reversed(log_history):
        if entry.get("step") == step and "eval_loss" in entry:
            return {key: value for key, value in entry.items() if key.startswith("eval_")}
    return None


def save_drafter(drafter: SpecBlockDraftModel, output_dir: str | os.PathLike, dtype: torch.dtype) -> None:
    """``save_pretrained`` a plain `SpecBlockDraftModel` copy (safetensors, no target embedding) in ``dtype``, with
    the drafter's decoding settings (those of the ``--init_drafter`` a run continued, else the defaults)."""
    plain = next((c for c in (SpecBlockDraftModel, DFlashDraftModel) if isinstance(drafter, c)), type(drafter))
    final = plain(drafter.config)
    final.load_state_dict(drafter.state_dict())
    final.generation_config = copy.deepcopy(drafter.generation_config)
    final.to(dtype).save_pretrained(output_dir)


def run_training(
    model_args: ModelArguments,
    data_args: DataArguments,
    training_args: SpecBlockTrainingArguments,
    command: str | None = None,
) -> SpecBlockTrainer:
    """Train a drafter end to end (what ``specblock-train`` runs); returns the trainer after saving. With
    ``--do_train false`` only evaluate the ``--init_drafter`` on the eval set (metrics in ``eval_results.json``)."""
    if data_args.features not in ("online", "precomputed"):
        raise ValueError(f"--features must be 'online' or 'precomputed', got {data_args.features!r}.")
    if training_args.num_blocks < 1:
        raise ValueError(f"--num_blocks must be >= 1, got {training_args.num_blocks}.")
    if training_args.single_block_steps < 0:
        raise ValueError(f"--single_block_steps must be >= 0, got {training_args.single_block_steps}.")
    save_dtype = _DTYPES.get(model_args.save_dtype)
    if save_dtype is None:
        raise ValueError(f"--save_dtype must be one of {', '.join(_DTYPES)}, got {model_args.save_dtype!r}.")
    features_dtype = _DTYPES.get(data_args.features_dtype)
    if features_dtype is None:
        raise ValueError(f"--features_dtype must be one of {', '.join(_DTYPES)}, got {data_args.features_dtype!r}.")

    device = target_device(model_args.target_device, training_args)
    target, tokenizer = load_model(model_args.target_model, device=device, dtype=model_args.target_dtype)
    target.requires_grad_(False)
    if not tokenizer.chat_template:
        raise ValueError(f"The tokenizer of {model_args.target_model!r} has no chat template to render conversations.")

    train_set = None
    if training_args.do_train:
        conversations = load_conversations(data_args.dataset, data_args.max_train_samples)
        train_set = tokenize_conversations(conversations, tokenizer, data_args.max_length, name=data_args.dataset)
    elif model_args.init_drafter is None:
        raise ValueError("--do_train false evaluates a trained drafter: pass it as --init_drafter FOLDER.")
    eval_source = data_args.eval_dataset
    if eval_source is None:
        eval_source = "sharegpt-heldout" if data_args.dataset in ("sharegpt", "sharegpt-train") else "none"
    eval_set = None
    if eval_source != "none":
        eval_conversations = load_conversations(eval_source, data_args.eval_samples)
        eval_set = tokenize_conversations(eval_conversations, tokenizer, data_args.max_length, name=eval_source)
    elif not training_args.do_train:
        raise ValueError("--do_train false evaluates on --eval_dataset: name one (e.g. sharegpt-heldout).")

    torch.manual_seed(training_args.seed)
    drafter = _build_drafter(model_args, target, train_set)
    started_from = getattr(drafter.config, "training_info", None)  # an --init_drafter's record (training_info)
    drafter.loss_config = SpecBlockLossConfig.from_args(training_args)

    if data_args.features == "precomputed" and train_set is not None:
        features_dir = data_args.features_dir or os.path.join(training_args.output_dir, "features")
        with training_args.main_process_first(desc="precomputing target features"):
            precompute_features(
                target,
                train_set,
                features_dir,
                drafter.config.feature_layers,
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
    trainer = (DFlashTrainer if model_args.drafter == "dflash" else SpecBlockTrainer)(
        model=drafter,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_set,
        data_collator=SpecBlockDataCollator(pad_token_id=pad_id),
        processing_class=tokenizer,
        target=target,
        num_blocks=1 if model_args.drafter == "eagle3" else training_args.num_blocks,
        single_block_steps=training_args.single_block_steps,
        place_target=False,  # loaded on --device already
    )
    trained = next(drafter.parameters()).dtype
    mixed = "bf16" if training_args.bf16 else "fp16" if training_args.fp16 else None
    trainer.session_record = {  # logged when the session starts, kept in its checkpoints (see trainer.SESSION_KEY)
        "command": command or "run_training(...)",
        "hardware": describe_hardware(
            training_args.device, target.dtype, trained, training_args.world_size, mixed, target_device=target.device
        ),
        "license": model_args.license,
        "base_model_id": model_args.base_model_id,
    }
    if not training_args.do_train:  # --do_train false: the --init_drafter's evaluation, nothing trained or saved
        metrics = trainer.evaluate()
        if training_args.should_save:
            os.makedirs(training_args.output_dir, exist_ok=True)
            trainer.save_metrics("eval", metrics)
        trainer.final_metrics = metrics
        return trainer
    resume = training_args.resume_from_checkpoint
    if resume == "last":  # the newest checkpoint whose save completed; none yet: a fresh start
        resume = last_complete_checkpoint(training_args.output_dir)
        logger.warning(f"--resume_from_checkpoint last: {resume or 'no complete checkpoint, starting fresh'}.")
    start = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=resume)
    seconds = time.perf_counter() - start
    metrics = dict(result.metrics)
    steps = trainer.train_micro_batches / training_args.gradient_accumulation_steps
    metrics["train_seconds_per_step"] = seconds / max(1.0, steps)
    metrics["train_tokens"] = trainer.state.num_input_tokens_seen  # all sessions, all processes
    metrics["train_seconds"] = trainer.training_seconds()  # all sessions
    metrics["train_cpu_seconds"] = trainer.training_cpu_seconds()
    if eval_set is not None:  # the evaluation of the last step where the Trainer just ran one (minutes on a CPU)
        metrics.update(evaluation_at(trainer.state.log_history, trainer.state.global_step) or trainer.evaluate())
    metrics["train_steps"] = trainer.state.global_step
    sessions = session_records(trainer.state.log_history, trainer.state.global_step)
    command = command or "run_training(...)"
    info = training_info(model_args, data_args, metrics, command, sessions, training_args.soft_labels, started_from)
    record_training_info(trainer.accelerator.unwrap_model(trainer.model), info)
    if training_args.should_save:
        trainer.save_metrics("train", metrics)
        trainer.save_state()
        save_drafter(trainer.accelerator.unwrap_model(trainer.model), training_args.output_dir, save_dtype)
        try:
            plot_learning_curve(trainer.state.log_history, os.path.join(training_args.output_dir, "learning_curve.png"))
        except ImportError as error:  # the drafter and metrics are saved; only the figure is missing
            logger.warning(f"No learning_curve.png: {error}")
        logger.warning(f"Saved the drafter ({model_args.save_dtype}) to {training_args.output_dir}.")
    trainer.final_metrics = metrics
    return trainer
