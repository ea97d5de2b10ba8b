"""The ``hf-merge`` command line: a thin layer over the library."""
