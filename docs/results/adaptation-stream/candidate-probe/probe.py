"""tau along a stream for one drafter/policy; constants overridable: KEY=VALUE args (HEAD_STEPS, HEAD_BATCH, lr, ...)."""
import sys, json, time, argparse, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[4] / "examples"))
import adaptation_stream as A
from transformers_specblock.generation.adaptation import update as U, adapter as AD
from transformers_specblock.hub.loading import load_model

drafter_name, stream_name, policy, ntok = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
over = dict(a.split("=") for a in sys.argv[5:])
lr = None
cfg = {}
buf = None
for k, v in over.items():
    if k == "lr": lr = float(v)
    elif k == "buf": buf = int(v)
    elif k.startswith("cfg."): cfg[k[4:]] = v
    elif k == "KEEP":
        import torch.nn.functional as F
        from transformers_specblock.generation.adaptation.update import first_token_acceptance
        @torch.no_grad()
        def _try_candidate(self):
            candidate = self.candidate
            fresh = [s for s in self.fresh if s.body_version == self.body_version]
            if candidate is None or not fresh:
                return
            normed = self.drafter.norm(torch.stack([s.state for s in fresh]))
            served = first_token_acceptance(self.drafter.lm_head(normed), fresh)
            tried = first_token_acceptance(F.linear(normed, candidate["lm_head.weight"]), fresh)
            self.report.candidate_gain = (tried - served) / len(fresh)
            if self.report.candidate_gain >= AD.PROMOTION_GAIN:
                for name, param in self._named(AD.HEAD_ONLY):
                    param.copy_(candidate[name])
                self.report.promoted = True
                self.candidate = None
        @torch.no_grad()
        def _train_candidate(self):
            head = self._named(AD.HEAD_ONLY)
            served = {n: p.detach().clone() for n, p in head}
            if self.candidate is not None:
                for n, p in head: p.copy_(self.candidate[n])
            with torch.enable_grad():
                loss = self._update(AD.HEAD_ONLY)
            if loss is not None:
                self.candidate = {n: p.detach().clone() for n, p in head}
            for n, p in head: p.copy_(served[n])
            return loss
        AD.OnlineAdapter._try_candidate = _try_candidate
        AD.OnlineAdapter._train_candidate = _train_candidate
    elif k == "PROMOTE":
        import torch.nn.functional as F
        from transformers_specblock.generation.adaptation.update import first_token_acceptance
        mode = v
        @torch.no_grad()
        def _try_candidate(self):
            candidate, self.candidate = self.candidate, None
            fresh = [s for s in self.fresh if s.body_version == self.body_version]
            if candidate is None or not fresh:
                return
            def gain(samples):
                if not samples: return 0.0
                normed = self.drafter.norm(torch.stack([s.state for s in samples]))
                served = first_token_acceptance(self.drafter.lm_head(normed), samples)
                tried = first_token_acceptance(F.linear(normed, candidate["lm_head.weight"]), samples)
                return (tried - served) / len(samples)
            g_all = gain(fresh); g1 = gain([s for s in fresh if s.depth == 1]); gd = gain([s for s in fresh if s.depth > 1])
            self.report.candidate_gain = g_all
            if mode == "split": ok = g1 > 0 and gd >= 0
            else: ok = g_all >= float(mode)
            if ok:
                for name, param in self._named(AD.HEAD_ONLY):
                    param.copy_(candidate[name])
                self.report.promoted = True
        AD.OnlineAdapter._try_candidate = _try_candidate
    elif k == "ADAM":
        lr_a, steps_a, batch_a, start_a, *rows_a = v.split(",")
        import torch.nn.functional as F
        @torch.no_grad()
        def _train_candidate(self):
            samples = self.buffer.for_head(self.body_version, int(batch_a))
            if not samples:
                return None
            loaded = self.drafter.__dict__.get("_loaded_weights")
            start = loaded["lm_head.weight"] if start_a == "loaded" else self.drafter.lm_head.weight
            states = self.drafter.norm(torch.stack([s.state for s in samples])).detach()
            ids = torch.stack([s.target_ids for s in samples]); probs = torch.stack([s.target_probs for s in samples]) * (ids >= 0)
            probs = probs / probs.sum(-1, keepdim=True).clamp(min=1e-12)
            full_W = start.detach().clone()
            if rows_a:  # train only the rows of the target's top ids and the drafter's own top proposals
                with torch.no_grad():
                    top_d = F.linear(states, full_W).topk(int(rows_a[0]), dim=-1).indices
                rows_idx = torch.unique(torch.cat([ids[:, : int(rows_a[1])].flatten(), top_d.flatten()]))
                rows_idx = rows_idx[rows_idx >= 0]
                remap = torch.full((full_W.shape[0],), -1, dtype=torch.long); remap[rows_idx] = torch.arange(rows_idx.numel())
                ids = remap[ids.clamp(min=0)].where(ids >= 0, torch.full_like(ids, -1))
                probs = probs * (ids >= 0)
                W = full_W[rows_idx].clone().requires_grad_(True)
            else:
                W = full_W.clone().requires_grad_(True)
            opt = torch.optim.Adam([W], lr=float(lr_a))
            first = None
            with torch.enable_grad():
                for _ in range(int(steps_a)):
                    logq = F.linear(states, W).log_softmax(-1)
                    loss = -(probs * logq.gather(1, ids.clamp(min=0))).sum(-1).mean()
                    opt.zero_grad(); loss.backward(); opt.step()
                    first = float(loss) if first is None else first
            if rows_a:
                full_W[rows_idx] = W.detach(); W = full_W
            self.candidate = {"lm_head.weight": W.detach()}
            return first
        AD.OnlineAdapter._train_candidate = _train_candidate
    elif k == "STRIDE":
        from transformers_specblock.generation.adaptation import signal as SG
        def for_head(self, body_version, limit):
            pool = [s for s in self.samples if s.body_version == body_version]
            step = max(1, len(pool) // limit)
            return pool[::-1][::step][:limit]
        SG.SignalBuffer.for_head = for_head
    elif k == "RANDOM":
        import random as _r
        from transformers_specblock.generation.adaptation import signal as SG
        _rng = _r.Random(0)
        def for_head(self, body_version, limit):
            pool = [s for s in self.samples if s.body_version == body_version]
            return _rng.sample(pool, min(limit, len(pool)))
        SG.SignalBuffer.for_head = for_head
    elif hasattr(U, k): setattr(U, k, type(getattr(U, k))(v))
    elif hasattr(AD, k): setattr(AD, k, type(getattr(AD, k))(v))
    else: raise SystemExit(f"unknown {k}")
torch.manual_seed(0)
target, tok = load_model("smollm2-135m-instruct", dtype=torch.float32)
args = argparse.Namespace(num_code=9, num_chat=4, num_sharegpt=15, seed=0, tree_budget=8, max_new_tokens=ntok)
streams = A.build_streams(tok, args)
drafter = A.load_drafter(drafter_name, policy, tok, target, args)
if lr is not None: drafter.config.adaptation_learning_rate = lr
for ck, cv in cfg.items(): setattr(drafter.config, ck, type(getattr(drafter.config, ck))(cv))
if buf is not None: drafter.config.adaptation_buffer_size = buf
taus, acts, gains, upd, secs = [], [], [], [], []
for row in streams[stream_name]:
    inputs = A.encode(tok, row)
    t = time.perf_counter()
    target.generate(**inputs, assistant_model=drafter, do_sample=False, max_new_tokens=ntok)
    secs.append(round(time.perf_counter() - t, 2))
    s = drafter.last_stats
    upd.append(round(s.adaptation_time_s, 3)); gains.append((round(s.adaptation_held_out_gain, 3), round(s.adaptation_candidate_gain, 3))); taus.append(round(s.tau, 3))
    acts.append(s.adaptation_action[0] + ("R" if s.adaptation_restored_loaded else "") + ("B" if s.adaptation_rolled_back else "") + ("P" if getattr(s, "adaptation_promoted", False) else ""))
n = len(taus); third = taus[2 * 9 // 3:9] if stream_name == "shift" else []
print(json.dumps({"drafter": drafter_name, "stream": stream_name, "policy": policy, "ntok": ntok, "over": over,
    "mean": round(sum(taus) / n, 4), "code_last_third": round(sum(third) / len(third), 4) if third else None,
    "secs": round(sum(secs), 1), "upd": round(sum(upd), 2), "taus": taus, "acts": acts, "gains": gains}), flush=True)
