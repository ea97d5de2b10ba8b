"""Load: ``from_sharded_pretrained`` (the model from the shards), page mapping on CPU, staged copies to GPUs, the
Auto-class hook."""
