"""Speculative decoding: a cheap drafter guesses the next tokens, the model verifies them in one
forward, and the longest correct prefix is kept (``runtime/engine/engine.py`` drives it)."""
