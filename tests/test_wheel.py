"""The package works for a user outside this checkout: build the wheel, install it into a new virtual environment
and use it from a folder outside the repository.

Isolation: the wheel is built from a copy of pyproject.toml, README.md and src/ (nothing is written into the
checkout) and installed with ``--no-deps`` into a new venv created without pip. Its dependencies (torch,
transformers, ...) come from the running environment through one ``.pth`` line naming that environment's
site-packages: a plain path line, so the ``.pth`` files in there - the editable install of this checkout among
them - are not processed, and ``transformers_specblock`` can only come from the wheel (checked). Every check runs
in a subprocess of the new venv, in an empty folder outside the repository, without PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # about a minute on 2 CPU cores: a wheel build, a venv, several fresh interpreters

CHECKS = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import transformers_specblock
    from transformers_specblock import CUSTOM_GENERATE_DIR, DFlashDraftModel, Eagle3DraftModel, SpecBlockDraftModel
    from transformers_specblock.commands.cli import BenchArguments, build_methods
    from transformers_specblock.hub import SHIPPED_DRAFTERS, shipped_drafter_path

    torch.set_num_threads(1)
    report = {
        "package": transformers_specblock.__file__,
        "custom_generate": os.path.isfile(os.path.join(CUSTOM_GENERATE_DIR, "custom_generate", "generate.py")),
        "shipped": {name: sorted(p.name for p in shipped_drafter_path(name).iterdir()) for name in SHIPPED_DRAFTERS},
    }
    # a random target with the sizes the shipped drafters were built for (SmolLM2-135M: vocab 49152, hidden 576,
    # 30 layers, 9 heads / 3 KV heads); a narrow MLP keeps it small
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(
        vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        intermediate_size=64, tie_word_embeddings=True, bos_token_id=0, eos_token_id=None, pad_token_id=None,
        initializer_range=0.2,
    )).eval()
    prompt = torch.tensor([[0, 11, 42, 7, 300, 5]])
    plain = target.generate(prompt, max_new_tokens=8, do_sample=False)
    drafters = {
        "specblock_by_name": SpecBlockDraftModel.from_pretrained("specblock-smollm2-135m-instruct", dtype=torch.float32),
        "eagle3_by_name": Eagle3DraftModel.from_pretrained("eagle3-smollm2-135m-instruct", dtype=torch.float32),
        "dflash_by_name": DFlashDraftModel.from_pretrained("dflash-smollm2-135m-instruct", dtype=torch.float32),
    }
    for method in build_methods(BenchArguments(target_model="smollm2-135m-instruct", methods="specblock"), target):
        drafters["bench_default"] = method.generate_kwargs["assistant_model"]  # what specblock-bench loads
    report["drafter_paths"] = {key: d.name_or_path for key, d in drafters.items()}
    report["equal_to_plain"] = {}
    for key, drafter in drafters.items():
        drafter.last_stats = None
        out = target.generate(prompt, max_new_tokens=8, do_sample=False, assistant_model=drafter)
        report["equal_to_plain"][key] = out.tolist() == plain.tolist() and drafter.last_stats is not None
    transformers_specblock.uninstall()
    out = target.generate(prompt, max_new_tokens=8, do_sample=False, assistant_model=drafters["specblock_by_name"],
                          custom_generate=CUSTOM_GENERATE_DIR, trust_remote_code=True)
    report["equal_to_plain"]["custom_generate"] = out.tolist() == plain.tolist()
    print("REPORT " + json.dumps(report))
    """
)


def run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def test_wheel_installs_and_works_outside_the_checkout(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env |= {"TOKENIZERS_PARALLELISM": "false", "HF_MODULES_CACHE": str(tmp_path / "hf_modules"),
            "HF_HUB_OFFLINE": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}  # fmt: skip

    # 1. a wheel from a clean copy of the sources
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    shutil.copytree(REPO / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    wheels = tmp_path / "wheels"
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
         str(source)], tmp_path, env)  # fmt: skip
    (wheel,) = wheels.glob("transformers_specblock-*.whl")

    # 2. a new venv holding only the wheel; dependencies through a .pth path line
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, env)
    python = venv / "bin" / "python"
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    tmp_path, env).stdout.strip())  # fmt: skip
    (site / "_dependencies_from_the_test_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
         str(wheel)], tmp_path, env)  # fmt: skip

    # 3. use it from a folder outside the checkout
    work = tmp_path / "work"
    work.mkdir()
    for script in ("specblock-bench", "specblock-train"):
        out = run([str(venv / "bin" / script), "--help"], work, env).stdout
        assert "usage:" in out and "--target_model" in out, script
    report = json.loads(run([str(python), "-c", CHECKS], work, env).stdout.split("REPORT ", 1)[1])

    assert Path(report["package"]).resolve().is_relative_to(site.resolve())  # the wheel, not the checkout
    assert report["custom_generate"]
    names = [f"{kind}-smollm2-135m-instruct" for kind in ("dflash", "eagle3", "specblock")] + [
        f"{kind}-qwen2.5-coder-0.5b-instruct" for kind in ("eagle3", "specblock")
    ]
    files = ["README.md", "config.json", "generation_config.json", "model.safetensors", "training_record.json"]
    assert report["shipped"] == {n: files for n in names}
    for key, path in report["drafter_paths"].items():
        assert Path(path).resolve().is_relative_to(site.resolve()), key
    assert report["equal_to_plain"] == {
        "specblock_by_name": True, "eagle3_by_name": True, "dflash_by_name": True, "bench_default": True,
        "custom_generate": True,
    }  # fmt: skip
