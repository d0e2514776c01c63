"""In the speculators venv: `convert_model(..., algorithm="dflash")` (speculators' converter of the z-lab DFlash
layout, what vLLM serves DFlash from) on a DFlash export, then its `DFlashDraftModel` on one block: the anchored-
block forward (`_backbone_forward`, the code its training and logits use) with a single anchor, whose block sees the
context features of the positions before the anchor."""

import json
import sys

import torch
from safetensors.torch import load_file, save_file
from speculators.convert.entrypoints import convert_model
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

args = json.loads(sys.argv[1])
convert_model(model=args["checkpoint"], verifier=args["verifier"], algorithm="dflash", output_path=args["converted"])
config = DFlashSpeculatorConfig.from_pretrained(args["converted"])
config.transformer_layer_config._attn_implementation = "eager"  # flex attention is a GPU path
model = DFlashDraftModel.from_pretrained(args["converted"], config=config).float().eval()
inputs = load_file(args["inputs"])
features, input_ids = inputs["features"], inputs["input_ids"]
loss_mask = torch.zeros_like(input_ids)
loss_mask[0, args["anchor"]] = 1
with torch.no_grad():
    verifier_last = torch.zeros(1, input_ids.shape[1], model.config.transformer_layer_config.hidden_size)
    hidden, logits, *_ = model._backbone_forward(
        features, input_ids, loss_mask, verifier_last, torch.zeros_like(input_ids), max_anchors=1
    )
save_file({"hidden": hidden.contiguous(), "logits": logits.float().contiguous()}, args["output"])
print(json.dumps({"aux_hidden_state_layer_ids": list(model.config.aux_hidden_state_layer_ids),
                  "block_size": model.block_size, "mask_token_id": model.mask_token_id}))
