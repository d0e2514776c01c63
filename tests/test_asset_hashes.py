"""Packaged GGUF files are checked against recorded sha256 values before they are converted."""

from __future__ import annotations

import hashlib
import importlib.util
import re

import pytest

from transformers_specblock.hub import assets
from transformers_specblock.hub.assets import PACKAGED_MODELS, PackagedModel, _assemble, load_packaged_model

HEX64 = re.compile(r"[0-9a-f]{64}")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_every_packaged_model_records_its_hashes():
    for name, entry in PACKAGED_MODELS.items():
        assert entry.sha256 is not None and HEX64.fullmatch(entry.sha256), name
        if len(entry.packages) > 1:  # chunked: one hash per chunk (one chunk per package), and the total size
            assert len(entry.chunk_sha256) == len(entry.packages) and entry.size is not None, name
            assert all(HEX64.fullmatch(h) for h in entry.chunk_sha256), name


@pytest.fixture
def chunks(tmp_path):
    data = [b"GGUF-abc", b"de", b"f"]
    parts = []
    for i, chunk in enumerate(data):
        parts.append(tmp_path / f"part{i}.bin")
        parts[-1].write_bytes(chunk)
    return parts, [sha(c) for c in data], sha(b"".join(data))


def test_assemble_accepts_the_recorded_hashes(chunks, tmp_path):
    parts, chunk_hashes, whole = chunks
    dest = tmp_path / "out" / "model.gguf"
    _assemble(parts, dest, size=11, sha256=whole, chunk_sha256=tuple(chunk_hashes))
    assert dest.read_bytes() == b"GGUF-abcdef"


@pytest.mark.parametrize("flaw", ["corrupt_chunk", "whole", "count"])
def test_assemble_refuses_a_mismatch_and_leaves_nothing(chunks, tmp_path, flaw):
    parts, chunk_hashes, whole = chunks
    if flaw == "corrupt_chunk":  # same size, one byte changed: only a hash can tell
        parts[1].write_bytes(b"dX")
        expected = rf"{re.escape(str(parts[1]))} has sha256 {sha(b'dX')}, expected {chunk_hashes[1]}"
    elif flaw == "whole":
        whole = "0" * 64
        expected = "model.gguf has sha256 .*, expected 0{64}"
    else:
        chunk_hashes = chunk_hashes[:2]
        expected = "Found 3 chunks for model.gguf, expected 2"
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(OSError, match=expected):
        _assemble(parts, tmp_path / "out" / "model.gguf", size=11, sha256=whole, chunk_sha256=tuple(chunk_hashes))
    assert not (tmp_path / "out" / "model.gguf").exists()
    assert [p for p in sorted(tmp_path.rglob("*")) if p not in before] in ([], [tmp_path / "out"])


def test_a_single_file_gguf_is_checked_before_converting(monkeypatch, tmp_path):
    package = tmp_path / "site" / "fake_gguf_single"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "model.gguf").write_bytes(b"GGUF-not-really")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    entry = PackagedModel(("fake-gguf-single==1",), "model.gguf", "model.gguf", sha256="f" * 64)
    monkeypatch.setitem(PACKAGED_MODELS, "fake-single", entry)
    monkeypatch.setattr(assets.AutoTokenizer, "from_pretrained", lambda *a, **k: pytest.fail("converted anyway"))
    with pytest.raises(OSError, match=f"model.gguf has sha256 {sha(b'GGUF-not-really')}, expected f{{64}}"):
        load_packaged_model("fake-single", cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache" / "fake-single").exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"])
def test_installed_qwen_chunks_match_the_recorded_hashes(name, tmp_path):
    entry = PACKAGED_MODELS[name]
    if any(importlib.util.find_spec(r.split("==")[0].replace("-", "_")) is None for r in entry.packages):
        pytest.skip("Qwen chunk packages not installed (make qwen-models)")
    _assemble(assets._gguf_parts(entry), tmp_path / entry.gguf_file, entry.size, entry.sha256, entry.chunk_sha256)
