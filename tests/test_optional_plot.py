"""matplotlib is the optional `plot` extra: the package imports without it, figures say how to get it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from test_benchmark import tiny_setup
from transformers_specblock.commands.benchmark import run_benchmark
from transformers_specblock.commands.report import write_report
from transformers_specblock.training import plot_learning_curve
from transformers_specblock.utils import import_pyplot

HINT = r"pip install 'transformers-specblock\[plot\]'"


@pytest.fixture
def no_matplotlib(monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError


def test_figures_name_the_extra_when_matplotlib_is_missing(no_matplotlib, tmp_path):
    with pytest.raises(ImportError, match=HINT):
        import_pyplot()
    with pytest.raises(ImportError, match=HINT):
        plot_learning_curve([{"loss": 1.0, "step": 1}], tmp_path / "curve.png")


def test_benchmark_report_without_matplotlib_keeps_the_tables(no_matplotlib, tmp_path, one_thread):
    target, tokenizer, prompts, methods, _ = tiny_setup()
    results = run_benchmark(target, tokenizer, prompts.select(range(1)), methods[:1], max_new_tokens=4)
    write_report(results, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json", "results.md"]


def test_package_and_commands_import_without_matplotlib(tmp_path):
    script = textwrap.dedent(
        """
        import sys
        sys.modules["matplotlib"] = None
        import transformers_specblock, transformers_specblock.commands.cli, transformers_specblock.training
        print("imported")
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})  # fmt: skip
    assert proc.returncode == 0 and "imported" in proc.stdout, proc.stderr[-3000:]
