"""The documentation: generated tables and figures match their results files, every page is in the site's
navigation, the README's links resolve, and the site builds with `mkdocs build --strict`."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import load_example

ROOT = Path(__file__).resolve().parents[1]
NOT_BUILT = ("lab-notes/", "results/")  # mkdocs.yml's exclude_docs: history and raw results


def render_docs():
    spec = importlib.util.spec_from_file_location("render_docs", ROOT / "utils" / "render_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def nav_pages(nav: list) -> list[str]:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_generated_parts_match_their_results_files():
    assert render_docs().main(["--check"]) == 0, "run: python utils/render_docs.py"


def test_a_changed_figure_is_caught_and_restored():
    module = render_docs()
    text = (ROOT / "README.md").read_text()
    cell = re.search(r"\| \d+\.\d\dx \(tau \d\.\d\d\) \|", text)
    assert cell is not None, "the README's results table has no speed-up cell"
    edited = text.replace(cell.group(0), "| 9.99x (tau 9.99) |", 1)
    assert module.render(edited, module.SECTIONS["README.md"]) == text


def test_every_docs_page_is_in_the_navigation():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = nav_pages(config["nav"])
    docs = ROOT / config["docs_dir"]
    pages = {p.relative_to(docs).as_posix() for p in docs.rglob("*.md")}
    built = {p for p in pages if not p.startswith(NOT_BUILT)}
    assert sorted(built - set(nav)) == [], "pages missing from mkdocs.yml's nav"
    assert sorted(set(nav) - pages) == [], "nav entries without a page"


def test_readme_is_short_and_its_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not re.match(r"[a-z]+://", target):
            assert (ROOT / target).exists(), f"README.md links to a missing {target}"


def test_site_builds_strict(tmp_path):
    """A broken link, anchor, page or API reference fails the build (mkdocs comes with the test extra)."""
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
def test_readme_cpu_quickstart_runs_as_written():
    """The README's first code block (the packaged SmolLM2 and the shipped drafter), run as written."""
    code = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[0]
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert float(result.stdout.strip().splitlines()[-1]) >= 1.0  # the printed tau


def test_demo_picks_the_hosts_fast_dtype():
    fast_dtype = load_example("demo").fast_dtype
    assert fast_dtype("cpu", "flags : fpu avx2 avx512f avx512_bf16")[0] == "bfloat16"  # AMD Zen 4 and later
    assert fast_dtype("cpu", "flags : fpu avx2 avx512f amx_bf16 amx_tile")[0] == "bfloat16"  # Xeon with AMX
    assert fast_dtype("cpu", "flags : fpu avx2 avx512f")[0] == "float32"  # no native bfloat16 matmul
    assert fast_dtype("cuda")[0] == "bfloat16"
