import sys, json, argparse, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[4] / "examples"))
import adaptation_stream as A
from transformers_specblock.hub.loading import load_model
name, ntok = sys.argv[1], int(sys.argv[2])
target, tok = load_model("smollm2-135m-instruct", dtype=torch.float32)
args = argparse.Namespace(num_code=9, num_chat=4, num_sharegpt=15, seed=0, tree_budget=8, max_new_tokens=ntok)
streams = A.build_streams(tok, args)
def run(d, rows):
    out = []
    for row in rows:
        target.generate(**A.encode(tok, row), assistant_model=d, do_sample=False, max_new_tokens=ntok)
        out.append(round(d.last_stats.tau, 3))
    return out
d = A.load_drafter(name, "off", tok, target, args)
base = run(d, streams["shift"]); sg = run(d, streams["sharegpt"][:6])
with torch.no_grad():
    W = target.lm_head.weight.detach().clone(); W[d.d2t] = d.lm_head.weight.detach()
    d.lm_head = torch.nn.Linear(W.shape[1], W.shape[0], bias=False); d.lm_head.weight.copy_(W)
    d.d2t = torch.arange(W.shape[0]); d.t2d = torch.ones(W.shape[0], dtype=torch.bool)
    d.config.draft_vocab_size = W.shape[0]
full = run(d, streams["shift"]); sgf = run(d, streams["sharegpt"][:6])
m = lambda x: round(sum(x) / len(x), 4)
print(json.dumps({"drafter": name, "ntok": ntok, "base": base, "full": full, "code": [m(base[:9]), m(full[:9])], "chat": [m(base[9:]), m(full[9:])], "sharegpt": [m(sg), m(sgf)]}))
