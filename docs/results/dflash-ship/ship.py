"""Write the shipped DFlash folder from the drafter `evaluate_drafter.py --output` saved.

    python docs/results/dflash-ship/ship.py SAVED EVAL_RESULTS_JSON SHIPPED_FOLDER

config.json: the saved architecture and records, with the eval rows of EVAL_RESULTS_JSON; the hardware record names
the GPU only. model.safetensors: the saved weights (bfloat16, byte-identical to the ones trained). The shipped
generation_config.json (decoding settings) is left as it is. Then regenerate the card with
``python -m transformers_specblock.commands.card SHIPPED_FOLDER``.
"""

import json
import shutil
import sys
from pathlib import Path

saved, rows_file, dest = map(Path, sys.argv[1:4])
config = json.loads((saved / "config.json").read_text())
info = config["training_info"]
info["hardware"] = info["hardware"].replace("one NVIDIA H200 (lent), ", "one NVIDIA H200, ")
config["eval_results"] = json.loads(rows_file.read_text())
(dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
shutil.copyfile(saved / "model.safetensors", dest / "model.safetensors")
print("wrote", dest / "config.json", "and", dest / "model.safetensors")
