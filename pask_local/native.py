"""Binds the pask extensions of our patched libllama (loaded through ``llama_cpp``) with ctypes.

``lib()`` returns the ctypes handle of the libllama that ``llama_cpp`` loaded, after checking that
it is the pask-patched build. Feature modules (layered KV cache, grammar state, ...) declare their
own functions with ``bind()`` so that each stays next to the code that uses it.
"""

from __future__ import annotations

import ctypes
import functools
import json
from importlib import resources
from typing import Any

from .errors import NativeError

SETUP_HINT = "run scripts/setup (or: python scripts/build_llama.py) to build and install it"


@functools.cache
def lib() -> ctypes.CDLL:
    """The libllama handle loaded by llama_cpp; raises NativeError if it lacks the pask symbols."""
    try:
        import llama_cpp.llama_cpp as raw
    except Exception as exc:  # ImportError, OSError from a broken shared library
        raise NativeError(f"cannot import llama_cpp ({exc}); {SETUP_HINT}") from None
    handle = raw._lib
    if not hasattr(handle, "pask_patch_version"):
        raise NativeError(f"this llama_cpp is not the pask-patched build; {SETUP_HINT}")
    handle.pask_patch_version.restype = ctypes.c_char_p
    handle.pask_patch_version.argtypes = []
    return handle


def bind(name: str, restype: Any, argtypes: list[Any]) -> Any:
    """Declare and return a pask C function; NativeError if this build lacks it."""
    handle = lib()
    try:
        fn = getattr(handle, name)
    except AttributeError:
        raise NativeError(f"libllama lacks {name}: the installed build predates this patch; {SETUP_HINT}") from None
    fn.restype = restype
    fn.argtypes = argtypes
    return fn


class NativeHandle:
    """Owns one pointer to a native object (``_ptr``) and releases it once: ``close()`` or collection."""

    _ptr = None

    def _release(self, ptr) -> None:
        raise NotImplementedError

    def close(self) -> None:
        if getattr(self, "_ptr", None):
            self._release(self._ptr)
            self._ptr = None

    def __del__(self) -> None:  # pragma: no cover
        try:
            self.close()
        except Exception:
            pass


def patch_version() -> str:
    """The series hash compiled into libllama (sha256 prefix of patches/ + ggml_kernels/)."""
    return lib().pask_patch_version().decode()


def build_info() -> dict[str, Any]:
    """The pask_build.json the build script put into the installed llama_cpp package."""
    try:
        text = resources.files("llama_cpp").joinpath("pask_build.json").read_text()
    except (FileNotFoundError, ModuleNotFoundError):
        raise NativeError(f"llama_cpp carries no pask_build.json; {SETUP_HINT}") from None
    return json.loads(text)
