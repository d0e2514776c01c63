"""In the specforge venv: load an EAGLE-3 export with SpecForge's own draft model class and unroll it.

The model is built as SpecForge's trainer builds it (`AutoDraftModelConfig.from_file` + `AutoDraftModel.from_config`,
resolving `LlamaForCausalLMEagle3` from `architectures`) and the export's weights loaded into it; its
`AutoDraftModel.from_pretrained` is run too, for its loading report (under transformers 5.8.1 it leaves the
rotary cos / sin caches, non-persistent buffers, uninitialised: reported as `from_pretrained_rotary_finite`). Then
the training-time-test loop of `specforge.algorithms.eagle3.model.Eagle3Model.forward` on the model's own methods:
`embed_input_ids`, `project_hidden_states`, `backbone` (with its `cache_hidden`, which adds the step index to the
positions) and `compute_logits`; after each step the ids shift left (`specforge.utils.padding`).
"""

import json
import sys

import torch
from safetensors.torch import load_file, save_file

torch._dynamo.config.disable = True  # its RMSNorm is torch.compile'd: eager here (same math, no C++ toolchain)
from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig  # noqa: E402
from specforge.modeling.draft import llama3_eagle  # noqa: E402,F401  (registers LlamaForCausalLMEagle3)
from specforge.utils import padding  # noqa: E402

args = json.loads(sys.argv[1])
folder = args["checkpoint"]
loaded, info = AutoDraftModel.from_pretrained(folder, output_loading_info=True, torch_dtype=torch.float32)
rotary = loaded.midlayer.self_attn.rotary_emb
from_pretrained_rotary_finite = all(bool(torch.isfinite(t).all()) for t in (rotary.cos_cached, rotary.sin_cached))
model = AutoDraftModel.from_config(AutoDraftModelConfig.from_file(f"{folder}/config.json")).float().eval()
missing, unexpected = model.load_state_dict(load_file(f"{folder}/model.safetensors"), strict=False)
inputs = load_file(args["inputs"])
features, input_ids = inputs["features"], inputs["input_ids"]
batch, length, _ = features.shape
position_ids = torch.arange(length)[None]
mask = model.prepare_decoder_attention_mask(torch.ones(batch, length, dtype=torch.bool), features, batch, length, 0)
cache_hidden = [[], []]
logits = []
with torch.no_grad():
    hidden = model.project_hidden_states(features)
    for _ in range(args["ttt_steps"]):
        embeds = model.embed_input_ids(input_ids).to(hidden.dtype)
        hidden = model.backbone(embeds, hidden, cache_hidden, mask, position_ids, None, True)
        logits.append(model.compute_logits(hidden).float())
        input_ids = padding(input_ids, left=False)
save_file({"logits": torch.stack(logits)}, args["output"])
print(json.dumps({
    "class": type(model).__name__,
    "missing_keys": sorted(missing),
    "unexpected_keys": sorted(unexpected),
    "from_pretrained_missing_keys": sorted(info["missing_keys"]),
    "from_pretrained_unexpected_keys": sorted(info["unexpected_keys"]),
    "from_pretrained_mismatched_keys": [str(k) for k in info.get("mismatched_keys", [])],
    "from_pretrained_rotary_finite": from_pretrained_rotary_finite,
    "norm_output": model.norm_output,
    "head_dim": model.midlayer.self_attn.head_dim,
}))
