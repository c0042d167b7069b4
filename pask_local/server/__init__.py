"""``pask-local serve``: an OpenAI-compatible chat-completions server with tool calling.

``app`` (routes), ``openai_io`` (request validation -> engine inputs, response shapes),
``scheduler`` (slots, the bounded queue, cancellation), ``streaming`` (SSE chunks with tool-call
deltas), ``metrics`` (Prometheus text), ``cli`` (the ``serve`` subcommand). Guide: docs/server.md.
"""
