"""Set-up shared by the bound scripts: the shift stream, a fresh shipped drafter that serves code calls 1-6 with the
signal captured and nothing served, then off on calls 7-9 (the reference). Returns what a bound needs."""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "examples"))
import adaptation_stream as A  # noqa: E402
from transformers_specblock.generation.adaptation import adapter as AD  # noqa: E402
from transformers_specblock.hub.loading import load_model  # noqa: E402


def collect(drafter_name: str, ntok: int):
    """(drafter, serve(rows) -> taus, test rows (calls 7-9), samples of calls 1-6, off's taus on calls 7-9)."""
    torch.manual_seed(0)
    target, tok = load_model("smollm2-135m-instruct", dtype=torch.float32)
    args = argparse.Namespace(num_code=9, num_chat=4, num_sharegpt=15, seed=0, tree_budget=8, max_new_tokens=ntok)
    rows = A.build_streams(tok, args)["shift"]
    AD.PROMOTION_GAIN = 9.0  # candidates are trained and tested, never served
    drafter = A.load_drafter(drafter_name, "head_only", tok, target, args)
    drafter.config.adaptation_buffer_size = 100000

    def serve(stream_rows):
        taus = []
        for row in stream_rows:
            target.generate(**A.encode(tok, row), assistant_model=drafter, do_sample=False, max_new_tokens=ntok)
            taus.append(round(drafter.last_stats.tau, 3))
        return taus

    serve(rows[:6])
    samples = list(AD.online_adapter_for(drafter).buffer.samples)
    drafter.config.online_adaptation = "off"
    return drafter, serve, rows[6:9], samples, serve(rows[6:9])
