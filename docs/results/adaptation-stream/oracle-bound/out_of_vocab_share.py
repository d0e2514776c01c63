import sys, argparse, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[4] / "examples"))
import adaptation_stream as A
from transformers_specblock.generation.adaptation import adapter as AD
from transformers_specblock.hub.loading import load_model
target, tok = load_model("smollm2-135m-instruct", dtype=torch.float32)
args = argparse.Namespace(num_code=9, num_chat=4, num_sharegpt=15, seed=0, tree_budget=8, max_new_tokens=64)
rows = A.build_streams(tok, args)["shift"]
AD.PROMOTION_GAIN = 9.0
drafter = A.load_drafter("specblock", "head_only", tok, target, args)
drafter.config.adaptation_buffer_size = 100000
to_draft = AD.target_to_draft_ids(drafter.d2t, drafter.config.vocab_size)
for i, row in enumerate(rows):
    inp = A.encode(tok, row)
    out = target.generate(**inp, do_sample=False, max_new_tokens=64)
    new = out[0, inp["input_ids"].shape[1]:]
    miss = (to_draft[new] < 0)
    print(i, "code" if i < 9 else "chat", f"{float(miss.float().mean()):.3f}", tok.convert_ids_to_tokens(new[miss].tolist())[:12])
print(drafter.d2t.numel(), drafter.config.vocab_size)
