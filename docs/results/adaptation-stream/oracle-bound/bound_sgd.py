"""Bound: the head (plain SGD on the newest BATCH states) or the whole drafter (`update_whole_drafter`) trained
offline on code calls 1-6's signal, served ungated on calls 7-9.
Variants ACTION:STEPS:LR:BATCH:REPLAY_BATCH:BODY_SCALE, e.g. head_only:10:2e-2:100000:0:0 full:10:2e-2:100000:100000:0.1
(full: the output side at LR, the body at BODY_SCALE x LR)."""
import json
import sys

import torch
from bound_common import collect

from transformers_specblock.generation.adaptation import update as U
from transformers_specblock.generation.adaptation.signal import SignalBuffer

drafter_name, ntok = sys.argv[1], int(sys.argv[2])
drafter, serve, test_rows, samples, base = collect(drafter_name, ntok)
print(json.dumps({"drafter": drafter_name, "ntok": ntok, "samples": len(samples), "off_7_9": base}), flush=True)
loaded = {n: p.detach().clone() for n, p in drafter.named_parameters()}
for variant in sys.argv[3:]:
    action, steps, lr, batch, replay_batch, body_scale = variant.split(":")
    with torch.no_grad():
        for n, p in drafter.named_parameters():
            p.copy_(loaded[n])
    if action == "head_only":
        head = drafter.lm_head.weight
        stored = samples[-int(batch):]
        states = torch.stack([s.state for s in stored])
        with torch.enable_grad():
            for _ in range(int(steps)):
                loss = U.adaptation_loss(drafter, stored, states)
                drafter.zero_grad(set_to_none=True)
                loss.backward()
                U.sgd_step([([head], float(lr))])
        drafter.zero_grad(set_to_none=True)
    else:
        U.FULL_STEPS, U.FULL_STORED, U.FULL_BATCH = int(steps), int(batch), int(replay_batch)
        U.FULL_LR_SCALE, U.BODY_LR_SCALE = 1.0, float(body_scale)
        buffer = SignalBuffer(100000)
        buffer.add(samples)
        U.update_whole_drafter(drafter, buffer, 0, float(lr))
    taus = serve(test_rows)
    print(json.dumps({"v": variant, "taus": taus, "gain": round(sum(taus) / sum(base) - 1, 4)}), flush=True)
