"""Colours and short names of the structural classes, and how a token's text is shown on one cell row."""

from __future__ import annotations

from pask_local.classes import StructuralClass as C

# colour, short label (legend and narrow tables)
CLASS_STYLE: dict[C, tuple[str, str]] = {
    C.SINK: ("#ff5fd7", "sink"),
    C.TEMPLATE: ("#8a8a8a", "tmpl"),
    C.TOOL_NAME: ("#ff5f5f", "tool"),
    C.PARAM_NAME: ("#ffaf5f", "param"),
    C.PARAM_REQUIRED: ("#ffd700", "req"),
    C.PARAM_TYPE: ("#d7af87", "type"),
    C.DESCRIPTION: ("#87afd7", "desc"),
    C.SCHEMA_PUNCT: ("#5f8787", "punct"),
    C.QUERY: ("#5fff5f", "query"),
    C.EXAMPLE: ("#afafff", "ex"),
    C.TOOL_RESULT: ("#87d787", "result"),
    C.GEN_STRUCT: ("#d0d0d0", "g.st"),
    C.GEN_NAME: ("#ff87af", "g.name"),
    C.GEN_KEY: ("#ffaf00", "g.key"),
    C.GEN_VALUE_REQUIRED: ("#00d7ff", "g.req"),
    C.GEN_VALUE_OPTIONAL: ("#5fafaf", "g.opt"),
    C.GEN_WS: ("#626262", "g.ws"),
}

HELD_COLOUR = "#2e8b57"      # heatmap: held by every layer
PARTIAL_COLOUR = "#b8860b"   # heatmap: held by some layers
EVICTED_COLOUR = "#5a1e1e"   # heatmap: held by none


def colour(cls: C) -> str:
    return CLASS_STYLE[cls][0]


def short(cls: C) -> str:
    return CLASS_STYLE[cls][1]


def display_text(text: str) -> str:
    """A token's text for the token view: visible whitespace controls, never empty."""
    if not text:
        return "∅"
    out = []
    for ch in text:
        if ch == "\n":
            out.append("↵")
        elif ch == "\t":
            out.append("⇥")
        elif ch == "\r":
            out.append("␍")
        elif ord(ch) < 32 or ord(ch) == 127:
            out.append("·")
        else:
            out.append(ch)
    return "".join(out)


def breaks_line(text: str) -> bool:
    """The token view starts a new row after a token that ends with a newline."""
    return text.endswith("\n")


def heat(frac: float) -> str:
    """Heatmap colour for the fraction of (layer, position) entries held, from evicted to held."""
    lo = (0x5a, 0x1e, 0x1e)
    hi = (0x2e, 0xcc, 0x71)
    r, g, b = (round(a + (z - a) * frac) for a, z in zip(lo, hi, strict=True))
    return f"#{r:02x}{g:02x}{b:02x}"
