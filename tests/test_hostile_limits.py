"""Limits on hostile sizes (docs/limits.md): a 1,000-tool list, a schema 50 levels deep, a 1 MB
description, a huge enum, too many schema nodes, a deeply nested or oversized JSON text, and a
request longer than the context all end in a one-line error in bounded time; inputs at the
limits still build a grammar llama.cpp accepts."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from conftest import REPO, run_cli

from pask_local.errors import SchemaError
from pask_local.schema import tools as T
from pask_local.schema.gbnf import build_grammar
from pask_local.schema.tools import load_tools, parse_tools, read_tools


def tool(name: str, params: dict | None = None, desc: str = "d") -> dict:
    return {"type": "function", "function": {"name": name, "description": desc,
                                             "parameters": params or {"type": "object", "properties": {}}}}


def nested(depth: int) -> dict:
    node: dict = {"type": "string"}
    for _ in range(depth):
        node = {"type": "object", "properties": {"x": node}, "required": ["x"]}
    return node


def _refused(data, fragment: str, seconds: float = 2.0) -> str:
    """Refused with one line, within ``seconds`` of this process's CPU time (other processes' load does
    not count: the bound is on the work a hostile input can cause)."""
    t0 = time.process_time()
    with pytest.raises(SchemaError) as err:
        load_tools(data)
    assert time.process_time() - t0 < seconds
    msg = str(err.value)
    assert fragment in msg and "\n" not in msg and len(msg) < 300, msg
    return msg


def test_a_thousand_tools() -> None:
    _refused([tool(f"f{i}") for i in range(1000)], "1000 tools given, at most 256")


def test_schema_fifty_levels_deep() -> None:
    _refused([tool("f", nested(50))], f"nested more than {T.MAX_DEPTH} levels deep")


def test_one_megabyte_descriptions() -> None:
    big = "x" * (1 << 20)
    _refused([tool("f", desc=big)], "description of tool 'f'")
    _refused([tool("f", {"type": "object", "properties": {"a": {"type": "string", "description": big}}})],
             "'description' at $[0].function.parameters.properties.a is longer than 65536 bytes")
    _refused([tool("f", {"type": "object", "properties": {"a": {"type": "string", "default": big}}})], "'default'")


def test_huge_enum_and_too_many_properties_and_nodes() -> None:
    _refused([tool("f", {"type": "object", "properties": {"a": {"enum": list(range(100_000))}}})],
             "has 100000 values (at most 1024)")
    _refused([tool("f", {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1000)}})],
             "has 1000 entries (at most 256)")
    many = [tool(f"f{i}", {"type": "object", "properties": {f"p{j}": {"type": "integer"} for j in range(200)}})
            for i in range(30)]
    _refused(many, f"more than {T.MAX_NODES} nodes", seconds=0.5)  # refused before any meta-schema check
    _refused([tool("f", {"type": "object", "properties": {"k" * 300: {"type": "integer"}}})], "a property name")


def test_deep_or_oversized_json_text(tmp_path: Path) -> None:
    with pytest.raises(SchemaError, match="nested too deeply"):
        parse_tools("[" * 200_000 + "]" * 200_000)
    big = tmp_path / "big.json"
    big.write_text(json.dumps([tool("f", desc="x" * 1000)] * 10_000))
    assert big.stat().st_size > T.MAX_INPUT_BYTES
    with pytest.raises(SchemaError, match="larger than 8 MiB"):
        read_tools(big)
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00[")
    with pytest.raises(SchemaError, match="not UTF-8"):
        read_tools(tmp_path / "bin.json")


def test_inputs_at_the_limits_build_a_grammar_llama_accepts(synthetic_vocab) -> None:
    from pask_local.grammar.state import GrammarState

    t0 = time.perf_counter()
    specs = load_tools([tool(f"f{i}", {"type": "object", "properties": {"a": {"type": "integer"}}})
                        for i in range(T.MAX_TOOLS)])
    deep = load_tools([tool("g", nested(T.MAX_DEPTH)),
                       tool("h", {"type": "object", "properties": {"e": {"enum": [f"v{i}" for i in range(T.MAX_ENUM)]}}},
                            desc="y" * T.MAX_TEXT_BYTES)])
    for s in (specs, deep):
        g = build_grammar(s)
        GrammarState(synthetic_vocab.vocab, g.text).close()
    assert time.perf_counter() - t0 < 30


@pytest.fixture(scope="module")
def synthetic_vocab(tmp_path_factory):
    from pask_local.calibration.synthetic import write_synthetic_gguf

    from pask_local.llm import Model

    path = tmp_path_factory.mktemp("lim") / "tiny.gguf"
    write_synthetic_gguf(path, arch="qwen3", n_layer=1)
    return Model(path)


@pytest.mark.slow
def test_cli_limits_one_line(tmp_path: Path) -> None:
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([tool(f"f{i}") for i in range(1000)]))
    msgs = tmp_path / "long.json"
    msgs.write_text(json.dumps([{"role": "user", "content": "word " * 60_000}]))
    for args, fragment in ((["--schema", str(tools), "hi"], "1000 tools given"),
                           (["--schema", str(REPO / "examples" / "get_weather.json"), "--messages", str(msgs)],
                            "context")):
        t0 = time.perf_counter()
        proc = run_cli("run", "--method", "full", *args, timeout=300, env={"PASK_THREADS": "1"})
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode > 0 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
        assert fragment in lines[0] and "Traceback" not in proc.stderr
        assert time.perf_counter() - t0 < 120
