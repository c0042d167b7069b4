"""pask-local's structural KV policy for HF transformers via kvpress (extra ``pask-local[kvpress]``).

``PASKPress`` (``press.py``) keeps, per layer, the prompt entries pask-local's PASK plan keeps;
``tag_request`` / ``gguf_tokenizer`` (``vocab.py``) tag a tool-calling prompt with pask-local's own
renderer on an HF tokenizer. An optional leaf: nothing else in pask_local imports it. Guide:
docs/kvpress.md.
"""

from __future__ import annotations

try:
    import kvpress  # noqa: F401
    import transformers  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(f"pask_local.kvpress needs kvpress and transformers: pip install 'pask-local[kvpress]' "
                      f"({exc})") from exc

from .keep import pask_method, prompt_keep
from .press import PASKPress
from .vocab import HFVocab, gguf_tokenizer, tag_request

__all__ = ["HFVocab", "PASKPress", "gguf_tokenizer", "pask_method", "prompt_keep", "tag_request"]
