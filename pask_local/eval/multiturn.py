"""BFCL multi-turn conversations run in-process: the model calls, bfcl-eval's environments answer.

For each turn of a conversation (``multiturn_env.Conversation``) the turn's user message(s) join
the history; the model (a ``Caller``) is asked with the tools of the case (BFCL's function docs of
the involved classes as OpenAI tools; miss_func's held-out functions join at the turn BFCL names,
with BFCL's own "I have updated some more functions..." user message); every call it returns is
executed in-process on the conversation's environment instances through bfcl-eval's executor and
its result fed back as a ``tool`` message (OpenAI format: the assistant message with
``tool_calls``, then one ``tool`` message per call with its ``tool_call_id``); the step repeats until
the model answers without a call. As in BFCL's runner, a turn is force-quit when its steps exceed
``max_steps`` (BFCL's ``MAXIMUM_STEP_LIMIT``, 20), which ends the conversation (scored invalid).

A call that raises in the environment comes back as BFCL's "Error during execution: ..." text; a
call whose name is not among the tools offered at that turn, or whose arguments are not a JSON
object of identifier keys, is not executed and comes back as an error text too (this differs
from BFCL's runner in one case: a miss_func call to a held-out function before it is offered is
refused here, where BFCL would run it). Nothing a model returns can crash the loop; a caller that
raises ``PaskError`` (a prompt past the context) ends that conversation with ``error`` recorded.

Scores (``multiturn_env``): ``correct`` is BFCL's ``multi_turn_checker`` on the whole
conversation (state and execution results against the ground truth). ``turn_correct`` is a
per-turn verdict judged from where the model stood: before each turn the model's environment is
copied and the turn's ground-truth calls run on the copy; after the model's turn its instances
must equal the copy's (BFCL's ``state_checker``) and its execution results must contain the
ground truth's (``response_checker``). An early mistake thus does not fail every later turn, which
makes the turn accuracy the more sensitive figure on small models. Turns whose ground truth is
empty are correct when the model made no call; turns never run (after a force-quit) are wrong.

Records: one JSON object per conversation in ``OUT/cases.jsonl`` (``eval.store.ResultStore``:
rerunning skips recorded ids, ``run.json`` refuses mixed settings). ``n_tool_errors`` counts the
calls that raised or were refused (an environment's own ``{"error": ...}`` answers are not counted).
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import PaskError
from .multiturn_env import (
    MULTI_TURN_CATEGORIES,
    Conversation,
    Environment,
    MultiTurnError,
    call_string,
    check_categories,
    load_conversations,
    new_run_name,
    release,
    score_conversation,
    score_turn,
)

Caller = Callable[[list[dict[str, Any]], list[dict[str, Any]]], dict[str, Any]]
"""(OpenAI messages, OpenAI tools) -> an OpenAI assistant message ``{"role", "content", "tool_calls"?}``.

Two optional extra keys are read and never put into the history: ``usage``
(``{"prompt_tokens", "completion_tokens"}``) and ``error`` (why a reply holds no call, e.g. output
that is not a valid call)."""

ERROR_PREFIX = "Error during execution: "   # BFCL's executor's prefix, so models see one error style


def step_limit() -> int:
    """BFCL's step limit per turn (``MAXIMUM_STEP_LIMIT``)."""
    from bfcl_eval.constants.default_prompts import MAXIMUM_STEP_LIMIT

    return int(MAXIMUM_STEP_LIMIT)


def added_functions_prompt() -> str:
    """The user message BFCL sends at a miss_func turn, when the held-out functions are added."""
    from bfcl_eval.constants.default_prompts import DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC

    return str(DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC)


