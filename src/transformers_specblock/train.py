"""``python -m transformers_specblock.train`` / ``accelerate launch -m transformers_specblock.train``: same as
``specblock-train``."""

from .commands.cli import train_command

if __name__ == "__main__":
    train_command()
