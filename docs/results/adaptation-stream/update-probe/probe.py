"""tau along a stream under head_only with different optimizers (monkeypatched)."""
import sys, json, time, torch
sys.path.insert(0, "/work/main/examples")
import adaptation_stream as A
from transformers_specblock.generation.adaptation import update as U
from transformers_specblock.hub.loading import load_model
import argparse

variant, drafter_name, stream_name, policy = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
ntok = int(sys.argv[5]) if len(sys.argv) > 5 else 32


def make_opt(kind, lr):
    def update(self, action, buffer, body_version):
        stored_samples = buffer.for_head(body_version, U.HEAD_BATCH)
        replay = buffer.for_replay(U.FULL_BATCH) if action == U.FULL else []
        if not stored_samples and not replay:
            return None
        opt = self.optimizers.get(action)
        if opt is None:
            head = U.output_parameters(self.drafter); ids = {id(p) for p in head}
            groups = [{"params": head, "lr": lr}]
            if action == U.FULL:
                groups.append({"params": [p for p in self.drafter.parameters() if id(p) not in ids], "lr": lr * U.BODY_LR_SCALE})
            opt = self.optimizers[action] = (torch.optim.SGD(groups, lr=lr) if kind == "sgd" else torch.optim.Adam(groups, fused=True))
        stored = torch.stack([s.state for s in stored_samples]).to(self.drafter.device, self.drafter.dtype) if stored_samples else None
        first = None
        self.drafter.train(False)
        with torch.enable_grad():
            for step in range(U.HEAD_STEPS if action == U.HEAD_ONLY else U.FULL_STEPS):
                loss = U.adaptation_loss(self.drafter, stored_samples, stored) if stored_samples else 0.0
                if replay:
                    loss = loss + U.adaptation_loss(self.drafter, replay, U.replay_states(self.drafter, replay))
                self.drafter.zero_grad(set_to_none=True); loss.backward(); opt.step()
                if step == 0: first = float(loss.detach())
        self.drafter.zero_grad(set_to_none=True)
        return first
    return update

if variant.startswith("body"):  # e.g. body0.05: the shipped update with that BODY_LR_SCALE
    U.BODY_LR_SCALE = float(variant[4:])
    variant_core = "base"
elif variant.startswith("steps"):  # e.g. steps2@0.02: HEAD_STEPS steps at that learning rate (the shipped code)
    U.HEAD_STEPS = int(variant[5:].split("@")[0])
    variant_core = "base"
elif variant.startswith("norank-"):
    variant_core = variant[len("norank-"):]
    U.output_parameters = lambda d: list(d.lm_head.parameters())
else:
    variant_core = variant
if variant_core != "base":
    kind, lr = variant_core.split("@")
    U.DrafterUpdater.update = make_opt(kind, float(lr))

torch.manual_seed(0)
target, tok = load_model("smollm2-135m-instruct", dtype=torch.float32)
args = argparse.Namespace(num_code=9, num_chat=4, num_sharegpt=8, seed=0, tree_budget=8, max_new_tokens=ntok)
streams = A.build_streams(tok, args)
drafter = A.load_drafter(drafter_name, policy, tok, target, args)
if variant.startswith("steps"):
    drafter.config.adaptation_learning_rate = float(variant.split("@")[1])
upd = []
taus = []; acts = []; gains = []
for row in streams[stream_name]:
    inputs = A.encode(tok, row)
    t = time.perf_counter()
    target.generate(**inputs, assistant_model=drafter, do_sample=False, max_new_tokens=ntok)
    s = drafter.last_stats
    upd.append(round(s.adaptation_time_s, 3)); gains.append(round(s.adaptation_held_out_gain, 3)); taus.append(round(s.tau, 3)); acts.append(s.adaptation_action[0] + ("R" if s.adaptation_restored_loaded else "") + ("B" if s.adaptation_rolled_back else ""))
print(json.dumps({"variant": variant, "drafter": drafter_name, "stream": stream_name, "policy": policy, "ntok": ntok, "taus": taus, "gains": gains, "update_s": upd, "acts": acts, "mean": sum(taus)/len(taus)}), flush=True)
