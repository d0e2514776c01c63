"""Bound with a custom learner: head (+ optional vocab bias) trained on calls 1-6's signal, served on 7-9."""
import json
import sys

import torch
from bound_common import collect

drafter_name, ntok = sys.argv[1], int(sys.argv[2])
variants = [v.split(":") for v in sys.argv[3:]]  # opt:lr:steps:loss:bias
drafter, run, test_rows, samples, base = collect(drafter_name, ntok)

print(json.dumps({"drafter": drafter_name, "ntok": ntok, "samples": len(samples), "off_7_9": base}), flush=True)
W0 = drafter.lm_head.weight.detach().clone()
states = drafter.norm(torch.stack([s.state for s in samples])).detach()
ids = torch.stack([s.target_ids for s in samples]); probs = torch.stack([s.target_probs for s in samples]) * (ids >= 0)
probs = probs / probs.sum(-1, keepdim=True).clamp(min=1e-12)
hard = torch.zeros_like(probs); hard[:, 0] = (ids[:, 0] >= 0).float()
for opt_name, lr, steps, loss_kind, use_bias in variants:
    with torch.no_grad(): drafter.lm_head.weight.copy_(W0)
    bias = torch.zeros(W0.shape[0], requires_grad=True)
    params = [drafter.lm_head.weight] + ([bias] if use_bias == "1" else [])
    if use_bias == "only": params = [bias]
    opt = (torch.optim.Adam if opt_name == "adam" else torch.optim.SGD)(params, lr=float(lr))
    tgt = probs if loss_kind == "soft" else hard
    with torch.enable_grad():
        for _ in range(int(steps)):
            logq = (drafter.lm_head(states) + bias).log_softmax(-1)
            loss = -(tgt * logq.gather(1, ids.clamp(min=0))).sum(-1).mean()
            opt.zero_grad(); loss.backward(); opt.step()
    h = None
    if use_bias != "0":
        b = bias.detach()
        h = drafter.lm_head.register_forward_hook(lambda m, i, o: o + b)
    taus = run(test_rows)
    if h: h.remove()
    drafter.lm_head.weight.grad = None
    print(json.dumps({"v": [opt_name, lr, steps, loss_kind, use_bias], "loss_end": round(float(loss), 3), "taus": taus, "gain": round(sum(taus) / sum(base) - 1, 4)}), flush=True)
