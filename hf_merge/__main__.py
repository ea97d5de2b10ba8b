"""``python -m hf_merge ...`` (and ``torchrun ... -m hf_merge merge SRC TGT``): the ``hf-merge`` CLI."""

import sys

from .cli.app import main

if __name__ == "__main__":
    sys.exit(main())
