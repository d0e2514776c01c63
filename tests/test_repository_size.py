"""The repository stops growing by a checkpoint at every ship (issue 60): no git-tracked file over 5 MB outside an
explicit allow-list, which holds one copy of each shipped drafter's weights and at most one resume point per running
training run (bfloat16, weights only, replaced in place). A drafter a test needs is a shipped one, or a small one."""

from __future__ import annotations

import json
import struct
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 5 * 1024 * 1024  # bytes

SHIPPED_WEIGHTS = {
    f"src/transformers_specblock/hub/shipped/{name}/model.safetensors"
    for name in (
        "dflash-smollm2-135m-instruct", "eagle3-smollm2-135m-instruct", "specblock-smollm2-135m-instruct",
        "eagle3-qwen2.5-coder-0.5b-instruct", "specblock-qwen2.5-coder-0.5b-instruct",
    )
}
"""One committed copy of each shipped drafter's weights (package data: the wheel ships them)."""
RESUME_POINTS = {f"docs/results/campaign/{run}/model.safetensors" for run in ("eagle3", "specblock")}
"""The training campaign's current resume points, one per running run (replaced in place at each commit)."""
ALLOWED = SHIPPED_WEIGHTS | RESUME_POINTS


def tracked_files() -> list[str]:
    """Every file git tracks in this checkout (the test needs the checkout: an sdist or a wheel has no history)."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"git ls-files failed: {error}")
    return [name for name in out.decode().split("\0") if name]


def test_no_tracked_file_over_5_mb_outside_the_allow_list():
    large = {}
    for name in tracked_files():
        path = ROOT / name
        if path.is_file() and not path.is_symlink() and path.stat().st_size > LIMIT:
            large[name] = path.stat().st_size
    unexpected = {name: size for name, size in large.items() if name not in ALLOWED}
    assert not unexpected, (
        f"git-tracked files over {LIMIT // 2**20} MB outside the allow-list (tests/test_repository_size.py): "
        + ", ".join(f"{name} ({size / 2**20:.1f} MB)" for name, size in sorted(unexpected.items()))
        + ". Every commit of such a file stays in every clone: point the code at a shipped drafter, use a small "
        "one, keep results out of the repository, or replace the one resume point in place."
    )
    assert set(large) <= ALLOWED


def test_the_allow_list_names_files_that_exist():
    """A stale entry would let a new file of the same name in silently."""
    tracked = set(tracked_files())
    assert SHIPPED_WEIGHTS <= tracked, sorted(SHIPPED_WEIGHTS - tracked)
    # a resume point leaves the list when its run ends (the folder then holds no weights)
    for name in RESUME_POINTS:
        assert name in tracked or not (ROOT / name).exists(), name


def safetensors_header(path: Path) -> dict:
    with open(path, "rb") as handle:
        (size,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(size))
    header.pop("__metadata__", None)
    return header


@pytest.mark.parametrize("name", sorted(RESUME_POINTS))
def test_resume_points_are_bfloat16_weights_only(name):
    """The campaign resumes from the weights alone (its optimizer restarts with a short warm-up), so a resume point
    holds bfloat16 weights and the draft-vocabulary buffers, no optimizer state and no float32 copy."""
    path = ROOT / name
    if not path.is_file():
        pytest.skip(f"{name}: the run has ended")
    header = safetensors_header(path)
    dtypes = {entry["dtype"] for key, entry in header.items() if key not in ("d2t", "t2d")}
    assert dtypes == {"BF16"}, (name, dtypes)
    assert not [key for key in header if "optimizer" in key or key.startswith(("exp_avg", "state."))]
    assert path.stat().st_size < 40 * 2**20
    assert (path.parent / "config.json").is_file()  # one resume point per run folder, in place


@pytest.mark.parametrize("name", sorted(SHIPPED_WEIGHTS))
def test_shipped_weights_are_bfloat16(name):
    header = safetensors_header(ROOT / name)
    assert {entry["dtype"] for key, entry in header.items() if key not in ("d2t", "t2d")} == {"BF16"}
