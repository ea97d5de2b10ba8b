"""Publish: the model card, the Hub upload, and the imports preloaded for them while weights are written."""
