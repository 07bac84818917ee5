"""The OpenAI-compatible HTTP gateway: validation, auth, limits, SSE, stop strings, ``n`` and
usage in front of the tokenizer and the engine (or router) services. Never imports torch."""
