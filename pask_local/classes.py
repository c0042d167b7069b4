"""The structural classes: a fixed, documented enum shared by tagging, policies, calibration and the TUI.

Every token position (prompt or generated) gets exactly one class. Prompt tokens are tagged by the
prompt renderer's spans; generated tokens by the grammar parser state. When a token straddles two
spans of different classes it takes the *more protective* one, i.e. the one that comes first in
``PROTECTION_ORDER`` (names and required parameters before free text and punctuation).
"""

from __future__ import annotations

from enum import StrEnum


class StructuralClass(StrEnum):
    # --- prompt side ---
    SINK = "sink"                      # first tokens / BOS (attention sinks)
    TEMPLATE = "template"              # chat-template and role tokens, fixed instructions
    TOOL_NAME = "tool_name"            # function names in the tool definitions
    PARAM_NAME = "param_name"          # parameter names (optional ones)
    PARAM_REQUIRED = "param_required"  # names of required parameters, wherever they appear
    PARAM_TYPE = "param_type"          # types, enums, defaults, formats
    DESCRIPTION = "description"        # free text in tool definitions
    SCHEMA_PUNCT = "schema_punct"      # JSON syntax and schema keywords in tool definitions
    QUERY = "query"                    # the user's message
    EXAMPLE = "example"                # few-shot examples, if any
    TOOL_RESULT = "tool_result"        # a tool's output returned in the conversation (role "tool")
    # --- generated side ---
    GEN_STRUCT = "gen_struct"          # braces, brackets, commas, colons, quotes
    GEN_NAME = "gen_name"              # the generated function name
    GEN_KEY = "gen_key"                # generated argument keys
    GEN_VALUE_REQUIRED = "gen_value_required"
    GEN_VALUE_OPTIONAL = "gen_value_optional"
    GEN_WS = "gen_ws"                  # whitespace emitted inside the call

    @property
    def is_generated(self) -> bool:
        return self.value.startswith("gen_")


PROMPT_CLASSES: tuple[StructuralClass, ...] = tuple(c for c in StructuralClass if not c.is_generated)
GENERATED_CLASSES: tuple[StructuralClass, ...] = tuple(c for c in StructuralClass if c.is_generated)

# Most protective first. Used to resolve a token that straddles spans of several classes.
PROTECTION_ORDER: tuple[StructuralClass, ...] = (
    StructuralClass.SINK,
    StructuralClass.TOOL_NAME,
    StructuralClass.PARAM_REQUIRED,
    StructuralClass.PARAM_NAME,
    StructuralClass.GEN_NAME,
    StructuralClass.GEN_KEY,
    StructuralClass.GEN_VALUE_REQUIRED,
    StructuralClass.QUERY,
    StructuralClass.TOOL_RESULT,
    StructuralClass.PARAM_TYPE,
    StructuralClass.TEMPLATE,
    StructuralClass.GEN_VALUE_OPTIONAL,
    StructuralClass.GEN_STRUCT,
    StructuralClass.EXAMPLE,
    StructuralClass.DESCRIPTION,
    StructuralClass.SCHEMA_PUNCT,
    StructuralClass.GEN_WS,
)
_RANK = {c: i for i, c in enumerate(PROTECTION_ORDER)}
assert len(_RANK) == len(StructuralClass), "PROTECTION_ORDER must list every class once"


def more_protective(a: StructuralClass, b: StructuralClass) -> StructuralClass:
    """The class that wins when one token straddles spans of classes ``a`` and ``b``."""
    return a if _RANK[a] <= _RANK[b] else b


def class_index(c: StructuralClass) -> int:
    """Stable integer id (enum declaration order), e.g. for numpy arrays of classes."""
    return list(StructuralClass).index(c)
