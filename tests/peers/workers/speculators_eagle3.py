"""In the speculators venv: read an EAGLE-3 checkpoint as speculators' users do and run its Eagle3 model.

With `convert_only`: its command line, `speculators convert <folder> --algorithm eagle3 --verifier <target>`, and
nothing else. Otherwise `convert_model(..., algorithm="eagle3")` (what that command calls) for a SpecForge /
SafeAILab layout (skipped for a checkpoint already in the speculators format), then
`Eagle3DraftModel.from_pretrained` (which fills what the checkpoint lacks from the verifier) and its
training-time-test forward; the draft logits of every step are captured from `lm_head`.
"""

import json
import subprocess
import sys

import torch
from safetensors.torch import load_file, save_file
from speculators.convert.entrypoints import convert_model
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

args = json.loads(sys.argv[1])
torch.manual_seed(0)
folder = args["checkpoint"]
with open(f"{folder}/config.json") as f:
    native = "speculators_model_type" in json.load(f)
if args.get("convert_only"):
    command = ["convert", folder, "--algorithm", "eagle3", "--verifier", args["verifier"], "--output-path"]
    subprocess.run([sys.executable, "-m", "speculators", *command, args["converted"]], check=True)
    print(json.dumps({"converted": args["converted"]}))
    sys.exit(0)
if not native:
    convert_model(model=folder, verifier=args["verifier"], algorithm="eagle3", output_path=args["converted"])
    folder = args["converted"]
config = Eagle3SpeculatorConfig.from_pretrained(folder)
config.transformer_layer_config._attn_implementation = "eager"  # flex attention is a GPU path
if native:
    config.speculators_config.verifier.name_or_path = args["verifier"]
model = Eagle3DraftModel.from_pretrained(folder, config=config).eval()
inputs = load_file(args["inputs"])
captured = []
model.lm_head.register_forward_hook(lambda module, inp, out: captured.append(out.detach().float()))
with torch.no_grad():
    model(
        hidden_states=inputs["features"],
        input_ids=inputs["input_ids"],
        document_ids=torch.zeros_like(inputs["input_ids"]),
        ttt_steps=args["ttt_steps"],
    )
save_file({"logits": torch.stack(captured)}, args["output"])
with open(f"{folder}/config.json") as f:
    written = json.load(f)
print(json.dumps({
    "layer_ids_in_config": written.get("eagle_aux_hidden_state_layer_ids"),
    "layer_ids_used": list(model.config.eagle_aux_hidden_state_layer_ids),
    "embedding_all_zero": bool((model.embed_tokens.weight == 0).all()),
    "norm_output": model.config.norm_output,
    "fc_norm": model.config.fc_norm,
    "norm_before_fc": model.config.norm_before_fc,
    "norm_before_residual": model.config.norm_before_residual,
}))
