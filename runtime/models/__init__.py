"""Getting a model: the registry of known models, pulling, converting and loading."""
