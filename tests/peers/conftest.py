"""Running the peers' own code: `run_peer(peer, worker, **args)` runs `workers/<worker>.py` with the python of
that peer's venv (built by `peer_envs.py`; the test skips, naming why, where it is not built) and returns the JSON
facts it prints. The subprocess sees neither this package nor its PYTHONPATH, and no network hub."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from . import peer_envs

WORKERS = Path(__file__).parent / "workers"


def _run_peer(peer: str, worker: str, **args) -> dict:
    reason = peer_envs.unavailable_reason(peer_envs.DEFAULT_ROOT, peer)
    if reason is not None:
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    command = [str(peer_envs.venv_python(peer_envs.DEFAULT_ROOT, peer)), str(WORKERS / f"{worker}.py"), json.dumps(
        {k: str(v) if isinstance(v, Path) else v for k, v in args.items()}
    )]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900, cwd=WORKERS)
    if done.returncode != 0:
        raise AssertionError(f"{worker}.py in the {peer} venv failed (exit {done.returncode}):\n{done.stderr[-6000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


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
