"""Name tables as data: each module defines ``TABLES`` (a list of
:class:`hf_merge.transforms.name_table.NameTable`), found by
:func:`hf_merge.transforms.name_table.all_tables`. Adding a model family is adding a table here."""
