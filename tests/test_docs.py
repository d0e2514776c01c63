"""The documentation: generated tables and figures match their results files, every page is in the site's
navigation, the README's links resolve, the site builds with `mkdocs build --strict`, and the built site links to
no page or file it lacks (nor to a repository file that does not exist), copies no weights or patches and stays
small; the pages' code lines fit the page and name no folder of a development machine."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import yaml

from conftest import load_example

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
NOT_BUILT = ("lab-notes/", "results/")  # history and raw results: in the repository, not built into the site
SITE_MB = 15  # the built site stays under this (pages, search index, theme and the few results figures shown)
CODE_LINE = 100  # characters per line of a fenced code block on a site page (what fits the page's width)
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|root|tmp|home|mnt|scratch)/")  # folders of a development machine


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


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site as `mkdocs build --strict` writes it (mkdocs comes with the test extra)."""
    site_dir = tmp_path_factory.mktemp("site") / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return site_dir


def test_site_builds_strict(site):
    """A broken link, anchor, page or API reference fails the build."""
    assert (site / "index.html").exists()


class Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.links += [value for name, value in attrs if name in ("href", "src") and value]


def site_links(site: Path) -> dict[Path, list[str]]:
    pages = {}
    for page in sorted(site.rglob("*.html")):
        parser = Links()
        parser.feed(page.read_text(encoding="utf-8"))
        pages[page] = parser.links
    return pages


def test_the_site_links_to_no_page_or_file_it_lacks(site):
    """Every relative href / src of every built page is a file of the site (a folder: its index.html)."""
    dead = []
    for page, links in site_links(site).items():
        for link in links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or not parts.path or link.startswith("/"):
                continue
            target = (page.parent / unquote(parts.path)).resolve()
            if parts.path.endswith("/") or target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                dead.append(f"{page.relative_to(site)} -> {link}")
    assert dead == [], f"{len(dead)} dead links in the built site:\n" + "\n".join(dead[:40])


def test_the_sites_links_to_repository_files_name_files_that_exist(site):
    """Links to files the site does not build point at the repository (utils/docs_hooks.py): each names a path of
    this checkout, a file for blob/ and a folder for tree/."""
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "utils" / "docs_hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    branch = f"/{hooks.REPOSITORY_BRANCH}/"
    repo_url = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["repo_url"].rstrip("/")
    missing, count = [], 0
    for page, links in site_links(site).items():
        for link in links:
            match = re.match(re.escape(repo_url) + r"/(blob|tree)" + re.escape(branch) + r"([^#?]+)", link)
            if match:
                count += 1
                path = ROOT / unquote(match.group(2))
                if not (path.is_file() if match.group(1) == "blob" else path.is_dir()):
                    missing.append(f"{page.relative_to(site)} -> {link}")
    assert count > 0, "no page links a repository file: has the hook stopped running?"
    assert missing == [], "links to repository paths that do not exist:\n" + "\n".join(missing)


def test_the_site_copies_no_weights_or_patches_and_stays_small(site):
    files = [path for path in site.rglob("*") if path.is_file()]
    heavy = [str(path.relative_to(site)) for path in files if path.suffix in (".safetensors", ".patch", ".bin", ".pt")]
    assert heavy == [], "weights or patches copied into the site"
    assert not (site / "lab-notes").exists(), "the lab notes are built into the site"
    size_mb = sum(path.stat().st_size for path in files) / 2**20
    assert size_mb < SITE_MB, f"the built site holds {size_mb:.1f} MB"


def test_the_api_reference_is_headed_by_public_names(site):
    """`transformers_specblock.SpecBlockDraftModel`, not the private module it is defined in."""
    headings = []
    for page in (site / "reference").rglob("index.html"):
        for heading in re.findall(r'<h2 id="([^"]+)"', page.read_text(encoding="utf-8")):
            headings.append(heading)
    assert "transformers_specblock.SpecBlockDraftModel" in headings
    private = [h for h in headings if re.search(r"\.(modeling|configuration)_|\.(integration|loading|assets)\.", h)]
    assert private == [], "API reference headed by private module paths"


def test_the_steps_of_a_decoding_step_are_one_numbered_list(site):
    """Draft, verify, accept, clean up: one list around the mask figure, not two that each start at 1."""
    page = (site / "concepts" / "tree-speculative-decoding" / "index.html").read_text(encoding="utf-8")
    section = page.split('id="one-step"', 1)[1].split("<h2", 1)[0]
    assert section.count("<ol>") == 1 and section.count("<li>") == 4


WHICH_METHOD_NAMES = {"SpecBlock": "specblock", "EAGLE-3": "eagle3", "DFlash": "dflash", "lookup tree": "lookup_tree",
                      "prompt lookup": "prompt_lookup"}  # fmt: skip


def test_which_method_figures_are_those_of_the_results_they_link():
    """Every 'method N.NNx (tau N.NN)' in a code or chat cell citing a glance run is that run's figure."""
    page = (ROOT / "docs" / "which-method.md").read_text()
    names = "|".join(WHICH_METHOD_NAMES)
    figure = re.compile(rf"({names})(?: alone)? (\d\.\d\d)x(?: \(tau (\d\.\d\d)\))?")
    checked = 0
    for row in re.findall(r"^\|(.+)\|$", page, re.M):
        cells = [cell.strip() for cell in row.split("|")]
        if len(cells) != 6 or cells[0] in ("hardware", "---"):
            continue
        for cell, prompts in ((cells[2], "humaneval"), (cells[3], "mt_bench")):
            run = re.search(r"\]\(results/(glance-[\w-]+)/\)", cell)
            if run is None:
                continue
            [folder] = [p for p in (RESULTS / run.group(1)).iterdir() if p.name.endswith(f"-{prompts}-b1")]
            methods = json.loads((folder / "results.json").read_text())["methods"]
            for name, speedup, tau in figure.findall(cell):
                method = methods[WHICH_METHOD_NAMES[name]]
                assert f"{method['speedup']:.2f}" == speedup, f"{run.group(1)} {prompts} {name}: {speedup}x"
                assert not tau or f"{method['tau']:.2f}" == tau, f"{run.group(1)} {prompts} {name}: tau {tau}"
                checked += 1
    assert checked >= 20


def site_pages() -> list[Path]:
    docs = ROOT / "docs"
    return [page for page in sorted(docs.rglob("*.md")) if not page.relative_to(docs).as_posix().startswith(NOT_BUILT)]


def test_code_blocks_fit_the_page():
    long = []
    for page in site_pages():
        for fence in re.finditer(r"^([ \t]*)(```+|~~~+)[^\n]*\n(.*?)^\1\2[ \t]*$", page.read_text(), re.S | re.M):
            lines = fence.group(3).splitlines()
            long += [f"{page.relative_to(ROOT)}: {line}" for line in lines if len(line) > CODE_LINE]
    assert long == [], f"code lines over {CODE_LINE} characters:\n" + "\n".join(long)


def test_no_docs_page_names_a_development_machines_folders():
    """Pages and lab notes (not the raw results files under docs/results)."""
    docs = ROOT / "docs"
    pages = [page for page in sorted(docs.rglob("*.md")) if page.relative_to(docs).parts[0] != "results"]
    found = [f"{page.relative_to(ROOT)}:{number}: {line.strip()[:120]}" for page in pages
             for number, line in enumerate(page.read_text().splitlines(), 1) if MACHINE_PATH.search(line)]  # fmt: skip
    assert found == [], "absolute folders of a development machine:\n" + "\n".join(found)


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
