"""The public frontends: gRPC and the OpenAI-compatible HTTP API over one generate interface."""

# Longest text prompt accepted, in UTF-8 bytes: ~250k tokens of English text, beyond any context we serve.
# Here, not in generate.py, so that the CLI can show it without importing the engine.
DEFAULT_MAX_PROMPT_BYTES = 1024 * 1024
