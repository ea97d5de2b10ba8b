"""Source readers: each turns one on-disk format into a :class:`~hf_merge.checkpoint.LazyCheckpoint`."""