def openai_tools(functions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """BFCL function docs (Gorilla schema, ``"type": "dict"``) as OpenAI tools, converted by BFCL's own
    ``convert_to_tool`` as its OpenAI-compatible handler sends them (float parameters, for one, gain
    "This is a float type value." and ``"format": "float"``), then normalised as ``pask-local run``
    and the server normalise tools (``schema.tools``): a model sees the prompt BFCL's runner gives it."""
    import copy

    from bfcl_eval.constants.enums import ModelStyle
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
    from bfcl_eval.model_handler.utils import convert_to_tool

    from ..schema.tools import as_tools
    from ..tagging.native import openai_tool

    converted = convert_to_tool(copy.deepcopy(functions), GORILLA_TO_OPENAPI, ModelStyle.OPENAI_COMPLETIONS)
    return [openai_tool(t) for t in as_tools(converted)]


def select_conversations(categories: list[str], split: str = "all", limit: int | None = None,
                         ids: list[str] | None = None) -> list[Conversation]:
    """Conversations of ``categories`` in ``split`` (``eval.split``: by hashed id), at most ``limit``
    per category, or exactly ``ids`` (each must exist)."""
    from .split import select

    cats = check_categories(categories)
    if limit is not None and limit < 1:
        raise MultiTurnError(f"--limit must be at least 1, got {limit}")
    out: list[Conversation] = []
    for cat in cats:
        convs = select(load_conversations(cat), split)
        if ids is not None:
            convs = [c for c in convs if c.id in ids]
        out.extend(convs[:limit] if limit is not None else convs)
    if ids is not None:
        missing = sorted(set(ids) - {c.id for c in out})
        if missing:
            raise MultiTurnError(f"no conversation {missing[0]!r} in {', '.join(cats)} (split {split})")
    return out


# ----------------------------------------------------------------- one step


def _arguments(raw: Any) -> tuple[dict[str, Any] | None, str | None]:
    """A tool call's arguments (an OpenAI JSON string or an object) -> (object, error text)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw or "{}")
        except json.JSONDecodeError as exc:
            return None, f"arguments are not valid JSON ({exc.msg})"
    if not isinstance(raw, dict):
        return None, "arguments must be a JSON object"
    return raw, None


def _reply(raw: Any, turn: int, step: int, used: set[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the assistant message for the history, its calls as {id, name, arguments, error}).

    Calls get an id when the caller gave none or reused one (``used``: the conversation's ids);
    arguments that are not a JSON object are kept out of the history (as ``{}``): the next request
    must stay a valid conversation."""
    if not isinstance(raw, dict):
        raise MultiTurnError(f"the caller returned {type(raw).__name__}, not an assistant message dict")
    content = raw.get("content")
    content = content if isinstance(content, str) else None
    calls: list[dict[str, Any]] = []
    wire: list[dict[str, Any]] = []
    for j, tc in enumerate(raw.get("tool_calls") or []):
        fn = tc.get("function") if isinstance(tc, dict) else None
        fn = fn if isinstance(fn, dict) else {}
        name = fn.get("name")
        name = name if isinstance(name, str) else str(name)
        call_id = tc.get("id") if isinstance(tc, dict) else None
        if not isinstance(call_id, str) or not call_id or call_id in used:
            call_id = f"call_t{turn}s{step}c{j}"
        used.add(call_id)
        args, error = _arguments(fn.get("arguments", "{}"))
        calls.append({"id": call_id, "name": name, "arguments": args, "error": error})
        wire.append({"id": call_id, "type": "function",
                     "function": {"name": name, "arguments": json.dumps(args if args is not None else {},
                                                                        ensure_ascii=False)}})
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if wire:
        msg["tool_calls"] = wire
    elif content is None:
        msg["content"] = ""   # an empty reply still is a message: keep the history valid
    return msg, calls


def execute_step(env: Environment, calls: list[dict[str, Any]], allowed: set[str]
                 ) -> tuple[list[str], list[str], list[bool]]:
    """Run one step's calls in order: (the call strings executed, one result text per call, which ran).

    A call that cannot be executed (unknown name, bad arguments) gets an error text and is not run;
    the others run in one batch through BFCL's executor, as BFCL runs a step's calls."""
    results: list[str | None] = []
    batch: list[str] = []
    for c in calls:
        if c["error"] is not None:
            results.append(f"{ERROR_PREFIX}{c['error']} (call to '{c['name'][:60]}')")
        elif c["name"] not in allowed:
            results.append(f"{ERROR_PREFIX}unknown function '{c['name'][:60]}': it is not among the tools offered")
        else:
            try:
                batch.append(call_string(c["name"], c["arguments"]))
                results.append(None)
            except MultiTurnError as exc:
                results.append(f"{ERROR_PREFIX}{exc}")
    done = iter(env.execute(batch) if batch else [])
    return batch, [r if r is not None else next(done) for r in results], [r is None for r in results]


# ----------------------------------------------------------------- one conversation


def run_conversation(conv: Conversation, caller: Caller, max_steps: int | None = None,
                     max_turns: int | None = None) -> dict[str, Any]:
    """Play one conversation with ``caller`` and score it; the record (module docstring).

    ``max_turns`` plays only the first turns (smoke runs): both scores then use those turns only.
    """
    limit = step_limit() if max_steps is None else max_steps
    if limit < 1:
        raise MultiTurnError(f"max steps must be at least 1, got {limit}")
    n_turns = len(conv.turns) if max_turns is None else min(max_turns, len(conv.turns))
    if n_turns < 1:
        raise MultiTurnError(f"max turns must be at least 1, got {max_turns}")
    t0 = time.perf_counter()
    name = new_run_name()
    messages: list[dict[str, Any]] = []
    functions = list(conv.functions)
    decoded: list[list[list[str]]] = []
    turns: list[dict[str, Any]] = []
    results_so_far: list[str] = []
    totals = {"prompt_tokens": 0, "gen_tokens": 0, "n_steps": 0, "n_calls": 0, "n_tool_errors": 0}
    force_quit = False
    error: str | None = None
    used_ids: set[str] = set()
    try:
        env = Environment(conv, name)
        for k in range(n_turns):
            user = conv.turns[k]
            if k in conv.held_out:
                functions = functions + conv.held_out[k]
                # BFCL's runner: a held-out turn has no user message of its own; this one announces the functions
                user = user or [{"role": "user", "content": added_functions_prompt()}]
            if not user:
                raise MultiTurnError(f"{conv.id}: turn {k} has no user message")
            tools = openai_tools(functions)
            allowed = {t["function"]["name"] for t in tools}
            messages.extend({"role": m["role"], "content": m["content"]} for m in user)
            truth = conv.ground_truth[k]
            expected = env.fork(f"{name}_turn{k}") if truth else None
            expected_results = expected.execute(truth) if expected is not None else []
            steps: list[list[str]] = []
            turn_rec: dict[str, Any] = {"calls": [], "results_errors": 0, "replies": []}
            count = 0
            while True:
                try:
                    raw = caller(copy.deepcopy(messages), tools)
                except PaskError as exc:
                    error = f"{type(exc).__name__}: {exc}"
                    break
                usage = raw.get("usage") if isinstance(raw, dict) else None
                if isinstance(usage, dict):
                    totals["prompt_tokens"] += int(usage.get("prompt_tokens") or 0)
                    totals["gen_tokens"] += int(usage.get("completion_tokens") or 0)
                msg, calls = _reply(raw, k, count, used_ids)
                messages.append(msg)
                totals["n_steps"] += 1
                reply_error = raw.get("error")
                turn_rec["replies"].append({"content": (msg["content"] or "")[:200], "n_calls": len(calls),
                                            **({"error": str(reply_error)[:200]} if reply_error else {})})
                if not calls:
                    break  # BFCL: a reply without a call ends the turn
                executed, results, ran = execute_step(env, calls, allowed)
                for c, res in zip(calls, results, strict=True):
                    messages.append({"role": "tool", "tool_call_id": c["id"], "content": res})
                errors = sum(r.startswith(ERROR_PREFIX) for r in results)
                turn_rec["results_errors"] += errors
                totals["n_tool_errors"] += errors
                totals["n_calls"] += len(calls)
                turn_rec["calls"].append([{"name": c["name"], "arguments": c["arguments"]} for c in calls])
                if executed:
                    steps.append(executed)
                    results_so_far.extend(r for r, was_run in zip(results, ran, strict=True) if was_run)
                count += 1
                if count > limit:
                    force_quit = True
                    break
            decoded.append(steps)
            turn_rec["executed"] = steps
            turn_rec["n_steps"] = count
            turn_rec["correct"] = (error is None and
                                   score_turn(k, conv, env, expected, expected_results, steps, results_so_far))
            turns.append(turn_rec)
            if force_quit or error is not None:
                break
        scored = conv if n_turns == len(conv.turns) else _first_turns(conv, n_turns)
        verdict = score_conversation(scored, decoded, name) if error is None else \
            {"valid": False, "error_type": "multi_turn:caller_error", "error_message": error}
    finally:
        release(name)
    turn_correct = [t["correct"] for t in turns] + [False] * (n_turns - len(turns))
    return {
        "id": conv.id, "category": conv.category,
        "correct": bool(verdict.get("valid")), "turn_correct": turn_correct,
        "n_turns": n_turns, "n_turns_run": len(turns), **totals,
        "seconds": round(time.perf_counter() - t0, 3), "force_quit": force_quit, "error": error,
        "checker": {k: verdict[k] for k in ("error_type", "error_message") if k in verdict},
        "turns": turns,
    }


def _first_turns(conv: Conversation, n: int) -> Conversation:
    import dataclasses

    return dataclasses.replace(conv, turns=conv.turns[:n], ground_truth=conv.ground_truth[:n])


# ----------------------------------------------------------------- many conversations


def run_multiturn(conversations: list[Conversation], caller: Caller, out: Path, method: str = "custom",
                  budget: float | None = None, settings: dict[str, Any] | None = None,
                  max_steps: int | None = None, max_turns: int | None = None,
                  log: Callable[[str], None] | None = print) -> list[dict[str, Any]]:
    """Run every conversation not yet recorded in ``out`` and return the records of all of them.

    ``method``/``budget`` key the records (``ResultStore``); ``settings`` (model, protocol, ...)
    go into ``run.json``, which a later run with other settings may not reuse.
    """
    from importlib import metadata

    from .store import ResultStore, record_key

    limit = step_limit() if max_steps is None else max_steps
    manifest = {"kind": "bfcl_multi_turn", "bfcl_eval": metadata.version("bfcl-eval"), "max_steps": limit,
                "max_turns": max_turns, **(settings or {})}
    store = ResultStore(out, manifest)
    records = []
    todo = [c for c in conversations if not store.done(c.id, method, budget)]
    if log and len(todo) < len(conversations):
        log(f"resuming: {len(conversations) - len(todo)} conversation(s) already in {store.path}")
    for i, conv in enumerate(conversations, 1):
        if store.done(conv.id, method, budget):
            records.append(store.records[record_key(conv.id, method, budget)])
            continue
        rec = {**run_conversation(conv, caller, limit, max_turns), "method": method, "budget": budget}
        store.add(rec)
        records.append(rec)
        if log:
            turns = sum(bool(t) for t in rec["turn_correct"])
            log(f"[{i}/{len(conversations)}] {conv.id}: {'correct' if rec['correct'] else 'wrong'}, "
                f"turns {turns}/{rec['n_turns']}, steps {rec['n_steps']}, calls {rec['n_calls']} "
                f"({rec['n_tool_errors']} errors), {rec['prompt_tokens']}+{rec['gen_tokens']} tokens, "
                f"{rec['seconds']:.1f} s" + (f", {rec['error']}" if rec["error"] else "")
                + (", force-quit" if rec["force_quit"] else ""))
    return records


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per category (and ``all``): conversations, conversation accuracy, per-turn accuracy, means."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(r["category"], []).append(r)
    order = [c for c in MULTI_TURN_CATEGORIES if c in groups] + sorted(set(groups) - set(MULTI_TURN_CATEGORIES))
    if len(order) > 1:
        groups["all"] = list(records)
        order.append("all")

    def stats(rs: list[dict[str, Any]]) -> dict[str, Any]:
        n = len(rs)
        turns = [t for r in rs for t in r["turn_correct"]]
        return {
            "conversations": n,
            "accuracy": sum(r["correct"] for r in rs) / n if n else 0.0,
            "turns": len(turns),
            "turn_accuracy": sum(bool(t) for t in turns) / len(turns) if turns else 0.0,
            "mean_steps": sum(r["n_steps"] for r in rs) / n if n else 0.0,
            "tool_errors": sum(r["n_tool_errors"] for r in rs),
            "force_quit": sum(bool(r["force_quit"]) for r in rs),
            "errors": sum(r["error"] is not None for r in rs),
            "prompt_tokens": sum(r["prompt_tokens"] for r in rs),
            "gen_tokens": sum(r["gen_tokens"] for r in rs),
            "seconds": round(sum(r["seconds"] for r in rs), 3),
        }

    return {"categories": {c: stats(groups[c]) for c in order}}


def markdown(summary: dict[str, Any]) -> str:
    """The summary as a small markdown table."""
    lines = ["| category | conversations | conversation acc. | turns | per-turn acc. | mean steps |",
             "|---|---:|---:|---:|---:|---:|"]
    for cat, s in summary["categories"].items():
        lines.append(f"| {cat} | {s['conversations']} | {100 * s['accuracy']:.1f}% | {s['turns']} | "
                     f"{100 * s['turn_accuracy']:.1f}% | {s['mean_steps']:.1f} |")
    return "\n".join(lines)


# ----------------------------------------------------------------- the engine as a caller


class EngineCaller:
    """A ``Caller`` on the in-process KV engine, the path ``pask-local run --messages`` takes:
    ``Engine.prepare``/``execute`` with the conversation, the tools and tool_choice auto, parallel
    calls allowed; the reply is ``EngineResult.message`` in OpenAI's shape."""

    def __init__(self, engine: Any, pool: Any = None) -> None:
        self.engine = engine
        self.pool = pool  # a one-slot ``SlotPool``: each step reuses the previous step's prompt (exact reuse)

    def __call__(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
        prepared = self.engine.prepare(messages, tools, "auto", parallel=True)
        res = self.engine.execute(prepared) if self.pool is None else self.pool.execute(self.engine, prepared)
        msg = res.message.to_openai()
        msg["usage"] = {"prompt_tokens": int(res.stats.get("n_prompt", len(res.prompt.tokens))),
                        "completion_tokens": int(res.stats.get("n_gen", len(res.tokens)))}
        if res.error:
            msg["error"] = res.error
        return msg


def engine_caller(gguf: Path, method: str = "full", budget: float = 0.33, max_tokens: int = 256,
                  prompt_style: str = "native", ngl: int = 0, flash_attn: bool = False, kv_type: str = "f16",
                  hysteresis: float = 0.02, policy: Path | None = None,
                  reuse_len: int = 0) -> tuple[EngineCaller, Callable[[], None]]:
    """(an ``EngineCaller`` for ``gguf`` with ``method`` at ``budget``, the function that frees the model).

    The model must have its own tool-call protocol (native): under the instruction prompt every
    reply is a call, so a turn could only end at the step limit. ``reuse_len`` > 0: the steps run in
    a one-slot pool of that many tokens with exact prefix reuse (``pask-local serve --slots 1``'s
    path: a step prefills only what its prompt adds to the previous one, with outputs equal to a
    fresh prefill's); 0: each step in a fresh context."""
    from ..chat.protocol import resolve_style
    from ..engine import Engine, EngineConfig, make_method
    from ..llm import Model
    from ..methods.registry import POLICY_METHODS
    from .prompting import ENGINE_STYLES, check_prompt_style

    check_prompt_style(prompt_style)
    model = Model(gguf, n_gpu_layers=ngl)
    try:
        _, fmt = resolve_style(model, ENGINE_STYLES[prompt_style])
        if fmt is None:
            raise MultiTurnError("multi-turn needs a model with its own tool-call protocol (e.g. --model "
                                 "qwen2.5-coder-1.5b): under the instruction prompt every reply is a call")
        m = make_method(method, model, policy if method in POLICY_METHODS else None)
        engine = Engine(model, m, EngineConfig(budget=budget, max_tokens=max_tokens,
                                               style=ENGINE_STYLES[prompt_style], flash_attn=flash_attn,
                                               kv_type=kv_type, hysteresis=hysteresis))
        pool = None
        if reuse_len > 0:
            from ..engine.pool import SlotPool

            slot_len = min(reuse_len, model.n_ctx_train)
            pool = SlotPool(model, SlotPool.layout_for(model, m, budget, slot_len, slots=1, kv_type=kv_type),
                            flash_attn=flash_attn, reuse="exact")
    except BaseException:
        model.close()
        raise

    def close() -> None:
        if pool is not None:
            pool.close()
        model.close()

    return EngineCaller(engine, pool), close
