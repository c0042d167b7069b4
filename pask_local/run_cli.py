"""`pask-local run`: one function call (or a list of parallel calls) for a request and a tool schema."""

from __future__ import annotations


def run_command() -> None:
    """Placeholder until the engine lands."""
    raise NotImplementedError
