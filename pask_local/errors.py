"""User-facing errors: each carries a one-line message the CLI prints before exiting non-zero."""

from __future__ import annotations


class PaskError(Exception):
    """Base class for errors the CLI reports as a single line (no traceback)."""

    exit_code = 1


class ModelError(PaskError):
    """A GGUF model cannot be found, read or loaded."""


class NativeError(PaskError):
    """The loaded llama_cpp is not the pask-patched build, or a native call failed."""


class SchemaError(PaskError):
    """A tool definition / JSON schema is invalid or uses an unsupported feature."""


class ContextLengthError(PaskError):
    """A request's prompt plus its generation limit does not fit the context."""


class RpcError(PaskError):
    """An RPC server (``--rpc``) cannot be reached or used, or this build has no RPC backend."""
