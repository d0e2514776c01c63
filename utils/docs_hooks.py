"""mkdocs hooks (mkdocs.yml `hooks:`): what the site holds, and where its links to everything else go.

The site builds the pages in the navigation, their figures, and the results figures a page shows. The lab notes
(docs/lab-notes) and the raw results (docs/results: JSON, JSON lines, READMEs, drafter weights, patches) stay in the
repository: a page's link to one of them, or to any other file of the repository (an example script, a test), is
pointed at that file in the repository (`repo_url`, branch REPOSITORY_BRANCH), so the site links to no page or file
it does not build. tests/test_docs.py checks both kinds of link in the built site.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import Files, InclusionLevel

REPOSITORY_BRANCH = "main"
REPOSITORY_ONLY = ("results/", "lab-notes/")  # folders under docs/ the site copies only shown figures from
FENCE = re.compile(r"^([ \t]*)(```+|~~~+).*?^\1\2[ \t]*$", re.M | re.S)
LINK = re.compile(r"(?<!!)(\[(?:[^\[\]]|\[[^\]]*\])*\]\()(?P<target>[^)\s]+)((?:\s+\"[^\"]*\")?\))")
HTML_LINK = re.compile(r"(<a\s[^>]*href=\")(?P<target>[^\"]+)(\")")
IMAGE = re.compile(r"!\[(?:[^\[\]]|\[[^\]]*\])*\]\((?P<target>[^)\s]+)|<img\s[^>]*src=\"(?P<html>[^\"]+)\"")


def is_relative(target: str) -> bool:
    return not re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:|#|/", target)


def resolve(page_uri: str, target: str) -> str:
    """A page's relative link as a path under docs/ (may start with ../ when it leaves docs/)."""
    path = posixpath.normpath(posixpath.join(posixpath.dirname(page_uri), target.split("#", 1)[0]))
    return path + "/" if target.split("#", 1)[0].endswith("/") and path != "." else path


def shown_figures(files: Files) -> set[str]:
    """Files under REPOSITORY_ONLY that a built page shows as an image."""
    shown = set()
    for file in files.documentation_pages():
        if file.src_uri.startswith(REPOSITORY_ONLY) or not file.inclusion.is_included():
            continue
        text = FENCE.sub("", Path(file.abs_src_path).read_text(encoding="utf-8"))
        for match in IMAGE.finditer(text):
            target = match.group("target") or match.group("html")
            if is_relative(target):
                shown.add(resolve(file.src_uri, target))
    return shown


def on_config(config):
    if not config.repo_url:
        raise ValueError("mkdocs.yml needs repo_url: links to repository files point there")
    return config


def on_files(files: Files, config) -> Files:
    """Keep from REPOSITORY_ONLY only the figures the pages show (weights, patches, JSON never reach the site)."""
    shown = shown_figures(files)
    for file in list(files):
        if file.src_uri.startswith(REPOSITORY_ONLY):
            if file.src_uri in shown:
                file.inclusion = InclusionLevel.NOT_IN_NAV
            else:
                files.remove(file)
    return files


def repository_url(config, path: str, anchor: str) -> str | None:
    """The repository address of a path under docs/ that exists in the checkout, else None."""
    docs = Path(config.docs_dir).resolve()
    root = Path(config.config_file_path).resolve().parent
    local = (docs / path).resolve()
    if not local.exists() or not local.is_relative_to(root):
        return None
    kind = "tree" if local.is_dir() else "blob"
    url = f"{config.repo_url.rstrip('/')}/{kind}/{REPOSITORY_BRANCH}/{local.relative_to(root).as_posix()}"
    return url + (f"#{anchor}" if anchor else "")


def built(files: Files, path: str) -> bool:
    """Whether the site builds this path under docs/ (a folder: its index.md or README.md)."""
    if path.endswith("/") or path == ".":
        folder = "" if path in ("./", ".") else path
        return any(built(files, folder + name) for name in ("index.md", "README.md"))
    file = files.get_file_from_path(path)
    return file is not None and file.inclusion.is_included()


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    """Point every link to a file the site does not build at that file in the repository."""

    def rewrite(match: re.Match) -> str:
        target = match.group("target")
        if not is_relative(target):
            return match.group(0)
        path = resolve(page.file.src_uri, target)
        if built(files, path):
            return match.group(0)
        url = repository_url(config, path, target.split("#", 1)[1] if "#" in target else "")
        if url is None:
            return match.group(0)  # mkdocs reports it (a missing file fails the strict build)
        return match.group(1) + url + match.group(match.re.groups)

    parts, last = [], 0
    for fence in FENCE.finditer(markdown):  # links inside code blocks are code
        parts += [HTML_LINK.sub(rewrite, LINK.sub(rewrite, markdown[last : fence.start()])), fence.group(0)]
        last = fence.end()
    parts.append(HTML_LINK.sub(rewrite, LINK.sub(rewrite, markdown[last:])))
    return "".join(parts)
