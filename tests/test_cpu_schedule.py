"""`--max_train_cpu_hours` with `--lr_scheduler_type warmup_stable_decay` (issue 62, item 4): one schedule for every
drafter, set in CPU time - warm-up by step, the peak rate through a stable phase, a linear decay over the last
`--decay_share` of the budget to 0 exactly at it - a stop with a checkpoint at the budget, and a resume that carries
on the same schedule (no second warm-up). The trainer's CPU clock is driven by the test (18 CPU-seconds per
optimizer step), never read from the machine."""

from __future__ import annotations

import json
import shutil

import pytest

from test_training import common_args, workspace  # noqa: F401  (workspace is a fixture)
from transformers_specblock.commands.cli import parse_train_args
from transformers_specblock.training import run_training
from transformers_specblock.training.trainer import CHECKPOINT_COMPLETE, SpecBlockTrainer

pytestmark = pytest.mark.usefixtures("one_thread")

STEP_CPU, BUDGET_HOURS, WARMUP, SHARE, LR0 = 18.0, 0.1, 2, 0.2, 3e-3  # 360 CPU-s: 20 steps, decay over 17-20


def expected_factor(step: int, cpu_seconds: float) -> float:
    """The schedule by hand: linear warm-up over WARMUP steps, 1.0, then (1 - p) / SHARE from p = 1 - SHARE."""
    progress = min(1.0, cpu_seconds / (BUDGET_HOURS * 3600))
    return min(step / WARMUP if step < WARMUP else 1.0, (1.0 - progress) / SHARE)


@pytest.fixture
def cpu_clock(monkeypatch):
    """A fake process clock that advances STEP_CPU seconds per training step; ``clock[0] = 0`` mimics a new
    process."""
    clock = [0.0]
    original = SpecBlockTrainer.training_step

    def ticking(self, *args, **kwargs):
        clock[0] += STEP_CPU
        return original(self, *args, **kwargs)

    monkeypatch.setattr(SpecBlockTrainer, "cpu_clock", staticmethod(lambda: clock[0]))
    monkeypatch.setattr(SpecBlockTrainer, "training_step", ticking)
    return clock


def _args(workspace, out, *extra):  # noqa: F811
    argv = common_args(workspace, out, "--max_steps", "100", "--max_train_cpu_hours", str(BUDGET_HOURS),
                       "--lr_scheduler_type", "warmup_stable_decay", "--decay_share", str(SHARE),
                       "--save_strategy", "steps", "--save_steps", "6", *extra)  # fmt: skip
    argv[argv.index("--warmup_steps") + 1] = str(WARMUP)
    return argv


def _rates(out) -> dict[int, float]:
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return {e["step"]: e["learning_rate"] for e in history if "loss" in e}


def test_cpu_budget_warmup_stable_decay_stop_and_resume(workspace, cpu_clock):  # noqa: F811
    full = workspace["root"] / "cpu_wsd_full"
    trainer = run_training(*parse_train_args(_args(workspace, full)))
    # (b) stopped by the CPU budget (360 s = 20 steps), far below max_steps, with a complete checkpoint there
    assert trainer.state.global_step == 20
    marker = json.loads((full / "checkpoint-20" / CHECKPOINT_COMPLETE).read_text())
    assert marker["train_cpu_seconds"] == pytest.approx(360.0)
    # (a) the rate step t used is the schedule after step t - 1, at CPU time 18 (t - 1): warm-up, stable, decay
    rates = _rates(full)
    assert sorted(rates) == list(range(1, 21))
    factors = [rates[t] / LR0 for t in range(1, 21)]
    assert factors == pytest.approx([expected_factor(s, STEP_CPU * s) for s in range(20)], abs=1e-9)
    assert factors[:3] == pytest.approx([0.0, 0.5, 1.0])  # warm-up by step
    assert factors[2:17] == pytest.approx([1.0] * 15)  # stable through p = 0.8 (step 16)
    assert factors[17:] == pytest.approx([0.75, 0.5, 0.25])  # linear decay ...
    assert trainer.lr_scheduler.get_last_lr()[0] == pytest.approx(0.0, abs=1e-12)  # ... to 0 at the budget
    cpu_clock[0] += 1000.0  # past the budget the factor stays 0
    assert trainer.lr_scheduler.lr_lambdas[0](25) == 0.0

    # (c) a resume in a new process (its CPU clock restarts at 0) from the step-6 checkpoint: progress comes from the
    # logged CPU seconds and the warm-up counts global steps, so steps 7-20 use the uninterrupted run's rates
    resumed = workspace["root"] / "cpu_wsd_resumed"
    resumed.mkdir()
    shutil.copytree(full / "checkpoint-6", resumed / "checkpoint-6")
    cpu_clock[0] = 0.0
    argv = _args(workspace, resumed, "--resume_from_checkpoint", str(resumed / "checkpoint-6"))
    again = run_training(*parse_train_args(argv))
    assert again.state.global_step == 20  # stopped at the same CPU budget
    assert again.training_cpu_seconds() == pytest.approx(360.0)
    after = _rates(resumed)  # steps 1-6 come from the checkpoint's history, 7-20 from the resumed session
    assert sorted(after) == list(range(1, 21))
    # the first factor the resumed session computes (after step 7, at 126 CPU-s) is the uninterrupted run's: the
    # peak, not a second warm-up (step 1 of a new ramp would be 0.5)
    assert after[8] == pytest.approx(rates[8], abs=1e-12) and after[8] == pytest.approx(LR0)
    assert [after[t] for t in range(7, 21)] == pytest.approx([rates[t] for t in range(7, 21)], abs=1e-12)
    assert again.lr_scheduler.get_last_lr()[0] == pytest.approx(0.0, abs=1e-12)
    assert (resumed / "checkpoint-20" / CHECKPOINT_COMPLETE).is_file()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--max_train_cpu_hours", "1", "--max_train_minutes", "30"], "exclude each other"),
        (["--max_train_cpu_hours", "0"], "max_train_cpu_hours must be"),
        (["--max_train_cpu_hours", "1", "--decay_share", "0"], "decay_share must be in"),
        (["--max_train_cpu_hours", "1", "--decay_share", "1.5"], "decay_share must be in"),
        (["--lr_scheduler_type", "warmup_stable_decay"], "decays to a time budget"),
        (["--max_train_cpu_hours", "1", "--lr_scheduler_type", "polynomial"], "--max_train_cpu_hours schedules"),
    ],
)
def test_cpu_budget_arguments_are_checked(workspace, extra, message):  # noqa: F811
    with pytest.raises(ValueError, match=message):
        parse_train_args(common_args(workspace, workspace["root"] / "unused", *extra))


def test_cpu_budget_arguments_parse(workspace):  # noqa: F811
    *_, args = parse_train_args(
        common_args(workspace, workspace["root"] / "unused", "--max_train_cpu_hours", "2.5",
                    "--lr_scheduler_type", "warmup_stable_decay", "--decay_share", "1")  # fmt: skip
    )
    assert (args.max_train_cpu_hours, args.decay_share, args.time_budget_option) == (2.5, 1.0, "--max_train_cpu_hours")
    *_, args = parse_train_args(common_args(workspace, workspace["root"] / "unused"))
    assert (args.max_train_cpu_hours, args.decay_share, args.time_budget_option) == (None, 0.2, None)
