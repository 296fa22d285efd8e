"""The engine core: requests in, tokens out, under continuous batching."""
