"""Running the peers' own code: `run_peer(peer, worker, **args)` runs `workers/<worker>.py` with the python of
that peer's venv (`peer_envs.run_worker`; the test skips, naming why, where the venv is not built) and returns the
JSON facts it prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from . import peer_envs

WORKERS = Path(__file__).parent / "workers"


def _run_peer(peer: str, worker: str, **args) -> dict:
    reason = peer_envs.unavailable_reason(peer_envs.DEFAULT_ROOT, peer)
    if reason is not None:
        pytest.skip(reason)
    try:
        return peer_envs.run_worker(peer_envs.DEFAULT_ROOT, peer, WORKERS / f"{worker}.py", args)
    except RuntimeError as error:
        raise AssertionError(str(error)) from None


@pytest.fixture(scope="session")
def run_peer():
    return _run_peer


def pytest_terminal_summary(terminalreporter):
    """Say which peers' code the run could not check (a skip is never a silent pass)."""
    skipped = [
        reason for name in sorted(peer_envs.PEERS)
        if (reason := peer_envs.unavailable_reason(peer_envs.DEFAULT_ROOT, name)) is not None
    ]
    if skipped:
        terminalreporter.write_line("peers' own code NOT checked: " + "; ".join(skipped))
