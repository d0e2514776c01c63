"""`SpecBlockTrainer`: the `Trainer` that runs the frozen target inside every step and logs the drafter metrics."""

from __future__ import annotations

import json
import math
import os
import re
import time
from typing import Any

import torch
from transformers import PreTrainedModel, Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, EvalLoopOutput

from ..models.specblock.modeling_specblock import SpecBlockDraftModel
from ..utils import write_atomically
from .features import _target_head, draft_target_logits, target_argmax, target_features
from .losses import _all_reduce, stats_to_metrics
from .modeling import SpecBlockDraftModelForTraining


SESSION_KEY = "session"
"""A `log_history` entry ``{"step": <first step>, "session": {...}}`` opens every training session (the first run
and each resume): its record (command, detected hardware) lives in the checkpoints' ``trainer_state.json``, so the
final model card lists every session."""


class _SessionRecorder(TrainerCallback):
    """Appends the trainer's `session_record` to the (restored) log history when a session starts, and lets a resumed
    session log, evaluate and save at its own ``--logging_steps`` / ``--eval_steps`` / ``--save_steps`` (`Trainer`
    keeps the checkpoint's and only warns)."""

    def __init__(self, trainer: "SpecBlockTrainer") -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: D102
        state.compute_steps(args, state.max_steps)
        if self.trainer.session_record is not None:
            state.log_history.append({"step": state.global_step, SESSION_KEY: dict(self.trainer.session_record)})


class _TimeBudget(TrainerCallback):
    """Stops training (saving a checkpoint) once the trainer's training time reaches its budget: wall time for
    ``max_train_minutes``, CPU time for ``max_train_cpu_hours``."""

    def __init__(self, trainer: "SpecBlockTrainer") -> None:
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):  # noqa: D102
        if self.trainer.budget_spent() >= 1.0 - 1e-12:
            control.should_training_stop = control.should_save = True


CHECKPOINT_COMPLETE = "checkpoint_complete.json"
"""Written (atomically) into a checkpoint folder once everything else in it is on disk; a folder without it is a save
that was interrupted, which `last_complete_checkpoint` passes over."""


