"""Per-prompt speed-up of every method of a `specblock-bench` run over plain: the median of plain's seconds per token
over the method's, and on how many prompts the method was faster. Usage: python per_prompt_medians.py RUN_FOLDER..."""

import json
import statistics
import sys

for folder in sys.argv[1:]:
    r = json.load(open(f"{folder}/results.json"))
    rows = r["per_prompt"]
    plain = {x["prompt_id"]: x["seconds"] / x["new_tokens"] for x in rows if x["method"] == "plain"}
    out = {}
    for m in r["methods"]:
        if m == "plain":
            continue
        ratios = [plain[x["prompt_id"]] / (x["seconds"] / x["new_tokens"]) for x in rows if x["method"] == m]
        out[m] = (round(statistics.median(ratios), 3), sum(q > 1 for q in ratios), len(ratios))
    print(folder, out)
