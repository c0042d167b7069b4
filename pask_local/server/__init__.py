"""``pask-local serve``: an OpenAI-compatible chat-completions server with tool calling.

``app`` (routes; requests go to ``engine.pool`` or, ``--no-batch``, ``engine.isolated_pool``, which
own the queue, the slots and cancellation), ``openai_io`` (request validation -> engine inputs,
response shapes), ``streaming`` (SSE chunks with tool-call deltas), ``metrics`` (Prometheus text),
``guard`` (Host, Content-Type, API key), ``transport`` (uvicorn), ``cli`` (the ``serve``
subcommand). Guide: docs/server.md.
"""
