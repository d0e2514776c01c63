"""examples/campaign.sh, as printed by DRY_RUN=1: a run restarted from the campaign's committed weights continues the
campaign's one learning-rate schedule (warm-up to the rate a cosine over MAX_STEPS reached at the committed step, then
decay over the steps left) instead of warming up to the peak again."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import load_example

ROOT = Path(__file__).resolve().parents[1]


def dry_run(drafter: str, campaign_dir: Path, max_steps: int) -> list[str]:
    (campaign_dir / "data").mkdir(parents=True, exist_ok=True)
    (campaign_dir / "data" / "train.jsonl").write_text("")  # present: the dry run builds no data
    env = dict(os.environ, DRY_RUN="1", PYTHON=sys.executable, MAX_STEPS=str(max_steps))
    result = subprocess.run(["bash", str(ROOT / "examples" / "campaign.sh"), drafter, str(campaign_dir)],
                            env=env, capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    return result.stdout.split()


def last_value(args: list[str], flag: str) -> str:
    """The value argparse keeps for a flag given more than once: the last."""
    return args[max(i for i, arg in enumerate(args) if arg == flag) + 1]


@pytest.mark.parametrize("drafter", ["specblock", "eagle3"])
def test_restart_from_committed_weights_continues_the_schedule(tmp_path, drafter):
    committed = json.loads((ROOT / "docs" / "results" / "campaign" / drafter / "campaign.json").read_text())
    done, max_steps = committed["campaign_steps"], 7000
    args = dry_run(drafter, tmp_path, max_steps)
    peak = float(last_value(args[: args.index("--lr_scheduler_type")], "--learning_rate"))
    expected = peak * 0.5 * (1 + math.cos(math.pi * (done - 100) / (max_steps - 100)))
    assert float(last_value(args, "--learning_rate")) == pytest.approx(expected, rel=1e-3)
    assert float(last_value(args, "--learning_rate")) < peak
    assert int(last_value(args, "--max_steps")) == max_steps - done
    assert last_value(args, "--data_seed") == str(done)
    assert last_value(args, "--output_dir") == str(tmp_path / f"{drafter}-from-step-{done}")


def test_resume_of_a_run_from_committed_weights_keeps_its_schedule_and_data_order(tmp_path):
    """A run started from the committed weights at step N, resumed from its checkpoint, is rebuilt with the schedule and
    data order it started with (not the first run's 7000 steps from the peak and seed 0's order)."""
    from transformers_specblock.training.trainer import CHECKPOINT_COMPLETE

    done, max_steps = 4110, 7000
    run = tmp_path / f"specblock-from-step-{done}"
    (run / "checkpoint-430").mkdir(parents=True)
    (run / "checkpoint-430" / CHECKPOINT_COMPLETE).write_text("")
    (run / "init_drafter").write_text(str(run / "start_drafter"))
    args = dry_run("specblock", tmp_path, max_steps)
    peak = float(last_value(args[: args.index("--lr_scheduler_type")], "--learning_rate"))
    expected = peak * 0.5 * (1 + math.cos(math.pi * (done - 100) / (max_steps - 100)))
    assert float(last_value(args, "--learning_rate")) == pytest.approx(expected, rel=1e-3)
    assert int(last_value(args, "--max_steps")) == max_steps - done
    assert last_value(args, "--data_seed") == str(done)
    assert last_value(args, "--warmup_steps") == "20"
    assert last_value(args, "--resume_from_checkpoint") == "last"
    assert last_value(args, "--output_dir") == str(run)


def test_committed_extrapolation_is_what_the_results_give():
    """docs/results/campaign/extrapolation.json (and the aims table rendered from it) follows the committed curves and
    tau measurements: rerun examples/campaign_extrapolation.py after adding either."""
    extrapolation = load_example("campaign_extrapolation")
    committed = json.loads((ROOT / "docs/results/campaign/extrapolation.json").read_text())
    assert committed == extrapolation.extrapolate()
    tau = committed["tau_at_16_nodes"]["fits"]
    for fit in tau.values():  # every fit has its points in step order, and more training accepted more
        steps = [p["step"] for p in fit["points"]]
        assert steps == sorted(steps) and len(steps) >= 2 and fit["tau_per_doubling"] > 0


def test_precision_follows_the_host(tmp_path):
    """bfloat16 where this CPU multiplies it natively, float32 where it is emulated (10-20x slower to train)."""
    from transformers_specblock.hub.provenance import native_bfloat16_flags

    args = dry_run("specblock", tmp_path, 7000)
    native = bool(native_bfloat16_flags())
    assert last_value(args, "--dtype") == ("bfloat16" if native else "float32")
    assert ("--bf16" in args) == native


def test_native_bfloat16_flags_read_the_cpu_flags():
    from transformers_specblock.hub.provenance import native_bfloat16_flags

    assert native_bfloat16_flags({"flags": "fpu avx2 fma"}) == []
    assert native_bfloat16_flags({"flags": "avx2 avx512f avx512_bf16 amx_bf16 amx_tile"}) == ["amx_bf16", "avx512_bf16"]
