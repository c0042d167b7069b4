"""Loads BFCL cases: the data bundled with the ``bfcl-eval`` package, or any file in BFCL's format.

A BFCL case file holds one JSON object per line (or one JSON array) with ``id``, ``question`` (a
list of turns, each a list of ``{"role", "content"}`` messages) and ``function`` (the tool list,
Gorilla/BFCL schema with ``"type": "dict"``). Possible answers are ``{"id", "ground_truth"}`` objects,
either in the same objects or in a second file. ``Case`` is the harness's view of one entry.

A turn may be a whole conversation in OpenAI's message format, as ``pask-local run --messages``
reads it (``messages.parse_messages``): assistant messages with ``tool_calls`` and ``tool``
results naming them by ``tool_call_id``. It is kept whole and the answer is the next call(s).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import util as importlib_util
from pathlib import Path
from typing import Any

from ..errors import PaskError
from ..messages import Message, MessageError, parse_messages

# Our category names (BFCL v4 naming) in the order tables list them.
CATEGORIES: tuple[str, ...] = (
    "simple_python",
    "multiple",
    "parallel",
    "parallel_multiple",
    "live_simple",
    "live_multiple",
    "live_parallel",
    "live_parallel_multiple",
)
# Older BFCL releases called simple_python "simple".
ALIASES: dict[str, str] = {"simple": "simple_python"}
BFCL_VERSION_PREFIX = "BFCL_v4"


class DataError(PaskError):
    """A dataset file or category is missing or malformed."""


@dataclass(frozen=True)
class Case:
    """One single-turn BFCL entry (its turn may be a conversation with earlier calls and results).

    ``functions`` are the case's own functions (what the checker scores against); ``tools``, when
    set, is what the prompt shows instead (a catalog workload: ``eval.catalog``), ``meta`` what the
    result record notes about it.
    """

    id: str
    category: str
    messages: list[dict[str, Any]]
    functions: list[dict[str, Any]]
    answer: list[dict[str, Any]] | None = field(default=None, compare=False)
    tools: list[dict[str, Any]] | None = field(default=None, compare=False)
    meta: dict[str, Any] | None = field(default=None, compare=False)

    @property
    def request(self) -> str:
        """The user's text (all user messages of the turn, joined)."""
        return "\n".join(m["content"] for m in self.messages if m.get("role") == "user")

    @property
    def system(self) -> str | None:
        texts = [m["content"] for m in self.messages if m.get("role") == "system"]
        return "\n".join(texts) if texts else None

    @property
    def is_conversation(self) -> bool:
        """The turn holds earlier assistant messages or tool results (handed to the model whole)."""
        return any(m.get("role") in ("assistant", "tool") for m in self.messages)

    def conversation(self) -> list[Message]:
        """The turn as typed messages (validated when the case was read)."""
        return parse_messages(self.messages)

    @property
    def prompt_functions(self) -> list[dict[str, Any]]:
        """The tools the prompt shows: the catalog when there is one, else the case's own functions."""
        return self.tools if self.tools is not None else self.functions

    @property
    def checker_category(self) -> str:
        """The category string handed to ``ast_checker`` (it dispatches on 'parallel'/'multiple')."""
        if self.category in CATEGORIES:
            return self.category
        n_answers = len(self.answer or [])
        if n_answers > 1:
            return "parallel_multiple" if len(self.functions) > 1 else "parallel"
        return "multiple" if len(self.functions) > 1 else "simple_python"


def canonical_category(name: str) -> str:
    """Map a user-given category name to ours; DataError for unknown names."""
    key = name.strip()
    key = ALIASES.get(key, key)
    if key not in CATEGORIES:
        raise DataError(f"unknown category {name!r}; choose from {', '.join(CATEGORIES)}")
    return key


def bfcl_data_dir() -> Path:
    """The ``data`` directory of the installed bfcl-eval package (found without importing it)."""
    spec = importlib_util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the bfcl-eval package is not installed (pip install --no-deps bfcl-eval)")
    path = Path(next(iter(spec.submodule_search_locations))) / "data"
    if not path.is_dir():
        raise DataError(f"bfcl-eval has no data directory at {path}")
    return path


def read_records(path: Path) -> list[dict[str, Any]]:
    """JSON objects from a JSONL file or a file holding one JSON array."""
    if not path.is_file():
        raise DataError(f"dataset file not found: {path}")
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            records = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    else:
        records = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
    if not all(isinstance(r, dict) for r in records):
        raise DataError(f"{path}: every entry must be a JSON object")
    return records


def _category_of(case_id: str, default: str) -> str:
    """The bundled category an id belongs to (longest matching prefix), else ``default``."""
    best = ""
    for cat in CATEGORIES:
        if case_id.startswith(cat + "_") and len(cat) > len(best):
            best = cat
    if not best and case_id.startswith("simple_"):
        best = "simple_python"
    return best or default


