"""Reads a user-supplied JSON file, turning a missing file or bad JSON into a one-line PaskError."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import PaskError


def read_json_file(path: str | Path, what: str, error: type[PaskError] = PaskError) -> Any:
    """The parsed JSON of ``path``; ``error("<what> file not found: ...")`` or ``error("...: invalid JSON ...")``."""
    p = Path(path)
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"{what} file not found: {p}") from None
    except json.JSONDecodeError as exc:
        raise error(f"{p}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
    except UnicodeDecodeError as exc:
        raise error(f"{p}: not UTF-8 text (byte {exc.start}); is this a {what} file?") from None
    except RecursionError:
        raise error(f"{p}: invalid JSON (nested too deeply)") from None
    except OSError as exc:
        raise error(f"cannot read {what} file {p}: {exc.strerror or exc}") from None
