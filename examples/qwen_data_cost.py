"""The measured cost of the Qwen data pipeline (examples/qwen_data.sh), from what it left on disk: disk and CPU
seconds per million tokens of target features, the regeneration rate, the data's size per split and source, and the
host. Writes docs/results/qwen-data/cost.json.

    python examples/qwen_data_cost.py [--data_dir /work/qwen-data/qwen2.5-coder-0.5b-instruct]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
from pathlib import Path

import torch

from transformers_specblock.training.features import features_bytes_per_token

REPO = Path(__file__).resolve().parents[1]


def host() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    return {
        "cpu_model_name": fields.get("Model name", "").strip(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "avx512_bf16": "avx512_bf16" in flags,
        "amx_bf16": "amx_bf16" in flags,
        "cores": int(fields.get("CPU(s)", "0").strip() or 0),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": 1,
        "note": "2 cores shared by several engineers' jobs (load average 4-9 while measured): CPU seconds "
        "(process time) are the cost; wall time is longer",
    }


def features(folder: Path) -> dict | None:
    path = folder / "features_info.json"
    if not path.is_file():
        return None
    info = json.loads(path.read_text())
    tokens, cpu, wall = info["num_tokens"], info["cpu_seconds"], info["seconds"]
    disk = sum((folder / s["file"]).stat().st_size for s in info["shards"])
    million = 1e6 / max(tokens, 1)
    return {
        "tokens": tokens,
        "sequences": info["num_sequences"],
        "shards": len(info["shards"]),
        "disk_bytes": disk,
        "cpu_seconds": cpu,
        "wall_seconds": wall,
        "bytes_per_token": round(disk / max(tokens, 1), 1),
        "bytes_per_token_layout": info["bytes_per_token_breakdown"],
        "disk_GB_per_million_tokens": round(disk * million / 1e9, 3),
        "cpu_seconds_per_million_tokens": round(cpu * million),
        "cpu_hours_per_million_tokens": round(cpu * million / 3600, 2),
        "tokens_per_cpu_second": round(tokens / max(cpu, 1e-9), 1),
        "target_dtype": info["target_dtype"],
        "stored_dtype": info["dtype"],
        "target_layer_ids": info["target_layer_ids"],
        "max_length": info["max_length"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir", default="/work/qwen-data/qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--output", default=str(REPO / "docs/results/qwen-data/cost.json"))
    options = parser.parse_args()
    data = Path(options.data_dir)
    result: dict = {"target": "qwen2.5-coder-0.5b-instruct (packaged Q4_K_M GGUF, dequantized; run in bfloat16)",
                    "host": host()}  # fmt: skip
    result["features"] = {split: features(data / "features" / split) for split in ("select", "train", "report")}
    result["features"] = {k: v for k, v in result["features"].items() if v}
    result["bytes_per_token_by_target_bfloat16"] = {
        "qwen2.5-coder-0.5b-instruct (H 896)": sum(features_bytes_per_token(896, torch.bfloat16).values()),
        "qwen2.5-coder-1.5b-instruct (H 1536)": sum(features_bytes_per_token(1536, torch.bfloat16).values()),
    }
    regen = data / "sources" / "regenerate_stats.json"
    if regen.is_file():
        runs = json.loads(regen.read_text())["runs"]
        tokens, cpu = sum(r["new_tokens"] for r in runs), sum(r["cpu_seconds"] for r in runs)
        wall = sum(r["seconds"] for r in runs)
        answers = sum(1 for line in (data / "sources" / "regenerated.jsonl").open() if line.strip())
        result["regeneration"] = {"answers": answers, "new_tokens": tokens, "cpu_seconds": cpu, "wall_seconds": wall,
                                  "new_tokens_per_cpu_second": round(tokens / max(cpu, 1e-9), 2),
                                  "cpu_hours_per_million_tokens": round(cpu / max(tokens, 1) * 1e6 / 3600, 1),
                                  "decoding": "greedy, LookupTreeModel.from_target(target) as assistant_model"}  # fmt: skip
    stats = data / "splits" / "stats.json"
    if stats.is_file():
        result["splits"] = json.loads(stats.read_text())
    dropped = data / "sources" / "dropped.jsonl"
    if dropped.is_file():
        rows = [json.loads(line) for line in dropped.open() if line.strip()]
        counts: dict[str, int] = {}
        for row in rows:
            key = f"{row['source']} <- {row['benchmark_match'].split(':')[0]}"
            counts[key] = counts.get(key, 0) + 1
        result["dropped_as_benchmark_matches"] = counts
    Path(options.output).parent.mkdir(parents=True, exist_ok=True)
    Path(options.output).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
