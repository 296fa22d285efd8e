"""Paged KV memory: the block manager, the pool and its stores, quantization codecs."""
