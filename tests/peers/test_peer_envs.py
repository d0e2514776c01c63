"""The peers' venv bookkeeping: a venv counts only when built from the current requirement list, and a peer that
could not be installed skips with the reason recorded at build time (never a silent pass)."""

from __future__ import annotations

from . import peer_envs


def test_a_missing_stale_or_skipped_venv_is_reported_with_its_reason(tmp_path):
    peer = peer_envs.PEERS["dflash"]
    assert "run `python3 tests/peers/peer_envs.py` first" in peer_envs.unavailable_reason(tmp_path, "dflash")
    peer_envs.skipped_file(tmp_path, "dflash").write_text("the package registry did not serve dflash==0.1.0 (x)\n")
    reason = peer_envs.unavailable_reason(tmp_path, "dflash")
    assert "not built: the package registry did not serve dflash==0.1.0" in reason
    peer_envs.marker(tmp_path, "dflash").parent.mkdir(parents=True)
    peer_envs.marker(tmp_path, "dflash").write_text("stale-hash\n")
    assert peer_envs.unavailable_reason(tmp_path, "dflash") is not None
    peer_envs.marker(tmp_path, "dflash").write_text(peer.spec_hash() + "\n")
    assert peer_envs.unavailable_reason(tmp_path, "dflash") is None


def test_every_peer_pins_the_cpu_torch_and_its_own_package():
    for peer in peer_envs.PEERS.values():
        assert peer_envs.TORCH == "torch==2.13.0"
        assert any(req.startswith(peer.package.split("==")[0]) for req in (*peer.resolved, *peer.no_deps))
        assert not any(req.split("[")[0].split("=")[0].split(">")[0] in ("torch", "torchvision", "torchaudio", "sglang")
                       for req in (*peer.resolved, *peer.no_deps))  # fmt: skip
