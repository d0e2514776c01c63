"""One cached virtual environment per peer tool, with the versions that tool pins (standard library only).

The peers' own code (vLLM's `speculators`, SGLang's `specforge`, z-lab's `dflash`) is installed from the package
registry into its OWN venv, never into this package's environment: the compatibility tests run it there in a
subprocess and exchange tensors through files. Usage (CI runs this as its own step):

    python3 tests/peers/peer_envs.py [--root DIR] [--only NAME ...]

Each venv is rebuilt only when its requirement list changes (a hash stored beside it). Where the registry cannot be
reached the venv is not built, the reason is written to `<root>/<name>.skipped` and printed, and the peers' tests
skip with that reason; any other install failure is an error.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_ROOT = Path.home() / ".cache" / "transformers-specblock" / "peer-venvs"
# The CPU wheel on disk: pinned first and held by a constraint, so no resolver step can pull a CUDA build.
TORCH = "torch==2.13.0"


@dataclass(frozen=True)
class Peer:
    """A peer tool's venv: `resolved` installs with dependencies, `no_deps` without (a pin we cannot or must not
    honour is replaced by what its modules import; `note` says which and why)."""

    name: str
    package: str
    resolved: tuple[str, ...]
    no_deps: tuple[str, ...] = ()
    probe: str = ""
    note: str = ""
    extra_constraints: tuple[str, ...] = field(default=())

    def spec_hash(self) -> str:
        text = json.dumps([TORCH, self.resolved, self.no_deps, self.extra_constraints, sys.version_info[:2]])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


PEERS: dict[str, Peer] = {
    peer.name: peer
    for peer in (
        Peer(
            name="speculators",
            package="speculators==0.9.0",
            # its pins: torch<=2.14.1 (2.13.0 taken), transformers<=5.19.0 (the newest allowed, pinned exactly) and
            # its other requirements as it states them, except torchvision / torchaudio: the registry's wheels are
            # CUDA builds that fail against the CPU torch (and break `import transformers`); it imports neither
            resolved=(
                "transformers==5.19.0", "aiohttp", "click", "datasets>=4.0.0,<=5.1.0", "httpx", "huggingface-hub",
                "loguru>=0.7.2,<=0.7.3", "numpy>=2.0.0,<=2.5.4", "openai>=2.0.0", "protobuf", "psutil",
                "pydantic>=2.0.0", "pydantic-settings>=2.0.0", "rich", "safetensors", "tqdm>=4.66.3,<=4.70.1",
                "typer>=0.12.0", "hs-connectors==0.9.0",
            ),
            no_deps=("speculators==0.9.0",),
            probe="import speculators, speculators.convert.entrypoints, speculators.models.eagle3",
            note="its pins honoured (torch 2.13.0 satisfies torch<=2.14.1) except torchvision / torchaudio, left out: "
            "the registry's CUDA wheels break against the CPU torch and speculators imports neither",
        ),
        Peer(
            name="specforge",
            package="specforge==0.2.0",
            # it pins torch==2.11.0 and sglang==0.5.14 (a CUDA serving stack); its modeling and export modules import
            # only torch, transformers, huggingface_hub and safetensors, so those are installed at its transformers pin
            resolved=("transformers==5.8.1", "huggingface-hub", "safetensors", "numpy"),
            no_deps=("specforge==0.2.0",),
            probe="import specforge.modeling.draft.llama3_eagle, specforge.export.to_hf, specforge.export.to_sglang",
            note="transformers==5.8.1 as pinned; torch 2.13.0 instead of its 2.11.0 (not a CPU wheel on disk); "
            "sglang, wandb, yunchang and the rest of its training stack left out (the modules used do not import them)",
        ),
        Peer(
            name="dflash",
            package="dflash==0.1.0",
            # its "local" extra is the HF-transformers backend: torch==2.13.0, transformers==5.15.0, jinja2
            resolved=("dflash[local]==0.1.0",),
            probe="import dflash.model, dflash.benchmark",
            note="all of its pins honoured (torch==2.13.0, transformers==5.15.0, datasets==5.0.1, tqdm==4.70.0)",
        ),
    )
}


def venv_python(root: Path, name: str) -> Path:
    return root / name / "bin" / "python"


def marker(root: Path, name: str) -> Path:
    return root / name / ".peer-spec"


def skipped_file(root: Path, name: str) -> Path:
    return root / f"{name}.skipped"


def is_ready(root: Path, peer: Peer) -> bool:
    path = marker(root, peer.name)
    return path.exists() and path.read_text().strip() == peer.spec_hash()


def unavailable_reason(root: Path, name: str) -> str | None:
    """None when the peer's venv is built and current; otherwise why not (for a test's skip message)."""
    peer = PEERS[name]
    if is_ready(root, peer):
        return None
    skipped = skipped_file(root, name)
    if skipped.exists():
        return f"peer venv {name!r} not built: {skipped.read_text().strip()}"
    return f"peer venv {name!r} not built at {root / name}: run `python3 tests/peers/peer_envs.py` first"


def run_worker(root: Path, peer: str, worker: Path, args: dict) -> dict:
    """Run `worker` (a script) with the peer venv's python and one JSON argument; returns the JSON of its last
    stdout line. The subprocess sees neither this package nor its PYTHONPATH, and no network hub."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    payload = json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in args.items()})
    done = subprocess.run(
        [str(venv_python(root, peer)), str(worker), payload],
        capture_output=True, text=True, env=env, timeout=1800, cwd=worker.parent,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{worker.name} in the {peer} venv failed (exit {done.returncode}):\n{done.stderr[-6000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _pip(python: Path, *args: str) -> None:
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        sys.stderr.write(done.stdout + done.stderr)
        raise subprocess.CalledProcessError(done.returncode, done.args)


def registry_reachable(peer: Peer) -> str | None:
    """None when the registry serves the peer's package, else the reason it could not be fetched."""
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check",
               "--retries", "2", "--timeout", "30"]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        try:
            done = subprocess.run([*command, "-d", tmp, peer.package], capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            return f"the package registry did not answer for {peer.package} within 300 s"
    if done.returncode == 0:
        return None
    lines = [line for line in done.stderr.splitlines() if line.strip() and "is ignored" not in line]
    return f"the package registry did not serve {peer.package} ({lines[-1].strip() if lines else 'no output'})"


def build(root: Path, peer: Peer) -> str:
    """Create or refresh the peer's venv; returns what was done."""
    if is_ready(root, peer):
        return "cached"
    reason = registry_reachable(peer)
    if reason is not None:
        skipped_file(root, peer.name).write_text(reason + "\n")
        return f"SKIPPED: {reason}"
    target = root / peer.name
    shutil.rmtree(target, ignore_errors=True)
    skipped_file(root, peer.name).unlink(missing_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(target)], check=True)
    python = venv_python(root, peer.name)
    constraints = target / "constraints.txt"
    constraints.write_text("\n".join((TORCH, *peer.extra_constraints)) + "\n")
    _pip(python, TORCH)
    _pip(python, "-c", str(constraints), *peer.resolved)
    if peer.no_deps:
        _pip(python, "--no-deps", *peer.no_deps)
    subprocess.run([str(python), "-W", "ignore", "-c", peer.probe], check=True)
    marker(root, peer.name).write_text(peer.spec_hash() + "\n")
    return "built"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help=f"where the venvs live ({DEFAULT_ROOT})")
    parser.add_argument("--only", nargs="*", choices=sorted(PEERS), help="build only these peers")
    args = parser.parse_args(argv)
    args.root.mkdir(parents=True, exist_ok=True)
    for name in args.only or sorted(PEERS):
        peer = PEERS[name]
        start = time.perf_counter()
        outcome = build(args.root, peer)
        print(f"peer venv {name:12s} {outcome} in {time.perf_counter() - start:.0f} s ({peer.note})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
