"""llama.cpp's RPC backend for pask-local: layers (and their K/V) on other machines.

``placement`` (where a model's layers go: ``--rpc``, ``--tensor-split``, ``--ngl``), ``endpoints``
(parsing), ``probe`` (a handshake with a deadline before ggml-rpc connects), ``ggml_rpc`` (the ctypes
bindings), ``server`` and ``cli`` (``pask-local rpc-server``). Guide: docs/rpc.md.
"""
