"""``python -m transformers_specblock.train`` / ``accelerate launch -m transformers_specblock.train``: same as
``specblock-train``."""

from .commands.cli import train_main

if __name__ == "__main__":
    train_main()
