"""Hub-style `custom_generate` entry for SpecBlock tree speculative decoding (no monkey-patching needed).

    import transformers_specblock
    transformers_specblock.uninstall()   # optional: keep transformers' stock GenerationMixin methods
    model.generate(**inputs, assistant_model=drafter, custom_generate=transformers_specblock.CUSTOM_GENERATE_DIR,
                   trust_remote_code=True)

Loading this module changes nothing in transformers: it only imports the package's patch-free `generate`, which
runs the stock `GenerationMixin.generate` with a `custom_generate` callable. The package's own import (needed
anyway for the drafter class) is what installs the router of the other route; `uninstall()` removes it, and this
module does not put it back.
"""

from transformers_specblock.generation.integration import generate  # noqa: F401  (transformers looks up `generate`)
