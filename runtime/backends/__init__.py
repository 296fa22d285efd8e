"""Where replies come from: the Backend interface, the local engine, an OpenAI server."""
