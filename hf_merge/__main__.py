"""``python -m hf_merge ...`` (and ``torchrun ... -m hf_merge merge SRC TGT``): the ``hf-merge`` CLI."""

from .cli.app import run

if __name__ == "__main__":
    run()