def last_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The checkpoint folder of ``output_dir`` with the highest step whose save completed, or None."""
    if not os.path.isdir(output_dir):
        return None
    steps = []
    for name in os.listdir(output_dir):
        match = re.fullmatch(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)", name)
        if match and os.path.isfile(os.path.join(output_dir, name, CHECKPOINT_COMPLETE)):
            steps.append(int(match.group(1)))
    return os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{max(steps)}") if steps else None


def session_records(log_history: list[dict[str, Any]], final_step: int) -> list[dict[str, Any]]:
    """The sessions of a run, oldest first, each with the steps it trained (``"<first>-<last>"``)."""
    starts = [(entry["step"], entry[SESSION_KEY]) for entry in log_history if SESSION_KEY in entry]
    return [
        {**record, "steps": f"{start}-{starts[i + 1][0] if i + 1 < len(starts) else final_step}"}
        for i, (start, record) in enumerate(starts)
    ]


class SpecBlockTrainer(Trainer):
    """`Trainer` whose step runs the frozen target (online features) or turns precomputed features into soft labels,
    draws the follow-up offsets, and logs the SpecBlock metrics (``acc_slot{k}``, ``accept_length``, ``rank_acc``,
    ``loss_draft``, ``loss_rank``) with the training loss and in every evaluation.

    The target is moved to the Trainer's device unless ``place_target=False`` (a target already placed, e.g. spread
    over GPUs with a ``device_map``); its features are moved to the drafter's device either way. The first
    ``single_block_steps`` optimizer steps train block 1 only; a SpecBlock drafter's forward gets the step for its
    loss schedule (evaluation: none, i.e. the full loss).

    The two clocks it reads, ``wall_clock`` and ``cpu_clock`` (`time.perf_counter`, `time.process_time`), are
    attributes so a test can drive them."""

    wall_clock = staticmethod(time.perf_counter)
    cpu_clock = staticmethod(time.process_time)

    def __init__(
        self,
        *args: Any,
        target: PreTrainedModel,
        num_blocks: int = 3,
        single_block_steps: int = 0,
        place_target: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.target = (target.to(self.args.device) if place_target else target).eval().requires_grad_(False)
        self.num_blocks = num_blocks
        self.single_block_steps = single_block_steps
        self.loss_is_scaled_for_ga = False  # per-micro-batch means: the Trainer divides by the accumulation steps
        drafter = self.accelerator.unwrap_model(self.model)
        self.block_size = getattr(drafter.config, "block_size", None) or drafter.config.ttt_steps  # eagle3: steps
        self.layer_ids = list(drafter.config.target_layer_ids)
        self._stats: dict[str, torch.Tensor | None] = {"train": None, "eval": None}
        self.train_micro_batches = 0  # in this session, this process
        self._session_start, self._session_cpu_start = self.wall_clock(), self.cpu_clock()
        self._earlier: dict[str, float] | None = None  # training time of the sessions before a resume
        self.session_record: dict[str, Any] | None = None  # set by run_training before train()
        self.add_callback(_SessionRecorder(self))
        if self._budget_seconds() is not None:
            self.add_callback(_TimeBudget(self))

    def followup_offsets(self, training: bool) -> list[int]:
        """M ~ U{1..K} per follow-up block, from a generator seeded by (seed, global step): the same on every
        process and across a resume; evaluation uses a fixed draw. Empty (block 1 only) during the first
        ``single_block_steps``."""
        step = self.state.global_step if training else -1
        if training and step < self.single_block_steps:
            return []
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
        if isinstance(drafter, SpecBlockDraftModelForTraining):
            batch["training_step"] = self.state.global_step if model.training else None
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
        self._session_start, self._session_cpu_start = self.wall_clock(), self.cpu_clock()
        self._earlier = None
        return super().train(*args, **kwargs)

    def _earlier_sessions(self, key: str) -> float:
        """A clock's total over the sessions before a resume, from the restored log history (its last ``key``: a
        log or the entry `_save_checkpoint` adds)."""
        if self._earlier is None:
            self._earlier = {}
        if key not in self._earlier:
            logged = (h[key] for h in reversed(self.state.log_history) if key in h)
            self._earlier[key] = next(logged, 0.0)
        return self._earlier[key]

    def training_seconds(self) -> float:
        """Wall-clock training time so far, across resumes."""
        return self._earlier_sessions("train_seconds") + self.wall_clock() - self._session_start

    def training_cpu_seconds(self) -> float:
        """CPU time of this process's training so far, across resumes: the compute a run spent, which wall time
        does not measure on a shared machine."""
        return self._earlier_sessions("train_cpu_seconds") + self.cpu_clock() - self._session_cpu_start

    def _budget_seconds(self) -> float | None:
        """The time budget in seconds of its clock (CPU for ``max_train_cpu_hours``, wall for
        ``max_train_minutes``), or None."""
        if getattr(self.args, "max_train_cpu_hours", None) is not None:
            return self.args.max_train_cpu_hours * 3600
        minutes = getattr(self.args, "max_train_minutes", None)
        return None if minutes is None else minutes * 60

    def budget_spent(self) -> float:
        """Training time so far over the budget (may pass 1): CPU time with ``max_train_cpu_hours``, wall time with
        ``max_train_minutes``, all sessions of a resumed run."""
        by_cpu = getattr(self.args, "max_train_cpu_hours", None) is not None
        spent = self.training_cpu_seconds() if by_cpu else self.training_seconds()
        # every process must stop at the same step and use the same rate: their mean (a no-op on one process)
        total, processes = _all_reduce(torch.tensor([spent], dtype=torch.float64, device=self.args.device))
        return total.item() / processes / self._budget_seconds()

    def time_progress(self) -> float:
        """Share of the time budget spent so far, in [0, 1]."""
        return min(1.0, self.budget_spent())

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        """With a time budget (``max_train_cpu_hours`` or ``max_train_minutes``): warm-up over the warm-up steps
        (global steps, so a resume does not warm up again), then the schedule by time progress (`time_progress`)
        instead of by step: linear / cosine decay over the whole budget, or ``warmup_stable_decay``: the peak rate
        until progress 1 - ``decay_share``, then a linear decay to 0 exactly at the budget, and 0 after it.
        Progress counts every session, so a resumed run continues the same schedule. Otherwise the Trainer's own
        scheduler."""
        if self._budget_seconds() is None:
            return super().create_scheduler(num_training_steps, optimizer)
        warmup = self.args.get_warmup_steps(num_training_steps)
        schedule = getattr(self.args.lr_scheduler_type, "value", self.args.lr_scheduler_type)
        decay_share = getattr(self.args, "decay_share", 0.2)

        def factor(step: int) -> float:
            if schedule == "warmup_stable_decay":
                ramp = step / warmup if step < warmup else 1.0
                return min(ramp, max(0.0, 1.0 - self.time_progress()) / decay_share)
            if step < warmup:
                return step / warmup if schedule != "constant" else 1.0
            if schedule in ("constant", "constant_with_warmup"):
                return 1.0
            progress = self.time_progress()
            return 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))

        if self.lr_scheduler is None:
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer or self.optimizer, factor)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def _save_checkpoint(self, model, trial) -> None:  # noqa: D102
        # the time up to this checkpoint, so a resume from it counts the steps after the last log too
        seconds = round(self.training_seconds(), 1)
        cpu_seconds = round(self.training_cpu_seconds(), 1)
        self.state.log_history.append(
            {"step": self.state.global_step, "train_seconds": seconds, "train_cpu_seconds": cpu_seconds}
        )
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        marker = os.path.join(folder, CHECKPOINT_COMPLETE)
        if self.args.should_save and os.path.exists(marker):  # a save over an older one: incomplete until done
            os.remove(marker)
        super()._save_checkpoint(model, trial)
        if self.args.should_save and os.path.isdir(folder):  # rotation may have removed it (save_total_limit 0)
            write_atomically(marker, json.dumps({"step": self.state.global_step, "train_seconds": seconds,
                                                  "train_cpu_seconds": cpu_seconds}))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:  # noqa: D102
        if "loss" in logs:  # a training-progress log: every process calls it
            logs.update(self._reduced_metrics("train"))
            logs["train_seconds"] = round(self.training_seconds(), 1)
            logs["train_cpu_seconds"] = round(self.training_cpu_seconds(), 1)
        super().log(logs, start_time)
