"""Which tool definitions the user's query points to: tool segments of a tagged prompt and a lexical score.

A tagged prompt says which tokens are tool names, parameter names, types and descriptions, but
not which tool each belongs to. ``tool_segments`` recovers that from the classes alone: a tool's
entry starts at its name (with the schema punctuation just before it, e.g. ``{"name": ``) and runs
to the next tool's; a segment that holds no parameter, type or description token (a tool name
quoted in an earlier assistant call) is not a tool definition.

``tool_relevance`` scores each tool by the query words its entry shares (name words count twice),
each word weighted by how few tools share it (``log(1 + n_tools / df)``), and maps the scores to
``[0, 1]`` by the best tool's. With fewer than two tools, or no shared word, every tool is 1.0:
nothing to choose between. Words are lower-cased alphanumeric runs (snake_case and camelCase
split), cut to their first 6 characters (``calculate`` / ``calculating``: ``calcul``), without
a short list of words every tool list is full of. It reads token texts and classes only: no
model call, so it runs before prefill.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np

from ..classes import StructuralClass as C
from ..classes import class_index

_NAME = class_index(C.TOOL_NAME)
_PUNCT = class_index(C.SCHEMA_PUNCT)
_QUERY = class_index(C.QUERY)
_TOOL = {class_index(c) for c in (C.TOOL_NAME, C.PARAM_NAME, C.PARAM_REQUIRED, C.PARAM_TYPE, C.DESCRIPTION,
                                  C.SCHEMA_PUNCT)}
_BODY = {class_index(c) for c in (C.PARAM_NAME, C.PARAM_REQUIRED, C.PARAM_TYPE, C.DESCRIPTION)}
_WORDS = _BODY | {_NAME}
STEM = 6
STOPWORDS = frozenset("""
a an the of to for and or in on at by with from as is are be been it its this that these those what which
who whom how when where i me my you your we our he she they them can could would should will shall may
please do does did not no yes if then than so about into over under all any each some get find give tell
show use using used given specified specify value values default string integer number float boolean bool
object array type types required optional list dict parameter parameters property properties description
name names function functions tool tools return returns e g eg etc
""".split())


def words(text: str) -> set[str]:
    """The stemmed, lower-cased content words of ``text`` (module docstring)."""
    text = re.sub(r"([a-z])([A-Z])", r"\1 \2", text)
    out = set()
    for w in re.findall(r"[^\W_]+", text.lower()):
        if len(w) < 2 or w.isdigit() or w in STOPWORDS:
            continue
        out.add(w[:STEM])
    return out


def tool_segments(classes: Sequence[int] | np.ndarray) -> np.ndarray:
    """The tool each position's entry belongs to (0, 1, ... in prompt order), -1 outside tool definitions."""
    cls = np.asarray(classes, dtype=np.int64)
    seg = np.full(len(cls), -1, dtype=np.int64)
    cur = -1
    for i, c in enumerate(cls):
        if c == _NAME and (i == 0 or cls[i - 1] != _NAME):
            cur += 1
            j = i - 1
            while j >= 0 and cls[j] == _PUNCT:  # the punctuation that opens the entry
                seg[j] = cur
                j -= 1
        if c in _TOOL and cur >= 0:
            seg[i] = cur
    # keep only segments that define something besides a name; renumber them in order
    out = np.full(len(cls), -1, dtype=np.int64)
    k = 0
    for t in range(cur + 1):
        members = seg == t
        if np.isin(cls[members], list(_BODY)).any():
            out[members] = k
            k += 1
    return out


def _text(pieces: Sequence[str], idx: np.ndarray) -> str:
    """The pieces at positions ``idx`` (sorted) joined, with a space where positions are skipped."""
    parts: list[str] = []
    prev = -2
    for i in idx:
        if i != prev + 1:
            parts.append(" ")
        parts.append(pieces[i])
        prev = i
    return "".join(parts)


def tool_scores(pieces: Sequence[str], classes: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(tool index per position, raw lexical score per tool): see the module docstring."""
    cls = np.asarray(classes, dtype=np.int64)
    if len(pieces) != len(cls):
        raise ValueError(f"{len(pieces)} token texts for {len(cls)} classes")
    seg = tool_segments(cls)
    n_tools = int(seg.max(initial=-1)) + 1
    query = words(_text(pieces, np.flatnonzero(cls == _QUERY)))
    names, bodies = [], []
    for t in range(n_tools):
        of_tool = seg == t
        names.append(words(_text(pieces, np.flatnonzero(of_tool & (cls == _NAME)))))
        bodies.append(words(_text(pieces, np.flatnonzero(of_tool & np.isin(cls, list(_WORDS))))))
    df: dict[str, int] = {}
    for b in bodies:
        for w in b:
            df[w] = df.get(w, 0) + 1
    scores = np.zeros(n_tools)
    for t in range(n_tools):
        for w in query & bodies[t]:
            scores[t] += math.log(1.0 + n_tools / df[w]) * (2.0 if w in names[t] else 1.0)
    return seg, scores


def tool_relevance(pieces: Sequence[str], classes: Sequence[int] | np.ndarray) -> np.ndarray:
    """Per position: its tool's score divided by the best tool's (1.0 outside tools, and for every
    tool when fewer than two are defined or none shares a word with the query)."""
    seg, scores = tool_scores(pieces, classes)
    rel = np.ones(len(seg))
    best = float(scores.max(initial=0.0))
    if len(scores) >= 2 and best > 0.0:
        in_tool = seg >= 0
        rel[in_tool] = scores[seg[in_tool]] / best
    return rel
