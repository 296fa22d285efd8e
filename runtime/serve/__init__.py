"""The OpenAI-compatible HTTP server over the engine (``liubai serve``)."""
