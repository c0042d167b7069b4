"""Shared BFCL-format test data: one small weather function in BFCL's schema dialect."""

from __future__ import annotations

FN = {"name": "get_weather", "description": "Weather for a city.",
      "parameters": {"type": "dict", "properties": {"city": {"type": "string", "description": "City"},
                                                     "unit": {"type": "string", "enum": ["c", "f"]}},
                     "required": ["city"]}}
