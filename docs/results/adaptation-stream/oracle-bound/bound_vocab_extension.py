import sys, json, argparse, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[4] / "examples"))
import adaptation_stream as A
from transformers_specblock.hub.loading import load_model
from transformers_specblock.generation.adaptation.signal import target_to_draft_ids
name, ntok = sys.argv[1], int(sys.argv[2])
target, tok = load_model("smollm2-135m-instruct", dtype=torch.float32)
args = argparse.Namespace(num_code=9, num_chat=4, num_sharegpt=15, seed=0, tree_budget=8, max_new_tokens=ntok)
rows = A.build_streams(tok, args)["shift"]
d = A.load_drafter(name, "off", tok, target, args)
to_draft = target_to_draft_ids(d.d2t, d.config.vocab_size)
def oov(rs, prompt=False):
    ids = set()
    for row in rs:
        inp = A.encode(tok, row)
        new = target.generate(**inp, do_sample=False, max_new_tokens=ntok)[0, inp["input_ids"].shape[1]:] if not prompt else inp["input_ids"][0]
        ids |= {t for t in new.tolist() if to_draft[t] < 0}
    return sorted(ids)
def run(rs):
    out = []
    for row in rs:
        target.generate(**A.encode(tok, row), assistant_model=d, do_sample=False, max_new_tokens=ntok)
        out.append(round(d.last_stats.tau, 3))
    return out
base_W, base_d2t, base_t2d = d.lm_head.weight.detach().clone(), d.d2t.clone(), d.t2d.clone()
def extend(extra):
    with torch.no_grad():
        ids = torch.tensor(extra, dtype=torch.long)
        d2t = torch.cat([base_d2t, ids]); order = d2t.argsort()
        W = torch.cat([base_W, target.lm_head.weight.detach()[ids]])[order]
        d.lm_head = torch.nn.Linear(W.shape[1], W.shape[0], bias=False); d.lm_head.weight.copy_(W)
        d.d2t = d2t[order]; t2d = base_t2d.clone(); t2d[ids] = True; d.t2d = t2d
        d.config.draft_vocab_size = W.shape[0]
m = lambda x: round(sum(x) / len(x), 4)
res = {"drafter": name, "ntok": ntok, "off": run(rows[6:])}
a = oov(rows[:6]); extend(a); res["from_1_6"] = (len(a), run(rows[6:]))
b = oov(rows[6:9]); extend(b); res["cheat_7_9"] = (len(b), run(rows[6:]))
c = sorted(set(oov(rows[6:9], prompt=True))); extend(c); res["prompt_7_9"] = (len(c), run(rows[6:]))
print(json.dumps(res))
