"""In the dflash venv: build and save a random drafter with z-lab's `DFlashDraftModel` (a Qwen3 config, their
`target_layer_ids` default), run one block through it on the target's features, and decode with `dflash_generate`.

Block: context = the target's features of the prompt (`extract_context_feature`, their +1 offset into HF
`hidden_states`), noise = the target's embedding of [last prompt token, mask x (block_size - 1)], positions 0..P+B-1
(what `dflash_generate` passes for the first block); hidden = `model(...)`, logits = `model.compute_logits(hidden,
target.lm_head)`.
"""

import json
import sys

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Qwen3Config

from dflash.model import DFlashDraftModel, build_target_layer_ids, dflash_generate, extract_context_feature

args = json.loads(sys.argv[1])
torch.manual_seed(args["seed"])
target = AutoModelForCausalLM.from_pretrained(args["target"], dtype=torch.float32).eval()
text = target.config
layers = args["draft_layers"]
config = Qwen3Config(
    architectures=["DFlashDraftModel"], hidden_size=text.hidden_size, intermediate_size=96,
    num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=text.vocab_size,
    rms_norm_eps=1e-6, rope_theta=50000.0, max_position_embeddings=512, initializer_range=0.2,
    num_target_layers=text.num_hidden_layers, block_size=args["block_size"],
    dflash_config={"mask_token_id": args["mask_token_id"],
                   "target_layer_ids": build_target_layer_ids(text.num_hidden_layers, layers)},
    tie_word_embeddings=False,
)
model = DFlashDraftModel(config).float().eval()
with torch.no_grad():  # random norm weights too, so that where each norm sits matters
    for name, param in model.named_parameters():
        if "norm" in name:
            param.copy_(torch.rand(param.shape) + 0.5)
model.save_pretrained(args["output_dir"])

prompt = torch.tensor([args["prompt"]])
with torch.no_grad():
    out = target(prompt, output_hidden_states=True)
    context = extract_context_feature(out.hidden_states, model.target_layer_ids)
    block = torch.full((1, model.block_size), model.mask_token_id)
    block[0, 0] = prompt[0, -1]
    noise = torch.nn.functional.embedding(block, target.get_input_embeddings().weight)
    positions = torch.arange(prompt.shape[1] + model.block_size)[None]
    hidden = model(target_hidden=context, noise_embedding=noise, position_ids=positions)
    logits = model.compute_logits(hidden, target.lm_head)
calls = []  # return_stats needs CUDA timers: the target's forwards are counted instead
target.register_forward_pre_hook(lambda module, inputs: calls.append(1))
generated = dflash_generate(model, target, prompt, args["max_new_tokens"], None)
save_file({"context": context.contiguous(), "hidden": hidden.contiguous(), "logits": logits.contiguous(),
           "generated": generated.contiguous()}, args["tensors"])
print(json.dumps({"target_layer_ids": list(model.target_layer_ids), "block_size": model.block_size,
                  "target_calls": len(calls)}))
