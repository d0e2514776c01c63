"""CPU time of adaptation when the bandit only skips (signal capture, keep_producers, held-out check) against "off":
8 HumanEval prompts, 48 new tokens, budget 16, two rounds, order swapped between rounds. Usage: probe.py"""
import json, sys, time, torch
from transformers_specblock import SpecBlockDraftModel
from transformers_specblock.generation.adaptation import bandit as BD
from transformers_specblock.hub.loading import load_model
from transformers_specblock.hub.prompts import load_prompts
torch.set_num_threads(1)
BD.CostAwareBandit.choose = lambda self, escalate=True: BD.SKIP
target, tok = load_model("smollm2-135m-instruct", device="cpu", dtype="float32")
ds = {p: SpecBlockDraftModel.from_pretrained("specblock-smollm2-135m-instruct", online_adaptation=p, tree_budget=16) for p in ("off", "bandit")}
for d in ds.values():
    with d.tree_settings(online_adaptation="off"):
        target.generate(**tok("Hello", return_tensors="pt", add_special_tokens=False), assistant_model=d, max_new_tokens=8)
prompts = load_prompts("humaneval", 8, tok)
cpu = {p: 0.0 for p in ds}; upd = 0.0; drafting = {p: 0.0 for p in ds}
for rep in range(2):
    for row in prompts:
        inputs = tok(row["text"], return_tensors="pt", add_special_tokens=False)
        for p, d in (ds.items() if rep % 2 == 0 else reversed(ds.items())):
            c = time.process_time()
            target.generate(**inputs, assistant_model=d, do_sample=False, max_new_tokens=48)
            cpu[p] += time.process_time() - c
            drafting[p] += d.last_stats.drafter_time_s
            if p == "bandit": upd += d.last_stats.adaptation.update_time_s
    print(rep, {p: round(v, 2) for p, v in cpu.items()}, "update/check/capture s", round(upd, 3), "drafting s", {p: round(v, 2) for p, v in drafting.items()}, flush=True)
print("cpu ratio bandit/off", cpu["bandit"] / cpu["off"])
