"""Every command reports a user error (a model it cannot load, a bad argument, a drafter for another target) as one
clean paragraph on stderr with a non-zero exit and no traceback; ``--traceback`` shows the traceback. The console
scripts are run as `pyproject.toml` declares them, in a subprocess (what a user sees); the rest in-process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conftest import make_drafter, make_target
from transformers_specblock.commands import card, convert, errors, regenerate
from transformers_specblock.commands.cli import bench_main, train_main

ROOT = Path(__file__).parents[1]
MISSING = "no-such-org/no-such-model"


def console_scripts() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def run_script(name: str, *argv: str) -> subprocess.CompletedProcess:
    """Run the console script `name` as pip's wrapper does (`sys.exit(module.function())` from pyproject.toml),
    offline."""
    module, function = console_scripts()[name].split(":")
    code = f"import sys; sys.argv[0] = {name!r}; from {module} import {function}; sys.exit({function}())"
    env = os.environ | {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=300)


def assert_one_paragraph(stderr: str, name: str, *needles: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip() and not _is_progress(line)]
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1 and lines[0].startswith(f"{name}: error: "), stderr
    for needle in needles:
        assert needle in lines[0], stderr


def _is_progress(line: str) -> bool:
    return "it/s]" in line or "%|" in line  # tqdm bars of loading weights


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A saved tiny target with a tokenizer, a drafter for it and a drafter for another target (vocab 96)."""
    from test_training import make_tokenizer

    root = tmp_path_factory.mktemp("command_errors")
    target = make_target("llama", vocab_size=128)
    target.save_pretrained(root / "target")
    make_tokenizer().save_pretrained(root / "target")
    make_drafter(target, tree_budget=4).save_pretrained(root / "drafter")
    make_drafter(make_target("llama", vocab_size=96), tree_budget=4).save_pretrained(root / "other_drafter")
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": "spell abc"}) + "\n")
    return root


def test_every_console_script_is_wrapped():
    assert set(console_scripts()) == {"specblock-train", "specblock-bench", "specblock-convert"}
    for name in console_scripts():
        module, function = console_scripts()[name].split(":")
        assert function.endswith("_command") or function == "main", name


@pytest.mark.parametrize("name", ["specblock-bench", "specblock-train"])
def test_console_script_missing_model_is_one_paragraph(tmp_path, name):
    argv = ["--target_model", MISSING, "--output_dir", str(tmp_path / "out")]
    if name == "specblock-train":
        argv += ["--use_cpu", "--report_to", "none"]
    result = run_script(name, *argv)
    assert result.returncode == 2
    assert_one_paragraph(result.stderr, name, f"Could not load the model '{MISSING}'", "--traceback")
    shown = run_script(name, *argv, "--traceback")
    assert shown.returncode == 1 and "Traceback (most recent call last)" in shown.stderr
    assert f"Could not load the model '{MISSING}'" in shown.stderr


def test_console_script_convert_missing_source(tmp_path):
    result = run_script("specblock-convert", "--to", "eagle3", str(tmp_path / "nothing"), str(tmp_path / "out"))
    assert result.returncode == 2
    assert_one_paragraph(result.stderr, "specblock-convert", str(tmp_path / "nothing"))


def test_python_m_regenerate_missing_model(tmp_path):
    env = os.environ | {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}
    argv = ["--target_model", MISSING, "--output", str(tmp_path / "r.jsonl")]
    result = subprocess.run([sys.executable, "-m", "transformers_specblock.commands.regenerate", *argv],
                            capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert result.returncode == 2
    assert_one_paragraph(result.stderr, "python -m transformers_specblock.commands.regenerate", MISSING)


def bench_argv(folders: Path, tmp_path: Path, *extra: str) -> list[str]:
    return [
        "--target_model", str(folders / "target"), "--dataset", str(folders / "prompts.jsonl"), "--num_prompts", "1",
        "--max_new_tokens", "4", "--warmup_tokens", "0", "--device", "cpu", "--output_dir", str(tmp_path / "b"), *extra,
    ]  # fmt: skip


@pytest.mark.parametrize(
    "extra, needles, raised",
    [
        (["--methods", "plain,no_such_method"], ["Unknown method 'no_such_method'"], ValueError),
        (["--methods", "specblock", "--specblock_model", "{drafter}", "--tree_budget", "many"],
         ['positive int or "auto", got \'many\''], ValueError),
        (["--methods", "specblock"], ["No specblock drafter 'specblock-target'", "--specblock_model"],
         FileNotFoundError),
        (["--methods", "specblock", "--specblock_model", "{other_drafter}"], ["vocab_size=96", "vocab_size=128"],
         ValueError),
        (["--methods", "specblock", "--specblock_model", "{missing_folder}"], ["specblock drafter"], OSError),
    ],
    ids=["bad_method", "bad_budget", "no_drafter", "drafter_for_another_target", "missing_drafter"],
)
def test_bench_user_errors(folders, tmp_path, capsys, monkeypatch, extra, needles, raised):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    fill = {"drafter": str(folders / "drafter"), "other_drafter": str(folders / "other_drafter"),
            "missing_folder": "no-such-owner/drafter"}
    extra = [arg.format(**fill) for arg in extra]
    assert errors.run_command("specblock-bench", bench_main, bench_argv(folders, tmp_path, *extra)) == 2
    assert_one_paragraph(capsys.readouterr().err, "specblock-bench", *needles)
    with pytest.raises(raised, match=re.escape(needles[0])) as info:  # --traceback: the error itself
        errors.run_command("specblock-bench", bench_main, [*bench_argv(folders, tmp_path, *extra), "--traceback"])
    assert type(info.value) is raised


def test_train_user_error(folders, tmp_path, capsys):
    argv = ["--target_model", str(folders / "target"), "--dataset", str(tmp_path / "missing.jsonl"),
            "--output_dir", str(tmp_path / "t"), "--use_cpu", "--report_to", "none", "--max_steps", "1"]  # fmt: skip
    assert errors.run_command("specblock-train", train_main, argv) == 2
    assert_one_paragraph(capsys.readouterr().err, "specblock-train", "missing.jsonl")


def test_card_of_a_missing_folder(tmp_path, capsys):
    assert card.main([str(tmp_path / "nothing")]) == 2
    assert_one_paragraph(capsys.readouterr().err, "python -m transformers_specblock.commands.card", "nothing")


def test_regenerate_bad_argument(folders, tmp_path, capsys):
    argv = ["--target_model", str(folders / "target"), "--output", str(tmp_path / "r.jsonl"), "--device", "gpu0"]
    assert errors.run_command("regenerate", regenerate.main, argv) == 2
    assert_one_paragraph(capsys.readouterr().err, "regenerate", "--device 'gpu0' is not a device")


def test_a_bug_keeps_its_traceback():
    def buggy(argv):
        raise ZeroDivisionError("a bug, not a user error")

    with pytest.raises(ZeroDivisionError):
        errors.run_command("cmd", buggy, [])


def test_convert_keeps_its_statuses(tmp_path, capsys):
    assert convert.main(["--to", "eagle3", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    assert_one_paragraph(capsys.readouterr().err, "specblock-convert")


def test_evaluate_drafter_example_missing_model(tmp_path):
    env = os.environ | {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}
    argv = ["--drafter", "no-such-owner/drafter", "--target_model", MISSING, "--output", str(tmp_path / "d")]
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "evaluate_drafter.py"), *argv],
                            capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert result.returncode == 2
    assert_one_paragraph(result.stderr, "examples/evaluate_drafter.py", MISSING)
