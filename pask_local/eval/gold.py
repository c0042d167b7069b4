"""A case's gold call as the call grammar emits it: argument keys in the grammar's order, the call JSON
(a list with parallel calls), inside the native call blocks when the plan has a native format.

Used by the fidelity runs (``eval.fidelity``) and by calibration (``pask_local.calibration.cases``);
``CaseSkipped`` says why a gold call cannot be written (an unknown tool, a call count that does not fit).
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import PaskError
from ..schema.tools import ToolSpec


class CaseSkipped(PaskError):
    """A case's gold call cannot be written for this plan, so the case cannot be teacher-forced (the message says why)."""


def order_like_schema(value: Any, schema: dict[str, Any]) -> Any:
    """``value`` with object keys in the grammar's order (required first, then optional, schema order)."""
    if isinstance(value, dict) and isinstance(schema.get("properties"), dict):
        props = schema["properties"]
        req = [k for k in props if k in schema.get("required", [])]
        opt = [k for k in props if k not in req]
        keys = [k for k in req + opt if k in value] + [k for k in value if k not in props]
        return {k: order_like_schema(value[k], props.get(k, {})) for k in keys}
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [order_like_schema(v, schema["items"]) for v in value]
    return value


def ordered_calls(tools: list[ToolSpec], calls: list[dict[str, Any]], parallel: bool) -> list[dict[str, Any]]:
    """``calls`` with arguments in the grammar's key order (exactly one unless ``parallel``)."""
    by_name = {t.name: t for t in tools}
    out = []
    for call in calls:
        tool = by_name.get(call["name"])
        if tool is None:
            raise CaseSkipped(f"gold call names an unknown tool {call['name']!r}")
        out.append({"name": call["name"], "arguments": order_like_schema(call["arguments"], tool.parameters)})
    if not parallel and len(out) != 1:
        raise CaseSkipped(f"{len(out)} gold calls for a single-call case")
    return out


def gold_call_text(tools: list[ToolSpec], calls: list[dict[str, Any]], parallel: bool) -> str:
    """The JSON text our grammar emits for ``calls`` (a list when ``parallel``)."""
    out = ordered_calls(tools, calls, parallel)
    return json.dumps(out if parallel else out[0], ensure_ascii=False)


def plan_gold_text(plan: Any, calls: list[dict[str, Any]], parallel: bool) -> str:
    """The text the plan's grammar emits for ``calls``: the call JSON, inside the native call blocks
    when the plan has a native call format."""
    if plan.fmt is None:
        return gold_call_text(plan.tools, calls, parallel)
    items = ordered_calls(plan.tools, calls, parallel)
    return plan.fmt.sep.join(plan.fmt.block(json.dumps(c, ensure_ascii=False)) for c in items)
