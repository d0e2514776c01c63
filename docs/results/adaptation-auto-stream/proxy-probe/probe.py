"""Does a proxy on a call's held-out signal predict what serving a candidate head does to tau? Two drafters serve
the HumanEval stream at a fixed budget: A keeps the loaded head (online_adaptation="head_only", promotion disabled: it
only captures signal and trains a candidate after each call), B serves A's latest candidate on the next prompt. Per
call: tau of both, and proxies of candidate vs loaded on A's fresh signal. Usage: probe.py OUT.jsonl [num_code]."""
import json, math, sys, torch
import torch.nn.functional as F
from transformers_specblock import SpecBlockDraftModel
from transformers_specblock.generation.adaptation import adapter as AD
from transformers_specblock.hub.loading import load_model
from transformers_specblock.hub.prompts import load_prompts

torch.set_num_threads(1)
out_path, num = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30
AD.PROMOTION_GAIN = math.inf
target, tok = load_model("smollm2-135m-instruct", device="cpu", dtype="float32")
A = SpecBlockDraftModel.from_pretrained("specblock-smollm2-135m-instruct", online_adaptation="head_only", tree_budget=16)
B = SpecBlockDraftModel.from_pretrained("specblock-smollm2-135m-instruct", online_adaptation="off", tree_budget=16)
for d in (A, B):
    with d.tree_settings(online_adaptation="off"):
        target.generate(**tok("Hello", return_tensors="pt", add_special_tokens=False), assistant_model=d, max_new_tokens=8)
As, Bs = A.served_for(target), B.served_for(target)  # the float32 copies that draft
loaded = Bs.lm_head.weight.detach().clone()


def trees(samples):
    out = []
    for s in samples:
        if s.depth == 1 or not out:
            out.append([])
        out[-1].append(s)
    return out


@torch.no_grad()
def proxies(weight, samples):
    states = As.norm(torch.stack([s.state for s in samples]))
    logits = F.linear(states, weight)
    ids = torch.stack([s.target_ids for s in samples]); probs = torch.stack([s.target_probs for s in samples])
    top = logits.argmax(-1)
    t0 = ids[:, 0]
    hard = (top == t0).float()
    rank = (logits > logits.gather(1, t0.clamp(min=0)[:, None])).sum(-1)  # rank of the target's argmax
    depth = torch.tensor([s.depth for s in samples])
    logq = logits.log_softmax(-1).gather(1, t0.clamp(min=0)[:, None])[:, 0]
    res = {"soft_d1": float((probs * (ids == top[:, None])).sum(-1)[depth == 1].sum()),
           "soft_all": float((probs * (ids == top[:, None])).sum(-1).sum()),
           "hard_d1": float(hard[depth == 1].sum()), "hard_all": float(hard.sum()),
           "top3_all": float(((rank < 3) & (t0 >= 0)).sum()), "logq": float(logq[t0 >= 0].sum())}
    # chain proxies: per tree, consecutive depths from 1 whose target token is the head's top-1 / in its top-3
    chain1 = chain3 = 0
    i = 0
    for tree in trees(samples):
        n = len(tree)
        h = hard[i:i + n]; r = rank[i:i + n] < 3
        chain1 += int(torch.cumprod(h, 0).sum()); chain3 += int(torch.cumprod(r.float(), 0).sum())
        i += n
    res.update(chain1=chain1, chain3=chain3)
    return res


prompts = load_prompts("humaneval", num, tok)
candidate = None
with open(out_path, "w") as f:
    for index, row in enumerate(prompts):
        inputs = tok(row["text"], return_tensors="pt", add_special_tokens=False)
        rec = {"call": index}
        if candidate is not None:
            Bs.lm_head.weight.data.copy_(candidate)
        else:
            Bs.lm_head.weight.data.copy_(loaded)
        outB = target.generate(**inputs, assistant_model=B, do_sample=False, max_new_tokens=48)
        rec["tau_cand"], rec["src_cand"] = B.last_stats.tau, B.last_stats.accepted_by_source
        outA = target.generate(**inputs, assistant_model=A, do_sample=False, max_new_tokens=48)
        rec["tau_loaded"], rec["src_loaded"] = A.last_stats.tau, A.last_stats.accepted_by_source
        rec["same_out"] = torch.equal(outA, outB)
        adapter = A.serving_state(target).adaptation
        fresh = adapter.fresh
        rec["signal"], rec["outside_vocab"] = len(fresh), sum(int(s.target_ids[0]) < 0 for s in fresh)
        if candidate is not None and fresh:
            pl, pc = proxies(loaded, fresh), proxies(candidate, fresh)
            rec["proxy_gain"] = {k: pc[k] - pl[k] for k in pl}
        candidate = adapter.candidate["lm_head.weight"].clone() if adapter.candidate is not None else None
        assert torch.equal(As.lm_head.weight, loaded) and B.served_for(target) is Bs
        print(json.dumps(rec), flush=True)
        f.write(json.dumps(rec) + "\n")
