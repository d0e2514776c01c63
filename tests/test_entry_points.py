"""Entry points take any model: a packaged name, a local folder or a Hub id (passed to `from_pretrained` unchanged),
with ``--device`` / ``--dtype``. A Hub id cannot be downloaded here, so `from_pretrained` is replaced by a recorder
and the Hub is switched to offline mode where a lookup must fail fast."""

from __future__ import annotations

import huggingface_hub.constants
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import make_target
from transformers_specblock.hub import assets
from transformers_specblock.hub.loading import load_model, resolve_device, resolve_dtype

HUB_ID = "meta-llama/Llama-3.1-8B-Instruct"


class Recorded(Exception):
    """Raised by the recording `from_pretrained` once it has seen its arguments (nothing can be downloaded)."""


@pytest.fixture
def record_from_pretrained(monkeypatch):
    """Record (name, kwargs) of every AutoModelForCausalLM / AutoTokenizer.from_pretrained call, then stop."""
    calls = []

    def recorder(kind):
        def from_pretrained(name, *args, **kwargs):
            calls.append((kind, name, kwargs))
            raise Recorded

        return from_pretrained

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", recorder("model"))
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", recorder("tokenizer"))
    return calls


@pytest.fixture
def offline(monkeypatch):
    """The Hub in offline mode: a lookup of an uncached id fails at once instead of retrying the network."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


# ----------------------------------------------------------------------------------------------- name resolution
def test_hub_id_reaches_from_pretrained_unchanged(record_from_pretrained):
    with pytest.raises(Recorded):
        assets.load_packaged_model(HUB_ID, dtype=torch.bfloat16, device_map="auto")
    assert record_from_pretrained == [("model", HUB_ID, {"dtype": torch.bfloat16, "device_map": "auto"})]
    assert assets.resolve_model_path(HUB_ID) == HUB_ID


def test_local_folder_wins_over_a_packaged_name(tmp_path, monkeypatch):
    (tmp_path / "smollm2-135m-instruct").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(assets, "_convert", lambda *args: pytest.fail("a local folder must not be converted"))
    assert assets.resolve_model_path("smollm2-135m-instruct") == "smollm2-135m-instruct"


def test_packaged_name_resolves_to_its_converted_folder(tmp_path, monkeypatch):
    converted = []
    monkeypatch.setattr(assets, "_convert", lambda entry, folder: converted.append(folder))
    path = assets.resolve_model_path("smollm2-135m-instruct", cache_dir=tmp_path)
    assert path == str(tmp_path / "smollm2-135m-instruct") and converted == [tmp_path / "smollm2-135m-instruct"]


@pytest.mark.parametrize("name", ["no-such-owner/no-such-model", "llama-70b"])
def test_missing_hub_id_fails_fast_with_a_clear_error(offline, name):
    with pytest.raises(OSError) as info:
        assets.load_packaged_model(name)
    message = str(info.value)
    assert repr(name) in message and "smollm2-135m-instruct" in message  # names the id and the packaged models
    assert "hf auth login" in message and f"hf download {name}" in message and "local folder" in message
    assert isinstance(info.value.__cause__, OSError)  # transformers' own error is kept as the cause


def test_broken_local_folder_keeps_transformers_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises((OSError, ValueError)) as info:
        assets.load_packaged_model(str(tmp_path))
    assert "Hub id" not in str(info.value)


# ------------------------------------------------------------------------------------------------ device / dtype
def test_device_resolution_on_this_machine():
    assert resolve_device(None) == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("auto") == "auto" and resolve_device("cpu") == "cpu"
    for bad, message in [("gpu0", "is not a device"), ("meta", "meta holds no weights")]:
        with pytest.raises(ValueError, match=message):
            resolve_device(bad)


def test_cuda_devices_are_checked(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA GPU is visible"):
        resolve_device("cuda:1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device(None) == "cuda" and resolve_device("cuda:1") == "cuda:1"
    with pytest.raises(ValueError, match=r"only 2 CUDA device\(s\)"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("bf16_supported", [True, False])
def test_dtype_rules(monkeypatch, bf16_supported):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16_supported)
    assert resolve_dtype("auto", "cpu", torch.bfloat16) == torch.float32  # the CPU: float32 whatever was saved
    for device in ("cuda", "cuda:1", "auto"):
        assert resolve_dtype("auto", device, torch.float16) == torch.float16  # a 16-bit checkpoint keeps its dtype
        assert resolve_dtype("auto", device, torch.bfloat16) == torch.bfloat16
        expected = torch.bfloat16 if bf16_supported else torch.float32
        assert resolve_dtype("auto", device, torch.float32) == expected and resolve_dtype("auto", device) == expected
    for name, dtype in [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)]:
        assert resolve_dtype(name, "cpu") == dtype and resolve_dtype(name, "cuda") == dtype  # explicit always wins
    with pytest.raises(ValueError, match="--dtype 'fp16' is not one of auto, float32, bfloat16, float16"):
        resolve_dtype("fp16", "cpu")


def test_load_model_passes_device_map_and_dtype(record_from_pretrained):
    cases = [
        ({}, "cpu", torch.float32),
        ({"dtype": "bfloat16"}, "cpu", torch.bfloat16),
        ({"device": "auto", "dtype": "float16"}, "auto", torch.float16),
        ({"device": "cpu", "dtype": "auto"}, "cpu", torch.float32),
    ]
    if torch.cuda.is_available():
        pytest.skip("expectations written for a machine without a GPU")
    for kwargs, device_map, dtype in cases:
        record_from_pretrained.clear()
        with pytest.raises(Recorded):
            load_model(HUB_ID, **kwargs)
        assert record_from_pretrained == [("model", HUB_ID, {"dtype": dtype, "device_map": device_map})]


def test_load_model_auto_dtype_on_a_gpu_reads_the_checkpoint(tmp_path, monkeypatch, record_from_pretrained):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    saved = {}
    for dtype in (torch.float16, torch.float32):
        saved[dtype] = tmp_path / str(dtype)
        make_target("llama").to(dtype).save_pretrained(saved[dtype])
    for dtype, expected in [(torch.float16, torch.float16), (torch.float32, torch.bfloat16)]:
        record_from_pretrained.clear()
        with pytest.raises(Recorded):
            load_model(str(saved[dtype]), device="cuda")
        assert record_from_pretrained == [("model", str(saved[dtype]), {"dtype": expected, "device_map": "cuda"})]


def test_load_model_auto_dtype_on_a_gpu_names_a_missing_hub_id(monkeypatch, offline):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(OSError, match="no-such-owner/no-such-model.*Hub id"):
        load_model("no-such-owner/no-such-model", device="auto")
