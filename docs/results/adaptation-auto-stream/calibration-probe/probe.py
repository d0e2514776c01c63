"""Is the budget split between the drafter and the free candidates (prompt lookup, n-gram and suffix caches) worth
adapting? Each drafter's node scores (log-probs) are multiplied by a fixed alpha (>1: less confident, more room for
the free candidates' chains, whose scores are their learnt acceptance rates) and tau is measured on the HumanEval
stream at a fixed budget, the drafters interleaved prompt by prompt. Usage: probe.py OUT.jsonl NUM ALPHA [ALPHA ...]."""
import json, sys, torch
from transformers_specblock import SpecBlockDraftModel
from transformers_specblock.generation.candidate_generators import specblock as SG
from transformers_specblock.hub.loading import load_model
from transformers_specblock.hub.prompts import load_prompts

torch.set_num_threads(1)
out_path, num, alphas = sys.argv[1], int(sys.argv[2]), [float(a) for a in sys.argv[3:]]
ALPHA = {}
original = SG.SpecBlockCandidateGenerator._read_round


def _read_round(self, *args, **kwargs):
    rnd = original(self, *args, **kwargs)
    alpha = ALPHA.get(id(self.drafter), 1.0)
    rnd.log_probs = [[[alpha * lp for lp in slot] for slot in block] for block in rnd.log_probs]
    return rnd


SG.SpecBlockCandidateGenerator._read_round = _read_round
target, tok = load_model("smollm2-135m-instruct", device="cpu", dtype="float32")
drafters = {}
for alpha in alphas:
    d = SpecBlockDraftModel.from_pretrained("specblock-smollm2-135m-instruct", tree_budget=16)
    target.generate(**tok("Hello", return_tensors="pt", add_special_tokens=False), assistant_model=d, max_new_tokens=8)
    ALPHA[id(d.served_for(target))] = alpha
    drafters[alpha] = d
prompts = load_prompts("humaneval", num, tok)
with open(out_path, "w") as f:
    for index, row in enumerate(prompts):
        inputs = tok(row["text"], return_tensors="pt", add_special_tokens=False)
        rec, ref = {"call": index}, None
        for alpha, d in drafters.items():
            out = target.generate(**inputs, assistant_model=d, do_sample=False, max_new_tokens=48)
            ref = out if ref is None else ref
            rec[str(alpha)] = {"tau": d.last_stats.tau, "src": d.last_stats.accepted_by_source, "same": torch.equal(out, ref)}
        print(json.dumps(rec), flush=True)
        f.write(json.dumps(rec) + "\n")