def _to_case(rec: dict[str, Any], answer: list[dict[str, Any]] | None, category: str, where: str) -> Case:
    for key in ("id", "question", "function"):
        if key not in rec:
            raise DataError(f"{where}: entry lacks {key!r}")
    question = rec["question"]
    if not isinstance(question, list) or not question:
        raise DataError(f"{where}: entry {rec['id']!r} has an empty or malformed 'question'")
    if isinstance(question[0], dict):  # a single turn given as a flat message list
        question = [question]
    if len(question) != 1:
        raise DataError(f"{where}: entry {rec['id']!r} is multi-turn; only single-turn cases are supported")
    messages = _messages(question[0], f"{where}: entry {rec['id']!r}")
    functions = rec["function"]
    if isinstance(functions, dict):
        functions = [functions]
    if not isinstance(functions, list) or not all(isinstance(f, dict) and "name" in f for f in functions):
        raise DataError(f"{where}: entry {rec['id']!r} has a malformed 'function' list")
    return Case(
        id=str(rec["id"]),
        category=category,
        messages=messages,
        functions=functions,
        answer=answer,
    )


def _messages(raw: Any, where: str) -> list[dict[str, Any]]:
    """A turn's messages, validated as ``run --messages`` validates them and normalized to OpenAI
    dicts: role and content, plus ``tool_calls`` / ``tool_call_id`` where a conversation has them."""
    if not isinstance(raw, list) or not all(isinstance(m, dict) for m in raw):
        raise DataError(f"{where}: a turn must be a list of message objects")
    if not all("role" in m and ("content" in m or m.get("role") == "assistant") for m in raw):
        raise DataError(f"{where}: has messages without role/content")
    # parse_messages says "references call id ..." for this too; name the actual mistake
    for i, m in enumerate(raw):
        if m.get("role") == "tool" and not any(p.get("role") == "assistant" and p.get("tool_calls")
                                                for p in raw[:i]):
            raise DataError(f"{where}: messages[{i}]: a tool result with no earlier assistant 'tool_calls'")
    try:
        parsed = parse_messages(raw)
    except MessageError as exc:
        raise DataError(f"{where}: {exc}") from None
    out: list[dict[str, Any]] = []
    for m in parsed:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            d["tool_calls"] = [c.to_openai() for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def load_bundled(category: str) -> list[Case]:
    """All cases of one bundled BFCL category, with their possible answers."""
    cat = canonical_category(category)
    root = bfcl_data_dir()
    questions = read_records(root / f"{BFCL_VERSION_PREFIX}_{cat}.json")
    answers = read_records(root / "possible_answer" / f"{BFCL_VERSION_PREFIX}_{cat}.json")
    by_id = {str(a["id"]): a.get("ground_truth") for a in answers}
    cases = []
    for rec in questions:
        case_id = str(rec.get("id"))
        if case_id not in by_id:
            raise DataError(f"bfcl-eval data: no possible answer for {case_id}")
        cases.append(_to_case(rec, by_id[case_id], cat, f"bfcl-eval {cat}"))
    return cases


def load_file(path: Path, answers_path: Path | None = None) -> list[Case]:
    """Cases from a user file in BFCL's format; answers inline (``ground_truth``) or in ``answers_path``.

    A case's category comes from its ``category`` field, else from a BFCL id prefix
    (``live_multiple_3-1-0``), else ``custom`` (scored by the checker branch its answer's shape implies).
    """
    records = read_records(path)
    answers: dict[str, Any] = {}
    if answers_path is not None:
        for rec in read_records(answers_path):
            if "id" not in rec or "ground_truth" not in rec:
                raise DataError(f"{answers_path}: every entry needs 'id' and 'ground_truth'")
            answers[str(rec["id"])] = rec["ground_truth"]
    cases = []
    seen: set[str] = set()
    for rec in records:
        case_id = str(rec.get("id"))
        if case_id in seen:
            raise DataError(f"{path}: duplicate id {case_id!r}")
        seen.add(case_id)
        answer = rec.get("ground_truth", answers.get(case_id))
        category = str(rec.get("category") or _category_of(case_id, "custom"))
        cases.append(_to_case(rec, answer, category, str(path)))
    if not cases:
        raise DataError(f"{path}: no cases")
    return cases


def load_cases(categories: list[str] | None, dataset: Path | None = None,
               answers: Path | None = None) -> list[Case]:
    """The cases to evaluate: bundled categories, or a user dataset filtered by ``categories``."""
    if dataset is None:
        cats = [canonical_category(c) for c in (categories or list(CATEGORIES))]
        return [case for cat in dict.fromkeys(cats) for case in load_bundled(cat)]
    cases = load_file(dataset, answers)
    if categories:
        wanted = {ALIASES.get(c, c) for c in categories}
        cases = [c for c in cases if c.category in wanted]
        if not cases:
            raise DataError(f"{dataset}: no cases in categories {', '.join(sorted(wanted))}")
    missing = [c.id for c in cases if c.answer is None]
    if missing:
        raise DataError(f"{dataset}: no possible answer for {len(missing)} case(s), e.g. {missing[0]!r}")
    return cases
