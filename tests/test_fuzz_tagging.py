"""Fuzzing the prompt tagger and the grammar accept path with random text, bytes and token ids.

- ``map_spans``: random spans (any Unicode, control characters, random classes, with and without
  special-token parsing of template spans) on a synthetic GGUF and on Gemma 3: one class per
  token, every id in the vocabulary, the first token the sink; undecodable bytes (lone surrogates,
  as argv carries them) are a one-line ``PaskError``, also through the CLI.
- ``GrammarState``: random token ids, in and out of the vocabulary: ``accepts`` agrees with
  ``accept``, a rejected token leaves the parser state unchanged, never an abort; the generated
  tagger's byte-by-byte acceptance reaches exactly the state whole-token acceptance reaches.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import REPO, run_cli
from grammar_helpers import gemma
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pask_local.calibration.synthetic import write_synthetic_gguf

from pask_local.classes import GENERATED_CLASSES, StructuralClass
from pask_local.errors import NativeError, PaskError
from pask_local.grammar.state import GrammarState
from pask_local.llm import Model
from pask_local.schema.gbnf import build_grammar
from pask_local.schema.tools import read_tools
from pask_local.tagging.generated import CallTagger
from pask_local.tagging.prompt import map_spans


def fuzz(n: int) -> settings:
    return settings(max_examples=n, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
                    database=None)


TEXT = st.text(st.characters(blacklist_categories=("Cs",)), min_size=0, max_size=30) | st.sampled_from(
    ["<s>", "</s>", "<start_of_turn>", "<|im_start|>", "\x00", "\ufeff", " \n\t ", "\U0001f600" * 3])
SPANS = st.lists(st.tuples(TEXT, st.sampled_from(list(StructuralClass))), max_size=8)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Model:
    path = tmp_path_factory.mktemp("fuzz") / "tiny.gguf"
    write_synthetic_gguf(path, arch="qwen3", n_layer=1)
    return Model(path)


def _check_mapping(model: Model, spans: list, special: bool) -> None:
    tokens, classes = map_spans(model, spans, special_template=special)
    assert len(tokens) == len(classes)
    assert all(0 <= t < model.n_vocab for t in tokens)
    assert all(isinstance(c, StructuralClass) for c in classes)
    if tokens:
        assert classes[0] is StructuralClass.SINK
    if not special:  # without special parsing the text comes back byte for byte after the BOS
        body = tokens[1:] if model.add_bos else tokens
        assert b"".join(model.piece(t) for t in body) == "".join(s for s, _ in spans).encode("utf-8")


@fuzz(200)
@given(spans=SPANS, special=st.booleans())
def test_random_spans_map_to_one_class_per_token(synthetic: Model, spans: list, special: bool) -> None:
    _check_mapping(synthetic, spans, special)


@pytest.mark.slow
@fuzz(40)
@given(spans=SPANS, special=st.booleans())
def test_random_spans_on_gemma(spans: list, special: bool) -> None:
    _check_mapping(gemma(), spans, special)


@fuzz(50)
@given(raw=st.binary(min_size=1, max_size=40))
def test_random_bytes_decoded_like_argv(synthetic: Model, raw: bytes) -> None:
    text = raw.decode("utf-8", "surrogateescape")  # what Python makes of a command-line argument
    spans = [("User: ", StructuralClass.TEMPLATE), (text, StructuralClass.QUERY)]
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        with pytest.raises(PaskError, match="not valid UTF-8") as err:
            map_spans(synthetic, spans)
        assert "\n" not in str(err.value)
        return
    _check_mapping(synthetic, spans, False)


def test_undecodable_request_is_one_line_on_the_cli() -> None:
    proc = run_cli("run", "--schema", str(REPO / "examples" / "get_weather.json"), "--method", "full",
                   "Weather in \udcff\udcfe Oslo?", timeout=300, env={"PASK_THREADS": "1"})
    assert proc.returncode > 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "UTF-8" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def weather(synthetic: Model):
    return build_grammar(read_tools(REPO / "examples" / "get_weather.json"))


def _ids(model: Model, data) -> list[int]:
    """Random token ids: some out of range, some random in the vocabulary, many that fit a call."""
    call = model.tokenize('{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}',
                          parse_special=False)
    return data.draw(st.lists(st.one_of(st.integers(-3, model.n_vocab + 3), st.sampled_from(call),
                                        st.sampled_from(call)), max_size=60))


@fuzz(60)
@given(data=st.data())
def test_random_token_ids_never_break_the_grammar_state(synthetic: Model, weather, data) -> None:
    state = GrammarState(synthetic.vocab, weather.text)
    try:
        for tok in _ids(synthetic, data):
            before = state.stacks()
            if state.accepts(tok):
                state.accept(tok)
                assert 0 <= tok < synthetic.n_vocab
            else:
                with pytest.raises(NativeError):
                    state.accept(tok)
                assert state.stacks() == before
            arr = np.array([tok, tok], dtype=np.int32)
            assert state.first_accepted(arr) in (-1, 0)
    finally:
        state.close()


@fuzz(60)
@given(data=st.data())
def test_tagger_bytewise_accept_equals_token_accept(synthetic: Model, weather, data) -> None:
    bytewise = GrammarState(synthetic.vocab, weather.text)
    whole = GrammarState(synthetic.vocab, weather.text)
    tagger = CallTagger(synthetic, weather, bytewise)
    try:
        for tok in _ids(synthetic, data):
            if not whole.accepts(tok):
                continue
            whole.accept(tok)
            assert tagger.accept(tok, synthetic.piece(tok)) in GENERATED_CLASSES
            assert bytewise.stacks() == whole.stacks()
    finally:
        bytewise.close()
        whole.close()


@pytest.mark.parametrize("tok", [-1, -(2**31), 320, 10**6])
def test_out_of_vocabulary_ids_are_errors_not_aborts(synthetic: Model, weather, tok: int) -> None:
    with pytest.raises(NativeError, match="outside the vocabulary"):
        synthetic.piece(tok)
    state = GrammarState(synthetic.vocab, weather.text)
    try:
        assert not state.accepts(tok)
        with pytest.raises(NativeError):
            state.accept(tok)
        with pytest.raises(NativeError, match="one logit per token"):
            state.full_filter(np.zeros(synthetic.n_vocab + 1, dtype=np.float32))
    finally:
        state.close()
