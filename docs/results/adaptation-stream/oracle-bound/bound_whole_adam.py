"""Bound: whole drafter (all but rank head) trained with Adam on calls 1-6's replayable signal, served on 7-9."""
import json
import sys
import time

import torch
from bound_common import collect

from transformers_specblock.generation.adaptation import update as U

drafter_name, ntok = sys.argv[1], int(sys.argv[2])
variants = [v.split(":") for v in sys.argv[3:]]  # lr:steps:batch
drafter, run, test_rows, samples, base = collect(drafter_name, ntok)
samples = [s for s in samples if s.slot >= 0]  # replayable

print(json.dumps({"drafter": drafter_name, "ntok": ntok, "replayable": len(samples), "off_7_9": base}), flush=True)
loaded = {n: p.detach().clone() for n, p in drafter.named_parameters()}
params = U.trainable_parameters(drafter, "full")
g = torch.Generator().manual_seed(0)
for lr, steps, batch in variants:
    with torch.no_grad():
        for n, p in drafter.named_parameters(): p.copy_(loaded[n])
    opt = torch.optim.Adam(params, lr=float(lr)); t = time.perf_counter()
    with torch.enable_grad():
        for _ in range(int(steps)):
            idx = torch.randperm(len(samples), generator=g)[: int(batch)].tolist()
            sub = [samples[i] for i in idx]
            loss = U.adaptation_loss(drafter, sub, U.replay_states(drafter, sub))
            opt.zero_grad(); loss.backward(); opt.step()
    drafter.zero_grad(set_to_none=True)
    secs = time.perf_counter() - t
    taus = run(test_rows)
    print(json.dumps({"v": [lr, steps, batch], "secs": round(secs, 1), "loss_end": round(float(loss), 3), "taus": taus, "gain": round(sum(taus) / sum(base) - 1, 4)}), flush=True)
