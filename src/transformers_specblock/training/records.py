"""A drafter's training record (``training_record.json`` next to its weights, `hub.provenance`): the record of a
finished run (`training_info`), of a run's checkpoint (`checkpoint_training_info`, for a drafter published while its
run goes on), and the record of the drafter a run started from (``--init_drafter``), kept nested under
``started_from`` so the record holds everything the weights have seen; the model card summarises it."""

from __future__ import annotations

import json
import os
import shlex
from typing import Any

from transformers import PreTrainedModel

from ..hub.assets import PACKAGED_MODELS
from ..hub.provenance import TRAINING_RECORD_NAME, resolve_base_model_id
from .arguments import DataArguments, ModelArguments, SpecBlockTrainingArguments, parse_train_args
from .data import describe_training_data
from .trainer import session_records


def training_info(
    model_args: ModelArguments,
    data_args: DataArguments,
    metrics: dict[str, Any],
    command: str,
    sessions: list[dict[str, Any]] | None = None,
    soft_labels: bool = True,
    started_from: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What the training record reports about a run (``training_record["training"]``; ``target`` and
    ``base_model`` go to the config itself, see `record_training_info`), from the arguments, the data file's own
    records and the ``sessions`` the trainer logged (each with the hardware detected when it started).

    ``started_from`` is the ``training_info`` of the ``--init_drafter`` the run continued (None: a new drafter); it is
    kept under ``started_from`` with the drafter's name, and ``total_train_tokens`` adds both runs' tokens."""
    packaged = model_args.target_model in PACKAGED_MODELS
    sessions = sessions or [{"command": command}]
    # --license / --base_model_id given in an earlier session still count after a resume without them
    license_id = next((s["license"] for s in reversed(sessions) if s.get("license")), model_args.license)
    explicit_id = next((s["base_model_id"] for s in reversed(sessions) if s.get("base_model_id")), None)
    base_model = resolve_base_model_id(model_args.target_model, model_args.base_model_id or explicit_id)
    data = describe_training_data(
        data_args.dataset, data_args.max_train_samples, data_args.max_length, model_args.target_model, base_model
    )
    labels = "the target's soft labels" if soft_labels else "the target's argmax as hard labels"
    shown = [{k: v for k, v in s.items() if k in ("command", "steps", "hardware")} for s in sessions]
    hardware = list(dict.fromkeys(s["hardware"] for s in sessions if s.get("hardware")))
    cpu_seconds = metrics.get("train_cpu_seconds")
    info = {
        "target": PACKAGED_MODELS[model_args.target_model].hub_id if packaged else model_args.target_model,
        "base_model": base_model,
        "target_model": model_args.target_model if packaged else None,  # the packaged GGUF the card describes
        "command": sessions[-1].get("command", command),
        "sessions": shown if len(shown) > 1 else None,
        "hardware": " / ".join(hardware) or None,
        "data": f"{data['data']}; trained on {labels}",
        "self_distilled": data["self_distilled"],
        "datasets": data["datasets"],
        "license": license_id,
        "train_tokens": metrics.get("train_tokens"),
        "train_steps": metrics.get("train_steps"),
        "train_time_minutes": round(metrics.get("train_seconds", 0.0) / 60, 1),
        "train_cpu_minutes": round(cpu_seconds / 60, 1) if cpu_seconds is not None else None,
    }
    if started_from and model_args.init_drafter:
        earlier_tokens = started_from.get("total_train_tokens", started_from.get("train_tokens"))
        if info["train_tokens"] is not None and earlier_tokens is not None:
            info["total_train_tokens"] = info["train_tokens"] + earlier_tokens
        info["started_from"] = {"drafter": model_args.init_drafter, **started_from}
    return {k: v for k, v in info.items() if v is not None}


def record_training_info(drafter: PreTrainedModel, info: dict[str, Any]) -> None:
    """Attach a run's record to the drafter (``save_pretrained`` writes it to ``training_record.json``; the
    generated model card summarises it): ``target`` (as given, or the packaged model's Hub id) ->
    ``config.target_name_or_path``, ``base_model`` (a Hub id or absent, never a path) -> ``config.base_model_id``,
    the rest -> the record's ``training``, the config's training settings (as the run used them) -> its
    ``training_settings``. Evaluation rows the record carried (from the ``--init_drafter`` it started as) are
    dropped: they measured other weights."""
    info = dict(info)
    drafter.config.target_name_or_path = info.pop("target")
    drafter.config.base_model_id = info.pop("base_model", None)
    settings = drafter.config.current_training_settings()
    drafter.config.training_record = {"training": info, **({"training_settings": settings} if settings else {})}


def parse_train_command(command: str) -> tuple[ModelArguments, DataArguments, SpecBlockTrainingArguments]:
    """A recorded ``specblock-train ...`` (or ``python -m transformers_specblock.train ...``) command line -> its
    three argument dataclasses."""
    words = shlex.split(command)
    start = next((i for i, word in enumerate(words) if word.startswith("--")), len(words))
    return parse_train_args(words[start:])


def checkpoint_training_info(checkpoint: str | os.PathLike) -> dict[str, Any]:
    """The record of the run that wrote ``checkpoint`` up to its step, as `training_info` writes it when a run
    ends: its sessions and commands (the newest session's command gives the arguments), tokens, steps and clocks from
    ``trainer_state.json``, and the record of the drafter it started from (the checkpoint's training record, as the
    Trainer saved it with the drafter the run was built from; ``training_info`` of its config.json for checkpoints
    of older releases)."""
    with open(os.path.join(checkpoint, "trainer_state.json")) as handle:
        state = json.load(handle)
    record_file = os.path.join(checkpoint, TRAINING_RECORD_NAME)
    if os.path.isfile(record_file):
        with open(record_file) as handle:
            started_from = json.load(handle).get("training")
    else:
        with open(os.path.join(checkpoint, "config.json")) as handle:
            started_from = json.load(handle).get("training_info")
    sessions = session_records(state["log_history"], state["global_step"])
    if not sessions:
        raise ValueError(f"{checkpoint} records no training session (not written by specblock-train).")
    model_args, data_args, training_args = parse_train_command(sessions[-1]["command"])
    clocks = [e for e in state["log_history"] if "train_seconds" in e]
    metrics = {
        "train_tokens": state.get("num_input_tokens_seen"),
        "train_steps": state["global_step"],
        "train_seconds": clocks[-1]["train_seconds"] if clocks else 0.0,
        "train_cpu_seconds": clocks[-1].get("train_cpu_seconds") if clocks else None,
    }
    return training_info(
        model_args, data_args, metrics, sessions[-1]["command"], sessions, training_args.soft_labels, started_from
    )
