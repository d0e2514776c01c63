"""The patch-free routes run with transformers' stock `GenerationMixin` in place.

In a fresh interpreter (so that the package import and the first load of the custom generate module both happen
inside the test): import transformers, remember every `GenerationMixin` attribute, import transformers_specblock,
call `uninstall()`, then generate through `custom_generate=CUSTOM_GENERATE_DIR` and through
`transformers_specblock.generate`, greedy and sampled, with a streamer. `GenerationMixin` must equal the stock one
after `uninstall()` and after every call (loading the custom generate module does not re-install the router), and
the outputs must equal stock `generate` without an assistant.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from transformers_specblock.generation import integration

SCRIPT = textwrap.dedent(
    """
    import json
    import sys

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.generation import GenerationMixin
    from transformers.generation.streamers import BaseStreamer

    STOCK = dict(vars(GenerationMixin))

    def changed():
        now = dict(vars(GenerationMixin))
        return sorted(k for k in STOCK.keys() | now.keys() if STOCK.get(k) is not now.get(k))

    import transformers_specblock
    from transformers_specblock import CUSTOM_GENERATE_DIR, SpecBlockDraftModel

    report = {"changed_on_import": changed()}
    transformers_specblock.uninstall()
    report["changed_after_uninstall"] = changed()

    class Recorder(BaseStreamer):
        def __init__(self):
            self.tokens, self.puts, self.ended = [], 0, False

        def put(self, value):
            self.puts += 1
            self.tokens.extend(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, bos_token_id=0, eos_token_id=None, pad_token_id=None, initializer_range=0.2,
    )).eval()
    torch.manual_seed(1)
    drafter = SpecBlockDraftModel.from_target(target, tree_budget=8)
    prompt = torch.tensor([[0, 5, 9, 3, 17]])
    routes = {
        "custom_generate": lambda **kw: target.generate(
            prompt, assistant_model=drafter, custom_generate=CUSTOM_GENERATE_DIR, trust_remote_code=True, **kw),
        "function": lambda **kw: transformers_specblock.generate(target, prompt, assistant_model=drafter, **kw),
    }
    for mode, settings in {"greedy": dict(do_sample=False), "sampled": dict(do_sample=True, top_k=None)}.items():
        torch.manual_seed(7)
        stock = target.generate(prompt, max_new_tokens=10, **settings)
        for route, run in routes.items():
            streamer, drafter.last_stats = Recorder(), None
            torch.manual_seed(7)
            out = run(max_new_tokens=10, streamer=streamer, **settings)
            report[f"{route}/{mode}"] = {
                "sequence": out[0].tolist(),
                "stock": stock[0].tolist(),
                "streamed": streamer.tokens,
                "puts": streamer.puts,
                "ended": streamer.ended,
                "tree_iterations": drafter.last_stats.iterations if drafter.last_stats else None,
                "changed_after": changed(),
            }
    report["custom_generate_modules"] = [m for m in sys.modules if m.endswith("custom_generate.generate")]
    print("REPORT " + json.dumps(report))
    """
)


def test_patch_free_routes_with_stock_generation_mixin(tmp_path):
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.split("REPORT ", 1)[1])

    routed = ["_assisted_decoding", "_prepare_generation_config", "_validate_generation_mode"]
    # route 1's router, on the releases it supports (elsewhere, e.g. the compatibility run on the newest release, the
    # import warns and patches nothing: the routes below are the ones to use there)
    assert report["changed_on_import"] == (routed if integration.router_problems() == [] else [])
    assert report["changed_after_uninstall"] == []
    assert len(report["custom_generate_modules"]) == 1  # the custom generate module really was loaded here
    for route in ("custom_generate", "function"):
        for mode in ("greedy", "sampled"):
            run = report[f"{route}/{mode}"]
            assert run["changed_after"] == [], (route, mode)
            assert run["tree_iterations"] is not None and run["tree_iterations"] > 0, (route, mode)
            assert run["streamed"] == run["sequence"] and run["ended"], (route, mode)  # prompt, then each chunk
            assert 2 <= run["puts"] <= 2 + run["tree_iterations"], (route, mode)  # prompt, then one put per chunk
            if mode == "greedy":
                assert run["sequence"] == run["stock"], route
            assert len(run["sequence"]) == 5 + 10
