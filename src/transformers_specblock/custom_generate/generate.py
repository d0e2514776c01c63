"""Hub-style `custom_generate` entry for SpecBlock tree speculative decoding (no monkey-patching needed).

    model.generate(**inputs, assistant_model=drafter, custom_generate=transformers_specblock.CUSTOM_GENERATE_DIR,
                   trust_remote_code=True)
"""

from transformers_specblock.generation import generate  # noqa: F401  (transformers looks up `generate`)
