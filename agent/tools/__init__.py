"""The agent's tools: the registry and its permissions, tool-call parsing, process I/O."""
