"""Compress once, reuse every turn: sequence state, prefix files, `compress`, `run --prefix`, `serve --prefix`.

Oracles: a restored stream continues exactly as the stream it was saved from (the same next-token
logits, bit for bit: upstream's own continuation), and holds the positions its header lists; a
Full KV prefix restored and continued gives the call a fresh run gives. Every damaged or foreign
file is refused with its one line, never used.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import openai
import pytest
from serve_helpers import WEATHER_TIME_TOOLS as TOOLS
from serve_helpers import serve_in_thread

from pask_local.engine.prefix_cache import Pinned, PrefixCache
from pask_local.errors import PaskError
from pask_local.prefix import state as kv_state
from pask_local.prefix.file import MAGIC, VERSION, PrefixFileError, PrefixHeader, read, write

QUESTION = "What is the weather in Paris in celsius?"


# ------------------------------------------------------------------ the prefix cache (no model)
def _pinned(tokens, method="pask-prior", budget=0.33):
    return Pinned(tuple(tokens), method, budget, lambda ctx, seq: None)


def test_pinned_prefix_serves_matching_requests_only():
    cache = PrefixCache(reuse="exact", min_reuse=4, chunk=4)
    short, long_ = _pinned(range(10)), _pinned(range(20))
    cache.pin(short)
    cache.pin(long_)
    start = cache.lookup(list(range(30)), [0, 1], method="pask-prior", budget=0.33)
    assert start.pinned is long_ and start.reuse == 20
    assert cache.lookup(list(range(15)), [0], method="pask-prior", budget=0.33).pinned is short
    # another method or budget, a prompt that does not go past the prefix, or that differs inside it
    assert cache.lookup(list(range(30)), [0], method="streaming", budget=0.33).pinned is None
    assert cache.lookup(list(range(30)), [0], method="pask-prior", budget=0.2).pinned is None
    assert cache.lookup(list(range(10)), [0], method="pask-prior", budget=0.33).pinned is None
    assert cache.lookup([0, 1, 2, 9, 4, 5, 6, 7, 8, 9, 10, 11], [0], method="pask-prior",
                        budget=0.33).pinned is None


def test_a_longer_held_full_prefix_beats_a_pinned_one():
    cache = PrefixCache(reuse="exact", min_reuse=4, chunk=4)
    cache.pin(_pinned(range(8), method="full", budget=None))
    cache.hold(1, list(range(24)))
    start = cache.lookup(list(range(30)), [0, 1], full=True, method="full", budget=None)
    assert start.pinned is None and start.seq == 1 and start.reuse == 24


# ------------------------------------------------------------------ the file format (no model)
def _header(n: int = 43, n_layer: int = 4, **changes) -> PrefixHeader:
    """A header with several classes and sparse, different kept sets per layer (n not a multiple of 8)."""
    names = ["sink", "template", "tool_name", "param_name", "description"]
    kept = [[0, 1, n - 1], [], list(range(n)), list(range(2, n, 3))][:n_layer]
    h = PrefixHeader(model_sha256="a" * 64, model_name="m.gguf", n_layer=n_layer, upstream="0.3.36",
                     template_sha256="b" * 64, style="native", tools_sha256="c" * 64, system_sha256="d" * 64,
                     method="pask-prior", budget=0.33, policy_sha256=None, kv_type="q8_0",
                     tokens=[(7919 * i) % 151_000 for i in range(n - 1)] + [2**32 - 1],
                     classes=[names[(i * i) % len(names)] for i in range(n)], kept=kept, state_kind="layered",
                     extra={"tools": ["get_weather"]})
    return dataclasses.replace(h, **changes)


def _frame(path: Path, head: dict | bytes, state: bytes, version: int = VERSION) -> Path:
    """A prefix file with this header JSON (as given, unchecked), state and version, and a valid checksum."""
    raw = head if isinstance(head, bytes) else json.dumps(head).encode("utf-8")
    body = MAGIC + struct.pack("<IQ", version, len(raw)) + raw + struct.pack("<Q", len(state)) + state
    path.write_bytes(body + hashlib.sha256(body).digest())
    return path


def _parts(path: Path) -> tuple[dict, bytes]:
    """(the header JSON as stored, the state) of a prefix file."""
    data = path.read_bytes()
    (n_head,) = struct.unpack_from("<Q", data, len(MAGIC) + 4)
    at = len(MAGIC) + 12
    return json.loads(data[at:at + n_head]), data[at + n_head + 8:-32]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def test_header_round_trips_through_its_packed_form(tmp_path):
    header = _header()
    path = tmp_path / "h.pkv"
    write(path, header, bytes(200))
    got, state = read(path, 10**6)
    assert got == header and state == bytes(200)
    raw, _ = _parts(path)
    assert isinstance(raw["tokens"], str) and len(base64.b64decode(raw["tokens"])) == 4 * 43
    assert sorted(raw["classes"]["names"]) == sorted(set(header.classes))
    assert [len(base64.b64decode(b)) for b in raw["kept"]] == [6] * 4  # ceil(43 / 8)
    assert base64.b64decode(raw["kept"][0]) == bytes([0b11, 0, 0, 0, 0, 0b100])  # positions 0, 1, 42
    # positions come back ascending, whatever order they were given in
    write(path, dataclasses.replace(header, kept=[[42, 0, 1], [], list(range(43))[::-1], [5]]), bytes(200))
    assert read(path, 10**6)[0].kept == [[0, 1, 42], [], list(range(43)), [5]]


def test_headers_no_file_can_hold_are_not_written(tmp_path):
    path = tmp_path / "h.pkv"
    for changes in ({"kept": [[43], [], [], []]}, {"kept": [[1, 1], [], [], []]},
                    {"kept": [[-1], [], [], []]}, {"tokens": [2**32] + list(range(42))},
                    {"classes": ["sink"] * 42}):
        with pytest.raises(ValueError):
            write(path, _header(**changes), b"")
    with pytest.raises(ValueError, match="more than 255"):
        write(path, _header(n=300, classes=[f"c{i}" for i in range(256)] + ["c0"] * 44,
                            tokens=list(range(300)), kept=[[]] * 4), b"")
    assert not path.exists()


def _malformed(raw: dict) -> list[tuple[str, dict]]:
    """Every way the packed fields can be wrong: (the reason read gives, the changes to ``raw``);
    n = 43, 4 layers."""
    names, b64codes = raw["classes"]["names"], raw["classes"]["codes"]
    codes = base64.b64decode(b64codes)
    kept = raw["kept"]
    return [
        ("tokens is not valid base64", {"tokens": "not base64!"}),
        ("tokens is not valid base64", {"tokens": raw["tokens"][:-1]}),
        ("not a positive multiple of 4", {"tokens": _b64(bytes(4 * 43 - 1))}),
        ("not a positive multiple of 4", {"tokens": ""}),
        ("tokens is not a base64 string", {"tokens": list(range(43))}),
        ("names and codes", {"classes": ["sink"] * 43}),
        ("names and codes", {"classes": {**raw["classes"], "more": 1}}),
        ("class codes is not valid base64", {"classes": {"names": names, "codes": "@@@@"}}),
        ("do not match the tokens", {"classes": {"names": names, "codes": _b64(codes[:-1])}}),
        ("do not match the tokens", {"classes": {"names": names, "codes": _b64(codes + b"\0")}}),
        ("outside the class names",
         {"classes": {"names": names, "codes": _b64(codes[:-1] + bytes([len(names)]))}}),
        ("distinct strings", {"classes": {"names": [*names[:-1], 5], "codes": b64codes}}),
        ("distinct strings", {"classes": {"names": [*names[:-1], names[0]], "codes": b64codes}}),
        ("distinct strings", {"classes": {"names": "sink", "codes": b64codes}}),
        ("kept bitmap 0 is not valid base64", {"kept": ["%%%%", *kept[1:]]}),
        ("kept bitmap 0 is not a base64 string", {"kept": [[0, 1, 42], *kept[1:]]}),
        ("5 bytes, not 6", {"kept": [_b64(bytes(5)), *kept[1:]]}),
        ("7 bytes, not 6", {"kept": [_b64(bytes(7)), *kept[1:]]}),
        ("outside the prefix", {"kept": [_b64(bytes(5) + bytes([0b1000])), *kept[1:]]}),
        ("one bitmap per layer", {"kept": kept[:-1]}),
        ("one bitmap per layer", {"kept": kept[0]}),
        ("bad layer count", {"n_layer": True, "kept": kept[:1]}),
    ]


def test_malformed_packed_fields_are_refused_with_one_line(tmp_path):
    good = tmp_path / "good.pkv"
    write(good, _header(), bytes(200))
    raw, state = _parts(good)
    for reason, changes in _malformed(raw):
        path = _frame(tmp_path / "bad.pkv", {**raw, **changes}, state)
        with pytest.raises(PrefixFileError, match="has a malformed header") as err:
            read(path, 10**6)
        assert reason in str(err.value) and "\n" not in str(err.value), (reason, str(err.value))
    # the unchanged header, framed the same way, reads (the refusals above are the changes')
    assert read(_frame(tmp_path / "same.pkv", raw, state), 10**6)[0] == _header()


def test_bitmaps_cannot_unpack_to_more_entries_than_the_state_holds(tmp_path):
    header = _header()  # 3 + 0 + 43 + 14 = 60 kept entries
    write(tmp_path / "a.pkv", header, bytes(60))
    assert read(tmp_path / "a.pkv", 10**6)[0] == header
    write(tmp_path / "b.pkv", header, bytes(59))
    with pytest.raises(PrefixFileError, match="malformed header .*60 kept entries"):
        read(tmp_path / "b.pkv", 10**6)


def test_a_version_1_file_is_refused_with_one_line(tmp_path):
    v1 = dataclasses.asdict(_header())  # version 1 wrote the lists as they are
    path = _frame(tmp_path / "old.pkv", v1, bytes(200), version=1)
    with pytest.raises(PrefixFileError) as err:
        read(path, 10**6)
    assert str(err.value) == ("prefix file old.pkv has format version 1; this pask-local reads version 2 "
                              "(compress the prefix again)")


def test_the_header_of_an_8k_prefix_is_compact(tmp_path):
    """8000 tokens, 28 layers each keeping a third of the positions: the header is the packed fields
    (tokens 4 B, a class code 1 B per token, a bitmap of n/8 B per layer) in base64 (4/3), plus the
    fixed fields; version 1's JSON lists were over 5x that."""
    n, n_layer = 8000, 28
    rng = np.random.default_rng(0)
    kept = [sorted(rng.choice(n, n // 3, replace=False).tolist()) for _ in range(n_layer)]
    names = ["sink", "template", "tool_name", "param_name", "param_type", "description", "enum_value",
             "required", "query", "other"]
    header = _header(n=n, n_layer=n_layer, tokens=rng.integers(0, 151_000, n).tolist(),
                     classes=[names[i] for i in rng.integers(0, len(names), n)], kept=kept)
    path = tmp_path / "8k.pkv"
    write(path, header, bytes(header.held()))
    (n_head,) = struct.unpack_from("<Q", path.read_bytes(), len(MAGIC) + 4)

    def b64(size: int) -> int:
        return 4 * -(-size // 3)

    packed = b64(4 * n) + b64(n) + n_layer * b64(n // 8)  # 42,668 + 10,668 + 28 * 1,336 = 90,744
    assert packed == 90_744
    assert packed < n_head < packed + 1_000  # the names, hashes and punctuation: under 1 KB
    v1 = len(json.dumps(dataclasses.asdict(header), separators=(",", ":")))
    assert v1 > 5 * n_head
    assert read(path, 10**8)[0] == header


# ------------------------------------------------------------------ sequence state (native)
def _text_tokens(model, n_repeat=12):
    return model.tokenize("The quick brown fox jumps over the lazy dog. " * n_repeat)


def test_layered_state_restores_into_another_stream_exactly(gemma_model):
    from pask_local.kv_layered import LayeredContext
    from pask_local.llm import ContextConfig

    m = gemma_model
    toks = _text_tokens(m)
    n = len(toks)
    caps = [n + 8] * m.n_layer
    a = LayeredContext(m, caps, ContextConfig(n_ctx=512, n_batch=512))
    b = LayeredContext(m, caps, ContextConfig(n_ctx=512, n_batch=512, n_seq_max=3))
    small = LayeredContext(m, [16] * m.n_layer, ContextConfig(n_ctx=512, n_batch=512))
    try:
        a.decode(toks, 0)
        for il in range(m.n_layer):  # a different hole pattern in every layer
            a.evict(il, list(range(3 + il, n - 8, 2 + il % 3)))
        blob = kv_state.save(a, 0)
        kv_state.restore(b, 2, blob)
        for il in range(m.n_layer):
            assert b.positions(il, 2) == a.positions(il, 0), il
            assert b.used(il, 0) == 0
        a.decode([toks[5]], n)
        b.decode([toks[5]], n, seq_id=2)
        assert np.array_equal(a.logits(), b.logits())
        with pytest.raises(PaskError, match="does not fit"):
            kv_state.restore(small, 0, blob)
        assert all(small.used(il, 0) == 0 for il in range(m.n_layer))  # nothing half-restored
        with pytest.raises(PaskError, match="does not fit"):
            kv_state.restore(b, 1, blob[: len(blob) // 2])
        assert all(b.used(il, 1) == 0 for il in range(m.n_layer))
    finally:
        for c in (a, b, small):
            c.close()


def test_full_kv_state_restores_into_a_pool_sized_context(qwen05_model, gemma_model):
    from pask_local.llm import Context, ContextConfig

    m = qwen05_model
    toks = _text_tokens(m)
    a = Context(m, ContextConfig(n_ctx=512, n_batch=512))
    b = Context(m, ContextConfig(n_ctx=768, n_batch=512, n_seq_max=3))
    try:
        a.decode(toks, 0)
        kv_state.restore(b, 2, kv_state.save(a, 0))
        a.decode([toks[5]], len(toks))
        b.decode([toks[5]], len(toks), seq_id=2)
        assert np.array_equal(a.logits(), b.logits())
    finally:
        a.close()
        b.close()
    # a sliding-window model's upstream cache: only into the stream count it was saved from
    g = gemma_model
    a = Context(g, ContextConfig(n_ctx=512, n_batch=512))
    one = Context(g, ContextConfig(n_ctx=512, n_batch=512))
    three = Context(g, ContextConfig(n_ctx=768, n_batch=512, n_seq_max=3))
    try:
        a.decode(_text_tokens(g), 0)
        blob = kv_state.save(a, 0)
        kv_state.restore(one, 0, blob)
        with pytest.raises(PaskError, match="stream count"):
            kv_state.restore(three, 1, blob)
    finally:
        for c in (a, one, three):
            c.close()


# ------------------------------------------------------------------ prefix files (Qwen 0.5B)
def _engine(model, method, budget=0.33):
    from pask_local.engine import Engine, EngineConfig, make_method

    return Engine(model, make_method(method, model), EngineConfig(budget=budget, max_tokens=48, style="native"))


def _tools():
    from pask_local.schema.tools import load_tools

    return load_tools(TOOLS)


@pytest.fixture(scope="module")
def prefix_file(qwen05_model, tmp_path_factory) -> Path:
    """The two tools' prefix compressed once with the default method at 0.33."""
    from pask_local.engine.factory import DEFAULT_METHOD
    from pask_local.prefix.build import compress, save

    path = tmp_path_factory.mktemp("prefix") / "tools.pkv"
    c = compress(_engine(qwen05_model, DEFAULT_METHOD), _tools(), [])
    assert c.held <= 0.34 * c.full  # the budget holds over the prefix
    save(path, c)
    return path


def _run(model, path, method, budget, question=QUESTION, tools=None):
    from pask_local.prefix.build import check_prompt, open_file, pin, run_from_prefix

    engine = _engine(model, method, budget or 1.0)
    tools = tools or _tools()
    header, blob = open_file(path, model)
    pinned = pin(path, header, blob, model, method, budget, "f16", tools)
    prepared = engine.prepare([{"role": "user", "content": question}], tools, "required")
    check_prompt(header.tokens, prepared.plan.prompt.tokens, path.name)
    return header, run_from_prefix(engine, prepared, pinned), engine, prepared


def test_whole_prefill_keeps_the_plans_positions_with_a_full_prefills_keys(qwen05_model):
    """``whole``: a planned method (floors-only) keeps the positions it keeps when it drops between
    chunks, but their keys are those of a prefill that dropped nothing (the method at budget 1.0, the
    oracle); dropped between chunks, the deepest layer's keys after the first chunk differ from it."""
    from pask_local.kv_rows import key_rows
    from pask_local.prefix.build import compress

    tools = _tools()
    ref = compress(_engine(qwen05_model, "floors-only", 1.0), tools, [])
    reading = compress(_engine(qwen05_model, "floors-only"), tools, [])
    whole = compress(_engine(qwen05_model, "floors-only"), tools, [], whole=True)
    assert whole.header.kept == reading.header.kept and whole.held <= 0.34 * whole.full < ref.held
    assert (whole.header.extra["prefill"], reading.header.extra["prefill"]) == ("whole", "reading")
    last = qwen05_model.n_layer - 1

    def keys(c) -> dict[int, np.ndarray]:
        pos, rows = key_rows(c.state[1:])[last]
        return {int(p): r for p, r in zip(pos, rows, strict=True) if p >= 64}  # past the first chunk

    want, got, dropped = keys(ref), keys(whole), keys(reading)
    assert len(got) > 20 and got.keys() == dropped.keys()
    err_whole = max(float(np.abs(got[p] - want[p]).max()) for p in got)
    err_reading = max(float(np.abs(dropped[p] - want[p]).max()) for p in got)
    assert err_whole <= 0.01 * err_reading, (err_whole, err_reading)


def test_a_shared_whole_prefill_compresses_as_a_prefill_of_its_own(qwen05_model):
    """``prefix.whole``: one whole prefill (paid once, by a budget-1.0 holder) serves planned methods
    at two budgets, one with a scoring pass (its scores, not the restored prefix's presence, rank).
    Each restores it (the restore runs), decodes only the last token, then drops what its plan
    does not keep: the same positions as a whole prefill of its own, the same keys (bit-equal before
    the last token, which a one-token batch decodes)."""
    from pask_local.kv_rows import key_rows
    from pask_local.prefix.build import compress
    from pask_local.prefix.whole import WholePrefills

    tools = _tools()
    held = WholePrefills()
    whole, paid = held.get(_engine(qwen05_model, "floors-only", 1.0), tools, [])
    again, paid_again = held.get(_engine(qwen05_model, "pask-prior", 1.0), tools, [])
    assert (paid, paid_again, held.prefills) == (True, False, 1) and again is whole
    # a whole-prompt method reads the prompt in other chunks (its last one holds its observation
    # window): its whole prefill differs in the last bits, so it is not served to a planned method
    assert held.get(_engine(qwen05_model, "snapkv", 1.0), tools, [])[1] and held.prefills == 2
    n, last = len(whole.tokens), qwen05_model.n_layer - 1
    for method, budget in (("floors-only", 0.33), ("pask-prior", 0.2), ("knorm", 0.33)):  # knorm: a scoring pass
        pinned, restored = whole.pinned(method, budget, drop_last=True), []

        def restore(ctx, seq, pinned=pinned, restored=restored):
            restored.append(seq)
            pinned.restore(ctx, seq)

        shared = compress(_engine(qwen05_model, method, budget), tools, [], whole=True,
                          start=dataclasses.replace(pinned, restore=restore))
        own = compress(_engine(qwen05_model, method, budget), tools, [], whole=True)
        assert restored == [0] and shared.header.kept == own.header.kept and shared.held <= (budget + 0.01) * own.full
        (pos_s, rows_s), (pos_o, rows_o) = key_rows(shared.state[1:])[last], key_rows(own.state[1:])[last]
        assert list(pos_s) == list(pos_o)
        before = np.asarray(pos_s) < n - 1
        assert np.array_equal(rows_s[before], rows_o[before])
        assert float(np.abs(rows_s - rows_o).max()) < 0.05


def test_a_policy_with_group_shares_sizes_slots_by_them_and_its_prefix_restores(qwen05_model, tmp_path):
    """A calibrated policy with group curves keeps more of the prompt in some layer groups (0.485 and
    0.505 of it here, at budget 0.33): a pool sizes each layer by its group's share (the mean still
    the budget), so a ~3k-token prefix compressed with it (read in chunks or whole) restores into a
    one-slot pool and the request is not clamped (sized by the budget alone, 12 of the 24 layers were clamped; on the
    1.5B model's 8k catalogs the restore itself did not fit)."""
    from pask_local.engine import Engine, EngineConfig, make_method
    from pask_local.engine.pool import slot_capacities
    from pask_local.eval.data import load_bundled
    from pask_local.policy.groups import GroupCurves
    from pask_local.policy.handwritten import handwritten_policy
    from pask_local.prefix.build import compress, pin, run_from_prefix
    from pask_local.schema.tools import as_tools

    n_layer = qwen05_model.n_layer
    curves = GroupCurves((0.05, 0.1, 0.2, 0.35, 0.5), ((0.0,) * 5, (0.0,) * 5, (0.1, 0.08, 0.05, 0.02, 0.01),
                                                      (0.5, 0.3, 0.15, 0.05, 0.01)), 0.5)
    path = tmp_path / "policy.json"
    dataclasses.replace(handwritten_policy(n_layer), group_budget=curves).save(path)
    method = make_method("pask", qwen05_model, path)
    keep = method.layer_keep(0.33, n_layer)
    assert keep[0] < 0.2 < 0.45 < keep[-1] and abs(sum(keep) / n_layer - 0.33) < 0.01
    caps = slot_capacities(qwen05_model, method, 0.33, 8192, 64)
    assert caps[-1] > 2 * caps[0] and sum(caps) <= 1.05 * sum(slot_capacities(qwen05_model, make_method(
        "pask-prior", qwen05_model), 0.33, 8192, 64))

    cases = load_bundled("simple_python")[:40]
    tools = as_tools(list({f["name"]: f for c in cases for f in c.functions}.values()))
    engine = Engine(qwen05_model, method, EngineConfig(budget=0.33, max_tokens=32, style="native"))
    c = compress(engine, tools, [])
    assert c.header.n_prefix > 2500
    # prefilled whole first, the smallest layer's slot holds the whole prefix too
    assert compress(engine, tools, [], whole=True).header.kept == c.header.kept
    pinned = pin("p", c.header, c.state, qwen05_model, "pask", 0.33, "f16")
    prepared = engine.prepare([cases[0].messages[-1]], tools, "required")
    res = run_from_prefix(engine, prepared, pinned)
    assert res.stats["prefix_source"] == "prefix" and res.stats["slot_clamped_layers"] == 0
    assert res.stats["max_over_budget_entries"] == 0 and res.parsed is not None


@pytest.mark.slow
def test_compressed_prefix_is_restored_and_answers(qwen05_model, prefix_file):
    from pask_local.engine.factory import DEFAULT_METHOD

    header, res, _, prepared = _run(qwen05_model, prefix_file, DEFAULT_METHOD, 0.33)
    assert header.method == DEFAULT_METHOD and header.budget == 0.33
    assert res.stats["prefix_source"] == "prefix" and res.stats["prefix_reused"] == header.n_prefix
    assert res.stats["n_prompt"] == prepared.n_prompt > header.n_prefix
    assert res.ok and res.parsed["name"] == "get_weather"
    assert res.stats["max_over_budget_entries"] == 0


@pytest.mark.slow
def test_full_kv_prefix_gives_the_fresh_call(qwen05_model, tmp_path):
    from pask_local.prefix.build import compress, save

    path = tmp_path / "full.pkv"
    save(path, compress(_engine(qwen05_model, "full"), _tools(), []))
    _, res, engine, prepared = _run(qwen05_model, path, "full", None)
    fresh = engine.execute(prepared)
    assert res.stats["prefix_reused"] > 0
    assert res.ok and fresh.ok and res.parsed == fresh.parsed


def _rewrite(src: Path, dst: Path, qwen05_model, **changes) -> Path:
    from pask_local.prefix.build import max_state_bytes

    header, blob = read(src, max_state_bytes(qwen05_model, qwen05_model.n_ctx_train))
    write(dst, dataclasses.replace(header, **changes), blob)
    return dst


@pytest.mark.slow
def test_damaged_and_foreign_files_are_refused(qwen05_model, gemma_model, prefix_file, tmp_path):
    from pask_local.engine.factory import DEFAULT_METHOD
    from pask_local.prefix.build import open_file, pin

    data = prefix_file.read_bytes()

    def refused(path: Path, match: str, model=qwen05_model) -> None:
        with pytest.raises(PrefixFileError, match=match):
            open_file(path, model)

    (tmp_path / "tampered.pkv").write_bytes(data[:-500] + bytes([data[-500] ^ 1]) + data[-499:])
    refused(tmp_path / "tampered.pkv", "damaged or was modified")
    (tmp_path / "truncated.pkv").write_bytes(data[: len(data) // 2])
    refused(tmp_path / "truncated.pkv", "damaged or was modified")
    (tmp_path / "tiny.pkv").write_bytes(data[:20])
    refused(tmp_path / "tiny.pkv", "truncated")
    (tmp_path / "version.pkv").write_bytes(data[:8] + (7).to_bytes(4, "little") + data[12:])
    refused(tmp_path / "version.pkv", "format version 7")
    (tmp_path / "other.pkv").write_bytes(b"GGUF" + data[4:])
    refused(tmp_path / "other.pkv", "not a pask-local prefix file")
    refused(prefix_file, "another model", model=gemma_model)
    refused(_rewrite(prefix_file, tmp_path / "tmpl.pkv", qwen05_model, template_sha256="0" * 64),
            "another chat template")
    refused(_rewrite(prefix_file, tmp_path / "weights.pkv", qwen05_model, model_sha256="0" * 64), "another model")
    refused(_rewrite(prefix_file, tmp_path / "build.pkv", qwen05_model, upstream="0.0.1"), "llama.cpp build")
    with pytest.raises(PrefixFileError, match="more than this model"):
        read(prefix_file, 1000)
    header, blob = open_file(prefix_file, qwen05_model)
    other_tools = _tools()[:1]
    with pytest.raises(PrefixFileError, match="another tool list"):
        pin(prefix_file, header, blob, qwen05_model, DEFAULT_METHOD, 0.33, "f16", other_tools)
    with pytest.raises(PrefixFileError, match="this run asks for 'streaming'"):
        pin(prefix_file, header, blob, qwen05_model, "streaming", 0.33, "f16")
    with pytest.raises(PrefixFileError, match="q8_0"):
        pin(prefix_file, header, blob, qwen05_model, DEFAULT_METHOD, 0.33, "q8_0")
    # a header whose positions disagree with its K/V: refused when restored, the stream left empty
    kept = [k[:-1] for k in header.kept]
    lying = _rewrite(prefix_file, tmp_path / "lying.pkv", qwen05_model, kept=kept)
    with pytest.raises(PrefixFileError, match="does not match the positions"):
        _run(qwen05_model, lying, DEFAULT_METHOD, 0.33)
    refused(_rewrite(prefix_file, tmp_path / "bad.pkv", qwen05_model, budget=3.0), "malformed header")
    raw, state = _parts(prefix_file)  # a header no writer makes, with a valid checksum
    n = header.n_prefix
    past = base64.b64encode(bytes(n // 8) + bytes([1 << (n % 8)]) if n % 8 else bytes(n // 8 + 1)).decode()
    for bad in ({"kept": [past] * header.n_layer}, {"tokens": "x"}, {"tokens": header.tokens}):
        refused(_frame(tmp_path / "bad.pkv", {**raw, **bad}, state), "malformed header")
    refused(_frame(tmp_path / "v1.pkv", dataclasses.asdict(header), state, version=1), "format version 1")


@pytest.mark.slow
def test_cli_compress_run_and_refusals(prefix_file, tmp_path, cli):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    model = ["--model", "qwen2.5-coder-0.5b"]
    out = cli("run", *model, "--schema", str(tools), "--prefix", str(prefix_file), QUESTION)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["name"] == "get_weather"
    bad = tmp_path / "bad.pkv"
    bad.write_bytes(prefix_file.read_bytes()[:-1] + b"\0")
    raw, state = _parts(prefix_file)
    old = _frame(tmp_path / "old.pkv", raw, state, version=1)
    for args, line in (
            (["run", *model, "--schema", str(tools), "--prefix", str(bad), QUESTION], "damaged"),
            (["run", *model, "--schema", str(tools), "--prefix", str(old), QUESTION], "format version 1"),
            (["run", *model, "--schema", str(tools), "--prefix", str(prefix_file), "--method", "snapkv", QUESTION],
             "this run asks for 'snapkv'"),
            (["compress", *model, "--tools", str(tools), "--method", "snapkv", "--out", str(tmp_path / "s.pkv")],
             "query-aware"),
            (["compress", *model, "--tools", str(tmp_path / "none.json"), "--out", str(tmp_path / "n.pkv")],
             "not found")):
        r = cli(*args)
        assert r.returncode == 1, (args, r.stderr)
        assert line in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.slow
def test_server_starts_every_matching_request_from_the_prefix(qwen05_path, prefix_file):
    from pask_local.engine.factory import DEFAULT_METHOD
    from pask_local.llm import Model
    from pask_local.prefix.build import open_file
    from pask_local.server.app import Server, ServerConfig
    from pask_local.server.openai_io import Defaults

    model = Model(qwen05_path)
    with pytest.raises(PaskError, match="this run asks for 'full'"):
        Server(model, ServerConfig("q", Defaults(method="full", max_tokens=48), slots=1, max_context=1024,
                                   prefixes=(prefix_file,)))
    srv = Server(model, ServerConfig("q", Defaults(method=DEFAULT_METHOD, max_tokens=48), slots=2,
                                     max_context=1024, prefixes=(prefix_file,)))
    try:
        n_prefix = open_file(prefix_file, model)[0].n_prefix
        with serve_in_thread(srv) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
            for city in ("Paris", "Oslo"):
                r = client.chat.completions.create(
                    model="q", messages=[{"role": "user", "content": f"What is the weather in {city}?"}],
                    tools=TOOLS, tool_choice="required", max_tokens=48)
                assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
                assert r.usage.prompt_tokens_details.cached_tokens == n_prefix
                assert r.model_extra["pask"]["prefix_source"] == "prefix"
            assert srv.pool.stats()["reused_prompt_tokens"] == 2 * n_prefix
    finally:
        srv.close()
        model.close()


@pytest.mark.slow
def test_prefix_dir_saves_a_new_catalog_and_restores_it_after_a_restart(qwen05_path, prefix_file, tmp_path):
    """serve --prefix-dir: a damaged file and another method's file are skipped with a line; a request
    with new tools gets its prefix compressed and saved; the next request, and a restarted server's
    first one, start from it."""
    from pask_local.llm import Model
    from pask_local.server.app import Server, ServerConfig
    from pask_local.server.openai_io import Defaults

    pdir = tmp_path / "prefixes"
    pdir.mkdir()
    (pdir / "damaged.pkv").write_bytes(prefix_file.read_bytes()[:-3] + b"xyz")
    (pdir / "default-method.pkv").write_bytes(prefix_file.read_bytes())  # pask-prior: pinned, never matches
    model = Model(qwen05_path)
    cfg = ServerConfig("q", Defaults(method="streaming", max_tokens=48), slots=1, max_context=1024, prefix_dir=pdir)

    def ask(url: str, city: str):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        r = client.chat.completions.create(
            model="q", messages=[{"role": "user", "content": f"What is the weather in {city}?"}],
            tools=TOOLS, tool_choice="required", max_tokens=48)
        assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
        return r

    try:
        srv = Server(model, cfg)
        assert any("skipped damaged.pkv" in w and "damaged" in w for w in srv.warnings), srv.warnings
        with serve_in_thread(srv) as url:  # the app closes the server when it stops
            first = ask(url, "Paris")
            assert first.model_extra["pask"]["prefix_source"] is None
            srv.prefix_dir.join(300)
            assert len(srv.prefix_dir.saved) == 1 and srv.prefix_dir.saved[0].parent == pdir
            second = ask(url, "Oslo")
            assert second.model_extra["pask"]["prefix_source"] == "prefix"
            assert second.usage.prompt_tokens_details.cached_tokens > 0
        again = Server(model, cfg)  # a restart: the saved file is loaded, nothing compressed again
        with serve_in_thread(again) as url:
            third = ask(url, "Rome")
            assert third.model_extra["pask"]["prefix_source"] == "prefix"
            again.prefix_dir.join(300)
            assert again.prefix_dir.saved == []
    finally:
        model.close()


def test_cli_compress_defaults_to_the_calibration_splits_choice(tmp_path, cli):
    """Without --method, compress runs DEFAULT_PREFIX_METHOD (the query-agnostic PASK variant chosen on
    the calibration split) at 0.33, and the file says so."""
    from pask_local.methods.registry import DEFAULT_PREFIX_METHOD, QUERY_AGNOSTIC

    assert DEFAULT_PREFIX_METHOD in QUERY_AGNOSTIC
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    out = tmp_path / "d.pkv"
    done = cli("compress", "--model", "gemma3-270m", "--tools", str(tools), "--out", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["method"] == DEFAULT_PREFIX_METHOD and report["budget"] == 0.33
    assert report["held_entries"] <= 0.34 * report["full_entries"]
    assert report["prefill"] == "reading"  # a planned method drops between chunks unless told otherwise
    done = cli("compress", "--model", "gemma3-270m", "--tools", str(tools), "--out", str(out), "--whole-prefill")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["prefill"] == "whole" and report["held_entries"] <= 0.34 * report["full_entries"]
